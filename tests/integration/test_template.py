"""The worker template: workers forked from a warm process run their program exactly as a fresh
interpreter would, are adopted by the agent, and die with it."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest

from tests.helpers.netns import wait_for

# A real worker template (torch imported) forks workers in each test.
pytestmark = pytest.mark.timeout(300)

# Plays the agent: makes itself the subreaper, starts the template, forks workers through it and
# reports what it saw as one JSON line. A separate process, so the test runner itself never
# becomes a subreaper of whatever else the suite starts.
DRIVER = textwrap.dedent("""
    import json, os, sys, time
    from pathlib import Path
    from ffctl.agent.template import Assignment, Template, set_child_subreaper, threads_now
    assert set_child_subreaper()
    tmp = Path(sys.argv[1])
    base = {**os.environ, "TEMPLATE_ONLY": "1"}
    t = Template(sys.executable, base, str(tmp), tmp / "template.log")
    t.start()
    assert t.wait_ready(120), (tmp / "template.log").read_text()
    template_threads = len(os.listdir(f"/proc/{t.proc.pid}/task"))
    out = {"template_threads": template_threads, "workers": []}
    for argv in json.loads(sys.argv[2]):
        env = {k: v for k, v in os.environ.items()}
        env["RANK"] = "3"
        t0 = time.monotonic()
        n = len(out["workers"])
        w = t.fork(Assignment(env, tuple(argv), str(tmp / f"w{n}.log"), str(tmp), err=str(tmp / f"w{n}.err")))
        forked = time.monotonic() - t0
        if argv[-1] == "hold":
            print(json.dumps({"holding": w.pid}), flush=True)
            time.sleep(600)
        code = w.wait(60)
        out["workers"].append({"pid": w.pid, "code": code, "fork_s": forked})
    t.stop()
    print(json.dumps(out), flush=True)
""")

SCRIPT = textwrap.dedent("""
    import json, os, sys, threading
    print(json.dumps({
        "name": __name__, "argv": sys.argv, "rank": os.environ.get("RANK"),
        "template_only": os.environ.get("TEMPLATE_ONLY"), "cwd": os.getcwd(),
        "ppid": os.getppid(), "torch": "torch" in sys.modules, "threads": threading.active_count(),
        "warm": sorted(m for m in ("torch.distributed.tensor", "torch.distributed.checkpoint.state_dict")
                       if m in sys.modules),
    }), flush=True)
    if sys.argv[1] == "fail":
        raise RuntimeError("boom from the worker")
    if sys.argv[1] == "hold":
        import time; time.sleep(600)
    sys.exit(int(sys.argv[1]))
""")


def _drive(tmp_path: Path, argvs: list[list[str]]) -> tuple[dict, subprocess.CompletedProcess[str]]:
    proc = subprocess.run([sys.executable, "-c", DRIVER, str(tmp_path), json.dumps(argvs)],
                          capture_output=True, text=True, timeout=300, cwd=Path(__file__).parents[2])
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1]), proc


def test_a_forked_worker_runs_its_script_as_a_fresh_interpreter_would(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    work = tmp_path / "work"
    work.mkdir()
    out, proc = _drive(tmp_path, [[str(script), "7", "--lr", "0.1"], [str(script), "fail"]])
    assert out["template_threads"] == 1  # safe to fork: nothing but the main thread
    ok, failed = out["workers"]
    assert ok["code"] == 7 and failed["code"] == 1
    seen = json.loads((tmp_path / "w0.log").read_text().splitlines()[0])
    assert seen["name"] == "__main__"
    assert seen["argv"] == [str(script), "7", "--lr", "0.1"]
    assert seen["rank"] == "3"  # the worker's own environment...
    assert seen["template_only"] is None  # ...and nothing of the template's
    assert seen["torch"] and seen["threads"] == 1
    # What an FSDP replacement would otherwise import between joining and restoring.
    assert seen["warm"] == ["torch.distributed.checkpoint.state_dict", "torch.distributed.tensor"]
    assert seen["cwd"] == str(tmp_path)
    # Its stderr in its own log, apart from its stdout, as torchrun keeps them.
    err = (tmp_path / "w1.err").read_text()
    assert "RuntimeError: boom from the worker" in err and "Traceback" in err
    assert "Traceback" not in (tmp_path / "w1.log").read_text()


def test_a_module_runs_as_main(tmp_path: Path) -> None:
    pkg = tmp_path / "mymod.py"
    pkg.write_text(SCRIPT)
    out, _ = _drive(tmp_path, [["-m", "mymod", "0"]])
    assert out["workers"][0]["code"] == 0
    seen = json.loads((tmp_path / "w0.log").read_text().splitlines()[0])
    assert seen["name"] == "__main__" and seen["argv"][1:] == ["0"]


def test_workers_are_adopted_by_the_agent_and_die_with_it(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    driver = subprocess.Popen([sys.executable, "-c", DRIVER, str(tmp_path), json.dumps([[str(script), "hold"]])],
                              stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parents[2])
    try:
        assert driver.stdout is not None
        line = driver.stdout.readline()
        worker = json.loads(line)["holding"]
        assert wait_for(lambda: (tmp_path / "w0.log").exists() and (tmp_path / "w0.log").read_text(), 60.0)
        assert psutil.Process(worker).ppid() == driver.pid  # adopted: the agent watches it as its child
        seen = json.loads((tmp_path / "w0.log").read_text().splitlines()[0])
        assert seen["ppid"] == driver.pid
        driver.send_signal(signal.SIGKILL)
        driver.wait(30)
        assert wait_for(lambda: not psutil.pid_exists(worker) or psutil.Process(worker).status() == psutil.STATUS_ZOMBIE, 30.0)
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
