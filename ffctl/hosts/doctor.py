"""`ffctl doctor`'s checks: can a host run ffctl jobs, and which faults can it take?

`check_host` asks one host, through any `Transport` (SSH or local), for what a run needs:
reachability, python, torch and ffctl versions, memory for snapshots, the tools network faults use
(iptables, tc and whether the kernel has the tbf and netem qdiscs), GPU tools, and the host's
clock offset from the controller. It returns a frozen `HostReport` and never prints; the
rendering lives in `ffctl.render.host_checks`.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, fields
from enum import Enum
from typing import Callable, Sequence

from fault_injectors.network import QDISC_TRIALS, probe_iptables, probe_qdisc
from fault_injectors.transport import CommandResult, LocalTransport, Transport, TransportError

MIN_PYTHON = (3, 10)
CLOCK_WARN_S = 0.5
CLOCK_SAMPLES = 3

# Tools looked up on the host. Network tools often live in sbin, which is missing from a
# non-root user's PATH, so those directories are searched too.
_TOOLS = ("iptables", "tc", "nvidia-smi", "dcgmi", "unshare")
_FACTS_SCRIPT = r"""
for t in "$@"; do
  p=$(command -v "$t" 2>/dev/null) || p=
  if [ -z "$p" ]; then
    for d in /usr/sbin /sbin /usr/local/sbin; do [ -x "$d/$t" ] && { p="$d/$t"; break; }; done
  fi
  echo "which.$t=$p"
