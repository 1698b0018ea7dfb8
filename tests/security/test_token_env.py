"""The job token is in no environment a worker's program can read: not in `os.environ` when the
program starts, not in the process's initial environment (/proc/self/environ), not in what its
children inherit; the recovery library still holds it, so the rank's reports reach the run."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from runs.events import EventKind
from tests.helpers.launch import assert_nothing_left, launch, rid

# Whole jobs launched and trained, often several a test: minutes on a loaded 2-core host.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

LOOK = textwrap.dedent("""
    import json, os, subprocess, sys
    from recovery import report_step
    from wire.jobenv import job_token

    with open("/proc/self/environ", "rb") as fh:
        initial = fh.read().decode(errors="replace")
    child = subprocess.run([sys.executable, "-c", "import os, json; print(json.dumps(dict(os.environ)))"],
                           capture_output=True, text=True, check=True).stdout
    seen = {"environ": json.dumps(dict(os.environ)), "initial": initial, "child": child,
            "library_has_it": bool(job_token())}
    with open(os.path.join(sys.argv[1], f"rank{os.environ['RANK']}.json"), "w") as fh:
        json.dump(seen, fh)
    report_step(1, 0.5)
""")


@pytest.mark.parametrize("recovery", ["peer", "restart-disk"])  # forked from the template; fresh interpreters
def test_no_environment_of_a_worker_holds_the_token(tmp_path: Path, recovery: str) -> None:
    script = tmp_path / "look.py"
    script.write_text(LOOK)
    out = tmp_path / "seen"
    out.mkdir()
    run_id = rid("token")
    extra = ["--ckpt-every", "1"] if recovery == "restart-disk" else []
    res = launch(tmp_path, run_id, "--nproc-per-node", "2", "--recovery", recovery, *extra, str(script), str(out))
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    token = (res.runs_dir / run_id / "token").read_text().strip()
    assert len(token) >= 32
    for rank in (0, 1):
        seen = json.loads((out / f"rank{rank}.json").read_text())
        assert seen["library_has_it"] is True
        for where in ("environ", "initial", "child"):
            assert token not in seen[where], (rank, where)
            assert "FFCTL_TOKEN" not in seen[where], (rank, where)
    # The library used it: the sealed step reports reached the controller.
    assert any(e.kind is EventKind.STEP and e.get("step") == 1 for e in res.events)
    assert_nothing_left(tmp_path)


def test_the_token_reaches_the_library_not_the_environment_through_an_assignment(tmp_path: Path) -> None:
    # In-process: what a worker does with its assignment before the program runs.
    code = textwrap.dedent("""
        import json, os, sys
        from ffctl.agent.template import Assignment, run_assignment
        os.environ["FFCTL_TOKEN"] = "stale-from-the-host"
        prog = sys.argv[1]
        run_assignment(Assignment(dict(os.environ), (prog,), "", "", "s3cret-token-value"))
    """)
    prog = tmp_path / "prog.py"
    prog.write_text("import os\nfrom wire.jobenv import job_token\n"
                    "print(job_token(), 'FFCTL_TOKEN' in os.environ)\n")
    proc = subprocess.run([sys.executable, "-c", code, str(prog)], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).parents[2])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["s3cret-token-value", "False"]
