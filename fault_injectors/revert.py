"""`ffctl inject revert --all`: remove everything ffctl left on a host, whatever the record says.

Found by owner tag, never by stored state:
1. dead man's switches (`ffctl-deadman:<run>:<fault>` in their argv) are told to revert now
   (SIGUSR1), which also resumes ranks a guarded hang-rank stopped; then waited for;
2. iptables/ip6tables: every jump to a `FFCTL-*` chain, then the chains;
3. tc: every root qdisc with the reserved handle `ffc1:`, on every interface;
4. links whose alias starts with `ffctl-down:` are brought up and get their old alias back;
5. shared memory: each run directory of ours (`/dev/shm/ffctl-<run>-<key>/`, see `runs.shm`) that
   no live process holds (none of its lock files is locked) is removed with its slots, fault
   files and FIFOs, one line each (what a controller or agent killed with SIGKILL left behind).

Each step is a script that succeeds when there is nothing to remove, so the whole thing is
idempotent. Run it once per host and once per sandbox namespace (`netns=`).
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Callable, Iterable

from fault_injectors import deadman, network
from fault_injectors.plan import HostCommand, Role
from fault_injectors.transport import CommandResult, Transport
from runs.shm import SHM_ROOT

HOST_NODE = -1  # HostCommand.node for commands that belong to a host, not to a node of a run

# $1 pkill pattern of the switches. Fire them, then give them up to 10 s to finish reverting.
FIRE_DEADMEN = r"""pkill -USR1 -f -- "$1"; r=$?; [ "$r" -le 1 ] || exit "$r"
i=0
while pgrep -f -- "$1" >/dev/null 2>&1; do
  i=$((i + 1)); [ "$i" -le 100 ] || { echo "dead man's switches still running after 10s"; exit 1; }
  sleep 0.1 2>/dev/null || sleep 1
done
"""

# $1 chain prefix. Jumps are deleted by line number (read back from iptables, never eval'd).
IPTABLES_SWEEP = r"""p=$1 rc=0
for ipt in iptables ip6tables; do
  command -v "$ipt" >/dev/null 2>&1 || continue
  "$ipt" -w -S >/dev/null 2>&1 || continue
  for base in $("$ipt" -w -S | awk '$1 == "-P" || $1 == "-N" { print $2 }'); do
    for n in $("$ipt" -w -n -L "$base" --line-numbers 2>/dev/null |
               awk -v p="$p" 'NR > 2 && index($2, p) == 1 { print $1 }' | sort -rn); do
      "$ipt" -w -D "$base" "$n" || rc=1
    done
  done
  for c in $("$ipt" -w -S | awk -v p="$p" '$1 == "-N" && index($2, p) == 1 { print $2 }'); do
    "$ipt" -w -F "$c" && "$ipt" -w -X "$c" || rc=1
  done
done
exit "$rc"
"""

# $1 reserved handle (`ffc1:`). `tc qdisc show` lines: qdisc KIND HANDLE dev IF root ...
TC_SWEEP = r"""command -v tc >/dev/null 2>&1 || exit 0
for dev in $(tc qdisc show | awk -v h="$1" '$3 == h && $4 == "dev" && $6 == "root" { print $5 }'); do
  tc qdisc del dev "$dev" root handle "$1"