done
echo "uid=$(id -u)"
echo "kernel=$(uname -r)"
awk '/^MemAvailable:/ {print "mem_kb=" $2}' /proc/meminfo 2>/dev/null
df -Pk /dev/shm 2>/dev/null | awk 'NR==2 {print "shm_kb=" $4}'
"""

# Is the qdisc's kernel module loaded, built in, or installable? (Used when the qdisc cannot be
# tried for real, e.g. without root.)
_QDISC_MODULE_SCRIPT = r"""
m=sch_$1; k=/lib/modules/$(uname -r)
[ -d "/sys/module/$m" ] && { echo present; exit 0; }
[ -f "$k/modules.builtin" ] && grep -q "/$m\.ko" "$k/modules.builtin" && { echo present; exit 0; }
[ -d "$k" ] && find "$k" -name "$m.ko*" 2>/dev/null | grep -q . && { echo present; exit 0; }
command -v modprobe >/dev/null 2>&1 && modprobe -n "$m" 2>/dev/null && { echo present; exit 0; }
[ -d "$k" ] && { echo absent; exit 0; }
echo unknown
"""

_QDISC_TRIAL = QDISC_TRIALS  # the launch preflight's probe, with these leaves


class QdiscSupport(str, Enum):
    USABLE = "usable"  # a qdisc of this kind was added (in a throwaway network namespace)
    PRESENT = "present"  # the kernel module exists, but it could not be tried here
    ABSENT = "absent"  # the kernel does not know the kind
    UNKNOWN = "unknown"  # neither tried nor found out


@dataclass(frozen=True)
class HostReport:
    """What one host can do. ``ssh_ok`` False means nothing else was checked (see ``error``).

    For the local machine ``ssh_ok`` means the machine answered at all. Versions are None when
    missing. Clock offset is host minus controller, in seconds (positive: the host is ahead).
    """

    host: str
    ssh_ok: bool
    error: str | None = None
    python_cmd: str = "python3"
    python: str | None = None
    torch: str | None = None
    ffctl: str | None = None
    kernel: str | None = None
    is_root: bool | None = None
    mem_available_bytes: int | None = None
    shm_free_bytes: int | None = None
    iptables: bool = False
    tc: bool = False
    tbf: QdiscSupport = QdiscSupport.UNKNOWN
    netem: QdiscSupport = QdiscSupport.UNKNOWN
    nvidia_smi: bool = False
    gpu_count: int | None = None
    dcgmi: bool = False
    clock_offset_s: float | None = None
    clock_rtt_s: float | None = None

    @property
    def python_too_old(self) -> bool:
        if self.python is None:
            return False
        try:
            version = tuple(int(p) for p in self.python.split(".")[:2])
        except ValueError:
            return False
        return version < MIN_PYTHON

    @property
    def can_run_job(self) -> bool:
        """Reachable, with a recent enough python that imports torch and ffctl."""
        return (
            self.ssh_ok
            and self.python is not None
            and not self.python_too_old
            and self.torch is not None
            and self.ffctl is not None
        )

    def problems(self) -> tuple[str, ...]:
        """One line per thing that stops a job or a kind of fault on this host."""
        if not self.ssh_ok:
            return (self.error or "unreachable",)
        out: list[str] = []
        py = self.python_cmd
        if self.python is None:
            out.append(f"{py} not found: ffctl cannot run here")
        elif self.python_too_old:
            need = ".".join(map(str, MIN_PYTHON))
            out.append(f"{py} is Python {self.python}; ffctl needs {need} or newer")
        else:
            if self.torch is None:
                out.append(f"torch is not importable by {py}")
            if self.ffctl is None:
                out.append(f"ffctl is not installed for {py}")
        if self.is_root is False:
            out.append("not root: network faults (iptables, tc) need root")
        if not self.iptables:
            out.append("iptables missing or its filter table unusable: net-partition and net-port-block cannot run")
        if not self.tc:
            out.append("tc not found: net-bandwidth, net-delay and net-loss cannot run")
        else:
            if self.tbf is QdiscSupport.ABSENT:
                out.append("kernel has no tbf qdisc: net-bandwidth cannot run")
            if self.netem is QdiscSupport.ABSENT:
                out.append("kernel has no netem qdisc (sch_netem): net-delay and net-loss cannot run")
        if self.clock_offset_s is not None and abs(self.clock_offset_s) > CLOCK_WARN_S:
            out.append(
                f"clock is {self.clock_offset_s:+.3f}s off the controller's "
                "(timings are corrected, but check NTP)"
            )
        return tuple(out)


def check_host(
    transport: Transport,
    *,
    controller_time_fn: Callable[[], float] = time.time,
    timeout: float = 15.0,
    python: str = "python3",
) -> HostReport:
    """Run every check on one host; each remote command gets ``timeout`` seconds.

    ``python`` is the interpreter the agent would be started with on that host.
    """
    host = transport.host
    try:
        connect = getattr(transport, "connect", None)
        if callable(connect):
            connect()  # SSH: connection, host key and authentication errors surface here
        probe = transport.run(["true"], timeout=timeout)
        if not probe.ok:
            return HostReport(host, False, error=f"{host}: {probe.describe()}", python_cmd=python)
        found: dict[str, object] = {"host": host, "ssh_ok": True, "python_cmd": python}
        found.update(_facts(transport, timeout))
        found.update(_python_stack(transport, python, timeout))
        tc_path = found.pop("_tc_path")
        unshare_path = found.pop("_unshare_path")
        for kind in _QDISC_TRIAL:
            found[kind] = _qdisc_support(transport, kind, tc_path, unshare_path, timeout)  # type: ignore[arg-type]
        offset, rtt = _clock_offset(transport, controller_time_fn, python, timeout)
        found["clock_offset_s"], found["clock_rtt_s"] = offset, rtt
    except TransportError as exc:
        return HostReport(host, False, error=_one_line(str(exc), host), python_cmd=python)
    names = {f.name for f in fields(HostReport)}
    return HostReport(**{k: v for k, v in found.items() if k in names})  # type: ignore[arg-type]


def check_local(
    *,
    controller_time_fn: Callable[[], float] = time.time,
    timeout: float = 15.0,
    python: str | None = None,
) -> HostReport:
    """`check_host` for this machine; ``python`` defaults to the interpreter running ffctl."""
    return check_host(
        LocalTransport("localhost"),
        controller_time_fn=controller_time_fn,
        timeout=timeout,
        python=python or sys.executable,
    )


def check_hosts(
    transports: Sequence[Transport], *, timeout: float = 15.0, python: str = "python3"
) -> list[HostReport]:
    """`check_host` for several hosts at once (one thread each), in the given order."""
    from concurrent.futures import ThreadPoolExecutor

    if not transports:
        return []
    with ThreadPoolExecutor(max_workers=min(32, len(transports))) as pool:
        return list(pool.map(lambda t: check_host(t, timeout=timeout, python=python), transports))


def clock_offset(
    transport: Transport,
    *,
    controller_time_fn: Callable[[], float] = time.time,
    python: str = "python3",
    timeout: float = 15.0,
) -> tuple[float | None, float | None]:
    """(host clock minus controller clock, round trip it was measured over), NTP-style; both
    None when the host gave no usable time. The launch uses this before starting agents."""
    return _clock_offset(transport, controller_time_fn, python, timeout)


# -- the individual checks -------------------------------------------------------------------


def _one_line(text: str, host: str) -> str:
    line = " ".join(text.split())
    return line if line.startswith(host) else f"{host}: {line}"


def _facts(transport: Transport, timeout: float) -> dict[str, object]:
    result = transport.run(["sh", "-c", _FACTS_SCRIPT, "ffctl-doctor", *_TOOLS], timeout=timeout)
    values: dict[str, str] = {}
    for line in result.stdout.splitlines():
        key, sep, value = line.partition("=")
        if sep:
            values[key.strip()] = value.strip()
    which = {t: values.get(f"which.{t}") or None for t in _TOOLS}
    nvidia = which["nvidia-smi"]
    is_root = values["uid"] == "0" if values.get("uid", "").isdigit() else None
    iptables = which["iptables"] is not None
    if iptables and is_root:
        # The launch preflight's own probe: installed is not enough, the filter table must be
        # usable here (a kernel without it, a container without the capability).
        iptables = probe_iptables(transport, "iptables", timeout).ok
    return {
        "iptables": iptables,
        "tc": which["tc"] is not None,
        "nvidia_smi": nvidia is not None,
        "dcgmi": which["dcgmi"] is not None,
        "gpu_count": _gpu_count(transport, nvidia, timeout) if nvidia else None,
        "is_root": is_root,
        "kernel": values.get("kernel") or None,
        "mem_available_bytes": _kib(values.get("mem_kb")),
        "shm_free_bytes": _kib(values.get("shm_kb")),
        "_tc_path": which["tc"],
        "_unshare_path": which["unshare"],
    }


def _kib(text: str | None) -> int | None:
    return int(text) * 1024 if text and text.isdigit() else None


def _gpu_count(transport: Transport, nvidia_smi: str, timeout: float) -> int | None:
    result = transport.run([nvidia_smi, "-L"], timeout=timeout)
    if not result.ok:
        return None
    return sum(1 for line in result.stdout.splitlines() if line.startswith("GPU "))


def _python_stack(transport: Transport, python: str, timeout: float) -> dict[str, str | None]:
    def ask(code: str) -> str | None:
        result = transport.run([python, "-c", code], timeout=timeout)
        lines = result.stdout.strip().splitlines()
        return lines[-1].strip() if result.ok and lines else None

    version = ask("import sys; print('%d.%d.%d' % sys.version_info[:3])")
    if version is None:
        return {"python": None, "torch": None, "ffctl": None}
    torch = ask("import torch; print(torch.__version__)")
    ffctl = ask("import ffctl; print(getattr(ffctl, '__version__', 'unknown'))")
    if ffctl is None:
        # An install whose package cannot be imported by name but whose module entry works.
        result = transport.run([python, "-m", "ffctl", "--version"], timeout=timeout)
        words = result.stdout.split()
        ffctl = words[-1] if result.ok and words else None
    return {"python": version, "torch": torch, "ffctl": ffctl}


def _qdisc_support(
    transport: Transport, kind: str, tc: str | None, unshare: str | None, timeout: float
) -> QdiscSupport:
    if tc and unshare:
        # The tree a fault builds, on lo in a brand-new network namespace: a real test that
        # touches none of the host's interfaces, the same one the launch preflight runs.
        trial = probe_qdisc(transport, _QDISC_TRIAL[kind], timeout)
        if trial.ok and "@untried" not in trial.stdout.split():
            return QdiscSupport.USABLE
        if _unknown_qdisc(trial):
            return QdiscSupport.ABSENT
        # Otherwise (no permission, no unshare support): fall back to looking for the module.
    lookup = transport.run(["sh", "-c", _QDISC_MODULE_SCRIPT, "ffctl-doctor", kind], timeout=timeout)
    answer = lookup.stdout.strip()
    if answer == "present":
        return QdiscSupport.PRESENT
    if answer == "absent":
        return QdiscSupport.ABSENT
    return QdiscSupport.UNKNOWN


def _unknown_qdisc(result: CommandResult) -> bool:
    text = (result.stderr + result.stdout).lower()
    # iproute2: "Error: Specified qdisc kind is unknown." (newer) or "Unknown qdisc" (older)
    return "qdisc kind is unknown" in text or "unknown qdisc" in text


def _clock_offset(
    transport: Transport, controller_time_fn: Callable[[], float], python: str, timeout: float
) -> tuple[float | None, float | None]:
    """NTP-style: the host's clock against the midpoint of the round trip; best of a few tries.

    `date` starts faster than python, so its round trip (the error bound) is smaller; python
    is the fallback where date has no %N (busybox).
    """
    best: tuple[float, float] | None = None
    commands = [["date", "+%s.%N"], [python, "-c", "import time; print(repr(time.time()))"]]
    for argv in commands:
        for _ in range(CLOCK_SAMPLES):
            sent = controller_time_fn()
            result = transport.run(argv, timeout=timeout)
            received = controller_time_fn()
            remote = _parse_time(result)
            if remote is None:
                break  # e.g. a date without %N: try the next way
            rtt = received - sent
            offset = remote - (sent + received) / 2
            if best is None or rtt < best[1]:
                best = (offset, rtt)
        if best is not None:
            return best
    return None, None


def _parse_time(result: CommandResult) -> float | None:
    if not result.ok:
        return None
    try:
        return float(result.stdout.strip())
    except ValueError:
        return None

