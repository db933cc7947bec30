"""The test tree keeps its shape: unit/ runs in one process without servers, integration/ holds
what needs SeaweedFS, processes, ``pulsenet up``, torchrun or vLLM, fuzz/ and golden/ sit beside
their harness and vectors, and helpers live in ``tests.support`` (imported one way, under xdist
too), never among the tests. Read from the source (AST)."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
FOLDERS = {"unit", "integration", "fuzz", "golden", "support"}
SERVER_FIXTURES = {"seaweed", "s3_factory", "store_factory"}
"""Fixtures that start or need the embedded SeaweedFS (``store_factory`` runs each test on it too)."""


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


def test_tests_are_split_into_folders_with_no_helpers_among_them() -> None:
    folders = {p.name for p in TESTS.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders == FOLDERS, f"tests/ holds {sorted(folders)}"
    top = sorted(p.name for p in TESTS.glob("*.py"))
    assert top == ["__init__.py", "conftest.py"], (
        f"Python files at tests/ top level: {top} (tests go in a folder, helpers in support/)"
    )
    for folder in FOLDERS:
        assert (TESTS / folder / "__init__.py").is_file(), f"tests/{folder} is not a package"
    for folder in ("unit", "integration"):
        strays = sorted(
            p.name for p in (TESTS / folder).glob("*.py") if p.name != "__init__.py" and not p.name.startswith("test_")
        )
        assert not strays, f"helpers among the tests in tests/{folder}: {strays} (move them to tests/support)"
    assert not list((TESTS / "support").glob("test_*.py")), "tests in tests/support"


def test_helpers_are_imported_from_tests_support_and_unit_tests_start_no_server() -> None:
    helpers = {p.stem for p in (TESTS / "support").glob("*.py") if p.name != "__init__.py"}
    bare, servers, upward = [], [], []
    for path in sorted(TESTS.rglob("test_*.py")):
        name = path.relative_to(TESTS).as_posix()
        imports = _imports(path)
        bare += [f"{name}: {m}" for m in sorted(imports & (helpers | {"conftest"}))]
        if path.parent.name != "unit":
            continue
        upward += [f"{name}: {m}" for m in sorted(imports) if m.startswith("tests.integration")]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                used = {a.arg for a in node.args.args} & SERVER_FIXTURES
                servers += [f"{name}::{node.name} ({', '.join(sorted(used))})"] if used else []
    assert not bare, "helpers imported by their bare name (use tests.support.NAME):\n" + "\n".join(bare)
    assert not upward, "unit tests importing integration tests:\n" + "\n".join(upward)
    assert not servers, "unit tests using the SeaweedFS fixtures (move them to tests/integration):\n" + "\n".join(servers)
