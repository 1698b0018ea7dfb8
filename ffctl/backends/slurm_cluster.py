"""What the Slurm node backend asks Slurm: the allocation's nodes, their states and addresses,
and a requeued job's earlier attempts.

The allocation's nodes come from ``scontrol show hostnames $SLURM_JOB_NODELIST`` (or, on a host
without the Slurm client, from `expand_nodelist`, a parser of the node-list syntax), at most
MAX_NODES of them: a longer list is refused from its bracket ranges before anything is expanded
(`nodelist_size`), names are made one at a time (`iter_nodelist`), and scontrol's answer is read
as it comes and stopped past the cap. Node states come from ``sinfo --Node`` (`parse_node_states`,
`is_out`), a node's address from its ``NodeAddr``.
A requeued job (``SLURM_RESTART_COUNT``) starts from the newest complete disk checkpoint an
earlier attempt of the same job left (`newest_checkpoint`, `resume_checkpoint`). Everything here
is a function of Slurm's answers (the command runner can be swapped for a fake one; scontrol's
node list is read from PATH's scontrol, which a test fakes there); the steps
that run agents and faults are `ffctl.backends.slurm_steps`, the backend `ffctl.backends.slurm`.
"""
from __future__ import annotations

import ipaddress
import json
import os
import re
import shutil
import socket
import subprocess
import threading
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

from fault_injectors.node import DRAIN_REASON_PREFIX
from ffctl.exits import EXIT_NO_REQUEUE, BadInput, InfraError, NoRequeue
from ffctl.launch_spec import LaunchSpec
from runs.store import RunStore

JOB_ID_ENV = "SLURM_JOB_ID"
NODELIST_ENV = "SLURM_JOB_NODELIST"
NODENAME_ENV = "SLURMD_NODENAME"  # the node a step (the batch step included) runs on
RESTART_ENV = "SLURM_RESTART_COUNT"  # how often the job was requeued
COMMAND_TIMEOUT_S = 30.0
# The most nodes an allocation may name. Far above any allocation ffctl drives (one agent and one
# srun step per node; the largest Slurm machines have about 10,000 nodes) and small enough that
# the list costs a few MiB: `SLURM_JOB_NODELIST=n[0-99999999]` would otherwise take gigabytes and
# minutes to expand. A longer list is refused (exit 2) from its ranges alone, before anything is
# expanded or scontrol is asked, and scontrol's answer is read with the same cap.
MAX_NODES = 65_536
MAX_NAME = 1024  # bytes a node name from scontrol may have (Slurm's are far shorter)
# How often the launch asks Slurm for its nodes' states (one sinfo call for all of them).
NODE_POLL_S = 2.0
# Node states (sinfo %T, flags stripped) that take a node out of a job's use.
OUT_STATES = ("down", "drain", "fail")

Runner = Callable[..., "subprocess.CompletedProcess[str]"]


# --------------------------------------------------------------------------------------------
# the allocation's nodes


def _split_top(text: str) -> list[str]:
    """`text` split at the commas outside brackets (``n[1-3,5],m7`` -> ``n[1-3,5]``, ``m7``)."""
    parts: list[str] = []
    depth, start = 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ']' in {text!r}")
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise ValueError(f"unbalanced '[' in {text!r}")
    parts.append(text[start:])
    return [p for p in (p.strip() for p in parts) if p]


def _ranges(body: str, whole: str) -> list[tuple[int, int, int]]:
    """``1-3,05,7-8`` -> (1, 3, 0), (5, 5, 2), (7, 8, 0): each range's bounds and zero padding
    (Slurm keeps a range's padding); ValueError on what is not a range."""
    out: list[tuple[int, int, int]] = []
    for item in body.split(","):
        item = item.strip()
        lo, sep, hi = item.partition("-")
        if not (lo.isascii() and lo.isdigit()) or (sep and not (hi.isascii() and hi.isdigit())):
            raise ValueError(f"bad range {item!r} in {whole!r}")
        if not sep:
            out.append((int(lo), int(lo), len(lo)))
            continue
        if int(hi) < int(lo):
            raise ValueError(f"range {item!r} runs backwards in {whole!r}")
        out.append((int(lo), int(hi), len(lo) if lo.startswith("0") else 0))
    return out


def _groups(item: str, whole: str) -> list[str | list[tuple[int, int, int]]]:
    """One host expression as its literal parts and its bracket groups' ranges, in order:
    ``r[1-2]n[1-2]`` -> "r", [(1, 2, 0)], "n", [(1, 2, 0)]."""
    parts: list[str | list[tuple[int, int, int]]] = []
    rest = item
    while True:
        m = re.search(r"\[([^\[\]]*)\]", rest)
        if m is None:
            if "[" in rest or "]" in rest:
                raise ValueError(f"unbalanced brackets in {whole!r}")
            parts.append(rest)
            return parts
        parts += [rest[: m.start()], _ranges(m.group(1), whole)]
        rest = rest[m.end():]


