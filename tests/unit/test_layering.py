"""The layering holds: imports point down only, never sideways between peers, and no module
imports itself back through others. Read from the source (AST), every import counted: top-level,
inside functions (lazy) and under ``TYPE_CHECKING`` alike.

Layers, lowest first (README "Architecture"; DESIGN.md):
codec and store know nothing of each other; sync, loco and rollouts are three channels on top of
them that share only ``signed``; rl sits above the channels and engines above rl (engines build on
rl's models and take rl's ``SamplingParams``; rl's eval samples through whatever engine nodes/
hands it, never importing one); nodes wire everything; bench, chaos (``pulsenet up``'s network under faults) and cli are the edges,
and neither bench nor chaos imports cli.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "pulsenet"
RANK = {
    "errors": 0,
    **dict.fromkeys(("deadlines", "fsutil", "logs", "procs", "runtime", "settings", "signing", "presets", "tracking"), 1),
    **dict.fromkeys(("codec", "store"), 2),
    **dict.fromkeys(("checkpoint", "signed"), 3),
    **dict.fromkeys(("sync", "loco", "rollouts"), 4),
    "rl": 5,
    "engines": 6,
    "nodes": 7,
    **dict.fromkeys(("bench", "chaos"), 8),
    "cli": 9,
    "__main__": 10,
}
"""A package (or top-level module) of ``pulsenet`` -> its layer; it may import lower layers only
(and itself)."""


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(path: Path, known: set[str]) -> set[str]:
    """The ``pulsenet`` modules a file imports (a ``from package import name`` that names a
    submodule counts as that submodule). The project uses absolute imports only."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("pulsenet")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("pulsenet"):
            assert node.level == 0, f"{path}: relative import"
            subs = {f"{node.module}.{a.name}" for a in node.names} & known
            out |= subs or {node.module}
    return out & known


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {m: _imports(p, set(mods)) - {m} for m, p in mods.items()}


def _part(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_every_package_has_a_layer() -> None:
    missing = {_part(m) for m in _graph()} - set(RANK) - {"__init__"}
    assert not missing, f"give these a layer in RANK: {sorted(missing)}"


def test_imports_point_down_only() -> None:
    wrong = []
    for module, deps in _graph().items():
        here = _part(module)
        for dep in deps:
            there = _part(dep)
            if here in ("__init__", there) or there == "__init__":
                continue
            if RANK[there] >= RANK[here]:
                wrong.append(f"{module} -> {dep} ({here} {RANK[here]} -> {there} {RANK[there]})")
    assert not wrong, "imports that point up or sideways:\n" + "\n".join(sorted(wrong))


def test_no_import_loops() -> None:
    graph = _graph()
    loops: list[list[str]] = []
    state: dict[str, int] = defaultdict(int)  # 0 new, 1 on the stack, 2 done
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph.get(m, ())):
            if _is_package_init(d) and m.startswith(d + "."):
                continue  # a module of a package importing that package's own __init__ names
            if state[d] == 1:
                loops.append([*stack[stack.index(d) :], d])
            elif state[d] == 0:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if state[m] == 0:
            visit(m)
    assert not loops, "import loops:\n" + "\n".join(" -> ".join(loop) for loop in loops)


def _is_package_init(module: str) -> bool:
    return (ROOT.parent / Path(*module.split(".")) / "__init__.py").is_file()


UP = "pulsenet.nodes.up"
"""``pulsenet up``: the top of ``nodes``, one small module per job (work directory, sites, the
supervisor's processes, the console, the launcher); the rest of ``nodes`` never imports it back."""


def test_pulsenet_up_is_a_package_above_the_rest_of_nodes() -> None:
    assert not (ROOT / "nodes" / "launcher.py").exists(), "pulsenet up lives in nodes/up/, not one launcher module"
    graph = _graph()
    assert {f"{UP}.{m}" for m in ("workdir", "sites", "supervisor", "console")} <= set(graph)
    back = sorted(f"{m} -> {d}" for m, deps in graph.items() for d in deps if m.startswith("pulsenet.nodes.") and not m.startswith(UP) and d.startswith(UP))
    assert not back, "nodes modules that import pulsenet up back:\n" + "\n".join(back)
    long = {m: n for m in graph if m.startswith(UP) and (n := len(_modules()[m].read_text().splitlines())) > 600}
    assert not long, f"pulsenet up modules over 600 lines: {long}"
