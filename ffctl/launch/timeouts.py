"""The timeouts that decide how soon a failure is noticed, and the orders among them that defeat
recovery. Pure: it reads a launch spec, an environment and a script's source, and says in one
line each what is wrong and which setting to change.

Fault tolerance heals only what it sees first. A peer lost inside a collective is seen by ffctl's
detectors (an exited process at once, a lost node after `--heartbeat-timeout`, a job without step
progress after `--hang-timeout`) or by torch's own process-group timeout, whose expiry makes the
collective raise. Users raise the process-group timeout to thousands of seconds to keep torch's
watchdog from tearing down jobs that fault tolerance would heal, and then wait that long on a
real hang in a script ffctl cannot watch step by step; others lower it below ffctl's hang limit,
and torch aborts the job before ffctl can heal it. Both are found here before the job starts.
"""
from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

# torch's defaults (torch.distributed.constants): 30 minutes for gloo, 10 for NCCL.
GLOO_DEFAULT_S = 1800.0
NCCL_DEFAULT_S = 600.0
NCCL_HEARTBEAT_DEFAULT_S = 480.0
BUDGET_S = 60.0  # a detection slower than this is said as such

_UNITS = {"seconds": 1.0, "minutes": 60.0, "hours": 3600.0, "milliseconds": 0.001}
# `init_process_group(..., timeout=timedelta(minutes=30))`, `timeout=datetime.timedelta(seconds=N)`.
_PG_TIMEOUT = re.compile(
    r"init_process_group\s*\((?:[^()]|\([^()]*\))*?timeout\s*=\s*(?:datetime\s*\.\s*)?timedelta\s*\(([^()]*)\)", re.S)
_TD_ARG = re.compile(r"(seconds|minutes|hours|milliseconds)\s*=\s*([0-9]+(?:\.[0-9]*)?)")


@dataclass(frozen=True)
class Timeout:
    """One timeout that bounds detection: what it is, its value and where it was set."""

    name: str
    seconds: float
    source: str


def script_pg_timeout(source: str) -> float | None:
    """The process-group timeout a script passes to `init_process_group`, when it is written as
    a literal `timedelta` (None: not given, or not readable without running the script)."""
    m = _PG_TIMEOUT.search(source)
    if m is None:
        return None
    parts = _TD_ARG.findall(m.group(1))
    if not parts:
        return None
    return sum(float(v) * _UNITS[unit] for unit, v in parts)


def _env_seconds(env: Mapping[str, str], name: str) -> float | None:
    raw = env.get(name, "").strip()
    try:
        value = float(raw)
    except ValueError:
        return None
    return value if value > 0 else None


def _rdzv_conf(conf: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for part in conf.strip("'\"").split(","):
        key, _, value = part.partition("=")
        try:
            out[key.strip()] = float(value)
        except ValueError:
            continue
    return out


def read_timeouts(*, heartbeat_s: float, hang_s: float, script_source: str | None, library: bool,
                  env: Mapping[str, str], rdzv_conf: str = "", gpu: bool = False) -> list[Timeout]:
    """Every timeout that decides detection for this launch, with its source."""
    out = [Timeout("node loss (--heartbeat-timeout)", heartbeat_s, "ffctl"),
           Timeout("hang (--hang-timeout)", hang_s, "ffctl")]
    if script_source is not None and not library:
        given = script_pg_timeout(script_source)
        if given is not None:
            out.append(Timeout("process-group timeout", given, "the script's init_process_group(timeout=...)"))
        else:
            default = NCCL_DEFAULT_S if gpu else GLOO_DEFAULT_S
            out.append(Timeout("process-group timeout", default, f"torch's default for {'NCCL' if gpu else 'gloo'}"))
    for name in ("TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC", "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC"):
        value = _env_seconds(env, name)
        if value is not None:
            out.append(Timeout(name, value / (1000.0 if name.endswith("MILSEC") else 1.0), "environment"))
    for key, value in _rdzv_conf(rdzv_conf).items():
        if key.endswith("timeout"):
            out.append(Timeout(f"rendezvous {key}", value, "--rdzv-conf (recorded; ffctl's rendezvous is its own)"))
    return out


def findings(timeouts: list[Timeout], *, steps_known: bool) -> list[str]:
    """One line per inversion or over-budget detection, naming the setting to change."""
    by = {t.name: t for t in timeouts}
    hang = by["hang (--hang-timeout)"]
    lines = []
    for t in timeouts:
        if t.source == "ffctl" and t.seconds > BUDGET_S:
            lines.append(f"{t.name} is {t.seconds:g} s: a failure it covers is noticed only after more than a "
                         f"minute; lower it")
    pg = by.get("process-group timeout")
    if pg is not None:
        if pg.seconds <= hang.seconds:
            lines.append(f"process-group timeout {pg.seconds:g} s ({pg.source}) is not above the hang timeout "
                         f"{hang.seconds:g} s: torch aborts a stuck collective before ffctl can see the hang and "
                         f"recover; raise the process-group timeout or lower --hang-timeout")
        elif not steps_known and pg.seconds > BUDGET_S:
            lines.append(f"a peer lost inside a collective is noticed only when the process-group timeout "
                         f"expires, {pg.seconds:g} s ({pg.source}): ffctl's hang detection needs the script's "
                         f"steps (recovery.report_step or --step-regex), or set a lower "
                         f"init_process_group(timeout=...)")
    beat = by.get("TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC")
    if beat is not None and beat.seconds <= hang.seconds:
        lines.append(f"TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC={beat.seconds:g} is not above the hang timeout "
                     f"{hang.seconds:g} s: NCCL's watchdog kills the process before ffctl recovers it; raise it")
    return lines