def _hosts(parts: Sequence[str | list[tuple[int, int, int]]]) -> Iterator[str]:
    """The host names of one expression's parts, lazily: each bracket group a range, the last
    group varying fastest (``r[1-2]n[1-2]``: r1n1 r1n2 r2n1 r2n2)."""
    if not parts:
        yield ""
        return
    head, tail = parts[0], parts[1:]
    if isinstance(head, str):
        for rest in _hosts(tail):
            yield head + rest
        return
    for lo, hi, width in head:
        for value in range(lo, hi + 1):
            for rest in _hosts(tail):
                yield str(value).zfill(width) + rest


def nodelist_size(text: str) -> int:
    """How many host names Slurm's node-list `text` spells (a name listed twice counts twice),
    from the bracket ranges alone: nothing is expanded. ValueError on text it cannot read."""
    total = 0
    for item in _split_top(text.strip()):
        count = 1
        for part in _groups(item, text):
            if not isinstance(part, str):
                count *= sum(hi - lo + 1 for lo, hi, _ in part)
        total += count
    return total


def iter_nodelist(text: str) -> Iterator[str]:
    """Slurm's node-list syntax as host names in order, lazily (duplicates included); the whole
    text is checked before the first name. ValueError on text it cannot read."""
    items = [_groups(item, text) for item in _split_top(text.strip())]
    for parts in items:
        yield from _hosts(parts)


def _too_many(count: int | str) -> str:
    # A count of thousands of digits is past what int-to-text converts (and says nothing more).
    shown = count if isinstance(count, str) or count.bit_length() < 60 else "over 10^18"
    return f"names {shown} nodes, more than the {MAX_NODES} ffctl takes"


def expand_nodelist(text: str, limit: int = MAX_NODES) -> list[str]:
    """Slurm's node-list syntax as host names in order: ``n[1-3,5],m7`` -> n1 n2 n3 n5 m7.

    The fallback for hosts without ``scontrol``; raises ValueError on text it cannot read and on
    a list of more than `limit` names (counted from its ranges, before any is made)."""
    count = nodelist_size(text)
    if count > limit:
        raise ValueError(_too_many(count))
    return list(dict.fromkeys(iter_nodelist(text)))  # in order, each name once


def _shown(nodelist: str) -> str:
    """The node list for a message: a long one cut (an environment variable can be 128 KiB)."""
    return nodelist if len(nodelist) <= 200 else nodelist[:200] + f"... ({len(nodelist)} characters)"


def _scontrol_hostnames(nodelist: str) -> list[str] | None:
    """``scontrol show hostnames NODELIST``, read as it comes and stopped past MAX_NODES names
    (BadInput) or COMMAND_TIMEOUT_S; None where there is no Slurm client or it fails."""
    try:
        # Unbuffered: each read returns what one read(2) gets, never waiting to fill its size.
        proc = subprocess.Popen(["scontrol", "show", "hostnames", nodelist], stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, bufsize=0)
    except OSError:
        return None  # no Slurm client on this host: the node list is read here
    assert proc.stdout is not None
    timer = threading.Timer(COMMAND_TIMEOUT_S, proc.kill)  # a blocked read ends when scontrol dies
    timer.start()
    names: list[str] = []
    tail = b""
    try:
        while chunk := proc.stdout.read(1 << 16):
            words = (tail + chunk).split()
            tail = words.pop() if words and not chunk[-1:].isspace() else b""
            names += [w.decode("utf-8", errors="replace") for w in words]
            if len(names) > MAX_NODES:
                proc.kill()
                raise BadInput(f"{NODELIST_ENV}={_shown(nodelist)}: {_too_many(f'over {MAX_NODES}')} "
                               "(scontrol show hostnames)")
            if len(tail) > MAX_NAME:  # an endless name is as much a runaway as endless names
                proc.kill()
                raise BadInput(f"{NODELIST_ENV}={_shown(nodelist)}: scontrol show hostnames answered a node "
                               f"name of over {MAX_NAME} bytes")
        if tail:
            names.append(tail.decode("utf-8", errors="replace"))
        ended = proc.wait()
    finally:
        timer.cancel()
        proc.stdout.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return names if ended == 0 else None


