"""Fuzz targets of the rollout channel: the Parquet batch decoder, the batch-manifest verify path,
and the trainer's row checks (intake rows).

``rollout.batch`` is not exact (the Parquet bytes carry no integrity check of their own: the
manifest's SHA-256 does that), so a mutated batch may decode to other rows; it must never raise
anything but a ``RolloutError``. ``rollout.manifest`` is exact: the signature covers the body, so
whatever still verifies is a body the trusted key signed: one of the seeds' manifests. Not always
the mutated seed's own: JSON objects may repeat a key (the last one wins), so splicing seed A's
head onto seed B's tail can carry B's signed body intact, which verifies, correctly, as B.

``rollout.assignment`` (issue 29) is what the trainer does with a batch's group ids before any
problem is drawn (``Assignment.batch_of``: one batch id within the bounds, groups no larger than a
step), checked against a plain reference, and then the shapes of the GRPO steps it would make of
an accepted batch (``next_step``, ``micro_batches``): rows per step and padded tokens per
micro-batch within configuration, whatever the rows' lengths.

``rollout.rows`` is what the intake does with a payload that matched its manifest: decode to arrays,
then ``rows.check_rows`` against a trainer's ``RowLimits``. Its mutators change rows the way a
compromised node would (token ids past the vocabulary, empty or overlong rows, a group with two
prompts, rewards and logprobs at and past their bounds) and re-encode them, besides the byte-level
ones. Not exact, but checked against a plain per-row reference: an accepted batch must satisfy
every limit, a refused one must break the limit its reason names (anything else is a crash).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import math
import random
import re
import struct

from pulsenet.codec.rollout import (
    MAX_TOKEN_ID,
    Rollout,
    RolloutColumns,
    decode_batch,
    decode_columns,
    encode_batch,
)
from pulsenet.errors import RolloutError, RolloutRowError
from pulsenet.nodes.feed import next_step
from pulsenet.rl.answers import answer_id
from pulsenet.rl.grpo import micro_batches
from pulsenet.rl.tasks import Assignment, group_id
from pulsenet.rollouts import RolloutBatch
from pulsenet.rollouts.layout import RolloutLayout
from pulsenet.rollouts.manifest import (
    BatchManifest,
    batch_manifest_from,
    sign_batch_manifest,
)
from pulsenet.rollouts.rows import RowLimits, check_rows
from pulsenet.signed import ObjectRef
from pulsenet.signing import key_id, sign_document, verify_document

_DIGEST = "3f" * 32
_LAYOUT = RolloutLayout()
_CONTEXT = _LAYOUT.context("fuzz", "s3://pulsenet-a/site", "inf-a")


@functools.cache
def _keys() -> tuple:
    """(trusted signing key, an untrusted one, the trusted map): fixed bytes, so seeds are stable."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    key = Ed25519PrivateKey.from_private_bytes(bytes(range(32)))
    other = Ed25519PrivateKey.from_private_bytes(bytes(range(1, 33)))
    return key, other, {key_id(key.public_key()): key.public_key()}


def _rows(seed: int, groups: int, g: int, max_len: int) -> list[Rollout]:
    rng = random.Random(seed)
    rows = []
    for gi in range(groups):
        prompt = tuple(rng.randrange(1 << 17) for _ in range(rng.randrange(1, max_len)))
        for _ in range(g):
            n = rng.randrange(0, max_len)
            rows.append(
                Rollout(
                    group=f"g{seed}-{gi}",
                    prompt_ids=prompt,
                    completion_ids=tuple(rng.randrange(1 << 17) for _ in range(n)),
                    logprobs=tuple(
                        struct.unpack("f", struct.pack("f", -rng.random() * 8))[0] for _ in range(n)
                    ),
                    reward=rng.choice([0.0, 1.0, 0.5]),
                    version=seed,
                    model_digest=_DIGEST,
                    node="inf-a",
                    seed=rng.randrange(1 << 40),
                )
            )
    return rows


