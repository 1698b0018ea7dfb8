"""The dead man's switch: a revert that runs on the target host by itself if ffctl cannot.

For each revertible fault with a duration, a small detached `sh -c` process on the target host
(inside the node's network namespace, if any) sleeps duration + grace, then runs the fault's
revert commands. It is started with `Transport.spawn_detached` before the fault is applied, so it
outlives a SIGKILLed ffctl and a cut SSH connection. It needs nothing but a POSIX shell there.

Its argv carries the owner tag `ffctl-deadman:<run_id>:<fault_id>` (as the script's `$0`), so it
is found again with `pgrep -f`:
- SIGTERM cancels it (after a normal revert), killing its sleep too;
- SIGUSR1 makes it revert now (what `ffctl inject revert --all` does);
- SIGHUP is ignored, so a closing SSH session does not take it down.

Revert commands reach the script as counted positional words (`N word1 .. wordN`) and are run
through an `eval` of parameter references only, so no host name, path or interface name is ever
parsed by the shell.

When it reverts (its timer ran out, or SIGUSR1), a switch given a record file (`-r PATH`, the
node's `logs/<node>/deadman.jsonl` in the run directory on that host) appends one JSON line:
`{"fault_id", "t", "by": "deadman", "trigger": "timer"|"signal", "ok", "exit"}`, `exit` being
the first failing revert command's status (0 when all succeeded). It is one short `printf` with
`>>` (O_APPEND), so lines from several switches never interleave. The path is a positional word
like the rest. `runs.store` merges these lines into the run's events as `fault_reverted`, which
is how a record whose controller was killed still learns that its fault was reverted.

This module also owns the fault's identity on a host: `fault_id(spec)` and the owner tags the
network faults put on their iptables rules and links.
"""
from __future__ import annotations

import hashlib
import math
import re
from collections import OrderedDict
from dataclasses import replace
from typing import Callable

from fault_injectors.plan import FaultPlan, HostCommand, Role, run_commands
from wire.fault_spec import FaultSpec
from fault_injectors.transport import CommandResult, Transport

DEADMAN_PREFIX = "ffctl-deadman"
DEFAULT_GRACE_S = 5.0
# A revertible fault always ends: without duration= it ends after this many seconds.
DEFAULT_DURATION_S = 30.0

TransportFor = Callable[[HostCommand], Transport]

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")

# Name of the file, in a node's log directory, a switch appends its line to (runs.store reads it).
RECORD_NAME = "deadman.jsonl"

# $0 is the owner tag, $1 the delay, then optionally `-r FILE`, then counted revert commands.
# A count is digits, `?` first for a command whose failure is expected (SIGCONT to a rank that may
# be gone): it does not make the recorded revert fail. So `-r` cannot be mistaken for a count.
DEADMAN_SCRIPT = r"""trap '' HUP
p= f=
trap '[ -z "$p" ] || kill "$p" 2>/dev/null; exit 0' TERM INT
trap 'f=1; [ -z "$p" ] || kill "$p" 2>/dev/null' USR1
sleep "$1" & p=$!
[ -z "$f" ] || kill "$p" 2>/dev/null
wait "$p"
trap '' TERM INT USR1
shift
r=
if [ "$#" -ge 2 ] && [ "$1" = -r ]; then r=$2; shift 2; fi
rc=0
while [ "$#" -gt 0 ]; do
  n=$1; shift
  a=; case $n in "?"*) a=1; n=${n#"?"} ;; esac
  c=; i=1
  while [ "$i" -le "$n" ]; do c="$c \"\${$i}\""; i=$((i + 1)); done
  eval "$c" >/dev/null 2>&1 </dev/null || { e=$?; [ -n "$a" ] || [ "$rc" -ne 0 ] || rc=$e; }
  shift "$n"
done
[ -n "$r" ] || exit 0
t=$(date +%s.%N 2>/dev/null); case $t in ''|*[!0-9.]*|.*|*.) t=$(date +%s 2>/dev/null) ;; esac
case $t in ''|*[!0-9.]*) t=null ;; esac
w=timer; [ -z "$f" ] || w=signal
ok=true; [ "$rc" -eq 0 ] || ok=false
{ printf '{"fault_id":"%s","t":%s,"by":"deadman","trigger":"%s","ok":%s,"exit":%d}\n' \
    "${0##*:}" "$t" "$w" "$ok" "$rc" >>"$r"; } 2>/dev/null || :
"""

