"""Every decoder of store or file bytes, fuzzed (tests/fuzz): a typed error or the exact output.

Bounded here (``PULSENET_FUZZ_CASES`` cases per target, default 3000; 20000 with
``PULSENET_SLOW=1``); ``python tests/fuzz/run.py --cases N`` runs long. Hypothesis properties for
the patch and payload decoders sit below the mutation run.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).parent))
import harness
import targets_codec as codec

from pulsenet.errors import PatchError, PayloadError, PulsenetError

SLOW = os.environ.get("PULSENET_SLOW") == "1"
CASES = int(os.environ.get("PULSENET_FUZZ_CASES", 20_000 if SLOW else 3_000))
TARGETS = harness.load_targets()


@pytest.mark.parametrize("target", TARGETS, ids=[t["name"] for t in TARGETS])
def test_fuzz_target(target: dict) -> None:
    cases = min(CASES, target.get("max_cases", CASES))  # a target that runs a node per case (names.*) caps it
    stats = harness.run_target(target, cases, seed=int(os.environ.get("PULSENET_FUZZ_SEED", "0")))
    print(f"\n{harness.Stats.HEADER}\n{stats.row()}\n{stats.errors}")
    assert not stats.mutator_errors, stats.mutator_errors[:5]
    assert not stats.crashes, "\n".join(f"{c.mutators}: {c.error}\n{c.trace}" for c in stats.crashes[:5])
    if target.get("rejects", True):
        assert stats.rejected > 0 and stats.rejected < stats.cases  # the mutations reach past the first check
    else:  # planted names (targets_names.py): nothing planted may stop the node, so nothing is refused
        assert stats.exact == stats.cases


def test_harness_finds_every_targets_file() -> None:
    files = sorted(p.stem for p in Path(__file__).parent.glob("targets_*.py"))
    assert "targets_codec" in files
    assert {"codec.patch", "codec.payload"} <= {t["name"] for t in TARGETS}


def test_harness_reports_an_untyped_error() -> None:
    """The invariant bites: a decoder that raises a builtin error, or returns another output, crashes."""
    seeds = codec.patch_seeds()[:2]

    def leaky(data: bytes) -> object:
        if data not in seeds:
            raise ValueError("untyped")
        return data

    stats = harness.run_target({"name": "leaky", "seeds": lambda: seeds, "decode": leaky}, 50)
    assert len(stats.crashes) > 40 and stats.crashes[0].error.startswith("ValueError")
    wrong = harness.run_target({"name": "wrong", "seeds": lambda: seeds, "decode": lambda d: len(d) // 10**9,
                                "exact": True}, 50)
    assert wrong.exact == 50  # every output equals its seed's (0): fine
    lying = harness.run_target({"name": "lying", "seeds": lambda: seeds, "decode": lambda d: d[:8],
                                "exact": True}, 200)
    assert lying.crashes and "differs" in lying.crashes[0].error


# --------------------------------------------------------------------------- Hypothesis


PATCH_SEEDS = codec.patch_seeds()
PATCH_OUT = [codec.decode_patch(s) for s in PATCH_SEEDS]
PAYLOAD_SEEDS = codec.payload_seeds()

edits = st.lists(st.tuples(st.integers(0, 1 << 16), st.integers(0, 255)), max_size=8)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=4),
    max_leaves=12,
)
raw_json = json_values.map(json.dumps) | st.sampled_from(
    ["[" * 50_000 + "]" * 50_000, '{"a":' * 5000 + "0" + "}" * 5000, "9" * 5000, "-1e999999", '"\\ud800"', "NaN"]
)
"""JSON text for one value: anything json.dumps writes, plus what it never would."""
HYPO = settings(max_examples=300 if SLOW else 60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _edit(data: bytes, changes: list[tuple[int, int]], cut: int | None) -> bytes:
    b = bytearray(data)
    for at, value in changes:
        if b:
            b[at % len(b)] = value
    return bytes(b[:cut] if cut is not None else b)


@HYPO
@given(k=st.integers(0, len(PATCH_SEEDS) - 1), changes=edits, cut=st.none() | st.integers(0, 1 << 14))
def test_patch_bytes_decode_exactly_or_raise_patch_error(k: int, changes: list, cut: int | None) -> None:
    data = _edit(PATCH_SEEDS[k], changes, cut)
    try:
        out = codec.decode_patch(data)
    except PatchError:
        return
    assert out == PATCH_OUT[k]


@HYPO
@given(k=st.integers(0, len(PATCH_SEEDS) - 1), which=st.integers(0, 1 << 10), key=st.text(max_size=8) |
       st.sampled_from(["name", "dtype", "shape", "sha256", "op", "nnz", "zones", "mask", "values", "data"]),
       value=raw_json)
def test_hostile_table_fields_raise_patch_error(k: int, which: int, key: str, value: str) -> None:
    table, body = codec._split(PATCH_SEEDS[k])
    entries = table["tensors"]
    target = entries[which % len(entries)] if which % 4 else table
    target[key] = "\0placeholder"
    raw = json.dumps(table).replace(json.dumps("\0placeholder"), value, 1)
    try:
        out = codec.decode_patch(codec._join(raw.encode(), body))
    except PatchError:
        return
    assert out == PATCH_OUT[k]


@HYPO
@given(k=st.integers(0, len(PAYLOAD_SEEDS) - 1), changes=edits, cut=st.none() | st.integers(0, 1 << 13))
def test_payload_bytes_decode_or_raise_payload_error(k: int, changes: list, cut: int | None) -> None:
    try:
        codec.decode_payload(_edit(PAYLOAD_SEEDS[k], changes, cut))
    except PayloadError:
        pass
    except PulsenetError as e:  # the payload decoder speaks PayloadError only
        raise AssertionError(f"{type(e).__name__} from the payload decoder") from e