def _batch_seeds() -> list[bytes]:
    return [
        encode_batch(_rows(1, 1, 1, 4)),
        encode_batch(_rows(2, 2, 4, 24)),
        encode_batch(_rows(3, 4, 2, 64)),
    ]


def _decode_batch(data: bytes) -> list[Rollout]:
    return decode_batch(data, max_rows=256, max_tokens=1 << 16)


def _footer_region(data: bytes) -> tuple[int, int]:
    """(start, end) of the Thrift footer, or the whole input when it cannot be found."""
    if len(data) >= 12 and data[-4:] == b"PAR1":
        n = int.from_bytes(data[-8:-4], "little")
        if 0 < n <= len(data) - 12:
            return len(data) - 8 - n, len(data) - 8
    return 0, len(data)


def _mutate_footer(data: bytes, rng: random.Random) -> bytes:
    """Change one byte of the footer (row counts, offsets, sizes, types, key-value metadata)."""
    start, end = _footer_region(data)
    if end <= start:
        return data
    out = bytearray(data)
    out[rng.randrange(start, end)] = rng.choice([0x00, 0x7F, 0x80, 0xFF, rng.randrange(256)])
    return bytes(out)


def _mutate_pages(data: bytes, rng: random.Random) -> bytes:
    """Overwrite a few bytes among the pages (headers, levels, compressed values) with big varints."""
    start, _ = _footer_region(data)
    if start <= 4:
        return data
    out = bytearray(data)
    pos = rng.randrange(4, start)
    patch = rng.choice(
        [b"\xff\xff\xff\xff\x0f", b"\x80\x80\x80\x80\x10", b"\x00", b"\x15\x00", b"\xfe\xff\xff\x07"]
    )
    out[pos : pos + len(patch)] = patch[: max(0, start - pos)]
    return bytes(out)


def _truncate_or_splice(data: bytes, rng: random.Random) -> bytes:
    """Cut the file, or drop / duplicate a slice of it while keeping the trailing magic."""
    if len(data) < 16:
        return data
    a = rng.randrange(4, len(data) - 8)
    b = rng.randrange(a, len(data) - 8)
    choice = rng.randrange(3)
    if choice == 0:
        return data[:a]
    if choice == 1:
        return data[:a] + data[b:]
    return data[:b] + data[a:b] + data[b:]


