"""docs/architecture.md's layer table, held by the code's imports.

The table lists the layers from the ground floor (plan, shared) up to the
plugin. A module may import modules of its own layer and of the layers listed
before it, never one listed after it; and no modules of the package import
each other in a circle.

Every import counts: at module level and inside functions (a lazy import is
still a dependency, and a circle held together by one is still a circle).
Imports under ``if TYPE_CHECKING:`` never run, so the layer rule ignores them
(a type named for a lower layer's hints is no dependency); the circle rule
counts them: two modules that name each other's types are one subject split
badly, and the types they share belong below both.
Only imports of ``pytest_cudagraph`` modules are read. ``from . import x``
counts as importing the module or subpackage ``x`` when there is one, and the
package's ``__init__.py`` otherwise; ``from .plan import Batch`` imports
``plan/__init__.py``. Importing ``a/b.py`` runs ``a/__init__.py`` first, but
that implied import is not an edge (every package would otherwise be a circle
with its own modules).

How the table's second column maps to files: a backticked path with a folder
(``plan/``, ``manager/graph_manager.py``) names that folder (all of it, when
it ends in ``/``) or that file, and sets the folder for the bare names after
it in the same row (``capture.py`` after ``manager/graph_manager.py`` is
``manager/capture.py``); a bare name before any path is a top-level module.
Every ``.py`` file of the package maps to exactly one layer; a package's
``__init__.py`` belongs to its folder's layer, and the top-level
``pytest_cudagraph/__init__.py`` (the public face, which loads the rest
lazily) to the top layer.
"""

from __future__ import annotations

import ast
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "pytest_cudagraph"
PAGE = ROOT / "docs" / "architecture.md"

# Imports that run against the table in files this change could not edit,
# as (importer, imported), paths relative to pytest_cudagraph/. Each entry
# says why it is there; remove it when its import is fixed. The test fails on
# any violation not listed here, and on an entry that no longer happens.
ALLOWED_UPWARD: dict[tuple[str, str], str] = {}


