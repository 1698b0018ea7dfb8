"""An allocation's node list that names more nodes than any real one: `SLURM_JOB_NODELIST=n[0-99999999]`
is refused within a second, in one line naming the count and the cap, without expanding it (the
check runs in a child process under a memory limit and a deadline, so an expansion fails the
test instead of the host); a `scontrol show hostnames` that answers without end is cut off at the
cap; a normal list still expands as Slurm spells it."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ffctl.backends.slurm_cluster import MAX_NODES, expand_nodelist, iter_nodelist, nodelist_size
from ffctl.exits import BadInput

ROOT = Path(__file__).resolve().parents[2]
HUGE = "n[0-99999999]"
MEMORY_LIMIT = 1 << 30  # address space of the child: an expansion of HUGE needs gigabytes
DEADLINE_S = 20.0

REFUSE = textwrap.dedent("""
    import json, resource, sys, time, tracemalloc
    resource.setrlimit(resource.RLIMIT_AS, (int(sys.argv[2]), int(sys.argv[2])))
    from ffctl.backends.slurm_cluster import allocation
    from ffctl.exits import BadInput

    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        allocation({"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": sys.argv[1]})
        why = None
    except BadInput as exc:
        why = str(exc)
    print(json.dumps({"why": why, "s": time.perf_counter() - t0, "peak": tracemalloc.get_traced_memory()[1]}))
""")


def _refused(nodelist: str, path: str) -> dict[str, object]:
    env = {**os.environ, "PATH": path}
    try:
        out = subprocess.run([sys.executable, "-c", REFUSE, nodelist, str(MEMORY_LIMIT)], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=DEADLINE_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"SLURM_JOB_NODELIST={nodelist}: still reading it after {DEADLINE_S:.0f} s")
    assert out.returncode == 0, out.stderr[-2000:]
    got: dict[str, object] = json.loads(out.stdout)
    return got


@pytest.mark.parametrize("nodelist,count", [(HUGE, "100000000"), ("a[0-9999]b[0-9999]", "100000000"),
                                            ("n[0-65535],m1", "65537")])
def test_a_node_list_past_the_cap_is_refused_at_once_in_one_line(nodelist: str, count: str, tmp_path: Path) -> None:
    # No Slurm client (the fallback parser reads the list) and a real one's stand-in alike: the
    # list is refused from its ranges before either sees it.
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "scontrol").write_text("#!/bin/sh\nexec yes node\n")
    (fake / "scontrol").chmod(0o755)
    for path in ("/nonexistent", f"{fake}{os.pathsep}/usr/bin{os.pathsep}/bin"):
        got = _refused(nodelist, path)
        why = got["why"]
        assert isinstance(why, str) and "\n" not in why, got
        assert count in why and str(MAX_NODES) in why and nodelist in why, why
        assert isinstance(got["s"], float) and got["s"] < 1.0, got
        assert isinstance(got["peak"], int) and got["peak"] < 1 << 20, got  # under 1 MiB of Python memory


def test_scontrol_answering_without_end_is_cut_off_at_the_cap(tmp_path: Path) -> None:
    # A list only Slurm reads (not the parser here): scontrol's answer is read as it comes.
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "scontrol").write_text("#!/bin/sh\nexec yes node\n")
    (fake / "scontrol").chmod(0o755)
    got = _refused("n[1-2", f"{fake}{os.pathsep}/usr/bin{os.pathsep}/bin")
    why = got["why"]
    assert isinstance(why, str) and f"names over {MAX_NODES} nodes" in why and "scontrol" in why, got
    assert isinstance(got["s"], float) and got["s"] < 5.0, got
    # One name without end is cut off too.
    (fake / "scontrol").write_text("#!/bin/sh\nexec cat /dev/zero\n")
    got = _refused("n[1-2", f"{fake}{os.pathsep}/usr/bin{os.pathsep}/bin")
    assert isinstance(got["why"], str) and "a node name of over 1024 bytes" in got["why"], got


def test_a_normal_node_list_expands_as_before() -> None:
    assert expand_nodelist("n[01-03,7],gpu[1-2]") == ["n01", "n02", "n03", "n7", "gpu1", "gpu2"]
    assert nodelist_size("n[01-03,7],gpu[1-2]") == 6
    assert expand_nodelist("r[1-2]n[08-09]") == ["r1n08", "r1n09", "r2n08", "r2n09"]
    assert next(iter_nodelist(HUGE)) == "n0"  # lazily: the first name without the other 99,999,999
    hosts = expand_nodelist(f"n[0-{MAX_NODES - 1}]")  # the cap itself is taken
    assert len(hosts) == MAX_NODES and hosts[-1] == f"n{MAX_NODES - 1}"
    with pytest.raises(ValueError, match=f"names {MAX_NODES + 1} nodes, more than the {MAX_NODES}"):
        expand_nodelist(f"n[0-{MAX_NODES}]")


def test_the_cli_refuses_it_with_exit_2_and_one_line(tmp_path: Path) -> None:
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("SLURM_")},
           "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": HUGE, "PATH": os.path.dirname(sys.executable)}
    out = subprocess.run([sys.executable, "-m", "ffctl", "launch", "--backend", "slurm", "--dry-run"], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=120)
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == 2 and len(lines) == 1, out.stderr[-2000:]
    assert "100000000" in lines[0] and str(MAX_NODES) in lines[0], lines


def test_bad_input_is_what_a_past_cap_list_raises() -> None:
    from ffctl.backends.slurm_cluster import allocation
    with pytest.raises(BadInput, match="more than the 65536"):
        allocation({"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": HUGE})
