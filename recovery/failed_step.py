"""The rest of a failed step, run through without its matrix products.

Once a collective of torch's modules has failed on a lost peer (`recovery.process_group`), the
step cannot commit: every later collective of its generation completes at once, issuing
nothing, and the step runs through to the optimizer's pre-hook, which raises. That leaves
FSDP2's state machine whole (every module resharded, every hook run), which raising in the
middle would not. What it costs is the step's compute on garbage: on a survivor the controller
waits for, up to a whole step (measured on the medium GPT sharded 2 x 2 on a CPU host:
0.26-0.38 s of a 0.4 s step, the largest part of a lost node's recovery after the replacements
started ahead).

So the rest of the step runs under `SkipProducts`, a torch dispatch mode that answers the matrix
products (`mm`, `addmm`, `bmm`, `baddbmm`: most of a transformer's forward and backward) with
zeros of their shape, dtype and device, and runs every other op as it is. The shapes, the
autograd graph and every hook are the same as before; only numbers that were garbage already are
zeros instead, finite (a zero logit's cross-entropy is log(vocab)), so code that checks a loss
for NaN does not trip on them. No kernel runs for a product on any device.

The mode is entered only where it is safe to leave later, on the thread that trains
(`enter`): outside the autograd engine (which restores its own thread-local state, dispatch
modes included, after each node: a mode entered in a backward hook would be gone after it),
outside any other dispatch mode (the user's or torch's, which would be exited out of order) and
outside compiled code. The job leaves it after the step function, whatever the step did
(`leave`). A product on a tensor subclass (a DTensor) runs as it is: its wrapper owns its result.
"""
from __future__ import annotations

import threading
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_aten = torch.ops.aten
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _product_shape(func: Any, args: tuple[Any, ...]) -> tuple[tuple[int, ...], torch.Tensor] | None:
    """(output shape, an input like it) of a matrix product, None for any other op."""
    if func is _aten.mm.default:
        return (args[0].shape[0], args[1].shape[1]), args[0]
    if func is _aten.addmm.default:
        return (args[1].shape[0], args[2].shape[1]), args[1]
    if func is _aten.bmm.default:
        return (args[0].shape[0], args[0].shape[1], args[1].shape[2]), args[0]
    if func is _aten.baddbmm.default:
        return (args[1].shape[0], args[1].shape[1], args[2].shape[2]), args[1]
    return None


class SkipProducts(TorchDispatchMode):
    """Matrix products answered with zeros while `active`; everything else as it is."""

    def __init__(self) -> None:
        super().__init__()
        self.active = True
        self.skipped = 0

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch wraps a mode's handler to keep torch.compile out of it, and the wrapper imports
        # torch._dynamo on its first call: seconds, paid in the very step this mode is to shorten.
        # Compiled code does not run under a dispatch mode anyway (torch falls back to eager).
        return False

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        if self.active and all(t in _PLAIN for t in types):
            found = _product_shape(func, args)
            if found is not None:
                shape, like = found
                self.skipped += 1
                return torch.zeros(shape, dtype=like.dtype, device=like.device)
        return func(*args, **(kwargs or {}))


class _State:
    def __init__(self) -> None:
        self.mode: SkipProducts | None = None
        self.thread: int | None = None  # the thread that trains (the one `job.run` binds on)


_STATE = _State()


def trains_here() -> None:
    """Say that the calling thread is the one that runs the steps."""
    _STATE.thread = threading.get_ident()


def enter() -> bool:
    """Run the rest of this step without its matrix products, where that is safe (see the
    module's docstring). Whether the mode is on now."""
    if _STATE.mode is not None:
        return True
    if (threading.get_ident() != _STATE.thread or torch._C._current_graph_task_id() != -1
            or torch._C._len_torch_dispatch_stack() != 0 or torch.compiler.is_compiling()):
        return False
    mode = SkipProducts()
    mode.__enter__()
    _STATE.mode = mode
    return True


def leave() -> int:
    """The step is over: products run again. How many it skipped."""
    mode, _STATE.mode = _STATE.mode, None
    if mode is None:
        return 0
    mode.active = False
    # Entered with nothing above it, it is on top unless code of the step entered a mode and
    # never left it; then it stays below that one, inactive: a pass-through.
    if torch._C._len_torch_dispatch_stack() and torch._C._get_dispatch_stack_at(
            torch._C._len_torch_dispatch_stack() - 1) is mode:
        mode.__exit__(None, None, None)
    return mode.skipped
