"""The trainer fixes the batch, not the node (issue 38): ``rl.answers.BatchCheck`` on hand-built
batches of the tiny arith task (byte codec: EOS is ``\\n``, id 10) and of a small dataset task whose
longer prompts the trainer's prompter drops."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from pulsenet.codec.rollout import Rollout, decode_columns, encode_batch
from pulsenet.errors import RolloutRowError
from pulsenet.nodes.hostile_rows import alias, rework
from pulsenet.rl.answers import BatchCheck, answer_id
from pulsenet.rl.models import BYTE_EOS
from pulsenet.rl.prompts import PromptConfig, Prompter, byte_codec
from pulsenet.rl.shape import RowShape
from pulsenet.rl.tasks import Assignment, DatasetTask, Problem, assign_problems, build_task, group_id

SEED, N, G = 3, 4, 3
DIGEST = "ab" * 32


@pytest.fixture(scope="module")
def arith():
    task = build_task("arith", seed=SEED)
    yield task
    task.close()


def _check(task, prompter: Prompter, **kw) -> BatchCheck:
    a = Assignment(batches_per_version=4, prompts_per_batch=N, group_size=G, **kw)
    shape = RowShape.of(prompter.sampling_params(), None, prompter.stopped)
    return BatchCheck(a, task, prompter, seed=SEED, shape=shape)


def _rows(task, prompter: Prompter, *, batch: int = 0, skip: tuple[int, ...] = ()) -> list[Rollout]:
    """Batch ``batch`` of node i0 at v2 as an honest node makes it: every problem its prompter
    keeps but ``skip``, G rows each, every completion ended by EOS."""
    rows = []
    for k, p in enumerate(assign_problems(task, node="i0", version=2, seed=SEED, n=N, batch=batch)):
        ids = prompter.encode(p.prompt)
        if ids is None or k in skip:
            continue
        for i in range(G):
            right = i != 1  # the second completion of each group is wrong
            done = (*(p.answer if right else "x").encode(), BYTE_EOS)
            rows.append(Rollout(
                group=group_id("i0", 2, batch, k), prompt_ids=tuple(ids), completion_ids=done,
                logprobs=(-0.5,) * len(done), reward=float(right), version=2, model_digest=DIGEST, node="i0", seed=i,
            ))  # fmt: skip
    return rows


def _cols(rows: list[Rollout]):
    return decode_columns(encode_batch(rows))


def _refused(check: BatchCheck, rows: list[Rollout], dropped: tuple[int, ...] = ()) -> str:
    with pytest.raises(RolloutRowError) as e:
        check(_cols(rows), dropped)
    return e.value.reason


def test_an_honest_batch_answers_its_batch_id_and_each_cheat_is_refused(arith) -> None:
    prompter = arith.prompter(byte_codec())
    check = _check(arith, prompter)
    honest = _rows(arith, prompter, batch=1)
    assert check(_cols(honest), ()) == "v2-b1" == answer_id(check.assignment, _cols(honest))
    g1 = honest[G].group  # problem 1's group
    # zero-padded aliases of one problem (issue 38's table: 12 of 12 batches trained on before)
    assert _refused(check, honest + [dataclasses.replace(r, group=alias(g1, 1)) for r in honest[G : 2 * G]]) == "group_id"
    assert _refused(check, [dataclasses.replace(r, group=alias(r.group, 2)) for r in honest]) == "group_id"
    # the better half of the groups; a group cut where its mean reward peaks; every group cut
    assert _refused(check, honest[: 2 * G]) == "assignment_changed"  # whole for 2 problems: trailing ones missing
    assert _refused(check, honest[G:]) == "incomplete"
    assert _refused(check, honest[:G] + honest[G + 1 :]) == "group_size"
    assert _refused(check, [r for k in range(N) for r in honest[k * G : k * G + 2]]) == "group_size_changed"
    # a wrong completion cut to a prefix that scores, its stop token gone; another problem's prompt
    head = honest[1].completion_ids[:-1]
    cut = dataclasses.replace(honest[0], completion_ids=head, logprobs=(-0.5,) * len(head))
    assert _refused(check, [cut, *honest[1:]]) == "row_shape"
    longer = (*honest[1].completion_ids, 49)
    on = dataclasses.replace(honest[1], completion_ids=longer, logprobs=(-0.5,) * len(longer))
    assert _refused(check, [honest[0], on, *honest[2:]]) == "row_shape"  # goes on past its stop token
    assert _refused(check, [dataclasses.replace(honest[0], prompt_ids=(49, 61)), *honest[1:]]) == "wrong_prompt"
    # a declaration of a problem the trainer's prompter keeps (a node withholding one it dislikes)
    assert _refused(check, honest[G:], (0,)) == "dropped_mismatch"
    assert _refused(check, honest, (N + 5,)) == "dropped_mismatch"


def test_the_hostile_reworks_are_refused_by_the_batch_check(arith) -> None:
    """nodes/hostile_rows.py's batches, from one honest batch: none passes; ``reward-one`` does
    (its rows are honest draws: re-scoring replaces the rewards, and the feed counts the lie)."""
    prompter = arith.prompter(byte_codec())
    check, honest = _check(arith, prompter), _rows(arith, prompter)

    def score(i: int, ids) -> float:
        return 1.0 if prompter.completion_text(ids) == "x" else 0.0  # "x": a prefix that "scores"

    for behaviour, want in (("better-half", {"assignment_changed", "incomplete"}), ("aliases", {"group_id"}),
                            ("copies", {"group_id"}), ("cut-groups", {"group_size", "group_size_changed"}),
                            ("prefix-cut", {"row_shape"})):  # fmt: skip
        [sent] = rework(behaviour, honest, score, previous=None, n=2, copies=32)
        assert sent != honest and _refused(check, sent) in want, behaviour
    [ones] = rework("reward-one", honest, score, previous=None, n=2, copies=32)
    assert check(_cols(ones), ()) == "v2-b0"


def test_problems_the_trainers_prompter_drops_are_declared_and_checked(tmp_path: Path) -> None:
    problems = [Problem("1+1=", "2"), Problem("a long prompt that a short limit drops=", "3")]
    task = DatasetTask(problems, key="t")
    prompter = Prompter(byte_codec(), PromptConfig(max_prompt_tokens=8, max_new_tokens=4))
    check = _check(task, prompter)
    drawn = assign_problems(task, node="i0", version=2, seed=SEED, n=N, batch=0)
    long = tuple(k for k, p in enumerate(drawn) if len(p.prompt) > 8)
    assert long and len(long) < N  # the draw has both kinds
    rows = _rows(task, prompter)
    assert check(_cols(rows), long) == "v2-b0"  # what an honest node declares
    assert _refused(check, rows, ()) == "dropped_mismatch"  # dropped, not declared
    assert _refused(check, rows, long[:-1]) == "dropped_mismatch"


def test_problems_are_distinct_and_group_ids_have_one_spelling() -> None:
    a = Assignment(batches_per_version=4, prompts_per_batch=8)
    with pytest.raises(RolloutRowError) as e:
        a.answers(["n-v1-b0-p3", "n-v1-b0-p3"], [2, 2], node="n", version=1)  # a Parquet dictionary may repeat one
    assert e.value.reason == "problem_repeated"
    for bad in ("n-v1-b0-p03", "n-v01-b0-p3", "n-v1-b00-p3", "n-v1-b0-p+3", "n-v1-b0-p3 "):
        assert a.check_group(bad, node="n", version=1) == "group_id", bad
    assert a.check_group("n-v1-b0-p0", node="n", version=1) == (0, 0)


def test_the_demand_record_signs_g_and_a_manifest_declares_its_dropped_problems() -> None:
    from pulsenet.errors import ManifestError
    from pulsenet.rollouts.demand import Demand, assigned_group_size
    from pulsenet.rollouts.layout import RolloutLayout
    from pulsenet.rollouts.manifest import BatchManifest
    from pulsenet.signed import ObjectRef

    d = Demand(trainer="t0", version=3, max_staleness=2, participants=("t0",), grants={"i0": 8}, taken={}, group_size=8)
    body = d.to_body()
    assert body["schema"] == 3 and Demand.from_body(body).group_size == 8
    old = dataclasses.replace(d, group_size=None).to_body()  # a trainer that sets no G writes schema 2, as before
    assert old["schema"] == 2 and "group_size" not in old and Demand.from_body(old).group_size is None
    for bad in ({**body, "group_size": 0}, {**body, "schema": 2}, {**old, "schema": 3}, {**body, "group_size": True}):
        with pytest.raises(ManifestError):
            Demand.from_body(bad)
    other = dataclasses.replace(d, trainer="t1", group_size=4)
    assert assigned_group_size([d], "i0") == 8 and assigned_group_size([d, other], "i0") is None  # they disagree
    assert assigned_group_size([d], "i9") is None

    layout = RolloutLayout()
    sha = "c" * 64
    m = BatchManifest(
        node="i0", seq=1, version=2, model_digest=DIGEST, payload=ObjectRef(layout.batch(2, "i0", 1, sha), 10, sha),
        rows=8, groups=2, tokens=40, publisher="k", created="now", dropped=(3, 5),
    )  # fmt: skip
    body = m.to_body()
    assert body["schema"] == 2 and BatchManifest.from_body(body, layout) == m
    v1 = {k: x for k, x in body.items() if k != "dropped"} | {"schema": 1}  # a node before issue 38
    assert BatchManifest.from_body(v1, layout).dropped == ()
    for bad in ([5, 3], [3, 3], [-1], [1 << 16], "3", [True]):
        with pytest.raises(ManifestError):
            BatchManifest.from_body({**body, "dropped": bad}, layout)
    with pytest.raises(ManifestError):
        BatchManifest.from_body({**v1, "dropped": [3]}, layout)  # schema 1 has no such field