def _layer_rows() -> list[tuple[str, list[str]]]:
    """(layer, backticked names of its second column) per row of the layer table, bottom first."""
    text = PAGE.read_text()
    section = text.split("## The layers", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if (
            not line.startswith("|")
            or len(cells) < 3
            or cells[0] in ("layer", "")
            or set(cells[0]) <= set("-: ")
        ):
            continue
        names = [n for n in re.findall(r"`([^`]+)`", cells[1]) if re.fullmatch(r"[\w/]+(\.py|/)", n)]
        rows.append((cells[0], names))
    return rows


def _modules() -> dict[str, Path]:
    """Every module of the package by its path relative to pytest_cudagraph/ (posix)."""
    return {p.relative_to(PACKAGE).as_posix(): p for p in sorted(PACKAGE.rglob("*.py"))}


def _layers() -> tuple[list[str], dict[str, str]]:
    """The layers bottom first, and each module's layer; asserts the table maps every module once."""
    rows = _layer_rows()
    modules = _modules()
    order = [layer for layer, _ in rows]
    assert len(order) == len(set(order)), f"a layer is listed twice: {order}"
    claims: dict[str, set[str]] = {}
    stale = []
    for layer, names in rows:
        folder = ""
        for name in names:
            if name.endswith("/"):  # a whole folder: `plan/`
                folder = name.rstrip("/")
                inside = [m for m in modules if m.startswith(folder + "/")]
                if not inside:
                    stale.append(f"{layer}: `{name}`")
                for m in inside:
                    claims.setdefault(m, set()).add(layer)
                continue
            if (
                "/" in name
            ):  # `manager/graph_manager.py`: this file, and the folder of the bare names after it
                folder, path = name.rsplit("/", 1)[0], name
            else:
                path = f"{folder}/{name}" if folder else name
            if path not in modules:
                stale.append(f"{layer}: `{name}` (read as {path})")
            claims.setdefault(path, set()).add(layer)
    assert not stale, f"docs/architecture.md names modules that do not exist: {stale}"
    twice = {m: sorted(ls) for m, ls in claims.items() if len(ls) > 1}
    assert not twice, f"docs/architecture.md puts modules in more than one layer: {twice}"
    layer_of = {m: next(iter(ls)) for m, ls in claims.items()}
    for module in modules:
        if module == "__init__.py":
            layer_of[module] = order[-1]
        elif module.endswith("/__init__.py"):
            folder = module.rsplit("/", 1)[0]
            if module in layer_of:
                continue
            around = {layer_of[m] for m in modules if m.startswith(folder + "/") and m in layer_of}
            assert len(around) == 1, (
                f"{folder}/ spans layers {sorted(around)}: its __init__.py has no one layer"
            )
            layer_of[module] = around.pop()
    missing = [m for m in modules if m not in layer_of]
    assert not missing, f"docs/architecture.md's layer table has no row for {missing}"
    return order, layer_of


def _dotted(module: str) -> str:
    parts = ["pytest_cudagraph", *module[: -len(".py")].split("/")]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(tree: ast.AST, *, type_checking: bool = False) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement, at any depth; the bodies of ``if TYPE_CHECKING:`` only with ``type_checking``."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        if isinstance(node, ast.If) and _is_type_checking(node.test) and not type_checking:
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def _edges(module: str, source: str, modules: set[str], *, type_checking: bool = False) -> set[str]:
    """The package modules ``module`` (a path relative to pytest_cudagraph/) imports in ``source``
    (with ``type_checking``, those imported only for type hints too)."""
    by_dotted = {_dotted(m): m for m in modules}

    def known(dotted: str) -> str | None:
        while dotted:  # the longest prefix that is a module: `import pytest_cudagraph.plan.config as c`
            if dotted in by_dotted:
                return by_dotted[dotted]
            dotted = dotted.rpartition(".")[0]
        return None

    own = _dotted(module)
    package = own if module.endswith("__init__.py") else own.rpartition(".")[0]
    edges: set[str] = set()
    for node in _import_nodes(ast.parse(source, filename=module), type_checking=type_checking):
        if isinstance(node, ast.Import):
            targets = [known(a.name) for a in node.names if a.name.split(".")[0] == "pytest_cudagraph"]
        else:
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                source_module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                source_module = node.module or ""
            if source_module.split(".")[0] != "pytest_cudagraph":
                continue
            # `from . import faults` imports the module faults.py; `from .plan import Batch` plan/__init__.py
            targets = [by_dotted.get(f"{source_module}.{a.name}") or known(source_module) for a in node.names]
        edges.update(t for t in targets if t is not None and t != module)
    return edges


def _imports(*, type_checking: bool = False) -> dict[str, set[str]]:
    """module -> the package modules it imports (paths relative to pytest_cudagraph/)."""
    modules = _modules()
    return {
        m: _edges(m, path.read_text(), set(modules), type_checking=type_checking)
        for m, path in modules.items()
    }


def _cycles(graph: dict[str, set[str]], limit: int = 50) -> list[list[str]]:
    """Every circle of imports (each from its first module in sorted order), at most ``limit``."""
    circles: list[list[str]] = []
    nodes = sorted(graph)
    # A circle lies within one strongly connected component: the walk below stays in start's, which
    # keeps it linear where there is no circle (every simple path of the whole graph is exponential).
    component = _components(graph)
    for start in nodes:
        # circles through start whose other modules sort after it: each circle found once
        stack: list[tuple[str, list[str]]] = [(start, [start])]
        while stack and len(circles) < limit:
            v, path = stack.pop()
            for w in sorted(graph.get(v, ()), reverse=True):
                if w == start:
                    circles.append([*path, start])
                elif w > start and w not in path and component.get(w) == component[start]:
                    stack.append((w, [*path, w]))
    return sorted(circles)


def _components(graph: dict[str, set[str]]) -> dict[str, int]:
    """Each node's strongly connected component, numbered (Kosaraju's two walks, without recursion)."""
    nodes = sorted(set(graph) | {w for targets in graph.values() for w in targets})
    order: list[str] = []
    seen: set[str] = set()
    for root in nodes:
        if root in seen:
            continue
        seen.add(root)
        stack = [(root, iter(sorted(graph.get(root, ()))))]
        while stack:
            v, it = stack[-1]
            w = next(it, None)
            if w is None:
                stack.pop()
                order.append(v)
            elif w not in seen:
                seen.add(w)
                stack.append((w, iter(sorted(graph.get(w, ())))))
    reverse: dict[str, set[str]] = {v: set() for v in nodes}
    for v, targets in graph.items():
        for w in targets:
            reverse[w].add(v)
    component: dict[str, int] = {}
    for root in reversed(order):
        if root in component:
            continue
        component[root] = len(component)
        todo = [root]
        number = component[root]
        while todo:
            v = todo.pop()
            for w in reverse[v]:
                if w not in component:
                    component[w] = number
                    todo.append(w)
    return component


def test_every_module_has_one_layer() -> None:
    order, layer_of = _layers()
    assert order[:2] == ["plan", "shared"] and order[-1] == "pytest side", order
    assert set(layer_of) == set(_modules())


def test_imports_run_up_the_layer_table() -> None:
    """A module imports its own layer and the layers listed before it, never one listed after it."""
    order, layer_of = _layers()
    rank = {layer: i for i, layer in enumerate(order)}
    upward = {}
    for module, targets in sorted(_imports().items()):
        for target in sorted(targets):
            if rank[layer_of[target]] > rank[layer_of[module]]:
                upward[(module, target)] = (
                    f"{module} ({layer_of[module]}) imports {target} ({layer_of[target]}), listed after it"
                )
    new = [line for key, line in upward.items() if key not in ALLOWED_UPWARD]
    gone = [f"{a} -> {b}" for a, b in ALLOWED_UPWARD if (a, b) not in upward]
    assert not new, "imports against docs/architecture.md's layer table:\n" + "\n".join(new)
    assert not gone, "ALLOWED_UPWARD lists imports that no longer run upward; remove them: " + ", ".join(gone)


def test_no_import_circles() -> None:
    """No circle of imports among the package's modules, counting imports inside functions and those
    for type hints alone."""
    circles = _cycles(_imports(type_checking=True))
    assert not circles, "import circles:\n" + "\n".join(" -> ".join(c) for c in circles)


def test_the_reader_sees_lazy_and_relative_imports() -> None:
    """The import reader itself: function-level imports count, TYPE_CHECKING ones do not."""
    modules = {
        "__init__.py",
        "faults.py",
        "plan/__init__.py",
        "plan/config.py",
        "manager/__init__.py",
        "manager/capture.py",
        "manager/layout.py",
        "checks/__init__.py",
    }
    source = (
        "from typing import TYPE_CHECKING\n"
        "import torch\n"
        "from .. import faults\n"
        "from ..plan import CaptureConfig\n"
        "import pytest_cudagraph.plan.config as config\n"
        "if TYPE_CHECKING:\n"
        "    from ..checks import VerifyReport\n"
        "def f():\n"
        "    from .layout import infer_layout\n"
        "    from . import layout\n"
    )
    assert _edges("manager/capture.py", source, modules) == {
        "faults.py",
        "plan/__init__.py",
        "plan/config.py",
        "manager/layout.py",
    }
    assert "checks/__init__.py" in _edges("manager/capture.py", source, modules, type_checking=True)
    assert _edges("manager/__init__.py", "from . import capture\nfrom .capture import X\n", modules) == {
        "manager/capture.py"
    }
    assert _cycles({"a": {"b"}, "b": {"c", "a"}, "c": {"a"}, "d": {"a"}}) == [
        ["a", "b", "a"],
        ["a", "b", "c", "a"],
    ]


# -- the manager: a face over parts that share one state -------------------------------------------
def _state_owners() -> dict[str, str]:
    """Each ManagerState field -> who writes it, read from state.py's section comments."""
    owners: dict[str, str] = {}
    section = ""
    for line in (PACKAGE / "manager" / "state.py").read_text().splitlines():
        stripped = line.strip()
        if stripped.startswith("# -- "):
            section = stripped
        elif line.startswith("    ") and not line.startswith("     ") and ": " in stripped:
            name = stripped.split(":")[0]
            if name.isidentifier():
                owners[name] = section
    return owners


def _state_writes(path: Path) -> set[str]:
    """The ManagerState fields a module assigns (``self.state.x = ...``, ``+=``)."""
    written = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets = (
            node.targets
            if isinstance(node, ast.Assign)
            else [node.target]
            if isinstance(node, (ast.AugAssign, ast.AnnAssign))
            else []
        )
        for target in targets:
            if (
                isinstance(target, ast.Attribute)
                and isinstance(target.value, ast.Attribute)
                and target.value.attr == "state"
            ):
                written.add(target.attr)
    return written


def test_the_manager_is_composed_not_inherited() -> None:
    from pytest_cudagraph.manager.capture import Capture
    from pytest_cudagraph.manager.graph_manager import GraphManager
    from pytest_cudagraph.manager.runtime import Runtime

    for cls in (GraphManager, Capture, Runtime):
        assert cls.__bases__ == (object,), f"{cls.__name__} inherits {cls.__bases__}"


def test_each_part_writes_only_the_state_it_owns() -> None:
    owners = _state_owners()
    assert {"entries", "hot", "replays", "module"} <= set(owners), owners
    for part, section in (("capture.py", "capture part"), ("runtime.py", "runtime part")):
        written = _state_writes(PACKAGE / "manager" / part)
        foreign = {
            name: owners.get(name, "not a field") for name in written if section not in owners.get(name, "")
        }
        assert not foreign, f"manager/{part} writes state another part owns: {foreign}"
    assert _state_writes(PACKAGE / "manager" / "capture.py"), "the reader found no write at all"


# -- the house's bounds: modules and classes split along their seams ---------------------------------
MAX_MODULE_LINES = 700
MAX_CLASS_LINES = 450


def _over_bounds() -> dict[str, int]:
    """Each module of the package over ``MAX_MODULE_LINES`` lines, and each class over
    ``MAX_CLASS_LINES`` lines (from its ``class`` statement to its last line, decorators not
    counted), with its length: ``path`` and ``path: Class`` (nested classes as ``Outer.Inner``)."""
    over: dict[str, int] = {}
    for module, path in _modules().items():
        source = path.read_text()
        lines = len(source.splitlines())
        if lines > MAX_MODULE_LINES:
            over[module] = lines
        stack: list[tuple[str, ast.AST]] = [("", ast.parse(source, filename=module))]
        while stack:
            prefix, node = stack.pop()
            for child in ast.iter_child_nodes(node):
                name = prefix
                if isinstance(child, ast.ClassDef):
                    name = f"{prefix}{child.name}"
                    assert child.end_lineno is not None
                    size = child.end_lineno - child.lineno + 1
                    if size > MAX_CLASS_LINES:
                        over[f"{module}: {name}"] = size
                    name += "."
                stack.append((name, child))
    return over


def test_no_module_over_700_lines_and_no_class_over_450() -> None:
    over = _over_bounds()
    assert over == {}, (
        f"modules over {MAX_MODULE_LINES} lines or classes over {MAX_CLASS_LINES}: {over}; split each "
        "along its seam (docs/architecture.md says where things live)"
    )


def test_the_bounds_reader_measures_modules_and_classes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reader itself, on a package of its own: a long module, a long class and a long nested
    one (named within its outer class), and what stays within both bounds (a module and a class of
    exactly the bound)."""
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "fits.py").write_text("x = 1\n" * MAX_MODULE_LINES)
    (package / "long.py").write_text("x = 1\n" * (MAX_MODULE_LINES + 1))

    def klass(name: str, lines: int, indent: str = "") -> str:
        """A class of ``lines`` lines, its statement included."""
        return f"{indent}class {name}:\n" + f"{indent}    x = 1\n" * (lines - 1)

    (package / "sub" / "fitting.py").write_text(klass("Fits", MAX_CLASS_LINES))
    (package / "sub" / "classes.py").write_text(klass("Long", MAX_CLASS_LINES + 1))
    (package / "sub" / "nested.py").write_text("class Outer:\n" + klass("Inner", MAX_CLASS_LINES, "    "))
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", package)
    assert _over_bounds() == {
        "long.py": MAX_MODULE_LINES + 1,
        "sub/classes.py: Long": MAX_CLASS_LINES + 1,
        "sub/nested.py: Outer": MAX_CLASS_LINES + 1,
    }
    (package / "sub" / "nested.py").write_text("class Outer:\n" + klass("Inner", MAX_CLASS_LINES + 1, "    "))
    assert set(_over_bounds()) == {
        "long.py",
        "sub/classes.py: Long",
        "sub/nested.py: Outer",
        "sub/nested.py: Outer.Inner",
    }