def allocation(env: Mapping[str, str]) -> tuple[str, list[str]]:
    """(job id, the allocation's node names) from the Slurm environment; BadInput outside one
    and for a node list of more than MAX_NODES names."""
    job = env.get(JOB_ID_ENV, "").strip()
    nodelist = env.get(NODELIST_ENV, "").strip()
    if not job or not nodelist:
        raise BadInput("--backend slurm: not inside a Slurm allocation (no SLURM_JOB_ID and SLURM_JOB_NODELIST); "
                       "run it from an sbatch script or under salloc")
    try:
        count: int | None = nodelist_size(nodelist)
    except ValueError:
        count = None  # a syntax only Slurm reads: scontrol's answer is capped as it is read
    if count is not None and count > MAX_NODES:
        raise BadInput(f"{NODELIST_ENV}={_shown(nodelist)}: {_too_many(count)}")
    names = _scontrol_hostnames(nodelist)
    if not names:
        try:
            names = expand_nodelist(nodelist)
        except ValueError as exc:
            raise BadInput(f"{NODELIST_ENV}={_shown(nodelist)}: {exc}") from None
    if not names:
        raise BadInput(f"{NODELIST_ENV}={_shown(nodelist)}: no nodes")
    return job, names


def split_nodes(spec: LaunchSpec, names: Sequence[str]) -> tuple[list[str], list[str]]:
    """(the job's nodes, the spare nodes): the first `spec.nnodes` names, and the rest."""
    if len(names) < spec.nnodes:
        raise BadInput(f"--nnodes {spec.nnodes}: the Slurm allocation has {len(names)} node(s) "
                       f"({', '.join(names)})")
    return list(names[: spec.nnodes]), list(names[spec.nnodes:])


# --------------------------------------------------------------------------------------------
# requeues


def restart_count(env: Mapping[str, str]) -> int:
    """How often Slurm requeued this job (``SLURM_RESTART_COUNT``; 0 when unset or unreadable)."""
    value = env.get(RESTART_ENV, "").strip()
    return int(value) if value.isdigit() else 0



def check_requeue(count: int, bound: int) -> None:
    """NoRequeue (exit 4) for a job requeued more often than `bound`: nothing starts."""
    if count > bound:
        raise NoRequeue(f"the Slurm job was requeued {count} time(s), more than --max-restarts {bound}: not "
                        f"starting (exit {EXIT_NO_REQUEUE}: do not requeue)")


def newest_checkpoint(runs_dir: Path, job: str, exclude: str = "") -> tuple[str, int, Path] | None:
    """(run id, step, step directory) of the newest complete disk checkpoint any earlier run of
    Slurm job `job` left in `runs_dir` (its run.json names the job); None when there is none."""
    from recovery.disk import complete_steps, step_dir  # torch comes with it: only when resuming

    best: tuple[str, int, Path] | None = None
    for info_path in sorted(runs_dir.glob("*/run.json")):
        run_dir = info_path.parent
        if run_dir.name == exclude:
            continue
        try:
            info = json.loads(info_path.read_text())
        except (OSError, ValueError):
            continue
        slurm = info.get("slurm") if isinstance(info, dict) else None
        if not isinstance(slurm, dict) or str(slurm.get("job_id")) != job:
            continue
        steps = complete_steps(run_dir / "checkpoints")
        if steps and (best is None or steps[-1] > best[1]):
            best = (run_dir.name, steps[-1], step_dir(run_dir / "checkpoints", steps[-1]))
    return best


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)  # checkpoints are written once: a hard link costs no space
    except OSError:
        shutil.copy2(src, dst)


def resume_checkpoint(record: RunStore, job: str) -> dict[str, Any]:
    """A requeued job: the newest complete disk checkpoint an earlier run of `job` left goes
    into this run's record, where the controller finds it and generation 0 restores it; returns
    the record's ``resumed_from`` (run None, step 0: none found, the job starts over)."""
    found = newest_checkpoint(record.path.parent, job, record.run_id)
    if found is None:
        return {"run": None, "step": 0}
    run, step, src = found
    shutil.copytree(src, record.path / "checkpoints" / src.name, copy_function=_link_or_copy)
    return {"run": run, "step": step}


