"""The layout of tests/: test modules import shared helpers from ``tests.support``, never from
another test module. A test module imported by another runs its module-level code (fixtures,
marks, ``pytestmark``) twice under two names, and ties one test's edits to the other's imports.
Read from the source (AST), every import counted: top-level, inside functions, relative ones."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def _is_test_module(module: str) -> bool:
    """``tests.<anything>.test_x`` (or ``tests.test_x``): a module pytest collects, not a helper."""
    parts = module.split(".")
    return parts[0] == "tests" and any(p.startswith("test_") or p == "conftest" for p in parts[1:])


def _imports(path: Path, root: Path) -> list[tuple[int, str]]:
    """(line, absolute module) of every import in ``path``, relative imports resolved from ``root``'s parent."""
    package = path.relative_to(root.parent).with_suffix("").parts[:-1]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = list(package[: len(package) - node.level + 1]) if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            # ``from tests.unit import test_x``: the names may be modules themselves
            out += [(node.lineno, module)] + [(node.lineno, f"{module}.{a.name}") for a in node.names]
    return out


def imports_of_test_modules(root: Path = TESTS) -> list[str]:
    """Every import of a test module from a file under ``root``, as ``file:line: module`` (one per line)."""
    found: dict[tuple[str, int], str] = {}
    for path in sorted(root.rglob("*.py")):
        for line, module in _imports(path, root):
            if _is_test_module(module):
                found.setdefault((str(path.relative_to(root.parent)), line), module)
    return [f"{file}:{line}: {module}" for (file, line), module in found.items()]


def test_no_test_module_imports_another_test_module() -> None:
    """Shared helpers live in ``tests/support`` (public names); a test module is imported by no one."""
    found = imports_of_test_modules()
    assert not found, "move these helpers into tests/support and import them from there:\n" + "\n".join(found)


def test_the_guard_sees_every_kind_of_import(tmp_path: Path) -> None:
    """The guard itself: top-level, nested, ``from tests.x import test_y`` and relative imports."""
    root = tmp_path / "tests"
    (root / "unit").mkdir(parents=True)
    (root / "unit" / "test_a.py").write_text("X = 1\n")
    (root / "unit" / "test_b.py").write_text(
        "from tests.unit.test_a import X\n"
        "import tests.unit.test_a\n"
        "def f():\n    from .test_a import X\n"
        "from tests.unit import test_a\n"
        "from tests.support.waiting import wait_until\n"
    )
    found = imports_of_test_modules(root)
    assert sorted(int(f.split(":")[1]) for f in found) == [1, 2, 4, 5], found
    assert not any("support" in f for f in found)
