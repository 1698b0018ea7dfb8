"""The import layering: lower packages never import `ffctl`, each third-party library stays in its
room, the folders of `ffctl/` import one way, and no import circle exists among the project's
modules (imports under `TYPE_CHECKING` and inside functions count: they are coupling too)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("runs", "wire", "recovery", "fault_injectors", "ffctl")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


MODULES = _modules()


def _imports(path: Path) -> set[str]:
    """Every module `path` imports, anywhere in it, as dotted names (a `from pkg import name`
    counts as `pkg.name` when that is a module, else as `pkg`)."""
    tree = ast.parse(path.read_text(), str(path))
    here = _module_name(path)
    is_pkg = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here.split(".")
                base = base[: len(base) - node.level + (1 if is_pkg else 0)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            for alias in node.names:
                sub = f"{mod}.{alias.name}"
                out.add(sub if sub in MODULES else mod)
    return out


GRAPH = {name: {m for m in _imports(path) if m in MODULES and m != name} for name, path in MODULES.items()}
THIRD_PARTY = {name: {m.split(".")[0] for m in _imports(path)} for name, path in MODULES.items()}


def _owner(module: str) -> str:
    return module.split(".")[0]


def _room(module: str) -> str:
    """The folder of `ffctl/` a module lives in (`ffctl.launch`), or its package elsewhere."""
    parts = module.split(".")
    if parts[0] == "ffctl" and len(parts) > 2:
        return ".".join(parts[:2])
    return parts[0] if parts[0] != "ffctl" else module


@pytest.mark.parametrize("lower", ["runs", "wire", "recovery", "fault_injectors"])
def test_lower_packages_never_import_ffctl(lower: str) -> None:
    bad = {m: sorted(i for i in GRAPH[m] if _owner(i) == "ffctl") for m in GRAPH if _owner(m) == lower}
    assert not {m: v for m, v in bad.items() if v}


def test_runs_imports_no_other_package_of_the_project() -> None:
    bad = {m: sorted(i for i in GRAPH[m] if _owner(i) != "runs") for m in GRAPH if _owner(m) == "runs"}
    assert not {m: v for m, v in bad.items() if v}
    # The run record is read where no torch exists (report on a laptop).
    assert not [m for m in GRAPH if _owner(m) == "runs" and "torch" in THIRD_PARTY[m]]


def test_the_wire_formats_import_only_the_record_s_vocabulary() -> None:
    # Every process speaks them: the controller, the agents, the ranks. What they import, every
    # process loads; so only the run record's words, and torch's store client where the store
    # protocol talks to it (`wire.control`, inside `connect`: the agents load that module without
    # torch, `tests/unit/test_storeclient.py`), never the rank's library or the fault injectors.
    bad = {m: sorted(i for i in GRAPH[m] if _owner(i) not in ("wire", "runs")) for m in GRAPH if _owner(m) == "wire"}
    assert not {m: v for m, v in bad.items() if v}
    heavy = {m: sorted(THIRD_PARTY[m] & {"torch", "psutil"}) for m in GRAPH if _owner(m) == "wire"}
    assert {m: v for m, v in heavy.items() if v} == {"wire.control": ["torch"]}


@pytest.mark.parametrize("library, room", [
    ("paramiko", "ffctl.hosts.ssh"), ("rich", "ffctl.render"), ("typer", "ffctl.cli"),
])
def test_each_library_stays_in_its_room(library: str, room: str) -> None:
    outside = sorted(m for m, libs in THIRD_PARTY.items() if library in libs and not (m == room or m.startswith(room + ".")))
    assert not outside, f"{library} imported outside {room}: {outside}"


# Which folders of ffctl/ each folder may import (besides the lower packages and the shared loose
# modules ffctl.exits and ffctl.launch_spec, the launch spec every room reads).
ALLOWED = {
    "ffctl.agent": set(),
    "ffctl.workload": set(),
    # The agent's config (what it starts agents with) and the node-backend protocol, never a backend.
    "ffctl.controller": {"ffctl.agent", "ffctl.backends.protocol"},
    "ffctl.hosts": {"ffctl.agent"},
    # A backend starts agents (their config) on hosts (SSH's transport and preflight).
    "ffctl.backends": {"ffctl.agent", "ffctl.hosts"},
    "ffctl.launch": {"ffctl.agent", "ffctl.backends", "ffctl.controller", "ffctl.hosts", "ffctl.workload"},
    "ffctl.render": {"ffctl.hosts.doctor"},  # the doctor's result types, to show them
    "ffctl.cli": {"ffctl.launch", "ffctl.backends", "ffctl.controller", "ffctl.hosts", "ffctl.render", "ffctl.agent",
                  "ffctl.bench"},
    # Simulated agents, a backend (the protocol, the stop sequence), the real controller.
    "ffctl.sim": {"ffctl.agent", "ffctl.backends", "ffctl.controller"},
}


def test_folders_import_one_way() -> None:
    bad: dict[str, list[str]] = {}
    for mod, deps in GRAPH.items():
        room = _room(mod)
        if room not in ALLOWED:
            continue
        for dep in deps:
            if _owner(dep) != "ffctl" or dep in ("ffctl", "ffctl.exits", "ffctl.launch_spec") or _room(dep) == room:
                continue
            if not any(dep == a or dep.startswith(a + ".") or _room(dep) == a for a in ALLOWED[room]):
                bad.setdefault(mod, []).append(dep)
    assert not bad


# What the controller and the node backends may take from the agent's folder: its configuration
# (what an agent is started with) and the workers' environment rule (the local backend starts its
# host template with the environment the workers' libraries load with), never the runtime that
# runs inside an agent.
AGENT_CONFIG = "ffctl.agent.config"
AGENT_LIGHT = (AGENT_CONFIG, "ffctl.agent.workerenv")
AGENT_STARTERS = ("ffctl.controller", "ffctl.backends")


def test_the_controller_and_the_backends_import_only_the_agent_s_config() -> None:
    bad = {m: sorted(d for d in GRAPH[m] if _room(d) == "ffctl.agent" and d not in AGENT_LIGHT)
           for m in GRAPH if any(m == s or m.startswith(s + ".") for s in AGENT_STARTERS)}
    assert not {m: v for m, v in bad.items() if v}
    # Those stay light: nothing of the project but the lower packages, nothing heavy.
    for light in AGENT_LIGHT:
        assert not [d for d in GRAPH[light] if _owner(d) == "ffctl"], light
        assert not THIRD_PARTY[light] & {"torch", "psutil", "recovery", "runs"}, light


def _reach(start: str) -> set[str]:
    """Every module `start` imports, directly or through others."""
    seen: set[str] = set()
    todo = [start]
    while todo:
        for dep in GRAPH[todo.pop()]:
            if dep not in seen:
                seen.add(dep)
                todo.append(dep)
    return seen


def test_the_controller_reaches_no_node_backend() -> None:
    # One protocol, one folder: the controller sees nodes only through `ffctl.backends.protocol`,
    # which imports no backend, so nothing the controller loads is a backend (or paramiko).
    backends = {m for m in GRAPH if _room(m) == "ffctl.backends"} - {"ffctl.backends.protocol"}
    assert not _reach("ffctl.backends.protocol") & backends
    for mod in (m for m in GRAPH if _room(m) == "ffctl.controller"):
        assert not _reach(mod) & backends, mod
    # And every backend module implements the protocol from that one place.
    for name in ("local", "ssh", "slurm"):
        assert "ffctl.backends.protocol" in GRAPH[f"ffctl.backends.{name}"], name


def test_no_import_circle() -> None:
    # Tarjan's strongly connected components: any component of more than one module is a circle.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    circles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(GRAPH[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(sorted(comp))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    assert not circles


def test_few_loose_modules_in_ffctl() -> None:
    loose = sorted(p.name for p in (ROOT / "ffctl").glob("*.py"))
    assert len(loose) <= 8, loose


def test_the_checker_sees_imports_of_every_kind(tmp_path: Path) -> None:
    # The checks above are only as good as the import finder: it must see imports inside
    # functions and under TYPE_CHECKING, and resolve `from pkg import module`.
    assert "ffctl.agent.agent" in GRAPH["ffctl.cli.cmd_agent"]  # imported inside a function
    assert any(_owner(m) == "recovery" for m in GRAPH["ffctl.agent.agent"])


# The controller's pieces take the job state, a recorder and the narrow things they need, never
# the controller: only the launch, the command line and the simulation start one.
CONTROLLER = "ffctl.controller.controller"


def test_nothing_in_the_controller_s_folder_imports_the_controller() -> None:
    assert not sorted(m for m in GRAPH if _room(m) == "ffctl.controller" and CONTROLLER in GRAPH[m])
    assert not sorted(m for m in GRAPH if CONTROLLER in GRAPH[m] and _room(m) not in
                      ("ffctl.launch", "ffctl.cli", "ffctl.sim"))


def test_planning_imports_no_runtime() -> None:
    # Planning a launch (the pure fault plan, the scan of the user's script) loads neither the
    # fault scheduler nor the controller, nor torch.
    for pure in ("ffctl.controller.faultplan", "ffctl.controller.script"):
        assert not GRAPH[pure] & {"ffctl.controller.injector", CONTROLLER}, pure
        assert "torch" not in THIRD_PARTY[pure], pure
    assert "ffctl.controller.injector" not in GRAPH["ffctl.launch.launch_plan"]
