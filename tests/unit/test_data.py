"""Datasets as tasks: every supported format, column mapping, held-out splits, and the ConfigErrors
a bad file gets (naming the file and the columns it has)."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pytest

from pulsenet.errors import ConfigError
from pulsenet.rl.data import load_problem_set
from pulsenet.rl.tasks import TaskConfig, assign_problems, build_task

ROWS = [{"question": f"{a}+{b}=", "solution": f"so \\boxed{{{a + b}}}", "level": a % 3} for a in range(10) for b in range(4)]


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_every_format_loads_the_same_rows(tmp_path: Path) -> None:
    ds = datasets.Dataset.from_list(ROWS)
    paths = [_jsonl(tmp_path / "d.jsonl", ROWS), tmp_path / "d.parquet", tmp_path / "d.csv", tmp_path / "saved"]
    ds.to_parquet(str(paths[1]))
    ds.to_csv(str(paths[2]), index=False)
    ds.save_to_disk(str(paths[3]))
    sets = [load_problem_set(p) for p in paths]
    for s in sets:  # question/solution found without a mapping; the gold answer is the box's content
        assert (s.prompt_column, s.answer_column) == ("question", "solution")
        assert [(r.prompt, r.answer) for r in s.train] == [(r["question"], str(eval(r["question"][:-1]))) for r in ROWS]
        assert s.train[5].columns == ROWS[5] and s.eval is None
    assert sets[0].key == load_problem_set(paths[0]).key  # a pure function of bytes and settings
    assert len({s.key for s in sets}) == 4


def test_column_mapping_and_missing_columns(tmp_path: Path) -> None:
    rows = [{"q": "2+2=", "gold": "4", "extra": 1}]
    path = _jsonl(tmp_path / "custom.jsonl", rows)
    with pytest.raises(
        ConfigError,
        match=r"custom\.jsonl: no prompt column \(prompt / question / problem\); its columns are \['q', 'gold', 'extra'\]",
    ):
        load_problem_set(path)
    with pytest.raises(ConfigError, match=r"custom\.jsonl: no answer column 'answer'; its columns are \['q', 'gold', 'extra'\]"):
        load_problem_set(path, prompt_column="q", answer_column="answer")
    s = load_problem_set(path, prompt_column="q", answer_column="gold")
    assert (s.train[0].prompt, s.train[0].answer) == ("2+2=", "4")
    assert load_problem_set(path, prompt_column="q", answer_column="extra").key != s.key  # the mapping is in the key
    with pytest.raises(ConfigError, match="does not exist"):
        load_problem_set(tmp_path / "absent.jsonl")
    (tmp_path / "x.txt").write_text("hello")
    with pytest.raises(ConfigError, match=r"must be \.jsonl"):
        load_problem_set(tmp_path / "x.txt")


def test_held_out_split_by_fraction_file_or_dataset_dict(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "d.jsonl", ROWS)
    s = load_problem_set(path, eval_fraction=0.25)
    assert len(s.eval) == 10 and len(s.train) == 30  # type: ignore[arg-type]
    assert {r.prompt for r in s.eval} | {r.prompt for r in s.train} == {r["question"] for r in ROWS}  # type: ignore[union-attr]
    again = load_problem_set(path, eval_fraction=0.25)
    assert [r.prompt for r in again.eval] == [r.prompt for r in s.eval]  # type: ignore[union-attr]
    assert [r.prompt for r in load_problem_set(path, eval_fraction=0.5).eval][:3] != [r.prompt for r in s.eval][:3]  # type: ignore[union-attr]
    with pytest.raises(ConfigError, match=r"eval_fraction 0.01 of 40 rows leaves an empty eval split"):
        load_problem_set(path, eval_fraction=0.01)
    held = _jsonl(tmp_path / "held.jsonl", ROWS[:3])
    s2 = load_problem_set(path, eval_path=held)
    assert [r.prompt for r in s2.eval] == [r["question"] for r in ROWS[:3]] and len(s2.train) == 40  # type: ignore[union-attr]
    _jsonl(tmp_path / "empty.jsonl", [])
    with pytest.raises(ConfigError, match=r"empty\.jsonl"):
        load_problem_set(path, eval_path=tmp_path / "empty.jsonl")
    _jsonl(tmp_path / "other.jsonl", [{"text": "x"}])
    with pytest.raises(ConfigError, match=r"other\.jsonl: no prompt column 'question'; its columns are \['text'\]"):
        load_problem_set(path, eval_path=tmp_path / "other.jsonl")
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS[:30]), "test": datasets.Dataset.from_list(ROWS[30:])})
    dd.save_to_disk(str(tmp_path / "dd"))
    s3 = load_problem_set(tmp_path / "dd")
    assert len(s3.train) == 30 and len(s3.eval) == 10  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"no split 'validation' \(it has \['test', 'train'\]\)"):
        load_problem_set(tmp_path / "dd", split="validation")


def test_a_dataset_task_assigns_deterministically_and_scores_with_math(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "d.jsonl", ROWS)
    config = TaskConfig(task=str(path), eval_fraction=0.25, eval_problems=4)
    task = build_task(config, seed=1)
    try:
        assert len(task.eval_problems) == 4 and task.reward_range == (0.0, 1.0)
        drawn = assign_problems(task, node="i0", version=3, seed=1, n=8)
        twin = build_task(config, seed=1)
        assert assign_problems(twin, node="i0", version=3, seed=1, n=8) == drawn
        twin.close()
        p = drawn[0]
        good, bad = f"The sum is $\\boxed{{{p.answer}}}$.", "\\boxed{-1}"
        scores = task.score_texts([p, p], [good, bad], ["g-0", "g-1"])
        assert scores.total == [1.0, 0.0] and scores.by_reward == {"math": [1.0, 0.0]}
        assert task.score(str(p.answer), p) == 1.0  # a plain final number verifies too
    finally:
        task.close()
