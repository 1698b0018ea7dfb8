"""torchrun's command line under `ffctl launch`: every spelling and `PET_*` variable resolves as
torchrun resolves it, and bad values are refused with one line (exit 2, nothing started)."""
from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from ffctl.cli.app import app, main
from ffctl.launch.torchrun import EXEC_MODULE, TorchrunArgError, TorchrunArgs, parse_nnodes, parse_nproc, resolve
from ffctl.launch_spec import LaunchSpec


def _resolve(given: dict[str, str] | None = None, flags: dict[str, bool] | None = None,
             script: tuple[str, ...] = ("train.py",), env: dict[str, str] | None = None,
             cpus: int = 8, gpus: int = 0) -> TorchrunArgs:
    return resolve(given or {}, flags or {}, script, env or {}, cpus=cpus, gpus=gpus)


def test_defaults_leave_the_layout_to_ffctl() -> None:
    args = _resolve()
    assert (args.nnodes, args.nproc_per_node, args.max_restarts) == (None, None, None)
    assert args.role == "default" and args.worker_argv == ("train.py",) and args.recorded == ()


@pytest.mark.parametrize("raw, expected", [("1", (1, 1)), ("3", (3, 3)), ("1:2", (1, 2)), ("2:2", (2, 2))])
def test_nnodes_takes_n_or_min_max(raw: str, expected: tuple[int, int]) -> None:
    assert parse_nnodes(raw) == expected
    args = _resolve({"nnodes": raw})
    assert args.nnodes == expected[0]  # as one torchrun on one host: MIN nodes start
    assert args.nnodes_range == (expected if expected[0] != expected[1] else None)
    # The range is recorded; a fixed count is the layout itself.
    assert (("nnodes", raw) in args.recorded) == (expected[0] != expected[1])


@pytest.mark.parametrize("name, value", [("event_log_handler", "console"), ("logs_specs", "my_specs"),
                                         ("signals_to_handle", "SIGTERM,SIGUSR1"), ("shutdown_timeout", "12.5")])
def test_newer_torchrun_options_are_accepted_and_recorded(name: str, value: str) -> None:
    assert (name, value) in _resolve({name: value}).recorded
    assert (name, value) in _resolve(env={f"PET_{name.upper()}": value}).recorded


def test_virtual_local_rank_is_a_recorded_flag() -> None:
    assert ("virtual_local_rank", "1") in _resolve(flags={"virtual_local_rank": True}).recorded
    assert ("virtual_local_rank", "1") in _resolve(env={"PET_VIRTUAL_LOCAL_RANK": "1"}).recorded
    assert not any(name == "virtual_local_rank" for name, _ in _resolve().recorded)


@pytest.mark.parametrize("name, value, why", [
    ("numa_binding", "node", "NUMA"), ("duplicate_stdout_filters", "loss", "log"),
    ("duplicate_stderr_filters", "err", "log"), ("signals_to_handle", "SIGTERM,SIGNOPE", "not a signal"),
    ("signals_to_handle", "sigterm", "not a signal"), ("shutdown_timeout", "-1", "seconds"),
    ("shutdown_timeout", "nan", "seconds"), ("shutdown_timeout", "soon", "seconds"),
])
def test_newer_torchrun_options_ffctl_cannot_honour_are_refused_with_the_reason(name: str, value: str, why: str) -> None:
    with pytest.raises(TorchrunArgError, match=why) as err:
        _resolve({name: value})
    assert f"--{name.replace('_', '-')}" in str(err.value) and value in str(err.value)


@pytest.mark.parametrize("raw", ["0:1", "x", "2:1", "1:2:3", "-1", "1.5", "", "٣"])
def test_bad_nnodes_is_refused(raw: str) -> None:
    with pytest.raises(TorchrunArgError, match="--nnodes"):
        _resolve({"nnodes": raw} if raw else {}, env={"PET_NNODES": "x"} if not raw else None)


@pytest.mark.parametrize("raw, cpus, gpus, expected", [
    ("4", 8, 0, 4), ("cpu", 6, 0, 6), ("gpu", 8, 2, 2), ("auto", 8, 0, 8), ("auto", 8, 4, 4)])
def test_nproc_per_node_takes_int_cpu_gpu_auto(raw: str, cpus: int, gpus: int, expected: int) -> None:
    assert parse_nproc(raw, cpus, gpus) == expected
    assert _resolve({"nproc_per_node": raw}, cpus=cpus, gpus=gpus).nproc_per_node == expected


