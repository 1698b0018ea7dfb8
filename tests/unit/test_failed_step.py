"""The rest of a failed step without its matrix products (`recovery.failed_step`), in one process.

Entered on the thread that trains, a forward and a backward keep their shapes, graph and hooks,
with every product zeros (finite: the loss is a number, the gradients zeros); left, the same
step computes as before, bit for bit. It is refused where it could not be left safely: on
another thread, inside the autograd engine, under another dispatch mode.
"""
from __future__ import annotations

import math
import threading
from collections.abc import Iterator

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from recovery import failed_step


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 5))


def _step(model: torch.nn.Module) -> tuple[float, list[torch.Tensor]]:
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    y = torch.tensor([0, 1, 2, 3])
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return float(loss.detach()), grads


@pytest.fixture(autouse=True)
def _trains_here() -> Iterator[None]:
    failed_step.trains_here()
    yield
    failed_step.leave()


def test_a_step_run_without_products_keeps_its_shapes_and_the_next_one_is_exact() -> None:
    model = _model()
    before, grads = _step(model)
    assert failed_step.enter()
    loss, zeros = _step(model)
    skipped = failed_step.leave()
    # 2 forward addmm, 3 backward mm (the first layer's input needs no gradient).
    assert skipped == 5
    assert math.isclose(loss, math.log(5), rel_tol=1e-6)  # zero logits: uniform over 5 classes
    assert [g.shape for g in zeros] == [g.shape for g in grads]
    assert not zeros[0].any() and not zeros[2].any()  # the weights' gradients are products
    assert all(torch.isfinite(g).all() for g in zeros)
    assert torch._C._len_torch_dispatch_stack() == 0
    after, again = _step(model)
    assert after == before and all(torch.equal(a, b) for a, b in zip(again, grads))


def test_entered_twice_is_one_mode_and_left_twice_is_harmless() -> None:
    assert failed_step.enter() and failed_step.enter()
    assert torch._C._len_torch_dispatch_stack() == 1
    failed_step.leave()
    assert failed_step.leave() == 0 and torch._C._len_torch_dispatch_stack() == 0


def test_refused_on_a_thread_that_does_not_train() -> None:
    answers: list[bool] = []
    worker = threading.Thread(target=lambda: answers.append(failed_step.enter()))
    worker.start()
    worker.join(timeout=60)
    assert answers == [False]


def test_refused_inside_the_autograd_engine() -> None:
    # Entered in a backward hook, the engine would drop it after that node (it restores the
    # thread's dispatch modes); the products of that backward run.
    answers: list[bool] = []
    w = torch.randn(3, 3, requires_grad=True)
    out = (w @ w).sum()
    out.register_hook(lambda g: answers.append(failed_step.enter()))  # type: ignore[func-returns-value]
    out.backward()
    assert answers == [False]
    assert w.grad is not None and w.grad.abs().sum() > 0


def test_refused_under_another_dispatch_mode_which_then_exits_in_order() -> None:
    class Other(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            return func(*args, **(kwargs or {}))

    with Other():
        assert not failed_step.enter()
    assert torch._C._len_torch_dispatch_stack() == 0


def test_a_mode_the_step_left_open_above_it_keeps_it_as_a_pass_through() -> None:
    class Other(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            return func(*args, **(kwargs or {}))

    assert failed_step.enter()
    other = Other()
    other.__enter__()  # the step's code never leaves it
    try:
        assert failed_step.leave() == 0
        a = torch.ones(2, 2)
        assert torch.equal(a @ a, torch.full((2, 2), 2.0))  # products run again below it
    finally:
        other.__exit__(None, None, None)
        from torch.utils._python_dispatch import _pop_mode

        while torch._C._len_torch_dispatch_stack():
            _pop_mode()
