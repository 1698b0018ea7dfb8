"""`ffctl report`: recovery time, lost time and lost GPU-hours of every fault of a run, recomputed
from its events; without a run, the runs recorded; with several, the runs side by side."""
from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from ffctl.render import html as html_page
from ffctl.render import make_console
from ffctl.exits import BadInput
from ffctl.render.report import (markdown_comparison, markdown_report, markdown_run_list, render_comparison,
                                 render_report, render_run_list)
from runs.events import RunStatus
from runs.metrics import compute
from runs.report_fields import BadField, line_of
from runs.store import CorruptRecord, RunStore, RunStoreError, list_runs, open_run


def left_behind(record: RunStore) -> dict[str, Any]:
    """What run.json says a killed controller leaves (its sandbox), narrowed to what is still
    on this machine, and the command that removes it."""
    try:
        sandbox = record.read_json("run.json").get("sandbox") or {}
    except (OSError, ValueError, AttributeError):
        return {}
    namespaces = [str(n) for n in sandbox.get("namespaces") or []]
    links = [str(n) for n in sandbox.get("links") or []]
    if not namespaces and not links:
        return {}
    from ffctl.backends.netns import SandboxError, list_namespaces

    try:
        present = set(list_namespaces())
        namespaces = [n for n in namespaces if n in present]
    except SandboxError:
        pass  # no `ip` here to look with: say what the record says
    links = [n for n in links if "/" not in n and Path("/sys/class/net", n).exists()]
    if not namespaces and not links:
        return {}
    return {"namespaces": namespaces, "links": links,
            "remove": f"ffctl inject revert --all --run {record.run_id}"}


def run_report(record: RunStore) -> dict[str, Any]:
    """The report of one run; BadField, with the line of events.jsonl that holds it, for a
    record field of the wrong type or range (`runs.report_fields`)."""
    try:
        rep = compute(record.run_id, record.events(), record.controller_alive()).to_dict()
    except BadField as exc:
        # Looked up on this path only: events carry no line numbers, and a good record is never
        # read twice for them.
        raise exc.at_line(line_of(record.events_path, exc.event)) from None
    if rep["status"] == RunStatus.INCOMPLETE.value:
        rep["left"] = left_behind(record)
    return rep


def listed_reports(records: list[RunStore]) -> list[dict[str, Any]]:
    """The reports of the runs of a listing; a run whose record cannot be read (garbage in its
    events or run.json) is left out with one warning line on stderr, so that one bad directory
    never hides every other run."""
    listed = []
    for record in records:
        try:
            listed.append(run_report(record))
        except Exception as exc:  # whatever a hostile record trips, the listing goes on
            why = " ".join(str(exc).split()) or type(exc).__name__
            typer.echo(f"ffctl: warning: run {record.run_id!r} skipped: {why[:300]}", err=True)
    return listed


def run_summary(rep: dict[str, Any]) -> dict[str, Any]:
    """A run as `ffctl report --json` without a run id lists it."""
    return {
        "run_id": rep["run_id"], "status": rep["status"], "strategy": rep["strategy"],
        "world_size": rep["world_size"], "steps_completed": rep["steps_completed"],
        "faults": len(rep["faults"]), "lost_s": sum(float(f.get("lost_s") or 0.0) for f in rep["faults"]),
        "lost_gpu_hours_total": rep["lost_gpu_hours_total"], "goodput": rep["goodput"],
    }


def _write(path: Path, page: str, console: Any) -> None:
    try:
        write_output(path, page)
    except OSError as exc:
        raise BadInput(f"--html {str(path)!r}: {exc.strerror or exc}") from None
    console.print(f"HTML report written to {path}", markup=False, highlight=False, soft_wrap=True)


# Kernel filesystems whose "regular files" are knobs and reports, never a place for a report:
# /proc/version, for one, is a regular file that root may even open for writing; only the write
# fails, after the whole job has run.
_KERNEL_FS = frozenset({"proc", "sysfs", "debugfs", "tracefs", "securityfs", "cgroup", "cgroup2", "configfs",
                        "bpf", "pstore", "efivarfs", "fusectl", "binfmt_misc", "devpts", "mqueue"})