def test_nproc_gpu_without_a_gpu_is_refused() -> None:
    with pytest.raises(TorchrunArgError, match="--nproc-per-node gpu: this machine has no GPU"):
        _resolve({"nproc_per_node": "gpu"})


def test_option_beats_pet_variable_beats_default() -> None:
    env = {"PET_NPROC_PER_NODE": "3", "PET_NNODES": "2", "PET_MAX_RESTARTS": "5", "PET_ROLE": "trainer"}
    args = _resolve(env=env)
    assert (args.nnodes, args.nproc_per_node, args.max_restarts, args.role) == (2, 3, 5, "trainer")
    args = _resolve({"nproc_per_node": "1", "max_restarts": "0", "role": "r"}, env=env)
    assert (args.nnodes, args.nproc_per_node, args.max_restarts, args.role) == (2, 1, 0, "r")
    # An empty variable is unset, as torchrun reads it.
    assert _resolve(env={"PET_NPROC_PER_NODE": ""}).nproc_per_node is None


def test_pet_flags_and_their_bad_values() -> None:
    assert _resolve(env={"PET_MODULE": "1"}, script=("pkg.train", "--x")).worker_argv == ("-m", "pkg.train", "--x")
    assert _resolve(env={"PET_MODULE": "0"}).worker_argv == ("train.py",)
    assert _resolve(env={"PET_NO_PYTHON": "1"}, script=("./run.sh", "a")).worker_argv == \
        ("-m", EXEC_MODULE, "./run.sh", "a")
    with pytest.raises(TorchrunArgError, match="PET_NO_PYTHON='yes'"):
        _resolve(env={"PET_NO_PYTHON": "yes"})


def test_module_no_python_and_separator() -> None:
    assert _resolve(flags={"module": True}, script=("pkg.train",)).worker_argv == ("-m", "pkg.train")
    assert _resolve(script=("--", "train.py", "--lr", "1")).worker_argv == ("train.py", "--lr", "1")
    with pytest.raises(TorchrunArgError, match="give one or the other"):
        _resolve(flags={"module": True, "no_python": True})
    with pytest.raises(TorchrunArgError, match="need a script"):
        _resolve(flags={"module": True}, script=())


def test_standalone_is_one_node_with_a_local_store() -> None:
    args = _resolve(flags={"standalone": True})
    assert args.nnodes == 1
    assert dict(args.recorded)["rdzv_backend"] == "c10d" and dict(args.recorded)["rdzv_endpoint"] == "localhost:0"
    with pytest.raises(TorchrunArgError, match="standalone is one node"):
        _resolve({"nnodes": "2"}, flags={"standalone": True})


def test_agent_options_are_recorded() -> None:
    given = {"rdzv_backend": "c10d", "rdzv_endpoint": "localhost:0", "rdzv_id": "job7", "rdzv_conf": "timeout=9",
             "monitor_interval": "1", "start_method": "fork", "log_dir": "/tmp/x", "redirects": "3",
             "tee": "0:3,1:1", "local_ranks_filter": "0", "node_rank": "0", "master_port": "29500",
             "local_addr": "127.0.0.1"}
    args = _resolve(given, flags={"run_path": True})
    assert dict(args.recorded) == {**given, "run_path": "1"}


@pytest.mark.parametrize("given, flag", [
    ({"start_method": "thread"}, "--start-method 'thread'"),
    ({"monitor_interval": "0"}, "--monitor-interval '0'"),
    ({"monitor_interval": "soon"}, "--monitor-interval 'soon'"),
    ({"redirects": "4"}, "-r/--redirects '4'"),
    ({"tee": "0:9"}, "-t/--tee '0:9'"),
    ({"rdzv_endpoint": "host:port"}, "--rdzv-endpoint 'host:port'"),
    ({"master_port": "70000"}, "--master-port '70000'"),
    ({"node_rank": "-1"}, "--node-rank '-1'"),
    ({"max_restarts": "-1"}, "--max-restarts '-1'"),
    ({"role": " "}, "--role ' '"),
])
def test_bad_values_name_the_option(given: dict[str, str], flag: str) -> None:
    with pytest.raises(TorchrunArgError) as exc:
        _resolve(given)
    assert flag in str(exc.value) and "\n" not in str(exc.value)