done
! tc qdisc show | awk -v h="$1" '$3 == h && $6 == "root" { found = 1 } END { exit !found }'
"""

# $1 alias prefix (`ffctl-down`). The alias is `ffctl-down:<run>:<fault>:<old alias>`.
LINK_SWEEP = r"""rc=0
for f in /sys/class/net/*/ifalias; do
  a=$(cat "$f" 2>/dev/null) || continue
  case $a in "$1":*) ;; *) continue ;; esac
  d=${f%/ifalias}; d=${d##*/}
  old=${a#"$1":*:*:}
  ip link set dev "$d" up && ip link set dev "$d" alias "$old" || rc=1
done
exit "$rc"
"""

# $1 the shared-memory root, $2 a run id ('' for every run). Only a real directory of ours, named
# as a run's is (ffctl-<run>-<32 hex>), mode 0700, none of whose locks a live process holds (an
# agent's node claim, the launcher's hold: flock, released by the kernel when its holder dies).
# Without flock(1) nothing can be shown dead and nothing is removed.
SHM_SWEEP = r"""rc=0
for d in "$1"/ffctl-*; do
  [ -d "$d" ] && [ ! -L "$d" ] && [ -O "$d" ] || continue
  name=${d##*/}; key=${name##*-}; run=${name#ffctl-}; run=${run%-"$key"}
  [ "${#key}" -eq 32 ] && [ -n "$run" ] && [ "$run" != "$name" ] || continue
  case $key in *[!0-9a-f]*) continue ;; esac
  [ -z "$2" ] || [ "$run" = "$2" ] || continue
  [ "$(stat -c %a -- "$d" 2>/dev/null)" = 700 ] || continue
  busy=0
  for l in "$d"/*.lock; do
    [ -f "$l" ] && [ ! -L "$l" ] || continue
    flock -n "$l" true 2>/dev/null || { busy=1; break; }
  done
  [ "$busy" = 0 ] || continue
  n=0
  for f in "$d"/ffctl-"$run"-n*-r*-s[01]; do [ -f "$f" ] && n=$((n + 1)); done
  rm -rf -- "$d" || { rc=1; continue; }
  echo "removed $d (run $run, $n snapshot slots)"
done
exit "$rc"
"""


class Sweep(str, Enum):
    """The steps of a revert-everything plan, each command's `about` (role `SWEEP`)."""

    DEADMEN = "deadmen"
    IPTABLES = "iptables"
    TC = "tc"
    LINKS = "links"
    SHM = "shm"


SCRIPTS = {Sweep.DEADMEN: FIRE_DEADMEN, Sweep.IPTABLES: IPTABLES_SWEEP, Sweep.TC: TC_SWEEP, Sweep.LINKS: LINK_SWEEP,
           Sweep.SHM: SHM_SWEEP}
STEP_NAMES = {
    Sweep.DEADMEN: "dead man's switches",
    Sweep.IPTABLES: "iptables chains",
    Sweep.TC: "tc qdiscs",
    Sweep.LINKS: "downed links",
    Sweep.SHM: "shared memory of dead runs",
}


def sweep_of(cmd: HostCommand) -> Sweep | None:
    """Which step of a revert-everything plan `cmd` is (None: not one)."""
    return Sweep(cmd.about) if cmd.role is Role.SWEEP and cmd.about in STEP_NAMES else None


class RevertError(RuntimeError):
    """Something ffctl left could not be removed; the message names the host and the command."""


def revert_all_plan(host: str, netns: str | None = None, run_id: str | None = None) -> list[HostCommand]:
    """Commands that remove every ffctl leftover on `host` (inside `netns` if given).

    `run_id` narrows which dead man's switches are fired and which dead runs' shared memory is
    removed to one run's; chains, qdiscs and downed links are removed whatever run they belong
    to. Shared memory is the host's, swept from the host (not from each namespace).
    """
    def cmd(sweep: Sweep, *args: str, where: str | None = netns) -> HostCommand:
        return HostCommand(HOST_NODE, host, ("sh", "-c", SCRIPTS[sweep], "sh", *args), netns=where, role=Role.SWEEP,
                           about=sweep.value)

    plan = [
        # Processes are seen from every namespace: the switches are fired from the host's own.
        cmd(Sweep.DEADMEN, deadman.pattern(run_id), where=None),
        cmd(Sweep.IPTABLES, network.CHAIN_PREFIX),
        cmd(Sweep.TC, network.QDISC_HANDLE),
        cmd(Sweep.LINKS, network.LINK_TAG_PREFIX),
    ]
    if netns is None:
        plan.append(cmd(Sweep.SHM, SHM_ROOT, run_id or ""))
    return plan


def removed_lines(cmd: HostCommand, result: CommandResult) -> list[str]:
    """What a step says it removed (the shared-memory sweep's lines)."""
    if sweep_of(cmd) is not Sweep.SHM:
        return []
    return [line for line in result.stdout.splitlines() if line.startswith("removed ")]


@dataclass(frozen=True)
class RevertOutcome:
    results: tuple[CommandResult, ...]

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.results)


def run_steps(commands: Iterable[HostCommand], transport_for: Callable[[HostCommand], Transport], where: str,
              timeout: float = 60.0) -> list[CommandResult]:
    """Run every step of a revert even when one fails (a command that may fail aside), then
    `RevertError` naming the first failure and how many more there were."""
    results = []
    failed = []
    for command in commands:
        result = transport_for(command).run(command.argv, timeout=timeout)
        results.append(result)
        if not result.ok and not command.allow_fail:
            lines = (result.stderr or result.stdout).strip().splitlines()
            detail = lines[-1] if lines else f"exit {result.returncode}"
            sweep = sweep_of(command)
            failed.append(f"on {where}: removing {STEP_NAMES[sweep] if sweep else 'something'} failed: {detail}")
    if failed:
        raise RevertError(failed[0] + (f" (and {len(failed) - 1} more)" if len(failed) > 1 else ""))
    return results


def revert_all(
    host: str,
    transport_for: Callable[[HostCommand], Transport],
    netns: str | None = None,
    run_id: str | None = None,
    timeout: float = 60.0,
) -> RevertOutcome:
    """Run `revert_all_plan`; every step runs even if one fails, then `RevertError` if any did."""
    where = host + (f" (netns {netns})" if netns else "")
    return RevertOutcome(tuple(run_steps(revert_all_plan(host, netns, run_id), transport_for, where, timeout)))
