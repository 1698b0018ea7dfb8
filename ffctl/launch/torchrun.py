"""torchrun's command line as `ffctl launch` takes it: names, `PET_*` defaults, normalisation.

`ffctl launch` is a superset of `torchrun`: every torchrun option is accepted in both spellings
(`--nproc-per-node` and `--nproc_per_node`), with torchrun's precedence (the option's value, else
the `PET_<NAME>` environment variable, else torchrun's default). The CLI collects the raw values
and `resolve` turns them into what the launch needs, pure and without touching the machine (the
CPU and GPU counts are arguments), so every spelling and variable is testable as a value.

Options that shape the job (`--nnodes`, `--nproc-per-node`, `--max-restarts`, `--role`, `-m`,
`--no-python`, `--standalone`) take effect. Options about how torchrun's own agent rendezvous and
supervises (`--rdzv-*`, `--node-rank`, `--master-port`, `--local-addr`, `--monitor-interval`,
`--start-method`, `--log-dir`, `-r`, `-t`, `--run-path`, `--event-log-handler`, `--logs-specs`,
`--signals-to-handle`) are accepted, checked where torchrun checks them, and recorded: ffctl's
controller runs the job's store, watches its workers and writes its own record, which is what
those options configure under torchrun. `--local-ranks-filter` picks the local ranks whose output
the console shows (ffctl.launch.echo); `--shutdown-timeout` is the workers' grace between SIGTERM
and SIGKILL; `--virtual-local-rank` gives every worker LOCAL_RANK=0 and, on a GPU host, its own
device as CUDA_VISIBLE_DEVICES. `--numa-binding` and `--duplicate-std{out,err}-filters` are
refused with the reason (ffctl has no such binding, and keeps every line in the rank's log).
An elastic `--nnodes MIN:MAX` starts MIN nodes, as one torchrun on one host does.
"""
from __future__ import annotations

import math
import signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ffctl.launch.echo import parse_ranks_filter
from ffctl.launch_spec import EXEC_MODULE

# torchrun's options, by the destination name its parser gives them (PET_<NAME.upper()>), with
# torchrun's defaults. Flags are "0"/"1" in the environment, as torchrun reads them.
VALUE_DEFAULTS: dict[str, str] = {
    "nnodes": "1:1",
    "nproc_per_node": "1",
    "rdzv_backend": "static",
    "rdzv_endpoint": "",
    "rdzv_id": "none",
    "rdzv_conf": "",
    "max_restarts": "",  # torchrun's is 0; ffctl's depends on the worker (see resolve)
    "monitor_interval": "0.1",
    "start_method": "spawn",
    "role": "default",
    "log_dir": "",
    "redirects": "0",
    "tee": "0",
    "local_ranks_filter": "",
    "node_rank": "0",
    "master_addr": "",
    "master_port": "",
    "local_addr": "",
    "event_log_handler": "null",
    "logs_specs": "",
    "signals_to_handle": "SIGTERM,SIGINT,SIGHUP,SIGQUIT",
    "shutdown_timeout": "",  # torchrun's is 30 s; ffctl's agents give workers 5 s unless told
    "numa_binding": "",
    "duplicate_stdout_filters": "",
    "duplicate_stderr_filters": "",
}
FLAGS = ("standalone", "module", "no_python", "run_path", "virtual_local_rank")
START_METHODS = ("spawn", "fork", "forkserver")
# Recorded; what each does under torchrun is ffctl's controller's or agents' job, and the ones
# ffctl carries out itself (shutdown_timeout, virtual_local_rank, local_ranks_filter) are read
# from the record of the launch.
RECORDED = ("rdzv_backend", "rdzv_endpoint", "rdzv_id", "rdzv_conf", "monitor_interval", "start_method",
            "log_dir", "redirects", "tee", "local_ranks_filter", "node_rank", "master_port", "local_addr",
            "run_path", "event_log_handler", "logs_specs", "signals_to_handle", "shutdown_timeout", "nnodes")
# torchrun options ffctl refuses rather than ignore, each with the reason.
REFUSED = {
    "numa_binding": "ffctl does not bind workers to NUMA nodes; bind them in the script (os.sched_setaffinity) "
                    "or drop the option",
    "duplicate_stdout_filters": "ffctl keeps every line each rank prints in its log (logs/<node>/<rank>.log in "
                                "the run record): filter that file instead",
    "duplicate_stderr_filters": "ffctl keeps every line each rank prints in its log (logs/<node>/<rank>.log in "
                                "the run record): filter that file instead",
}


class TorchrunArgError(ValueError):
    """One line naming the bad option and value (exit code 2)."""


@dataclass(frozen=True)
class TorchrunArgs:
    """A torchrun command line, normalised: what ffctl's LaunchSpec takes from it."""

    nnodes: int | None  # None: not given (neither option nor PET_NNODES)
    nnodes_range: tuple[int, int] | None  # MIN:MAX as given; ffctl runs MIN nodes
    nproc_per_node: int | None
    max_restarts: int | None  # None: the default for the kind of worker
    role: str
    master_addr: str | None  # --master-addr or PET_MASTER_ADDR
    worker_argv: tuple[str, ...]  # what the workers run: (script, args...) or ("-m", module, args...)
    recorded: tuple[tuple[str, str], ...]  # options accepted and recorded, with their values