# -- through the real command line: both spellings, `=` and separate values ---------------------

def _spec(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *argv: str, env: dict[str, str] | None = None
          ) -> tuple[int, str, LaunchSpec | None]:
    """Run `ffctl launch --dry-run ARGV` in-process and capture the spec it planned."""
    import ffctl.launch.launch_plan as launch_plan  # the command imports it when it runs

    seen: list[LaunchSpec] = []
    real = launch_plan.plan_launch

    def spy(spec: LaunchSpec):  # type: ignore[no-untyped-def]
        seen.append(spec)
        return real(spec)

    monkeypatch.setattr(launch_plan, "plan_launch", spy)
    monkeypatch.chdir(tmp_path)
    for key in [k for k in __import__("os").environ if k.startswith("PET_")]:
        monkeypatch.delenv(key)
    for key, value in (env or {}).items():
        monkeypatch.setenv(key, value)
    (tmp_path / "train.py").write_text("print('hi')\n")
    argv_all = ["launch", "--dry-run", "--runs-dir", str(tmp_path / "runs"), *argv]
    res = CliRunner().invoke(app, argv_all)
    if res.exit_code == 0:
        return res.exit_code, res.output, seen[0] if seen else None
    # Refusals become exit codes in the real entry point.
    try:
        code = main(argv_all)
    except SystemExit as exc:
        code = int(exc.code or 0)
    return code, res.output, seen[0] if seen else None


@pytest.mark.parametrize("argv", [
    ["--nnodes", "1", "--nproc-per-node", "2", "train.py", "--lr", "1"],
    ["--nnodes=1", "--nproc_per_node=2", "train.py", "--lr", "1"],
    ["--standalone", "--nproc_per_node=2", "train.py", "--lr", "1"],
    ["--nnodes=1:1", "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0",
     "train.py", "--lr", "1"],
    ["--rdzv_id=abc", "--monitor-interval=1", "--run-path", "--nproc-per-node=2", "train.py", "--lr", "1"],
    ["--nproc-per-node", "2", "--", "train.py", "--lr", "1"],
])
def test_spellings_reach_the_same_spec(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, argv: list[str]) -> None:
    code, out, spec = _spec(tmp_path, monkeypatch, *argv)
    assert code == 0, out
    assert spec is not None
    assert (spec.nnodes, spec.nproc_per_node, spec.script) == (1, 2, ("train.py", "--lr", "1"))
    assert spec.max_restarts is None  # torchrun's 0 is applied once the worker is known


