"""The import graph of src/dlperf flows one way: no lower layer imports a higher one, no cycle spans packages.

Every module is parsed with :mod:`ast`, so imports inside functions (the lazy ones) count as much as
those at the top of a file. Layers, lowest first (docs/design/architecture.md):

    base (the top-level modules) < engine, models, data < hybrid, kvstore < probe < parallel < bench < cli

A cycle inside one package may stay (the code says why); a cycle through two packages means a helper
lives inside a capability instead of below it.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src"
PACKAGE = SRC / "dlperf"

LAYERS: dict[str, int] = {
    "": 0,  # top-level modules: errors, _io, timing, registry, devices, _threads, machine, ...
    "engine": 1, "models": 1, "data": 1,
    "hybrid": 2, "kvstore": 2,
    "probe": 3,
    "parallel": 4,
    "bench": 5,
    "cli": 6,
}

# Inside dlperf.parallel, its sub-packages in the same one-way order, lowest first: the primitives at its root
# (split, replicas, optimizers), allreduce among one process's devices, how processes start, what carries gradients
# further (buckets, the process group, parameter servers), the strategies built from those, plans, and training,
# which uses them all.
PARALLEL_LAYERS: dict[str, int] = {
    "": 0, "allreduce": 1, "launchers": 2, "communication": 3, "strategies": 4, "planning": 5, "training": 6,
}

# Cycles inside one package, by their modules, each with why it stays or what it waits for. A cycle that is
# not (a subset of) an entry fails; so does an entry that no cycle matches any more.
PACKAGE_CYCLES: dict[frozenset[str], str] = {
    frozenset({"dlperf.hybrid.backends.registry", "dlperf.hybrid.backends.compiled",
               "dlperf.hybrid.backends.cuda_graphs", "dlperf.hybrid.backends.eager", "dlperf.hybrid.backends.graph",
               "dlperf.hybrid.backends.native"}):
        "stays: the registry loads the built-in backends lazily and each registers itself against its base class",
    frozenset({"dlperf.parallel.training.planned", "dlperf.parallel.training.trainer"}):
        "stays: plan_for times candidate Trainers built from pinned plans, and a Trainer told plan='auto' asks "
        "plan_for before it builds (imported when it plans)",
    frozenset({"dlperf.engine.engine", "dlperf.engine.naive", "dlperf.engine.threaded"}):
        "stays: the engine registry loads the built-in engines lazily and each registers itself",
}


@dataclass(frozen=True)
class Edge:
    importer: str
    imported: str
    file: str
    line: int
    type_only: bool

    def where(self) -> str:
        return f"{self.file}:{self.line}: {self.importer} -> {self.imported}"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _resolve(importer: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = importer.split(".")
    if not is_package:
        base.pop()
    if node.level > 1:
        base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> list[Edge]:
    """Every import of a dlperf module in ``path``, at any depth, as the most specific module it names."""
    return imports_in(name, path.read_text(), str(path.relative_to(SRC.parent)), path.name == "__init__.py", modules)


def _named(node: ast.AST, importer: str, is_package: bool, modules: dict[str, Path]) -> list[str]:
    """The modules one import statement names (``from pkg import mod`` names ``pkg.mod`` when it is one)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom):
        source = _resolve(importer, is_package, node)
        return [f"{source}.{a.name}" if f"{source}.{a.name}" in modules else source for a in node.names]
    return []