def _manifest_seeds() -> list[bytes]:
    key = _keys()[0]
    out = []
    for seq, (version, rows, size) in enumerate([(0, 1, 900), (7, 24, 81234), (123456, 512, 1 << 30)]):
        sha = f"{seq:02x}" * 32
        m = BatchManifest(
            node="inf-a",
            seq=seq,
            version=version,
            model_digest=_DIGEST,
            payload=ObjectRef(key=_LAYOUT.batch(version, "inf-a", seq, sha), size=size, sha256=sha),
            rows=rows,
            groups=max(1, rows // 4),
            tokens=rows * 100,
            publisher=key_id(key.public_key()),
            created="2026-01-01T00:00:00.000000+00:00",
        )
        out.append(sign_batch_manifest(m, key, context=_CONTEXT))
    return out


def _verify_manifest(data: bytes) -> BatchManifest:
    return batch_manifest_from(verify_document(data, _keys()[2], context=_CONTEXT), layout=_LAYOUT)


@functools.cache
def _signed_manifests() -> tuple[BatchManifest, ...]:
    return tuple(_verify_manifest(s) for s in _manifest_seeds())


def _is_signed_manifest(out: object, _expected: object) -> bool:
    """Exactness for a signature: the output is a manifest the trusted key signed (module docstring)."""
    return out in _signed_manifests()


_ODD_VALUES = [None, True, -1, 0, 2**63, 1e308, "", "x" * 300, [], {}, "inf-b", "../x", "ab" * 32, [1] * 40]


def _mutate_body(data: bytes, rng: random.Random) -> bytes:
    """Change, drop or add one body field (signature unchanged: must fail), or re-sign the change
    with an untrusted key, or re-sign the original body for another context."""
    try:
        env = json.loads(data)
        body = env["body"]
        if not isinstance(body, dict) or not body:
            return data
    except (ValueError, KeyError, TypeError, RecursionError):
        return data
    name = rng.choice(sorted(body))
    action = rng.randrange(4)
    if action == 0:
        body[name] = rng.choice(_ODD_VALUES)
    elif action == 1:
        del body[name]
    elif action == 2 and isinstance(body.get("payload"), dict):
        body["payload"][rng.choice(["key", "size", "sha256", "extra"])] = rng.choice(_ODD_VALUES)
    else:
        body[f"extra{rng.randrange(3)}"] = rng.choice(_ODD_VALUES)
    try:
        if rng.random() < 0.3:
            return sign_document(body, _keys()[1], context=_CONTEXT)
        return json.dumps(env, allow_nan=True).encode()
    except (ValueError, TypeError):
        return data


def _mutate_envelope(data: bytes, rng: random.Random) -> bytes:
    """Rewrite the envelope: other whitespace and key order (still valid), or a changed context,
    key id or signature."""
    try:
        env = json.loads(data)
        if not isinstance(env, dict):
            return data
    except (ValueError, RecursionError):
        return data
    action = rng.randrange(4)
    if action == 0:
        items = list(env.items())
        rng.shuffle(items)
        return json.dumps(dict(items), indent=rng.choice([None, 1, 2])).encode()
    if action == 1:
        env["context"] = rng.choice(["", _CONTEXT + "x", "pulsesync/policy", None])
    elif action == 2:
        env["key_id"] = rng.choice([key_id(_keys()[1].public_key()), "", None, 5])
    else:
        sig = env.get("sig")
        if isinstance(sig, str) and sig:
            i = rng.randrange(len(sig))
            env["sig"] = sig[:i] + rng.choice("AB+/=") + sig[i + 1 :]
    return json.dumps(env).encode()


# --- intake rows ---------------------------------------------------------------------------------

_LIMITS = RowLimits(
    vocab_size=1 << 17, max_prompt_tokens=48, max_completion_tokens=40, max_row_tokens=80, reward_min=-1.0, reward_max=1.0
)


def _valid_rows(seed: int, groups: int, g: int) -> list[Rollout]:
    rng = random.Random(seed)
    rows = []
    for gi in range(groups):
        prompt = tuple(rng.randrange(1 << 17) for _ in range(rng.randrange(1, 40)))
        for _ in range(g):
            n = rng.randrange(1, 40)
            rows.append(
                Rollout(
                    group=f"g{seed}-{gi}",
                    prompt_ids=prompt,
                    completion_ids=tuple(rng.randrange(1 << 17) for _ in range(n)),
                    logprobs=tuple(struct.unpack("f", struct.pack("f", -rng.random() * 8))[0] for _ in range(n)),
                    reward=rng.choice([0.0, 1.0, -1.0, 0.5]),
                    version=seed,
                    model_digest=_DIGEST,
                    node="inf-a",
                    seed=rng.randrange(1 << 40),
                )
            )
    rng.shuffle(rows)  # groups interleaved: the prompt check must not assume contiguous groups
    return rows


def _rows_seeds() -> list[bytes]:
    return [encode_batch(_valid_rows(s, groups, g)) for s, groups, g in ((11, 1, 1), (12, 3, 4), (13, 6, 8))]


def _reference_defect(cols: RolloutColumns, lim: RowLimits) -> str | None:
    """The first reason ``check_rows`` must give, computed row by row in plain Python."""
    rows = cols.to_rows()
    if any(not r.prompt_ids or not r.completion_ids for r in rows):
        return "empty_row"
    if any(
        len(r.prompt_ids) > lim.max_prompt_tokens
        or len(r.completion_ids) > lim.max_completion_tokens
        or (lim.max_row_tokens is not None and len(r.prompt_ids) + len(r.completion_ids) > lim.max_row_tokens)
        for r in rows
    ):
        return "row_too_long"
    if any(not 0 <= t < lim.vocab_size for r in rows for t in r.prompt_ids + r.completion_ids):
        return "token_range"
    prompts: dict[str, tuple[int, ...]] = {}
    if any(prompts.setdefault(r.group, r.prompt_ids) != r.prompt_ids for r in rows):
        return "group_prompts"
    if any(not (math.isfinite(x) and lim.logprob_min <= x <= 0) for r in rows for x in r.logprobs):
        return "logprob_range"
    if any(not (math.isfinite(r.reward) and lim.reward_min <= r.reward <= lim.reward_max) for r in rows):
        return "reward_range"
    return None


def _intake_rows(data: bytes) -> RolloutColumns:
    cols = decode_columns(data, max_rows=256, max_tokens=1 << 16)
    want = _reference_defect(cols, _LIMITS)
    try:
        check_rows(cols, _LIMITS)
    except RolloutRowError as e:
        if e.reason != want:
            raise AssertionError(f"check_rows refused for {e.reason!r}, the reference says {want!r}") from None
        raise
    if want is not None:
        raise AssertionError(f"check_rows accepted rows with a {want!r} defect")
    return cols


def _row_defect(rows: list[Rollout], rng: random.Random) -> list[Rollout]:
    """One row-level change of the kinds issue 21 lists, at or past a bound (or just inside it)."""
    i = rng.randrange(len(rows))
    r = rows[i]
    n = len(r.completion_ids)
    kind = rng.randrange(10)
    if kind == 0:  # a token id at, just below or far past the vocabulary
        field = rng.choice(["prompt_ids", "completion_ids"])
        ids = list(getattr(r, field)) or [0]  # (an earlier defect may have emptied it)
        ids[rng.randrange(len(ids))] = rng.choice([_LIMITS.vocab_size, _LIMITS.vocab_size - 1, MAX_TOKEN_ID, 0])
        change = {field: tuple(ids)}
        if field == "completion_ids":
            change["logprobs"] = (*r.logprobs, -1.0)[: len(ids)]
        return _set(rows, i, **change)
    if kind == 1:
        return _set(rows, i, prompt_ids=()) if rng.random() < 0.5 else _set(rows, i, completion_ids=(), logprobs=())
    if kind == 2:  # a prompt or completion at or one past its limit
        if rng.random() < 0.5:
            k = _LIMITS.max_prompt_tokens + rng.choice([0, 1])
            return [dataclasses.replace(x, prompt_ids=(5,) * k) if x.group == r.group else x for x in rows]
        k = _LIMITS.max_completion_tokens + rng.choice([-5, 0, 1])
        return _set(rows, i, completion_ids=(5,) * k, logprobs=(-1.0,) * k)
    if kind == 3:  # another prompt in the same group
        other = rows[rng.randrange(len(rows))].prompt_ids
        return _set(rows, i, prompt_ids=other if rng.random() < 0.7 else (*r.prompt_ids[:-1], 1))
    if kind == 4:  # two groups merged under one id
        return _set(rows, i, group=rows[rng.randrange(len(rows))].group)
    if kind == 5:
        return _set(rows, i, reward=rng.choice([1e300, -1e300, 1.0, -1.0, 1.0000001, -1.0000001, 3.4e38, 0.0]))
    if kind == 6 and n:  # logprobs at and past [logprob_min, 0]
        lp = list(r.logprobs)
        lp[rng.randrange(n)] = rng.choice([0.0, -0.0, 1e-7, 0.5, -80.0, -80.00001, -1e30, 3e38])
        return _set(rows, i, logprobs=tuple(lp))
    if kind == 7:  # a row removed or duplicated
        return rows[:i] + rows[i + 1 :] if len(rows) > 1 and rng.random() < 0.5 else [*rows, r]
    if kind == 8:  # a group id that collides with a qualified one, or is long
        return _set(rows, i, group=rng.choice(["inf-b/3/g0", "x" * 256, "\u00e9" * 256, "g/../g"]))
    return _set(rows, i, seed=rng.choice([-(1 << 63), (1 << 63) - 1, 0]))


def _set(rows: list[Rollout], i: int, **change: object) -> list[Rollout]:
    return [dataclasses.replace(r, **change) if j == i else r for j, r in enumerate(rows)]


def _mutate_rows(data: bytes, rng: random.Random) -> bytes:
    """Decode, change rows (1-3 defects), re-encode with the real encoder (what a node can sign)."""
    try:
        rows = decode_batch(data, max_rows=256, max_tokens=1 << 16)
    except RolloutError:
        return data
    for _ in range(rng.choice((1, 1, 2, 3))):
        rows = _row_defect(rows, rng)
    try:
        return encode_batch(rows)
    except RolloutError:  # the encoder refuses what cannot travel (a non-finite float32 logprob)
        return data


# --- rollout.assignment: the numbers of group ids, and the padded shapes of the steps (issue 29) ---

_ASSIGN = Assignment(batches_per_version=4, prompts_per_batch=8, max_group_rows=6)
_ROWS_PER_STEP = 6
_MICRO_TOKENS = 256
_GROUP_RE = re.compile(r"(.+)-v([0-9]+)-b([0-9]+)-p([0-9]+)")


def _assigned_rows(seed: int, groups: int, g: int, batch: int) -> list[Rollout]:
    rows = _valid_rows(seed, groups, g)
    ids = {gid: group_id("inf-a", seed, batch, k) for k, gid in enumerate(dict.fromkeys(r.group for r in rows))}
    return [dataclasses.replace(r, group=ids[r.group]) for r in rows]


def _assignment_seeds() -> list[bytes]:
    return [encode_batch(_assigned_rows(s, groups, g, b)) for s, groups, g, b in ((21, 1, 1, 0), (22, 3, 4, 3), (23, 8, 6, 1))]


def _reference_answer(cols: RolloutColumns) -> tuple[str, str]:
    """``("ok", answer)`` or ``("refused", reason)``, as ``Assignment.batch_of`` must decide, in plain Python."""
    sizes = collections.Counter(int(k) for k in cols.group)
    batches, problems = set(), []
    for k, gid in enumerate(cols.groups):
        m = _GROUP_RE.fullmatch(gid)
        if (
            m is None or any(len(x) > 15 or x != str(int(x)) for x in m.groups()[1:])  # one spelling per number
            or m[1] != cols.node or int(m[2]) != cols.version
        ):  # fmt: skip
            return "refused", "group_id"
        if int(m[3]) >= _ASSIGN.batches_per_version or int(m[4]) >= _ASSIGN.prompts_per_batch:
            return "refused", "out_of_assignment"
        if sizes[k] > (_ASSIGN.max_group_rows or sizes[k]):
            return "refused", "group_size"
        batches.add(int(m[3]))
        problems.append(int(m[4]))
    if len(batches) != 1:
        return "refused", "mixed_batches"
    if len(set(problems)) != len(problems):
        return "refused", "problem_repeated"
    if len(set(sizes.values())) > 1:
        return "refused", "group_size"
    return "ok", f"v{cols.version}-b{batches.pop()}"


def _check_steps(cols: RolloutColumns) -> None:
    """The steps a trainer makes of an accepted batch: at most ``_ROWS_PER_STEP`` rows of whole
    groups each, micro-batches of at most ``_MICRO_TOKENS`` padded tokens (or one row)."""
    groups: dict[str, list[Rollout]] = {}
    for r in cols.to_rows():
        groups.setdefault(r.group, []).append(r)
    batch = RolloutBatch(manifest=None, columns=cols, batch_id="inf-a/x")  # type: ignore[arg-type]
    ready = collections.deque((batch, g) for g in groups.values())
    seen = 0
    while ready:
        step, _ = next_step(ready, _ROWS_PER_STEP)
        seen += len(step)
        if not 0 < len(step) <= _ROWS_PER_STEP:
            raise AssertionError(f"a step of {len(step)} rows (at most {_ROWS_PER_STEP})")
        lengths = [len(r.prompt_ids) + len(r.completion_ids) for r in step]
        for rows, w in micro_batches(range(len(step)), lengths, None, _MICRO_TOKENS):
            if len(rows) > 1 and len(rows) * w > _MICRO_TOKENS:
                raise AssertionError(f"a micro-batch of {len(rows)} x {w} padded tokens (at most {_MICRO_TOKENS})")
    if seen != len(cols):
        raise AssertionError(f"steps hold {seen} of {len(cols)} rows")


def _answer(data: bytes) -> str:
    cols = decode_columns(data, max_rows=256, max_tokens=1 << 16)
    outcome, want = _reference_answer(cols)
    try:
        got = answer_id(_ASSIGN, cols)
    except RolloutRowError as e:
        if (outcome, want) != ("refused", e.reason):
            raise AssertionError(f"refused for {e.reason!r}, the reference says {outcome} {want!r}") from None
        raise
    if (outcome, want) != ("ok", got):
        raise AssertionError(f"answered {got!r}, the reference says {outcome} {want!r}")
    _check_steps(cols)
    return got  # type: ignore[return-value]


def _mutate_group_ids(data: bytes, rng: random.Random) -> bytes:
    """What a node could sign: numbers past every bound (``p99999999999``, hundreds of digits),
    another node or version, one batch number per group, groups larger than a step, and rows of
    very different lengths (the padded shape of a step)."""
    try:
        rows = decode_batch(data, max_rows=256, max_tokens=1 << 16)
    except RolloutError:
        return data
    i = rng.randrange(len(rows))
    r = rows[i]
    m = _GROUP_RE.fullmatch(r.group)
    node, v, b, k = (m[1], m[2], m[3], m[4]) if m else ("inf-a", str(r.version), "0", "0")
    huge = rng.choice(["99999999999", "9" * 15, "9" * 16, "9" * 200, "4", "8", "3", "7", "0" * 20 + "1"])
    kind = rng.randrange(7)
    if kind == 0:
        group = f"{node}-v{v}-b{b}-p{huge}"
    elif kind == 1:
        group = f"{node}-v{v}-b{huge}-p{k}"
    elif kind == 2:
        group = rng.choice([f"inf-b-v{v}-b{b}-p{k}", f"{node}-v{int(v) + 1}-b{b}-p{k}", f"{node}-v{huge}-b{b}-p{k}"])
    elif kind == 3:  # this group answers another batch number: the node picks its problems
        group = f"{node}-v{v}-b{(int(b) + rng.randrange(1, 4)) % 4}-p{k}"
    elif kind == 4:  # a group grows past a step
        return encode_batch(rows + [r] * rng.randrange(1, 8))
    elif kind == 5:  # one long row among short ones
        n = rng.choice([40, 200, 1000])
        return encode_batch(_set(rows, i, completion_ids=(5,) * n, logprobs=(-1.0,) * n))
    else:
        group = rng.choice([f"{node}-v{v}-b{b}-p{k}-p0", f"{node}-v{v}-b-{b}-p{k}", f"{node}-v{v}-b{b}-p{k}\n"])
    try:
        return encode_batch([dataclasses.replace(x, group=group) if x.group == r.group else x for x in rows])
    except RolloutError:  # the encoder refuses what cannot travel
        return data


TARGETS: list[dict] = [
    {
        "name": "rollout.batch",
        "seeds": _batch_seeds,
        "decode": _decode_batch,
        "exact": False,
        "mutators": [_mutate_footer, _mutate_pages, _truncate_or_splice],
    },
    {
        "name": "rollout.manifest",
        "seeds": _manifest_seeds,
        "decode": _verify_manifest,
        "exact": True,
        "equal": _is_signed_manifest,
        "mutators": [_mutate_body, _mutate_envelope],
    },
    {
        "name": "rollout.rows",
        "seeds": _rows_seeds,
        "decode": _intake_rows,
        "exact": False,
        "mutators": [_mutate_rows, _mutate_rows, _mutate_footer],
    },
    {
        "name": "rollout.assignment",
        "seeds": _assignment_seeds,
        "decode": _answer,
        "exact": False,
        "mutators": [_mutate_group_ids, _mutate_group_ids, _mutate_rows],
    },
]