# pkill's own command line holds the pattern too; `[f]fctl` matches the tag but not itself.
CANCEL_SCRIPT = r"""pkill -"$1" -f -- "$2"; r=$?; [ "$r" -le 1 ]"""


def safe_id(text: str) -> str:
    """`text` with only [A-Za-z0-9._-]: owner tags are split on ':' and matched as patterns."""
    return _UNSAFE.sub("_", text) or "_"


def fault_id(spec: FaultSpec) -> str:
    """The fault's id: the one the controller gave (`with_fault_id`), else a digest of the spec.

    The digest keeps plans pure and `--dry-run` stable; two identical ad hoc faults of one run
    would share it, which is why the controller should always set its own id.
    """
    if spec.fault_id:
        return safe_id(spec.fault_id)
    text = repr((spec.kind.value, str(spec.target), str(spec.trigger), spec.duration, spec.seed, spec.options))
    return "s" + hashlib.sha1(text.encode()).hexdigest()[:10]


def with_fault_id(spec: FaultSpec, fid: str) -> FaultSpec:
    """`spec` carrying the controller's fault id, so rules and guards are tagged with it."""
    return replace(spec, fault_id=fid)


def owner_tag(run_id: str, fid: str) -> str:
    """Comment put on everything a fault installs: `ffctl:<run_id>:<fault_id>`."""
    return f"ffctl:{safe_id(run_id)}:{safe_id(fid)}"


def deadman_tag(run_id: str, fid: str) -> str:
    return f"{DEADMAN_PREFIX}:{safe_id(run_id)}:{safe_id(fid)}"


def duration_of(spec: FaultSpec) -> float:
    return spec.duration if spec.duration is not None else DEFAULT_DURATION_S


def _ere(text: str) -> str:
    return re.sub(r"([.\[\]()*+?{}|^$\\])", r"\\\1", text)


def pattern(run_id: str | None = None, fid: str | None = None) -> str:
    """pgrep/pkill pattern for the switches of a fault, a run, or (both None) every run."""
    if run_id is None:
        return f"[f]{DEADMAN_PREFIX[1:]}:"
    tag = f"{DEADMAN_PREFIX[1:]}:{_ere(safe_id(run_id))}:"
    return f"[f]{tag}" if fid is None else f"[f]{tag}{_ere(safe_id(fid))}( |$)"


def record_file(record_dir: str, node: int) -> str:
    """Where the switches of `node` append their lines: `<record_dir>/logs/<node>/deadman.jsonl`.

    `record_dir` is the run directory as the target host sees it (the run record itself for
    local and sandboxed nodes, the remote run directory over SSH, whose logs come home with the
    node's other logs).
    """
    return f"{record_dir.rstrip('/') or ''}/logs/{node}/{RECORD_NAME}"


def deadman_command(
    run_id: str, fid: str, reverts: tuple[HostCommand, ...], delay_s: float, record: str | None = None
) -> HostCommand:
    """One switch for reverts that all run on the same node, host and namespace; with `record`,
    it appends a line to that file when it reverts."""
    first = reverts[0]
    words: list[str] = ["-r", record] if record else []
    for cmd in reverts:
        words += [("?" if cmd.allow_fail else "") + str(len(cmd.argv)), *cmd.argv]
    # Whole seconds: POSIX sleep takes no fractions. Rounded up, never early.
    tag = deadman_tag(run_id, fid)
    argv = ("sh", "-c", DEADMAN_SCRIPT, tag, str(max(1, math.ceil(delay_s))), *words)
    return HostCommand(first.node, first.host, argv, netns=first.netns, role=Role.DEADMAN, about=tag)