_KINDS = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device"),
          (stat.S_ISSOCK, "a socket"))


def _filesystem_of(path: str) -> str | None:
    """The type of the filesystem mounted nearest above `path` (a resolved path), from this
    process's mount table; None where there is none to read (not Linux)."""
    try:
        with open("/proc/self/mounts", encoding="utf-8", errors="replace") as fh:
            table = fh.read().splitlines()
    except OSError:
        return None
    best, kind = "", None
    for row in table:
        fields = row.split()
        if len(fields) < 3:
            continue
        # The table escapes a space, tab, newline and backslash in a mount point as octal.
        mount = (fields[1].replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n")
                 .replace("\\134", "\\"))
        if (path == mount or path.startswith(mount.rstrip("/") + "/")) and len(mount) >= len(best):
            best, kind = mount, fields[2]
    return kind


def check_output(flag: str, path: Path) -> None:
    """BadInput naming `flag` and `path` unless a report can be written there: an existing,
    writable regular file (a link to one is the user's own choice and fine), or a new file in an
    existing, writable directory; never a directory, FIFO, device or socket, nor a file of a
    kernel filesystem. Called before any work, so a bad path costs nothing: writing a FIFO nobody
    reads would hang after the work, and /dev/full or /proc/version would refuse only then."""
    shown = f"{flag} {str(path)!r}"
    try:
        st = os.stat(path)  # follows links: what counts is what a write would reach
    except FileNotFoundError:
        if os.path.lexists(path):
            raise BadInput(f"{shown}: a link to nothing: name the file itself") from None
        parent = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(parent):
            raise BadInput(f"{shown}: not a file in an existing directory") from None
        if not os.access(parent, os.W_OK | os.X_OK):
            raise BadInput(f"{shown}: directory {parent!r} is not writable") from None
        target = os.path.realpath(parent)
    except NotADirectoryError:
        raise BadInput(f"{shown}: not a file in an existing directory") from None
    except OSError as exc:
        raise BadInput(f"{shown}: {exc.strerror or exc}") from None
    else:
        if stat.S_ISDIR(st.st_mode):
            raise BadInput(f"{shown} is a directory: name a file in it")
        for test, what in _KINDS:
            if test(st.st_mode):
                raise BadInput(f"{shown} is not a regular file ({what})")
        if not stat.S_ISREG(st.st_mode):
            raise BadInput(f"{shown} is not a regular file")
        if not os.access(path, os.W_OK):
            raise BadInput(f"{shown} is not writable")
        target = os.path.realpath(path)
    kind = _filesystem_of(target)
    if kind in _KERNEL_FS:
        raise BadInput(f"{shown} is a file of the kernel's {kind} filesystem, not one to write a report to")