def node_state(host: str, run: Runner = subprocess.run) -> str | None:
    """Slurm's state of `host` (``IDLE``, ``MIXED``, ``DOWN+DRAIN``...) with its reason if any;
    None when scontrol cannot say."""
    try:
        out = run(["scontrol", "show", "node", host, "--oneliner"], capture_output=True, text=True,
                  timeout=COMMAND_TIMEOUT_S, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    state = re.search(r"\bState=(\S+)", out)
    reason = re.search(r"\bReason=(.*?)(?: \w+=|$)", out)
    if state is None:
        return None
    return state.group(1) + (f" ({reason.group(1).strip()})" if reason and reason.group(1).strip() else "")


def sinfo_argv(hosts: Sequence[str]) -> list[str]:
    """One line per node: ``NAME|STATE|REASON`` (``sinfo --Node``)."""
    return ["sinfo", "--noheader", "--Node", f"--nodes={','.join(hosts)}", "--format=%N|%T|%E"]


def parse_node_states(text: str) -> dict[str, tuple[str, str]]:
    """``sinfo --Node --format=%N|%T|%E`` output as {node: (state, reason)}; a node listed once
    per partition counts once, lines it cannot read are skipped."""
    states: dict[str, tuple[str, str]] = {}
    for line in text.splitlines():
        name, sep, rest = line.strip().partition("|")
        state, _, reason = rest.partition("|")
        if sep and name and state:
            states.setdefault(name, (state.strip(), "" if reason.strip() == "none" else reason.strip()))
    return states


def is_out(state: str) -> bool:
    """Whether a node in `state` is out of use: DOWN, DRAIN(ED/ING), FAIL(ING), with or without
    sinfo's flag characters (``down*``, ``drained~``) or another state joined by '+'."""
    return any(word.strip("*~#%$@!^-").lower().startswith(OUT_STATES) for word in state.split("+"))


def ffctl_drained(states: Mapping[str, tuple[str, str]], run_id: str | None = None) -> list[str]:
    """The nodes ffctl drained (its reason mark), all runs' or one run's, still out of use."""
    mark = DRAIN_REASON_PREFIX + (f"{run_id}:" if run_id else "")
    return [n for n, (state, reason) in states.items() if is_out(state) and reason.startswith(mark)]


def node_address(host: str, run: Runner = subprocess.run) -> str:
    """The address Slurm reaches `host` on (its NodeAddr), as an IP address."""
    addr = host
    try:
        out = run(["scontrol", "show", "node", host, "--oneliner"], capture_output=True, text=True,
                  timeout=COMMAND_TIMEOUT_S, check=False)
        m = re.search(r"\bNodeAddr=(\S+)", out.stdout)
        if m:
            addr = m.group(1)
    except (OSError, subprocess.TimeoutExpired):
        pass
    try:
        return str(ipaddress.ip_address(addr))
    except ValueError:
        pass
    try:
        return str(socket.getaddrinfo(addr, None, socket.AF_INET)[0][4][0])
    except (OSError, IndexError):
        raise InfraError(f"Slurm node {host}: cannot resolve its address {addr!r}") from None


def bindable(address: str) -> bool:
    try:
        with socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET) as sock:
            sock.bind((address, 0))
        return True
    except OSError:
        return False


def route_source(destination: str, run: Runner = subprocess.run) -> str:
    """This host's source address on its route to `destination` (``ip route get``); "" if none."""
    try:
        words = run(["ip", "route", "get", destination], capture_output=True, text=True,
                    timeout=COMMAND_TIMEOUT_S, check=False).stdout.split()
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return words[words.index("src") + 1] if "src" in words[:-1] else ""


def interface_of(address: str, ip_addr_output: str) -> str | None:
    """The interface `ip -o addr show` lists `address` on."""
    for line in ip_addr_output.splitlines():
        words = line.split()
        if len(words) >= 4 and words[2] in ("inet", "inet6") and words[3].split("/", 1)[0] == address:
            return words[1].rstrip(":").split("@", 1)[0]
    return None


class NodeStatePoller:
    """Asks Slurm for the states of the nodes `hosts()` names every NODE_POLL_S (one `sinfo` for
    all of them) and hands what it reads to `seen`, on a thread of its own, from `start` to `stop`."""

    def __init__(self, hosts: Callable[[], list[str]], seen: Callable[[dict[str, tuple[str, str]]], None],
                 run: Runner = subprocess.run) -> None:
        self._hosts = hosts
        self._seen = seen
        self._run = run
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="ffctl-slurm-nodes", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=COMMAND_TIMEOUT_S)

    def _loop(self) -> None:
        while not self._stop.wait(NODE_POLL_S):
            try:
                out = self._run(sinfo_argv(self._hosts()), capture_output=True, text=True,
                                timeout=COMMAND_TIMEOUT_S, check=False)
            except (OSError, subprocess.TimeoutExpired):
                continue
            if out.returncode == 0:
                self._seen(parse_node_states(out.stdout))


def drained_here(run_id: str | None) -> tuple[str, ...]:
    """The Slurm nodes ffctl drained (all runs', or `run_id`'s) as this machine's Slurm client
    lists them; none where there is no client or it cannot reach its controller."""
    if shutil.which("sinfo") is None:
        return ()
    try:
        out = subprocess.run(["sinfo", "--noheader", "--Node", "--format=%N|%T|%E"], capture_output=True,
                             text=True, timeout=COMMAND_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return ()
    return tuple(ffctl_drained(parse_node_states(out.stdout), run_id)) if out.returncode == 0 else ()