def _statements(node: ast.AST, type_only: bool = False):
    """Every node below ``node`` with whether it sits under ``if TYPE_CHECKING:``."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _is_type_checking(child.test):
            for inner in child.body:
                yield inner, True
                yield from _statements(inner, True)
            for inner in child.orelse:
                yield inner, type_only
                yield from _statements(inner, type_only)
            continue
        yield child, type_only
        yield from _statements(child, type_only)


def imports_in(name: str, source: str, rel: str, is_package: bool, modules: dict[str, Path]) -> list[Edge]:
    """One edge per dlperf module each import statement names, resolved to the deepest existing module."""
    found: dict[tuple[str, int], Edge] = {}
    for node, type_only in _statements(ast.parse(source, filename=rel)):
        for target in _named(node, name, is_package, modules):
            if target.split(".")[0] != "dlperf":
                continue
            while target not in modules and "." in target:
                target = target.rsplit(".", 1)[0]
            if target != name:
                found.setdefault((target, node.lineno), Edge(name, target, rel, node.lineno, type_only))
    return list(found.values())


def package_of(module: str) -> str:
    """The subpackage directly below dlperf ('' for a top-level module)."""
    parts = module.split(".")
    if len(parts) > 2 or (len(parts) == 2 and (PACKAGE / parts[1]).is_dir()):
        return parts[1]
    return ""


def layer_of(module: str) -> int:
    package = package_of(module)
    assert package in LAYERS, f"{module}: package {package!r} has no layer; add it to LAYERS"
    return LAYERS[package]


@pytest.fixture(scope="module")
def graph() -> list[Edge]:
    modules = all_modules()
    return [edge for name, path in modules.items() for edge in imports_of(name, path, modules)]


FACADE = "dlperf"
"""The package itself (``dlperf/__init__.py``): the public face, which re-exports a few names of any layer, loaded
on first use (``dlperf.Loop``). Nothing inside the package imports those names from it; a cycle through it
would still fail :func:`test_no_cycle_spans_two_packages`."""


def upward(edge: Edge) -> bool:
    if edge.importer == FACADE and not edge.imported.startswith("dlperf.cli"):
        return False
    if edge.imported.startswith("dlperf.cli") and not edge.importer.startswith("dlperf.cli"):
        return True
    return layer_of(edge.importer) < layer_of(edge.imported)


def parallel_part(module: str) -> str | None:
    """The sub-package of dlperf.parallel a module lies in ('' for its root modules), None outside it."""
    parts = module.split(".")
    if parts[:2] != ["dlperf", "parallel"] or len(parts) == 2:
        return None
    return parts[2] if len(parts) > 3 or (PACKAGE / "parallel" / parts[2]).is_dir() else ""


def test_every_parallel_part_has_a_layer():
    parts = {parallel_part(m) for m in all_modules()} - {None}
    missing = parts - set(PARALLEL_LAYERS)
    assert not missing, f"sub-packages of dlperf.parallel with no layer: {missing}"


def test_no_import_runs_up_inside_parallel(graph):
    def up(e: Edge) -> bool:
        a, b = parallel_part(e.importer), parallel_part(e.imported)
        return a is not None and b is not None and PARALLEL_LAYERS[a] < PARALLEL_LAYERS[b]

    bad = sorted({e.where() for e in graph if up(e)})
    assert not bad, "imports inside dlperf.parallel from a lower sub-package to a higher one:\n" + "\n".join(bad)


def test_every_package_has_a_layer():
    for name in all_modules():
        layer_of(name)


def test_no_import_runs_up_a_layer(graph):
    bad = sorted({e.where() for e in graph if upward(e)})
    assert not bad, "imports from a lower layer to a higher one:\n" + "\n".join(bad)


def strongly_connected(nodes: list[str], edges: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative (the graph is a few hundred modules deep at most)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    counter = 0
    for root in nodes:
        if root in index:
            continue
        work = [(root, iter(sorted(edges.get(root, ()))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            advanced = False
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                    advanced = True
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                components.append(sorted(component))
    return components


def test_strongly_connected_finds_cycles():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set()}
    assert sorted(strongly_connected(["a", "b", "c", "d"], edges)) == [["a", "b", "c"], ["d"]]


def runtime_cycles(graph: list[Edge]) -> list[list[str]]:
    """Strongly connected components of the imports that run (``if TYPE_CHECKING:`` ones never do)."""
    edges: dict[str, set[str]] = {}
    for e in graph:
        if not e.type_only:
            edges.setdefault(e.importer, set()).add(e.imported)
    return strongly_connected(sorted(all_modules()), edges)


def test_no_cycle_spans_two_packages(graph):
    runtime = [e for e in graph if not e.type_only]
    problems = []
    for component in runtime_cycles(graph):
        if len({package_of(m) for m in component}) < 2:
            continue
        inside = set(component)
        lines = [e.where() for e in runtime if e.importer in inside and e.imported in inside
                 and package_of(e.importer) != package_of(e.imported)]
        problems.append(f"cycle through {', '.join(component)}; edges between packages:\n  " + "\n  ".join(lines))
    assert not problems, "\n".join(problems)


def test_cycles_inside_a_package_are_explained(graph):
    cycles = [set(c) for c in runtime_cycles(graph) if len(c) > 1]
    unexplained = [sorted(c) for c in cycles if not any(c <= listed for listed in PACKAGE_CYCLES)]
    assert not unexplained, f"import cycles with no entry in PACKAGE_CYCLES: {unexplained}"
    stale = [sorted(listed) for listed in PACKAGE_CYCLES if not any(c <= listed for c in cycles)]
    assert not stale, f"no longer cycles, delete from PACKAGE_CYCLES: {stale}"


def test_detects_lazy_and_type_only_imports():
    modules = {m: Path() for m in ("dlperf.probe.x", "dlperf.bench", "dlperf.bench.runner", "dlperf.cli")}
    source = ("from typing import TYPE_CHECKING\n"
              "if TYPE_CHECKING:\n    from ..bench import runner\n"
              "def f():\n    from ..bench.runner import g\n    import dlperf.cli.options\n    return g\n")
    edges = imports_in("dlperf.probe.x", source, "x.py", False, modules)
    assert [(e.imported, e.line, e.type_only) for e in edges] == [
        ("dlperf.bench.runner", 3, True), ("dlperf.bench.runner", 5, False), ("dlperf.cli", 6, False)]
    assert all(upward(e) for e in edges)


def test_modules_and_constructors_stay_small():
    """One concept per module: none over 800 lines, the Trainer's under 550, and no constructor with
    more than 10 parameters besides a config object (group options into a config dataclass instead)."""
    too_long = [f"{p.relative_to(SRC)}: {n} lines" for p in sorted(PACKAGE.rglob("*.py"))
                if (n := len(p.read_text().splitlines())) > 800]
    assert not too_long, too_long
    assert len((PACKAGE / "parallel" / "training" / "trainer.py").read_text().splitlines()) < 550
    crowded = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name == "__init__":
                args = node.args
                count = len(args.posonlyargs) + len(args.args) - 1 + len(args.kwonlyargs)
                if count > 10:
                    crowded.append(f"{path.relative_to(SRC)}:{node.lineno}: {count} parameters")
    assert not crowded, crowded


MODULE_DOCSTRING_LINES = 25


def test_module_docstrings_stay_short():
    """A module docstring says what the module is for in a few lines, a doctest included; the design, the rules
    and the measured figures behind it live on a page under docs/design/ that the docstring names."""
    long = [f"{p.relative_to(SRC)}: {n} lines" for p in sorted(PACKAGE.rglob("*.py"))
            if (doc := ast.get_docstring(ast.parse(p.read_text()), clean=False)) is not None
            and (n := len(doc.splitlines())) > MODULE_DOCSTRING_LINES]
    assert not long, f"module docstrings over {MODULE_DOCSTRING_LINES} lines (move the rest to docs/design/): {long}"


def test_pages_the_source_names_exist():
    """A docstring or comment that sends the reader to docs/... names a page that is there."""
    root = SRC.parent
    missing = [f"{p.relative_to(SRC)}: {page}" for p in sorted(PACKAGE.rglob("*.py"))
               for page in sorted(set(re.findall(r"\bdocs/[\w./-]*\w\.md", p.read_text())))
               if not (root / page).is_file()]
    assert not missing, f"pages named in the source that do not exist: {missing}"


def test_public_class_names_are_unique():
    """One name for one thing: no two public classes of dlperf share a name."""
    where: dict[str, list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                where.setdefault(node.name, []).append(str(path.relative_to(SRC)))
    twice = {name: files for name, files in where.items() if len(files) > 1}
    assert not twice, f"public classes defined more than once: {twice}"


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_reaches(name: str, source: str, is_package: bool, modules: dict[str, Path]) -> list[str]:
    """Where a module uses another module's private names: ``from .m import _x``, or ``m._x`` on a dlperf module it
    imported. A private *module* (``dlperf._io``) is the package's own and may be imported inside it; its private
    names may not."""
    found, module_names = [], {}
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            source_module = _resolve(name, is_package, node)
            if source_module.split(".")[0] != "dlperf":
                continue
            for alias in node.names:
                full = f"{source_module}.{alias.name}"
                if full in modules:
                    module_names[alias.asname or alias.name] = full
                elif _private(alias.name) and source_module != name:
                    found.append(f"line {node.lineno}: from {source_module} import {alias.name}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in modules and alias.asname:
                    module_names[alias.asname] = alias.name
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and _private(node.attr)
                and node.value.id in module_names and module_names[node.value.id] != name):
            found.append(f"line {node.lineno}: {node.value.id}.{node.attr} ({module_names[node.value.id]})")
    return sorted(found, key=lambda hit: int(hit.split(":")[0].split()[1]))


def test_no_module_uses_another_modules_private_names():
    """A name with a leading underscore belongs to its file: one that another module needs is made public, with
    a name that says what it is, so a reader knows what may change without looking further."""
    modules = all_modules()
    reaches = {str(path.relative_to(SRC)): hits for name, path in modules.items()
               if (hits := private_reaches(name, path.read_text(), path.name == "__init__.py", modules))}
    assert not reaches, f"private names used across modules: {reaches}"


def test_private_reaches_are_found():
    modules = {"dlperf.a": Path("a.py"), "dlperf.b": Path("b.py"), "dlperf._io": Path("_io.py")}
    source = ("from .a import _hidden, shown\nfrom . import b\nfrom . import _io\nimport dlperf.a as a\n"
              "b._inner()\n_io.atomic()\na._x\n")
    assert private_reaches("dlperf.c", source, False, modules) == [
        "line 1: from dlperf.a import _hidden", "line 5: b._inner (dlperf.b)", "line 7: a._x (dlperf.a)"]


_FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]+")
# a whole command to run (``dlperf launch --nproc-per-node 2``, ``torchrun --nproc-per-node 2``) is guidance, not a
# flag standing in for one of the library's parameters
_COMMAND = re.compile(r"(dlperf \w+|torchrun|pip install)[^;,)]*")


def _library_files():
    return [p for p in sorted(PACKAGE.rglob("*.py")) if p.relative_to(PACKAGE).parts[0] != "cli"]


def test_the_library_prints_nothing():
    """Notes go through logging (the CLI shows them); a library module never prints."""
    printing = [f"{p.relative_to(SRC)}:{node.lineno}" for p in _library_files()
                for node in ast.walk(ast.parse(p.read_text()))
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print"]
    assert not printing, f"library modules that print: {printing}"


def test_library_errors_name_parameters_not_flags():
    """An error the library raises names its parameters (``batch_size=1``); the CLI turns them into its flags
    (dlperf.cli.options.FLAGS). A flag in a library error would be wrong for every library caller."""
    naming = []
    for path in _library_files():
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
            if not name.endswith(("Error", "_fail", "Exception")) and name != "unknown_choice":
                continue
            found = next((m.group(0) for sub in ast.walk(node) if isinstance(sub, ast.Constant)
                          and isinstance(sub.value, str) for m in [_FLAG.search(_COMMAND.sub("", sub.value))] if m),
                         None)
            if found:
                naming.append(f"{path.relative_to(SRC)}:{node.lineno}: {found}")
    assert not naming, f"library errors that name CLI flags: {naming}"


def test_the_flag_table_covers_the_parameters_library_errors_name():
    from dlperf.cli.options import FLAGS, flag_words

    assert flag_words("batch_size=8 with lr=0.5 and kvstore='local'") == \
        "--batch-size 8 with --lr 0.5 and --kvstore local"
    assert flag_words("give kvstore=None") == "give no --kvstore"
    assert all(flag.startswith("--") for flag in FLAGS.values())
