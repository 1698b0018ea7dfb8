"""The FSDP path's state dicts (`recovery.fsdp.live_state_dicts`): taken from torch once, handed out
again while they still refer to the live shards, and equal at every step to what torch's
`get_model_state_dict` / `get_optimizer_state_dict` would return afresh: after optimizer steps,
with a scheduler moving the learning rate, and after a load.

One process, a gloo group of one, a model sharded with `fully_shard` on a 1-rank mesh.
"""
from __future__ import annotations

from typing import Any, Iterator

import pytest
import torch
import torch.distributed as dist

from recovery.fsdp import live_state_dicts


@pytest.fixture
def fsdp() -> Iterator[tuple[torch.nn.Module, torch.optim.Optimizer, Any]]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
        mesh = init_device_mesh("cpu", (1,))
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
        yield model, opt, sched
    finally:
        dist.destroy_process_group()


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, sched: Any, steps: int) -> None:
    for i in range(steps):
        torch.manual_seed(100 + i)
        model(torch.randn(4, 8)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        sched.step()


def _plain(obj: Any) -> Any:
    """A state dict with every tensor (a DTensor as its local shard) made a plain copy."""
    if isinstance(obj, torch.Tensor):
        local = obj.to_local() if hasattr(obj, "to_local") else obj
        return local.detach().clone()
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_plain(v) for v in obj)
    return obj


def _assert_same(a: Any, b: Any) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b)
        for k in a:
            _assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b):
            _assert_same(x, y)
    else:
        assert a == b


def test_the_cached_state_dicts_equal_torchs_own_at_every_step_and_after_a_load(fsdp: Any) -> None:
    from torch.distributed.checkpoint import state_dict as dcp

    model, opt, sched = fsdp
    get_model, get_opt = live_state_dicts(model, opt)
    _train(model, opt, sched, 1)
    saved_model, saved_opt = _plain(get_model()), _plain(get_opt())
    for _ in range(3):
        _train(model, opt, sched, 1)
        _assert_same(_plain(get_model()), _plain(dcp.get_model_state_dict(model)))
        _assert_same(_plain(get_opt()), _plain(dcp.get_optimizer_state_dict(model, opt)))
    assert (get_model.taken, get_opt.taken) == (1, 1), "taken afresh although nothing was replaced"
    assert get_opt()["param_groups"][0]["lr"] == opt.param_groups[0]["lr"] != saved_opt["param_groups"][0]["lr"]

    # A load (what a restore does) puts the saved values back; the handed-out dicts follow.
    dcp.set_model_state_dict(model, dcp.get_model_state_dict(model) | {
        k: torch.distributed.tensor.DTensor.from_local(v, p.device_mesh, p.placements)
        for (k, v), p in zip(saved_model.items(), dcp.get_model_state_dict(model).values())})
    fresh_opt = dcp.get_optimizer_state_dict(model, opt)
    dcp.set_optimizer_state_dict(model, opt, fresh_opt | {"state": {
        fqn: {k: (torch.distributed.tensor.DTensor.from_local(saved_opt["state"][fqn][k], v.device_mesh, v.placements)
                  if hasattr(v, "device_mesh") else saved_opt["state"][fqn][k].clone()) for k, v in st.items()}
        for fqn, st in fresh_opt["state"].items()}})
    _assert_same(_plain(get_model()), saved_model)
    assert _plain(get_opt())["state"].keys() == saved_opt["state"].keys()
    _assert_same(_plain(get_opt())["state"], saved_opt["state"])
    _train(model, opt, sched, 1)
    _assert_same(_plain(get_model()), _plain(dcp.get_model_state_dict(model)))
    _assert_same(_plain(get_opt()), _plain(dcp.get_optimizer_state_dict(model, opt)))


def test_a_replaced_tensor_or_a_changed_count_takes_the_state_dict_afresh(fsdp: Any) -> None:
    model, opt, sched = fsdp
    get_model, get_opt = live_state_dicts(model, opt)
    _train(model, opt, sched, 1)
    get_model(), get_opt()
    model.register_buffer("seen", torch.zeros(2))  # a new tensor in the state dict
    assert "seen" in get_model() and get_model.taken == 2
    first = next(iter(opt.state.values()))
    first["count"] = 1  # an optimizer keeping a Python number beside its tensors
    assert get_opt.taken == 1 and get_opt() and get_opt.taken == 2
    first["count"] = 2
    assert next(iter(get_opt()["state"].values()))["count"] == 2 and get_opt.taken == 3