def guard(
    plan: FaultPlan, run_id: str, grace: float = DEFAULT_GRACE_S, record_dir: str | None = None
) -> FaultPlan:
    """`plan` with a dead man's switch per (node, host, namespace) of its revert commands.

    Works for any revertible plan (network faults, hang-rank); a plan that already has switches
    or nothing to revert comes back unchanged. With `record_dir` (the run directory on the
    target hosts), each switch records its revert there (`record_file`).
    """
    if plan.deadman or not plan.revert:
        return plan
    groups: OrderedDict[tuple[int, str, str | None], list[HostCommand]] = OrderedDict()
    for cmd in plan.revert:
        groups.setdefault((cmd.node, cmd.host, cmd.netns), []).append(cmd)
    fid = fault_id(plan.spec)
    delay = duration_of(plan.spec) + grace
    deadman = tuple(
        deadman_command(run_id, fid, tuple(cmds), delay,
                        record_file(record_dir, node) if record_dir else None)
        for (node, _, _), cmds in groups.items()
    )
    return replace(plan, deadman=deadman)


def tag_of(cmd: HostCommand) -> str | None:
    """The owner tag of a switch command, None for any other command."""
    return cmd.about if cmd.role is Role.DEADMAN else None


def signal_command(node: int, host: str, pat: str, signal: str) -> HostCommand:
    """pkill -SIGNAL the switches matching `pat` on a host (none found is fine).

    Runs outside any namespace: processes are seen from every network namespace, and the
    fault's namespace may already be gone.
    """
    return HostCommand(node, host, ("sh", "-c", CANCEL_SCRIPT, "sh", signal, pat))


def cancel_commands(plan: FaultPlan) -> tuple[HostCommand, ...]:
    """Commands that stop the plan's switches without reverting (after a normal revert)."""
    out = []
    for cmd in plan.deadman:
        tag = tag_of(cmd)
        if tag is None:
            continue
        _, run_id, fid = tag.split(":", 2)
        out.append(signal_command(cmd.node, cmd.host, pattern(run_id, fid), "TERM"))
    return tuple(dict.fromkeys(out))


def arm(plan: FaultPlan, transport_for: TransportFor, timeout: float = 30.0) -> None:
    """Start the plan's switches on their hosts (before applying the fault)."""
    for cmd in plan.deadman:
        transport_for(cmd).spawn_detached(cmd.argv, timeout=timeout)


def disarm(plan: FaultPlan, transport_for: TransportFor, timeout: float = 30.0) -> list[CommandResult]:
    return run_commands(cancel_commands(plan), transport_for, timeout)


def apply_guarded(plan: FaultPlan, transport_for: TransportFor, timeout: float = 30.0) -> list[CommandResult]:
    """Arm the switches, then apply. If applying fails half way, revert and disarm, then raise.

    Call the family's preflight first (`network.preflight`): it is what fails before anything
    is touched.
    """
    arm(plan, transport_for, timeout)
    try:
        return run_commands(plan.apply, transport_for, timeout)
    except Exception:
        try:
            revert_guarded(plan, transport_for, timeout)
        except Exception:  # the switch stays armed and reverts later
            pass
        raise


def revert_guarded(plan: FaultPlan, transport_for: TransportFor, timeout: float = 30.0) -> list[CommandResult]:
    """Revert, then cancel the switches. A failed revert leaves them armed as the fallback."""
    results = run_commands(plan.revert, transport_for, timeout)
    results += disarm(plan, transport_for, timeout)
    return results


__all__ = [
    "DEADMAN_PREFIX", "DEFAULT_DURATION_S", "DEFAULT_GRACE_S", "RECORD_NAME", "apply_guarded", "arm",
    "cancel_commands", "deadman_command", "deadman_tag", "disarm", "duration_of", "fault_id", "guard",
    "owner_tag", "pattern", "record_file", "revert_guarded", "safe_id", "signal_command", "tag_of", "with_fault_id",
]