def _value(name: str, given: Mapping[str, str | None], env: Mapping[str, str]) -> tuple[str, bool]:
    """torchrun's precedence: the option, else PET_<NAME>, else the default; and whether it was
    set by either of the first two."""
    raw = given.get(name)
    if raw is not None:
        return raw, True
    from_env = env.get(f"PET_{name.upper()}")
    # An empty variable is torchrun's "not set" too (its env action treats "" as no default).
    if from_env:
        return from_env, True
    return VALUE_DEFAULTS[name], False


def _flag(name: str, given: Mapping[str, bool], env: Mapping[str, str]) -> bool:
    if given.get(name):
        return True
    raw = env.get(f"PET_{name.upper()}", "0").strip()
    if raw not in ("0", "1"):
        raise TorchrunArgError(f"PET_{name.upper()}={raw!r}: not 0 or 1")
    return int(raw) != 0


# torch's rendezvous timeouts (`--rdzv-conf timeout=...`): seconds, which ffctl reads when it
# tells how long a lost peer goes unnoticed (`ffctl.launch.timeouts`).
RDZV_TIMEOUTS = ("timeout", "join_timeout", "last_call_timeout", "close_timeout", "read_timeout")


def _check_rdzv_conf(conf: str) -> None:
    for part in (p for p in conf.strip().strip("'\"").split(",") if p.strip()):
        key, _, value = part.partition("=")
        if key.strip() not in RDZV_TIMEOUTS:
            continue
        try:
            seconds = float(value)
        except ValueError:
            seconds = math.nan
        if not 0 < seconds < math.inf:
            raise TorchrunArgError(f"--rdzv-conf {conf!r}: {key.strip()}={value!r} is not a number of seconds above 0")


def _count(option: str, raw: str, low: int) -> int:
    text = raw.strip()
    if not text.isascii() or not text.isdigit() or int(text) < low:
        raise TorchrunArgError(f"{option} {raw!r}: not a whole number of at least {low}")
    return int(text)


def parse_nnodes(raw: str) -> tuple[int, int]:
    """`N` or `MIN:MAX`, as torchrun's `--nnodes` takes it."""
    parts = raw.split(":")
    if len(parts) == 1:
        n = _count("--nnodes", parts[0], 0)  # (0 is refused by LaunchSpec.validate, with the range)
        return n, n
    if len(parts) != 2:
        raise TorchrunArgError(f"--nnodes {raw!r}: use N or MIN:MAX")
    low, high = _count("--nnodes", parts[0], 1), _count("--nnodes", parts[1], 1)
    if low > high:
        raise TorchrunArgError(f"--nnodes {raw!r}: MIN is more than MAX")
    return low, high


def parse_nproc(raw: str, cpus: int, gpus: int) -> int:
    """`int`, `cpu` (this machine's CPU count), `gpu` (its GPU count) or `auto` (GPUs if any,
    else CPUs), as torchrun's `--nproc-per-node` takes it."""
    text = raw.strip()
    if text == "cpu":
        return max(1, cpus)
    if text == "gpu":
        if gpus < 1:
            raise TorchrunArgError("--nproc-per-node gpu: this machine has no GPU")
        return gpus
    if text == "auto":
        return gpus if gpus > 0 else max(1, cpus)
    return _count("--nproc-per-node", raw, 0)  # (the range is LaunchSpec.validate's)


def _check_std(option: str, raw: str) -> None:
    # torchrun's -r/-t: one of 0-3 for every rank, or `rank:value,...` per local rank.
    text = raw.strip()
    if text in ("0", "1", "2", "3"):
        return
    for part in text.split(","):
        rank, _, value = part.partition(":")
        if not (rank.strip().isascii() and rank.strip().isdigit() and value.strip() in ("0", "1", "2", "3")):
            raise TorchrunArgError(f"{option} {raw!r}: use 0-3 or LOCAL_RANK:0-3,...")


def _check_endpoint(raw: str) -> None:
    if not raw:
        return
    host, sep, port = raw.rpartition(":")
    if sep and not (port.isascii() and port.isdigit() and int(port) < 65536 and host):
        raise TorchrunArgError(f"--rdzv-endpoint {raw!r}: use HOST[:PORT]")


