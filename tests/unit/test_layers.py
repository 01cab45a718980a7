"""The layering of docs/architecture.md holds in the code: every module of eagleforge belongs to
one layer of the table there, imports only its own layer and the layers below it (lazy imports
inside functions and ``TYPE_CHECKING`` imports count too), and no modules import each other
in a circle."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "src" / "eagleforge"
ARCHITECTURE = ROOT / "docs" / "architecture.md"


def layers() -> list[tuple[str, list[str]]]:
    """The ``layers`` block of docs/architecture.md, bottom layer first: (name, modules)."""
    block = re.search(r"```layers\n(.*?)```", ARCHITECTURE.read_text(), re.S)
    assert block is not None, f"{ARCHITECTURE} has no ```layers block"
    rows = [line.split(":", 1) for line in block[1].strip().splitlines()]
    return [(name.strip(), modules.split()) for name, modules in reversed(rows)]


def modules() -> dict[str, Path]:
    """Every module of the package by dotted name (``eagleforge.`` left off; a package by its
    own name)."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    found.pop("", None)  # eagleforge/__init__.py: the version only
    return found


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The eagleforge modules ``name`` imports, wherever in the file."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join([p for p in base if p] + ([node.module] if node.module else []))
            elif (node.module or "").startswith("eagleforge"):
                module = node.module.removeprefix("eagleforge").lstrip(".")  # type: ignore[union-attr]
            else:
                continue
            for alias in node.names:  # `from eagleforge.data import features` names a module
                sub = f"{module}.{alias.name}".lstrip(".")
                found.add(sub if sub in known else module)
        elif isinstance(node, ast.Import):
            found |= {
                a.name.removeprefix("eagleforge").lstrip(".")
                for a in node.names
                if a.name.startswith("eagleforge")
            }
    return {m for m in found if m and m != name}


def layer_of(module: str, table: list[tuple[str, list[str]]]) -> int | None:
    """The layer whose entry is the longest prefix of ``module`` (``data`` holds
    ``data.features``; ``parallel.fsdp`` may sit above ``parallel``)."""
    best, best_length = None, -1
    for index, (_, entries) in enumerate(table):
        for entry in entries:
            if (module == entry or module.startswith(entry + ".")) and len(entry) > best_length:
                best, best_length = index, len(entry)
    return best


def graph() -> dict[str, set[str]]:
    found = modules()
    return {name: imports(name, path, set(found)) for name, path in found.items()}


def test_every_module_has_a_layer() -> None:
    table = layers()
    missing = sorted(m for m in modules() if layer_of(m, table) is None)
    assert not missing, f"add these modules to the layers block of {ARCHITECTURE.name}: {missing}"


def test_no_module_imports_a_higher_layer() -> None:
    table = layers()
    upward = [
        f"{module} ({table[layer_of(module, table) or 0][0]}) imports {target} "
        f"({table[layer_of(target, table) or 0][0]})"
        for module, targets in sorted(graph().items())
        for target in sorted(targets)
        if (layer_of(target, table) or 0) > (layer_of(module, table) or 0)
    ]
    assert not upward, "\n".join(upward)


def test_no_import_circles() -> None:
    edges = graph()
    circles, state = [], dict.fromkeys(edges, 0)  # 0 unseen, 1 on the path, 2 done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(edges[module]):
            if target not in state:
                continue  # the package __init__ of a module, say: not in the graph
            if state[target] == 1:
                circles.append(" -> ".join(path[path.index(target) :] + [module, target]))
            elif state[target] == 0:
                visit(target, path + [module])
        state[module] = 2

    for module in sorted(edges):
        if state[module] == 0:
            visit(module, [])
    assert not circles, "\n".join(circles)


def test_the_checks_read_real_arrows() -> None:
    """Not vacuous: the graph holds the arrows the code has, and turning the table upside down
    makes one of them point up."""
    edges = graph()
    assert "batch" in edges["draft.ttt"] and "draft.family" in edges["parallel.fsdp"]
    upside_down = list(reversed(layers()))
    assert (layer_of("draft.family", upside_down) or 0) > (
        layer_of("parallel.fsdp", upside_down) or 0
    )
