"""The layering holds: imports point down only, never sideways between peers, and no module
imports itself back through others. Read from the source (AST), every import counted: top-level,
inside functions (lazy) and under ``TYPE_CHECKING`` alike.

Layers, lowest first (README "Architecture"; DESIGN.md):
codec and store know nothing of each other; sync, loco and rollouts are three channels on top of
them that share only ``signed``; rl sits above the channels and engines above rl (engines build on
rl's models and take rl's ``SamplingParams``; rl's eval samples through whatever engine nodes/
hands it, never importing one); nodes wire everything; bench, chaos (``pulsenet up``'s network
under faults) and cli are the edges, and neither bench nor chaos imports cli.
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
    back = sorted(
        f"{m} -> {d}"
        for m, deps in graph.items()
        for d in deps
        if m.startswith("pulsenet.nodes.") and not m.startswith(UP) and d.startswith(UP)
    )
    assert not back, "nodes modules that import pulsenet up back:\n" + "\n".join(back)
    long = {m: n for m in graph if m.startswith(UP) and (n := len(_modules()[m].read_text().splitlines())) > 600}
    assert not long, f"pulsenet up modules over 600 lines: {long}"


LOCO_STEPS = ("update", "collect", "recovery", "persist", "overlap", "progress", "algorithm")
"""The modules whose functions the PULSELoCo round driver calls, one per step (or concern)."""


def test_the_pulseloco_trainer_is_a_round_driver() -> None:
    """``LocoTrainer`` reads as the round, one call per step; each step's work lives in its own
    ``loco`` module (issue 31: it was 972 lines and 51 methods, with an overlapped copy of the round)."""
    path = _modules()["pulsenet.loco.trainer"]
    tree = ast.parse(path.read_text())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "LocoTrainer"]
    methods = [n.name for n in cls.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
    assert len(methods) <= 25, f"LocoTrainer has {len(methods)} methods: {methods}"
    assert "run_round_overlapped" not in methods, "one round path: overlap is a step run_round calls"
    assert len(path.read_text().splitlines()) < 600
    assert {f"pulsenet.loco.{m}" for m in LOCO_STEPS} <= _graph()["pulsenet.loco.trainer"]
    long = {
        m: n
        for m in _modules()
        if m.startswith("pulsenet.loco.") and (n := len(_modules()[m].read_text().splitlines())) > 650
    }
    assert not long, f"loco modules over ~600 lines: {long}"


BUILD = "pulsenet.nodes.build"
"""The one composition root of each node: every component of a trainer or inference node is made
there and handed to ``TrainerNode`` / ``InferenceNode``, whose constructors only keep them."""


def _calls(path: Path, names: set[str]) -> set[str]:
    """Which of ``names`` a file calls (``Name(...)`` or ``module.Name(...)``)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
            if name in names:
                out.add(name)
    return out


def test_one_function_builds_each_node() -> None:
    """Only ``nodes/build.py`` constructs a node, in the package and in the tests alike; the node
    modules construct none of the components they are handed (7876ec8: ``TrainerNode.__init__``
    made its publisher, intake, rounds and demand writer, and seven test files built nodes by hand)."""
    nodes = {"TrainerNode", "InferenceNode"}
    files = [*ROOT.rglob("*.py"), *(ROOT.parent / "tests").rglob("*.py")]
    builders = sorted(str(p.relative_to(ROOT.parent)) for p in files if _calls(p, nodes))
    assert builders == ["pulsenet/nodes/build.py"], builders
    components = {"Publisher", "RolloutIntake", "LocoTrainer", "LocoRounds", "LocalRounds", "DemandWriter",
                  "DemandReader", "Rescorer", "Replayer", "Evaluator", "RolloutWriter", "Subscriber",
                  "ConsumerTracker"}  # fmt: skip
    for node in ("trainer", "inference"):
        made = _calls(ROOT / "nodes" / f"{node}.py", components)
        assert not made, f"nodes/{node}.py builds {sorted(made)}: nodes/build.py makes every component"
    assert BUILD in _graph()


KERNELS = {"pulsenet.codec.kernels", "pulsenet.codec.relative_kernels"}
"""Issue 31's size rule holds for every module but these: one numba kernel per format step, read
side by side: no module over 600 lines, no class over 25 methods unless its docstring says why."""


def _classes(path: Path) -> list[tuple[str, int, str]]:
    """(name, methods, docstring) of every class in a file."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ClassDef):
            methods = [n for n in node.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
            out.append((node.name, len(methods), ast.get_docstring(node) or ""))
    return out


def test_modules_are_small_and_big_classes_say_why() -> None:
    """7876ec8 + issue 31: store/seaweed.py (664 lines), codec/rollout.py (663), store/s3.py (631)
    and engines/vllm_engine.py (608) each held two ideas; RoundStore had 34 methods and no word on
    why. A class past 25 methods states its count ("Why N methods") so the reason is revisited
    when the count moves."""
    mods = _modules()
    long = {
        m: n
        for m, p in mods.items()
        if m not in KERNELS and (n := len(p.read_text().splitlines())) > 600
    }
    assert not long, f"modules over 600 lines: {long}"
    big = [
        f"{m}.{name} ({n} methods)"
        for m, p in mods.items()
        for name, n, doc in _classes(p)
        if n > 25 and f"Why {n} methods" not in doc
    ]
    assert not big, "classes over 25 methods whose docstring does not say why: " + ", ".join(big)
    split = ("store.seaweed_security", "store.s3_errors", "codec.parquet_footer", "engines.vllm_config")
    assert {f"pulsenet.{m}" for m in split} <= set(mods)


def _methods(module: str, cls: str) -> list[str]:
    tree = ast.parse(_modules()[module].read_text())
    (node,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls]
    return [n.name for n in node.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]


CHANNEL_ROOMS = {
    "pulsenet.rollouts.intake": ("RolloutIntake", {"checks", "batch_queue", "sources", "intake_types"}),
    "pulsenet.sync.publisher": ("Publisher", {"outbox", "retention", "resume"}),
}
"""The two channel classes a reader meets most, and the modules holding the work they call: the
intake's numbered check ladder, its queue and each source's head; the publisher's outgoing
versions, retention and restart."""


def test_the_intake_and_the_publisher_are_split_by_idea() -> None:
    """Issue 31: intake.py was 855 lines (config, stats, the check ladder, heads, the queue and the
    class in one), publisher.py 735 with a 31-method class. Each class keeps at most 25 methods
    and calls into the modules that hold its work, which never import it back (sizes: the rule
    above)."""
    graph = _graph()
    for module, (cls, rooms) in CHANNEL_ROOMS.items():
        methods = _methods(module, cls)
        assert len(methods) <= 25, f"{cls} has {len(methods)} methods: {methods}"
        package = module.rsplit(".", 1)[0]
        assert {f"{package}.{m}" for m in rooms} <= graph[module], f"{module} should call into {sorted(rooms)}"
        below = {d for m in rooms for d in graph[f"{package}.{m}"]}
        assert module not in below, f"a module {module} calls into imports it back"
