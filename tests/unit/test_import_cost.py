"""What the short-lived processes import: the CLI and every agent start on each launch (and the
CLI on each `ffctl report`), so what they load beyond torch is start-up time of every job."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _python(code: str, timeout: float = 60) -> str:
    """What a fresh interpreter in the source tree prints running `code` (which must succeed)."""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def test_the_cli_and_the_agent_do_not_load_distributed_tensors() -> None:
    # torch.distributed.tensor brings sympy: half a second of CPU per process. Only a worker
    # that shards its model needs it (and the worker template loads it for its forks).
    code = ("import sys; import ffctl.cli.app, ffctl.agent.agent; "
            "print(sorted(m for m in ('torch.distributed.tensor', 'sympy') if m in sys.modules))")
    assert _python(code).strip() == "[]"


def test_commands_that_train_nothing_do_not_load_torch() -> None:
    # `ffctl report`, `project`, `--help` and a launch refused for its command line read files
    # and print: torch is a second and a half of CPU they have no use for.
    code = ("import sys; from ffctl.cli.app import main; import recovery; "
            "from recovery import PeerFailure; from wire import jobenv, messages; print('torch' in sys.modules)")
    assert _python(code).strip() == "False"
    # ...while what a training script imports is all there.
    code = "import recovery; print(recovery.Job.__name__, recovery.StepContext.__name__, recovery.report_step.__name__)"
    assert _python(code).split() == ["Job", "StepContext", "report_step"]


def test_a_dtensor_is_still_snapshotted_as_its_local_shard() -> None:
    # Loaded lazily, the DTensor class must still be recognised once the user's code has loaded it.
    code = """
import os, torch, torch.distributed as dist
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="0")
store = dist.HashStore()
dist.init_process_group("gloo", store=store, rank=0, world_size=1)
from recovery.snapshot import _dtensor_type
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.device_mesh import init_device_mesh
assert _dtensor_type() is DTensor
mesh = init_device_mesh("cpu", (1,))
t = distribute_tensor(torch.arange(4.0), mesh)
from recovery.snapshot import _flatten
out = []
ref = _flatten({"w": t}, out)
print(type(ref["w"]).__name__, out[0].tolist())
dist.destroy_process_group()
"""
    assert _python(code, timeout=90).split()[-5:] == ["_ShardRef", "[0.0,", "1.0,", "2.0,", "3.0]"]
