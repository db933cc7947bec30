"""Reward tasks: arithmetic and chains, MATH/GSM8K JSONL scoring, problem assignment, the cached warm-up."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from pulsenet.errors import ConfigError
from pulsenet.rl import warmup
from pulsenet.rl.local import LocalTrainer
from pulsenet.rl.tasks import (
    IGNORE_INDEX,
    ArithmeticTask,
    ChainTask,
    DatasetTask,
    FewShotTask,
    Problem,
    answers_match,
    assign_problems,
    extract_answer,
    reference_answer,
)

# --- arithmetic and chains ---------------------------------------------------


def test_arithmetic_batch_and_problems_unchanged() -> None:
    # Golden values from before the reward-task additions: PULSELoCo tests and benches rely on them.
    assert ArithmeticTask(1).problems(step=3, n=3) == [
        Problem("51+37=", "88"),
        Problem("85-71=", "14"),
        Problem("11-9=", "2"),
    ]
    x, _ = ArithmeticTask(2).batch(1, 24, step=4)
    assert bytes(x[0].tolist()) == b"57-40=17\n31+8=39\n" + b"\0" * 7


def test_arithmetic_scores_exact_first_line() -> None:
    task = ArithmeticTask(0)
    p = Problem("12+34=", "46")
    assert task.score("46\n", p) == 1.0
    assert task.score("46", p) == 1.0
    assert task.score("460\n", p) == 0.0
    assert task.score("the answer is 46", p) == 0.0


def _eval(expr: str) -> int:
    assert re.fullmatch(r"[\d+\-*()]+", expr)
    return int(eval(expr))  # the prompt must mean its answer under ordinary precedence


def test_chain_problems_are_correct_multi_step() -> None:
    task = ChainTask(3, n_ops=2)
    problems = task.problems(step=0, n=200)
    assert len({p.prompt for p in problems}) > 150
    for p in problems:
        assert p.prompt.endswith("=") and len(re.findall(r"[+\-*]", p.prompt)) == 2
        assert _eval(p.prompt[:-1]) == int(p.answer)
    assert any("(" in p.prompt for p in problems)  # (a+b)*c appears
    assert any(p.prompt.count("*") == 0 for p in problems)  # a+b-c appears
    three = ChainTask(3, n_ops=3, max_operand=9).problems(step=0, n=50)
    assert all(_eval(p.prompt[:-1]) == int(p.answer) for p in three)
    assert ChainTask(3).key != ChainTask(3, n_ops=3).key != ArithmeticTask(3).key


def test_chain_task_packs_supervised_batches() -> None:
    x, y = ChainTask(0).batch(2, 64, step=0)
    row = bytes(x[0].tolist()).rstrip(b"\0").decode()
    examples = row.split("\n")[:-1]
    assert examples
    for e in examples:
        prompt, answer = e.split("=")
        assert _eval(prompt) == int(answer)
    assert bytes(t for t in y[0].tolist() if t != IGNORE_INDEX).decode() == "".join(
        e.split("=")[1] + "\n" for e in examples
    )
    with pytest.raises(ValueError):
        ChainTask(0, n_ops=0)


# --- assignment --------------------------------------------------------------


def test_assignment_is_a_pure_function_of_node_version_seed() -> None:
    task = ArithmeticTask(0)
    a = assign_problems(task, node="inf-1", version=5, seed=7, n=16)
    task.batch(2, 32)  # task state (next_step) must not matter
    task.problems(step=9, n=4)
    assert assign_problems(ArithmeticTask(123), node="inf-1", version=5, seed=7, n=16) == a  # restarted node
    assert assign_problems(task, node="inf-1", version=5, seed=7, n=8) == a[:8]  # a prefix, not a reshuffle
    assert assign_problems(task, node="inf-2", version=5, seed=7, n=16) != a
    assert assign_problems(task, node="inf-1", version=6, seed=7, n=16) != a
    assert assign_problems(task, node="inf-1", version=5, seed=8, n=16) != a
    second = assign_problems(task, node="inf-1", version=5, seed=7, n=16, batch=1)  # same version, next batch
    assert second != a and second == assign_problems(ArithmeticTask(1), node="inf-1", version=5, seed=7, n=16, batch=1)
    # Fields cannot bleed into each other ("1" + "23" vs "12" + "3").
    assert assign_problems(task, node="a1", version=23, seed=0, n=4) != assign_problems(
        task, node="a12", version=3, seed=0, n=4
    )
    chains = assign_problems(ChainTask(0), node="inf-1", version=5, seed=7, n=16)
    assert chains != a and all(
        p.prompt.count("+") + p.prompt.count("-") + p.prompt.count("*") == 2 for p in chains
    )


def test_few_shot_prefixes_solved_examples() -> None:
    base = ChainTask(0)
    task = FewShotTask(base, k=3)
    assert len(task.shots) == 3 and task.prefix.count("\n") == 3
    for line in task.prefix.splitlines():
        prompt, answer = line.split("=")
        assert _eval(prompt) == int(answer)
    drawn = assign_problems(task, node="n", version=1, seed=2, n=5)
    plain = assign_problems(base, node="n", version=1, seed=2, n=5)
    assert [p.prompt for p in drawn] != [task.prefix + p.prompt for p in plain]  # own stream (key differs)
    assert all(p.prompt.startswith(task.prefix) for p in drawn)
    assert drawn == assign_problems(FewShotTask(ChainTask(9), k=3), node="n", version=1, seed=2, n=5)
    assert FewShotTask(base, k=3, seed=1).prefix != task.prefix
    assert task.score(drawn[0].answer + "\n(2+3)*4=", drawn[0]) == 1.0


# --- datasets (MATH / GSM8K style) ---------------------------------------------


def _write_jsonl(path: Path, rows: list[object]) -> Path:
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_dataset_task_loads_math_and_gsm8k_rows(tmp_path: Path) -> None:
    path = _write_jsonl(
        tmp_path / "p.jsonl",
        [
            {"problem": "What is 1/2 + 1/4?", "answer": "\\boxed{\\frac{3}{4}}"},
            {"problem": "Tom has 3 apples...", "answer": "He has 3+4=7 apples.\n#### 1,007"},
            {"problem": "2+2?", "answer": 4},
            {"problem": "Solve", "answer": "x = \\boxed{\\dfrac{1}{2}}"},
        ],
    )
    task = DatasetTask.load(str(path))
    assert [p.answer for p in task.problems] == ["\\frac{3}{4}", "1,007", "4", "\\dfrac{1}{2}"]
    frac, gsm, four, half = task.problems
    assert task.score("so the sum is \\boxed{\\frac{3}{4}}.", frac) == 1.0
    assert task.score("\\boxed{\\frac{3}{5}} no wait \\boxed{ \\frac{3}{4} }", frac) == 1.0  # last box wins
    assert task.score("\\boxed{\\frac{3}{4}} no wait \\boxed{1}", frac) == 0.0
    assert task.score("3+4=7, so 1000+7 = 1007", gsm) == 1.0  # last number, commas ignored
    assert task.score("The answer is 1,007.", gsm) == 1.0
    assert task.score("1007 or 1008", gsm) == 0.0
    assert task.score("4.0", four) == 1.0 and task.score("no idea", four) == 0.0
    assert task.score("$\\boxed{\\frac12}$", half) == 0.0  # no symbolic equivalence
    assert task.score("\\boxed{\\frac{1}{2}}", half) == 1.0  # \dfrac == \frac
    assert DatasetTask.load(str(path)).key == task.key
    path2 = _write_jsonl(tmp_path / "q.jsonl", [{"problem": "2+2?", "answer": 4}])
    assert DatasetTask.load(str(path2)).key != task.key
    drawn = assign_problems(task, node="n", version=0, seed=0, n=20)
    assert set(drawn) <= set(task.problems) and len(set(drawn)) > 1


def test_answer_extraction_and_matching() -> None:
    assert extract_answer("a \\boxed{x^{2}+1} b") == "x^{2}+1"
    assert extract_answer("cut off \\boxed{12") == "12"  # unbalanced box: fall back to the last number
    assert extract_answer("no answer here") is None
    assert extract_answer("-3.5 then -2") == "-2"
    assert reference_answer("steps\n#### 72") == "72"
    assert answers_match("0.5", "1/2") and answers_match("1,000", "1000.00")
    assert not answers_match(None, "1") and not answers_match("2", "1")


def test_dataset_task_rejects_malformed_rows(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"problem": "ok", "answer": "1"}\n{"problem": "no answer"}\n')
    with pytest.raises(ConfigError, match=r"bad.jsonl row 2: 'answer' must be"):
        DatasetTask.load(str(bad))
    bad.write_text("not json\n")
    with pytest.raises(ConfigError, match=r"bad.jsonl: cannot load it"):
        DatasetTask.load(str(bad))
    bad.write_text("\n")
    with pytest.raises(ConfigError, match=r"bad.jsonl"):
        DatasetTask.load(str(bad))


# --- warm-up cache -----------------------------------------------------------


def test_warmup_is_cached_by_key_and_written_atomically(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.set_num_threads(1)
    a = warmup.warm_tiny_model(tmp_path, steps=3, seed=1)
    files = sorted(p.name for p in tmp_path.iterdir())
    assert len(files) == 1 and files[0].startswith("tiny-warm-") and files[0].endswith(".safetensors")

    def no_training(*_: object, **__: object) -> float:
        raise AssertionError("a cache hit must not train")

    with monkeypatch.context() as m:
        m.setattr(LocalTrainer, "train_step", no_training)
        b = warmup.warm_tiny_model(tmp_path, steps=3, seed=1)
        with pytest.raises(AssertionError):  # different steps: a different key, so no stale hit
            warmup.warm_tiny_model(tmp_path, steps=4, seed=1)
        with pytest.raises(AssertionError):
            warmup.warm_tiny_model(tmp_path, steps=3, seed=2)
        with pytest.raises(AssertionError):
            warmup.warm_tiny_model(tmp_path, steps=3, seed=1, config=warmup.WarmupConfig(lr=1e-3))
    assert all(torch.equal(a.state_dict()[k], b.state_dict()[k]) for k in a.state_dict())
    assert b.lm_head.weight is b.model.embed_tokens.weight  # still tied after loading
    fresh = warmup.warm_tiny_model(None, steps=3, seed=1)  # no cache: trains, same weights
    assert all(torch.equal(a.state_dict()[k], fresh.state_dict()[k]) for k in a.state_dict())
    assert sorted(p.name for p in tmp_path.iterdir()) == files  # no temporaries left behind
