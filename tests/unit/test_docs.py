"""The docs keep their shape and tell the truth: the README is a short front door that starts with
the two commands CI runs, the design page stays an architecture page, every page is linked from
the index and every relative link resolves, and the commands the README and the guides show run
(CONTRIBUTING.md, "Documentation", states the convention this test reads)."""
from __future__ import annotations

import os
import re
import shlex
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.conftest import is_root
from tests.helpers.launch import ffctl_argv

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
MAX_README_LINES = 200
MAX_DESIGN_LINES = 300
FIRST_BLOCK = [
    "scripts/setup && .venv/bin/ffctl launch --nnodes 2 --nproc-per-node 2 --steps 60 --spares 2"
    " --inject kill-rank:rank=1,step=20 --inject kill-node:node=1,step=40",
    "scripts/setup && .venv/bin/python -m pytest -q",
]
# Commands that change something run as a plan only; the others run as written unless they need a
# recorded run, which the test's fresh directory does not have.
DRY_RUN = {"launch", "inject", "run", "bench"}
READ_ONLY = {"report", "project", "doctor", "faults"}
SHELL_ENDS = {">", ">>", "|", "2>", "2>&1", "&&", ";"}
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(`{3,})(.*)$")


def _pages() -> list[Path]:
    return [README, ROOT / "CONTRIBUTING.md", ROOT / "CHANGELOG.md", *sorted(DOCS.rglob("*.md"))]


def _blocks(path: Path) -> list[tuple[str, int, list[str]]]:
    """Each fenced block of `path`: its info string, the line number of its first line, its lines."""
    out: list[tuple[str, int, list[str]]] = []
    lines = path.read_text().splitlines()
    i = 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        fence, info, start, body = match.group(1), match.group(2).strip(), i + 2, []
        i += 1
        while i < len(lines) and not lines[i].startswith(fence):
            body.append(lines[i])
            i += 1
        out.append((info, start, body))
        i += 1
    return out


def test_the_readme_is_a_short_front_door_that_starts_with_the_two_commands() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines (at most {MAX_README_LINES})"
    bash = [body for info, _, body in _blocks(README) if info.split()[:1] == ["bash"]]
    assert bash and bash[0] == FIRST_BLOCK, f"README.md's first bash block is not CI's two commands: {bash[:1]}"
    # ... and nothing but the title and its one line stands before it.
    first = lines.index("```bash")
    assert [line for line in lines[:first] if line.strip()][2:] == [], lines[:first]


def test_the_design_page_stays_an_architecture_page() -> None:
    lines = (DOCS / "DESIGN.md").read_text().splitlines()
    assert len(lines) <= MAX_DESIGN_LINES, f"docs/DESIGN.md has {len(lines)} lines (at most {MAX_DESIGN_LINES})"


def _links(path: Path) -> list[str]:
    text = path.read_text()
    # Links inside fenced blocks are code, not links.
    for _, _, body in _blocks(path):
        for line in body:
            text = text.replace(line, "")
    return [t for t in LINK.findall(text) if not t.startswith(("http://", "https://", "mailto:", "#"))]


def test_the_index_links_every_page_under_docs() -> None:
    index = DOCS / "README.md"
    linked = {(index.parent / t.split("#")[0]).resolve() for t in _links(index)}
    pages = {p.resolve() for p in DOCS.rglob("*.md")} - {index.resolve()}
    missing = sorted(str(p.relative_to(ROOT)) for p in pages - linked)
    assert not missing, f"docs/README.md does not link: {missing}"


def test_every_relative_link_points_at_a_file() -> None:
    broken = []
    for page in _pages():
        for target in _links(page):
            if not (page.parent / target.split("#")[0]).exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, broken


def _commands(path: Path) -> list[tuple[int, str]]:
    """The `ffctl ...` lines of `path`'s bash blocks, with their line numbers (continuations joined)."""
    out: list[tuple[int, str]] = []
    for info, start, body in _blocks(path):
        if info.split()[:1] != ["bash"]:
            continue
        i = 0
        while i < len(body):
            number, line = start + i, body[i]
            while line.rstrip().endswith("\\") and i + 1 < len(body):
                i += 1
                line = line.rstrip()[:-1] + " " + body[i].strip()
            i += 1
            stripped = line.strip()
            if stripped.startswith(".venv/bin/ffctl "):
                stripped = stripped[len(".venv/bin/"):]
            if stripped.startswith("ffctl "):
                out.append((number, stripped))
    return out


def _files(path: Path) -> dict[str, str]:
    """The files `path` writes: fenced blocks whose info string names one after the language."""
    return {info.split()[1]: "\n".join(body) + "\n" for info, _, body in _blocks(path) if len(info.split()) == 2}


def _argv(line: str) -> list[str]:
    words = shlex.split(line, comments=True)[1:]
    for i, word in enumerate(words):
        if word in SHELL_ENDS:
            words = words[:i]
            break
    command = words[0]
    if command in DRY_RUN:
        return words if "--dry-run" in words else [command, "--dry-run", *words[1:]]
    assert command in READ_ONLY, f"the docs show `ffctl {command}`, which this test does not know how to run"
    positional = [w for w in words[1:] if not w.startswith("-")]
    needs_a_run = command == "project" or (command == "report" and ("--last" in words or positional))
    return [command, "--help"] if needs_a_run else words


def _doc_commands() -> list[tuple[Path, int, str]]:
    pages = [README, *sorted(DOCS.glob("*.md")), *sorted((DOCS / "guides").glob("*.md"))]
    return [(page, number, line) for page in pages for number, line in _commands(page)]


DOC_COMMANDS = _doc_commands()


def test_the_docs_show_commands_to_run() -> None:
    # The collector itself: the README's own commands and a guide's are found.
    shown = {(page.name, line.split()[1]) for page, _, line in DOC_COMMANDS}
    assert ("README.md", "report") in shown and ("faults.md", "launch") in shown, shown


def _run(cwd: Path, env: dict[str, str], page: Path, number: int, line: str) -> str | None:
    """None if the doc's command ran with exit 0, else what a reader needs to fix it."""
    argv = _argv(line)
    proc = subprocess.run(ffctl_argv(*argv), cwd=cwd, capture_output=True, text=True, env=env, timeout=60)
    if proc.returncode == 0:
        return None
    return (f"{page.relative_to(ROOT)}:{number}: `{line}` ran as `ffctl {shlex.join(argv)}`, "
            f"exit {proc.returncode}: {(proc.stderr or proc.stdout).strip()[-600:]}")


@pytest.mark.slow
def test_every_command_the_docs_show_runs(tmp_path: Path) -> None:
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    for page in {page for page, _, _ in DOC_COMMANDS}:
        for name, text in _files(page).items():
            (tmp_path / name).write_text(text)
    env = {**os.environ, "FFCTL_RUNS_DIR": str(tmp_path / "ffctl-runs"), "COLUMNS": "100"}
    # Namespaces need root, as the guides say.
    todo = [c for c in DOC_COMMANDS if is_root() or not ("--sandbox netns" in c[2] or "--backend netns" in c[2])]
    # Each command is a second of interpreter start-up and imports, mostly waiting: a few at once.
    with ThreadPoolExecutor(max_workers=2) as pool:
        failed = [f for f in pool.map(lambda c: _run(tmp_path, env, *c), todo) if f]
    assert not failed, "\n".join(failed)
