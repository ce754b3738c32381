"""The shape of the code: no import circle among the project's modules, imports only down the layers of
docs/architecture.md, and no file over 500 lines.

Read from the source with ``ast`` (nothing is imported: no Ray, no torch), so it runs in well under a second."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import ROOT

#: The packages whose modules must import each other without a circle.
PACKAGES = ("fedsweep", "actors")
#: Folders every Python file of which is held to :data:`MAX_LINES`.
SIZED = ("fedsweep", "actors", "benchmarks", "tests")
MAX_LINES = 500


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules() -> dict[str, Path]:
    return {module_name(p): p for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py"))}


def _absolute(module: str, path: Path, node: ast.ImportFrom) -> str:
    """The absolute name a ``from`` import names (relative ones resolved against ``module``'s package)."""
    if not node.level:
        return node.module or ""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    base = package[: len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _known(name: str, modules: dict[str, Path]) -> str | None:
    """The project module ``name`` is, or lies in (its longest prefix that is one); None outside the project."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in modules:
            return ".".join(parts[:end])
    return None


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules ``module`` imports, at module level or inside a function (a lazy import still
    closes a circle). ``from x import y`` imports the module ``x.y`` when there is one, else ``x``."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(module, path, node)
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        found.update(t for t in (_known(name, modules) for name in targets) if t is not None)
    found.discard(module)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = project_modules()
    return {m: imports_of(m, p, modules) for m, p in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle (its modules, the first repeated at the end), or None when there is none."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)):
            return cycle
    return None


def test_the_cycle_finder_finds_a_lazy_import_circle(tmp_path):
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None
    modules = {"pkg": tmp_path / "pkg" / "__init__.py", "pkg.x": tmp_path / "pkg" / "x.py", "pkg.y": tmp_path / "pkg" / "y.py"}
    modules["pkg.x"].parent.mkdir()
    modules["pkg"].write_text("from pkg import x\n")
    modules["pkg.x"].write_text("import os\n\ndef f():\n    from .y import g\n")
    modules["pkg.y"].write_text("from pkg.x import f\n")
    graph = {m: imports_of(m, p, modules) for m, p in modules.items()}
    assert graph == {"pkg": {"pkg.x"}, "pkg.x": {"pkg.y"}, "pkg.y": {"pkg.x"}}
    assert find_cycle(graph) == ["pkg.x", "pkg.y", "pkg.x"]


def test_no_import_circle_among_the_modules():
    graph = import_graph()
    assert "fedsweep.config" in graph and "actors.server" in graph
    cycle = find_cycle(graph)
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def _within(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


#: docs/architecture.md's layers, top to bottom, and the modules (or packages) of each: a module imports only
#: modules of its own layer or of a layer below it, lazy imports included.
LAYERS = {
    "commands": ("fedsweep.cli", "fedsweep.cli_table", "fedsweep.cli_common"),
    "benchmark": ("fedsweep.bench", "fedsweep.bench_run", "fedsweep.bench_folder", "fedsweep.bench_figures"),
    "sweeps": ("fedsweep.sweep", "fedsweep.stopping", "fedsweep.optuna_search", "fedsweep.table", "fedsweep.report",
               "fedsweep.checkpoint"),
    "drivers": ("fedsweep.experiment",),
    "tracking": ("fedsweep.tracking", "fedsweep.tracking_process", "fedsweep.metric_writer", "fedsweep.sqlite_store"),
    "actors": ("actors",),
    "engine": ("fedsweep.engine",),
    "pool": ("fedsweep.pool",),
    "federation": ("fedsweep.federation",),
    "configuration": ("fedsweep.config", "fedsweep.loading", "fedsweep.checks", "fedsweep.layout", "fedsweep.search",
                      "fedsweep.storage"),
    "algorithms": ("fedsweep.algorithms",),
    "models, data": ("fedsweep.models", "fedsweep.data", "fedsweep.client_data", "fedsweep.evaluation"),
    "utilities": ("fedsweep.dotted", "fedsweep.schema", "fedsweep.config_file", "fedsweep.safe_pickle", "fedsweep.node_cache",
                  "fedsweep.conv_kernels"),
}


def _layer(module: str) -> int | None:
    for rank, members in enumerate(LAYERS.values()):
        if _within(module, members):
            return rank
    return None


def _doc_layers() -> dict[str, str]:
    """docs/architecture.md's table of layers: each row's first cell → its modules cell."""
    text = (ROOT / "docs" / "architecture.md").read_text().split("## The layers", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1:-1] for line in text.splitlines() if line.startswith("| ") and not line.startswith("| layer |")]
    return {cells[0].strip(): cells[1] for cells in rows}


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Each import of ``graph`` from a module to one of a higher layer (the package ``fedsweep`` itself is in none)."""
    names = list(LAYERS)
    return [f"{m} ({names[_layer(m)]}) imports {t} ({names[_layer(t)]})" for m in sorted(graph) if m != "fedsweep"
            for t in sorted(graph[m]) if t != "fedsweep" and _layer(t) < _layer(m)]


def test_each_module_imports_only_its_own_layer_and_the_layers_below_as_the_architecture_page_says():
    graph = import_graph()
    unplaced = sorted(m for m in graph if m != "fedsweep" and _layer(m) is None)
    assert not unplaced, f"modules in no layer of LAYERS (and of docs/architecture.md): {unplaced}"
    upward = upward_imports(graph)
    assert not upward, "imports up the layers: " + "; ".join(upward)
    doc = _doc_layers()
    assert list(doc) == list(LAYERS)  # the page's rows: these layers, in this order
    for layer, members in LAYERS.items():  # each module named in its row (a package by its folder)
        for m in members:
            name = m.split(".")[-1] + ("/" if (ROOT / m.replace(".", "/")).is_dir() else ".py")
            assert name in doc[layer], f"docs/architecture.md, row {layer!r}: {name} not named"


def test_an_import_up_the_layers_is_found_and_one_down_or_within_a_layer_is_not():
    # checks.py read the tracking URI from tracking.py until 2026-11-27
    assert upward_imports({"fedsweep.checks": {"fedsweep.tracking", "fedsweep.config"}}) == [
        "fedsweep.checks (configuration) imports fedsweep.tracking (tracking)"]
    assert upward_imports({"fedsweep.algorithms.fedper": {"fedsweep.algorithms.fedavg", "fedsweep.models"},
                           "fedsweep": {"fedsweep.cli"}, "fedsweep.cli": {"fedsweep"}}) == []


def test_every_python_file_has_at_most_500_lines():
    sizes = {str(p.relative_to(ROOT)): len(p.read_text().splitlines())
             for folder in SIZED for p in sorted((ROOT / folder).rglob("*.py"))}
    assert len(sizes) > 20
    over = {file: n for file, n in sizes.items() if n > MAX_LINES}
    assert not over, f"files over {MAX_LINES} lines: {over}"
