"""`Job`'s public surface: the DDP path (`recovery/ddp.py`) is built on it alone, read from the
module's source, and state is registered in torch's words (`state_dict`, `load_state_dict`, or
the object itself), the older `get`/`set` spelling kept as an alias."""
from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest
import torch

from recovery.job import Job
from wire.jobenv import JobEnv
from recovery.standalone import PlainJob

ROOT = Path(__file__).resolve().parents[2]


def _private_members(path: Path, cls: str) -> set[str]:
    """The `_` names class `cls` of `path` defines: its methods and the attributes it sets."""
    tree = ast.parse(path.read_text())
    body = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    out = {n.name for n in body.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    for node in ast.walk(body):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
            out.add(node.attr)
    return {n for n in out if n.startswith("_") and not n.startswith("__")}


def _own_names(tree: ast.Module) -> set[str]:
    """The `_` names ddp.py defines itself (its own classes' methods and attributes)."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out.add(node.name)
        elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
              and isinstance(node.value, ast.Name) and node.value.id == "self"):
            out.add(node.attr)
    return out


def test_the_ddp_path_touches_no_private_attribute_of_job() -> None:
    source = ROOT / "recovery" / "ddp.py"
    tree = ast.parse(source.read_text())
    job_private = _private_members(ROOT / "recovery" / "job.py", "Job")
    assert {"_after_step", "_on_fresh_start", "_reduction", "_group"} <= job_private  # the test sees them
    bad: list[str] = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or not node.attr.startswith("_") or node.attr.startswith("__"):
            continue
        # Reached through what names the job (`job.x`, `self.job.x`, `host.x`), or a name only
        # `Job` has, whatever it is reached through.
        through = node.value
        named = ((isinstance(through, ast.Name) and through.id in ("job", "host"))
                 or (isinstance(through, ast.Attribute) and through.attr in ("job", "host")))
        if named or (node.attr in job_private and node.attr not in _own_names(tree)):
            bad.append(f"line {node.lineno}: .{node.attr}")
    assert not bad, bad
    # The protocol ddp.py declares of its host names public members only.
    host = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Host")
    declared = [n.name for n in host.body if isinstance(n, ast.FunctionDef)]
    declared += [n.target.id for n in host.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)]
    assert declared and not [n for n in declared if n.startswith("_")], declared


def _bare_job() -> Job:
    """A `Job` with only what registration uses (no store, no agent)."""
    job = Job.__new__(Job)
    job.entries = []
    return job


def _plain_job() -> PlainJob:
    return PlainJob(JobEnv(rank=0, world_size=1, local_rank=0, local_world_size=1, node=0, run_id="t",
                           store_host="127.0.0.1", store_port=0, gen=0))


@pytest.mark.parametrize("make", [_bare_job, _plain_job])
def test_state_registers_in_torch_words_and_the_old_ones(make: Any) -> None:
    job = make()
    model, net = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    job.register_stateful("model", model, replicated=True)
    job.register("optim", state_dict=opt.state_dict, load_state_dict=opt.load_state_dict, replicated=True)
    job.register("net", get=net.state_dict, set=net.load_state_dict)  # the older spelling
    job.register("pos", lambda: {"i": 1}, lambda state: None)  # positional, as ever
    entries = {e.name: e for e in job.entries}
    assert entries["model"].replicated and entries["optim"].replicated and not entries["net"].replicated
    assert entries["model"].get().keys() == model.state_dict().keys() and entries["pos"].get() == {"i": 1}
    with torch.no_grad():
        model.weight.zero_()
    entries["model"].set(net.state_dict())
    assert torch.equal(model.weight, net.weight)
    with pytest.raises(TypeError, match="not both"):
        job.register("x", state_dict=net.state_dict, get=net.state_dict, load_state_dict=net.load_state_dict)
    with pytest.raises(TypeError, match="unexpected keyword argument 'sett'"):
        job.register("y", get=net.state_dict, sett=net.load_state_dict)
    with pytest.raises(TypeError, match="must be callables"):
        job.register("z", net.state_dict)
    with pytest.raises(ValueError, match="registered twice"):
        job.register_stateful("model", model)