def write_output(path: Path, text: str) -> None:
    """Write `text` to the output file `check_output` accepted. Opened without blocking and
    checked again by what was opened: should the path have become a FIFO since the check, the
    open fails at once (no reader) instead of hanging, and a FIFO or device that is there all
    the same is refused before anything is written (OSError, as for a full disk)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NONBLOCK | os.O_CLOEXEC, 0o666)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"not a regular file: {str(path)!r}")
        os.set_blocking(fd, True)
        os.ftruncate(fd, 0)  # only now: a file that turned out not to be one is left as it was
        with os.fdopen(fd, "w", encoding="utf-8", closefd=False) as fh:
            fh.write(text)
    finally:
        os.close(fd)


def check_outputs(html: Path | None, runs_dir: Path) -> None:
    """`--html FILE` (matplotlib installed, a file `check_output` accepts) and `--runs-dir` (a
    directory when it exists), checked before any record is read: one line, exit 2."""
    if html is not None:
        html_page.require_matplotlib()
        check_output("--html", html)
    if runs_dir.exists() and not runs_dir.is_dir():
        raise BadInput(f"--runs-dir {str(runs_dir)!r} is not a directory")


def newest_run(runs_dir: Path, named: list[str] | None) -> str:
    """The id `--last` stands for: the newest run recorded in `runs_dir`."""
    if named:
        raise BadInput(f"--last and run id {named[0]!r}: choose one")
    found = list_runs(runs_dir)
    if not found:
        raise BadInput(f"--last: no runs in {str(runs_dir)!r}")
    return found[0].run_id


def register(app: typer.Typer) -> None:
    @app.command("report")
    def report(
        runs: Annotated[Optional[list[str]], typer.Argument(
            help="Run ids; none lists the runs, several are compared side by side.")] = None,
        as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
        markdown: Annotated[bool, typer.Option(
            "--markdown", help="Print GitHub-flavoured Markdown tables (for CI summaries).")] = False,
        html: Annotated[Optional[Path], typer.Option(
            "--html", metavar="FILE",
            help="Also write one self-contained HTML page: the tables, a timeline and the loss curve "
                 "(needs the html extra: pip install 'ffctl[html]').")] = None,
        last: Annotated[bool, typer.Option("--last", help="The newest run in the runs directory (no id needed).")] = False,
        runs_dir: Annotated[Path, typer.Option("--runs-dir", envvar="FFCTL_RUNS_DIR",
                                               help="Where run records are.")] = Path("ffctl-runs"),
        project_to: Annotated[Optional[str], typer.Option("--project", hidden=True)] = None,
    ) -> None:
        """Show each fault's detection and recovery time, lost time, lost steps and lost GPU-hours.

        Without a run id, lists the runs in the runs directory, newest first; with several,
        compares them in one table. Exits 1 when a named run is incomplete (its controller was
        lost before it finished the record): the figures stop where it died and the sandbox may
        still be on the machine, which a script must not mistake for a run that ended.
        """
        if as_json and markdown:
            raise BadInput("--json and --markdown: choose one")
        if project_to is not None:
            # The projection grew into its own command (fleet presets, Daly's model, several sizes).
            raise BadInput(f"--project {project_to!r}: projection is `ffctl project RUN... --mtbf T@N --gpus N` "
                           "(or --fleet llama3|rsc1|rsc2) now")
        check_outputs(html, runs_dir)
        if last:
            runs = [newest_run(runs_dir, runs)]
        records = []
        for run_id in runs or []:
            try:
                records.append(open_run(runs_dir, run_id))
            except RunStoreError as exc:
                raise BadInput(str(exc)) from None
        console = make_console(quiet=as_json or markdown)
        if not records:
            listed = listed_reports(list_runs(runs_dir))
            if as_json:
                typer.echo(json.dumps([run_summary(r) for r in listed], indent=2))
            elif markdown:
                typer.echo(markdown_run_list(listed), nl=False)
            render_run_list(listed, console, str(runs_dir))
            if html is not None:
                _write(html, html_page.run_list_html(listed, str(runs_dir)), console)
            return
        reports = []
        for record in records:
            try:
                reports.append(run_report(record))
            except CorruptRecord as exc:
                raise BadInput(f"unreadable run record: {exc}") from None
            except BadField as exc:
                raise BadInput(f"run {record.run_id!r}: unreadable record: {exc}") from None
        if as_json:
            typer.echo(json.dumps(reports[0] if len(reports) == 1 else reports, indent=2))
        elif markdown:
            typer.echo(markdown_report(reports[0]) if len(reports) == 1 else markdown_comparison(reports), nl=False)
        if len(reports) == 1:
            render_report(reports[0], console)
        else:
            render_comparison(reports, console)
        if html is not None:
            page = html_page.report_html(reports, {r.run_id: r.events() for r in records})
            _write(html, page, console)
        if any(r["status"] == RunStatus.INCOMPLETE.value for r in reports):
            raise typer.Exit(1)