def resolve(given: Mapping[str, str | None], flags: Mapping[str, bool], script: Sequence[str],
            env: Mapping[str, str], cpus: int = 1, gpus: int = 0) -> TorchrunArgs:
    """Normalise torchrun options (`given`: value options by destination name, None when not
    given; `flags`: the flag options) and the script with its arguments into what ffctl runs.

    Raises TorchrunArgError with one line naming the bad option and value."""
    values: dict[str, str] = {}
    set_by_user: set[str] = set()
    for name in VALUE_DEFAULTS:
        values[name], was_set = _value(name, given, env)
        if was_set:
            set_by_user.add(name)
    on = {name: _flag(name, flags, env) for name in FLAGS}

    argv = list(script)
    if argv and argv[0] == "--":
        argv = argv[1:]  # `torchrun [options] -- script args`
    if not argv and (on["module"] or on["no_python"]):
        raise TorchrunArgError("-m/--module and --no-python need a script (module or program) to run")

    nnodes: int | None = None
    nnodes_range: tuple[int, int] | None = None
    if on["standalone"]:
        # torchrun's --standalone: one node, a store on a free local port, a fresh run id.
        values.update(rdzv_backend="c10d", rdzv_endpoint="localhost:0", rdzv_id="standalone")
        set_by_user |= {"rdzv_backend", "rdzv_endpoint", "rdzv_id"}
    if "nnodes" in set_by_user:
        nnodes_range = parse_nnodes(values["nnodes"])
        # One torchrun on one host with MIN:MAX runs one node once MIN may start: ffctl starts
        # MIN nodes, what the same command line gives under torchrun here. More local nodes are
        # asked for with a fixed --nnodes N.
        nnodes = nnodes_range[0]
        if nnodes_range[0] == nnodes_range[1]:
            nnodes_range = None
    if on["standalone"] and nnodes is not None and nnodes > 1:
        raise TorchrunArgError(f"--standalone with --nnodes {values['nnodes']!r}: standalone is one node")
    if on["standalone"] and nnodes is None:
        nnodes = 1
    nproc = parse_nproc(values["nproc_per_node"], cpus, gpus) if "nproc_per_node" in set_by_user else None
    max_restarts = _count("--max-restarts", values["max_restarts"], 0) if "max_restarts" in set_by_user else None
    role = values["role"].strip()
    if not role or not role.isprintable():
        raise TorchrunArgError(f"--role {values['role']!r}: give a name")
    for name, why in REFUSED.items():
        if name in set_by_user:
            raise TorchrunArgError(f"--{name.replace('_', '-')} {values[name]!r}: {why}")
    for name in (n.strip() for n in values["signals_to_handle"].split(",")):
        if not (name.isascii() and name.isupper() and isinstance(getattr(signal, name, None), signal.Signals)):
            raise TorchrunArgError(f"--signals-to-handle {values['signals_to_handle']!r}: {name!r} is not a signal "
                                   "name (SIGTERM,SIGINT,...)")
        if name in ("SIGKILL", "SIGSTOP"):
            raise TorchrunArgError(f"--signals-to-handle {values['signals_to_handle']!r}: {name} cannot be handled")
    if values["shutdown_timeout"]:
        try:
            grace = float(values["shutdown_timeout"])
        except ValueError:
            grace = -1.0
        if not 0 <= grace <= 3600:
            raise TorchrunArgError(f"--shutdown-timeout {values['shutdown_timeout']!r}: seconds from 0 to 3600")
    if values["start_method"] not in START_METHODS:
        raise TorchrunArgError(f"--start-method {values['start_method']!r}: use {', '.join(START_METHODS)}")
    try:
        interval = float(values["monitor_interval"])
    except ValueError:
        raise TorchrunArgError(f"--monitor-interval {values['monitor_interval']!r}: not a number of seconds") from None
    if not 0 < interval < float("inf"):
        raise TorchrunArgError(f"--monitor-interval {values['monitor_interval']!r}: must be more than 0")
    _count("--node-rank", values["node_rank"], 0)
    if values["master_port"]:
        port = _count("--master-port", values["master_port"], 0)
        if port > 65535:
            raise TorchrunArgError(f"--master-port {values['master_port']!r}: not a port")
    _check_std("-r/--redirects", values["redirects"])
    _check_std("-t/--tee", values["tee"])
    _check_endpoint(values["rdzv_endpoint"])
    _check_rdzv_conf(values["rdzv_conf"])
    try:
        parse_ranks_filter(values["local_ranks_filter"])
    except ValueError as exc:
        raise TorchrunArgError(str(exc)) from None
    if on["module"] and on["no_python"]:
        raise TorchrunArgError("-m/--module and --no-python: give one or the other")

    if argv:
        if on["module"]:
            argv = ["-m", *argv]
        elif on["no_python"]:
            argv = ["-m", EXEC_MODULE, *argv]
    recorded = tuple((name, values[name]) for name in RECORDED
                     if name in set_by_user and name != "run_path" and (name != "nnodes" or nnodes_range))
    recorded += tuple((name, "1") for name in ("run_path", "virtual_local_rank") if on[name])
    return TorchrunArgs(nnodes=nnodes, nnodes_range=nnodes_range, nproc_per_node=nproc,
                        max_restarts=max_restarts, role=role,
                        master_addr=values["master_addr"] or None, worker_argv=tuple(argv), recorded=recorded)