def test_pet_environment_through_the_cli(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    code, out, spec = _spec(tmp_path, monkeypatch, "train.py",
                            env={"PET_NPROC_PER_NODE": "3", "PET_MAX_RESTARTS": "2", "PET_ROLE": "trainer"})
    assert code == 0, out
    assert spec is not None and (spec.nnodes, spec.nproc_per_node, spec.max_restarts, spec.role) == (1, 3, 2, "trainer")


def test_builtin_workload_keeps_its_layout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    code, out, spec = _spec(tmp_path, monkeypatch, "--steps", "5")
    assert code == 0, out
    assert spec is not None and (spec.nnodes, spec.nproc_per_node, spec.script) == (2, 2, ())
    code, out, spec = _spec(tmp_path, monkeypatch, "-m", "ffctl.workload.train", "--steps", "5")
    assert code == 0, out
    assert spec is not None and spec.script == ("-m", "ffctl.workload.train", "--steps", "5")


def test_bad_torchrun_value_is_one_line_exit_2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    code, _, spec = _spec(tmp_path, monkeypatch, "--nnodes", "2:1", "train.py")
    assert code == 2 and spec is None
    assert "--nnodes '2:1': MIN is more than MAX" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


# -- what workers are given --------------------------------------------------------------------

def test_omp_threads_as_torchrun_sets_them() -> None:
    from ffctl.agent.workerenv import worker_env

    assert worker_env({}, {"LOCAL_WORLD_SIZE": "2"}, False)["OMP_NUM_THREADS"] == "1"
    assert "OMP_NUM_THREADS" not in worker_env({}, {"LOCAL_WORLD_SIZE": "1"}, False)
    assert worker_env({"OMP_NUM_THREADS": "4"}, {"LOCAL_WORLD_SIZE": "2"}, False)["OMP_NUM_THREADS"] == "4"


def test_job_env_carries_torchruns_names() -> None:
    from wire.jobenv import JobEnv

    env = JobEnv(rank=3, world_size=4, local_rank=1, local_world_size=2, node=1, run_id="r", store_host="h",
                 store_port=5, gen=2, role="trainer", max_restarts=7).to_env()
    assert {k: env[k] for k in ("RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "WORLD_SIZE",
                                "LOCAL_WORLD_SIZE", "ROLE_WORLD_SIZE", "GROUP_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                                "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID")} == {
        "RANK": "3", "LOCAL_RANK": "1", "GROUP_RANK": "1", "ROLE_RANK": "3", "ROLE_NAME": "trainer", "GROUP_WORLD_SIZE": "2",
        "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "ROLE_WORLD_SIZE": "4", "MASTER_ADDR": "h", "MASTER_PORT": "5",
        "TORCHELASTIC_RESTART_COUNT": "2", "TORCHELASTIC_MAX_RESTARTS": "7", "TORCHELASTIC_RUN_ID": "r"}


def test_error_file_as_torchs_record_writes_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.distributed.elastic.multiprocessing.errors import record

    from ffctl.agent.workers import read_error_file

    path = tmp_path / "0.gen0.error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))

    @record
    def failing() -> None:
        raise ValueError("bad batch")

    with pytest.raises(ValueError):
        failing()
    assert read_error_file(path) == "ValueError: bad batch"
    assert read_error_file(tmp_path / "missing.json") is None
    (tmp_path / "junk.json").write_text("{not json")
    assert read_error_file(tmp_path / "junk.json") is None
    (tmp_path / "plain.json").write_text('{"message": "OOM on device 0"}')
    assert read_error_file(tmp_path / "plain.json") == "OOM on device 0"


def test_a_ranks_stderr_is_echoed_to_stderr_and_its_stdout_to_stdout(tmp_path: Path) -> None:
    from ffctl.launch.echo import RankEcho

    logs = tmp_path / "logs"
    (logs / "0").mkdir(parents=True)
    out: list[str] = []
    err: list[str] = []
    echo = RankEcho(logs, out.append, nproc_per_node=2, write_err=err.append)
    (logs / "0" / "1.log").write_bytes(b"step 1\n")
    (logs / "0" / "1.err").write_bytes(b"Traceback (most recent call last):\nValueError: x\n")
    echo.poll()
    assert out == ["[rank 1]: step 1"]
    assert err == ["[rank 1]: Traceback (most recent call last):", "[rank 1]: ValueError: x"]


def test_with_torchruns_tee_lines_carry_torchruns_prefix(tmp_path: Path) -> None:
    from ffctl.launch.echo import RankEcho

    logs = tmp_path / "logs"
    (logs / "1").mkdir(parents=True)
    seen: list[str] = []
    echo = RankEcho(logs, seen.append, nproc_per_node=2, role="trainer")
    (logs / "1" / "3.log").write_bytes(b"hello\n")
    echo.poll()
    assert seen == ["[trainer1]:hello"]  # torchrun --tee 3: [<role><local rank>]:line


def test_rank_output_is_echoed_with_its_rank(tmp_path: Path) -> None:
    from ffctl.launch.echo import RankEcho, parse_ranks_filter

    logs = tmp_path / "logs"
    (logs / "0").mkdir(parents=True)
    (logs / "1").mkdir()
    seen: list[str] = []
    echo = RankEcho(logs, seen.append, nproc_per_node=2, local_ranks=parse_ranks_filter("0"))
    (logs / "0" / "0.log").write_bytes(b"hello\npart")
    (logs / "0" / "1.log").write_bytes(b"filtered out\n")
    (logs / "1" / "2.log").write_bytes(b"node one\n")
    (logs / "0" / "template.log").write_bytes(b"not a rank\n")
    echo.poll()
    assert seen == ["[rank 0]: hello", "[rank 2]: node one"]
    with open(logs / "0" / "0.log", "ab") as fh:
        fh.write(b"ial line\nlast")
    echo.poll(final=True)
    assert seen[2:] == ["[rank 0]: partial line", "[rank 0]: last"]
    assert parse_ranks_filter("") is None and parse_ranks_filter("0, 2") == {0, 2}
    with pytest.raises(TorchrunArgError, match="--local-ranks-filter 'x'"):
        _resolve({"local_ranks_filter": "x"})
