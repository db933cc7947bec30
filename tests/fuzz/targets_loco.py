"""Fuzz targets for PULSELoCo's round documents and the trainer's state files (issue 12).

``loco.manifest``, ``loco.record``, ``loco.digest``, ``loco.state_ref``: the bytes of a signed
document through ``RoundStore._verify`` and its parser, exactly as a trainer reads them from the store (envelope,
signature under the right trainer's key and the run's context, body checks). Exact: whatever
verifies is the seed's document, so a mutant either fails typed or decodes to the same value.

``loco.<doc>.resigned``: hostile bodies (wrong types, huge or negative numbers, deep values, missing
or extra fields, other trainers and rounds) re-signed with a trusted key, some with the right
trainer's key and context and some not: what a compromised trainer key can write. Not exact; a
document that decodes must still satisfy the reader's promises (checked here).

``loco.trainer_state``, ``loco.global_state``: a trainer's local resume point (``torch.save``,
``weights_only``) and a global state (safetensors) through their loaders, against the model's
shapes. Not exact: neither file format carries a checksum (the resume point is written atomically
on the trainer's own disk; a global state from the store is checked against its signed SHA-256
before it is loaded), so a flipped value bit loads; anything that loads must have the model's
names, shapes and dtypes.

``loco.aggregate`` (issue 21): a set of payloads from peers (some hostile: values scaled by 1e30,
3e38, NaN, one huge entry, a duplicated payload, another round) through a round's screening and
apply path, as two trainers take it: the record writer (``t0``: decode, validate, ``NormScreen.
exclude``, quorum) and a reader following a hostile writer that screened nothing (``NormScreen.
refuse``, then ``apply_round``); and the outer step on every valid payload unscreened (a run whose
factors are set huge), which must apply finitely or be void. Typed rejections: a malformed or invalid set member
(PayloadError), no quorum or a refused record (RoundError). Whatever is applied must leave θ and
the momentum finite, a void step must leave them untouched bit for bit, an honest writer's set must
pass a reader that shares its reference, and no payload over ``weights_factor x ‖θ‖`` is averaged.
"""

from __future__ import annotations

import atexit
import copy
import functools
import hashlib
import json
import random
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from pulsenet.codec import payload as wire
from pulsenet.errors import PayloadError, RoundError
from pulsenet.loco import algorithm as alg
from pulsenet.loco.documents import (
    KIND_DIGEST,
    KIND_JOINING,
    KIND_MANIFEST,
    KIND_RECORD,
    KIND_STATE,
    Manifest,
    Record,
    RoundStore,
    StateRef,
)
from pulsenet.loco.layout import LocoLayout
from pulsenet.signed import ObjectRef
from pulsenet.signing import key_id, sign_document
from pulsenet.store.local import LocalStore

IDS = ("t0", "t1", "t2")
R = 3
LAYOUT = LocoLayout()
HOSTILE: list[Any] = [
    -1, 0, 1, 3, 2**31, 2**63, 10**30, -(10**30), 1.5, 1e308, True, False, None, "", "3", "t1", "T1",
    "x" * 5000, [], [3], [[[[]]]], {}, {"key": "k"}, "0" * 64, "ab" * 32, "\u202e", "a\u0000b",
]  # fmt: skip


@functools.cache
def _key(tid: str) -> Ed25519PrivateKey:
    return Ed25519PrivateKey.from_private_bytes(hashlib.sha256(f"pulsenet-fuzz:{tid}".encode()).digest())


@functools.cache
def _dir() -> Path:
    """The run's scratch, removed when the fuzzer exits (each run's names left ~60 MB in /tmp)."""
    path = Path(tempfile.mkdtemp(prefix="pulsenet-fuzz-loco-"))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


@functools.cache
def _rs(tid: str = "t2", run: str = "fuzz-run") -> RoundStore:
    keys = {t: _key(t).public_key() for t in IDS}
    return RoundStore(LocalStore(_dir() / "store"), tid, _key(tid), keys, run=run)


def _sha(i: int) -> str:
    return hashlib.sha256(str(i).encode()).hexdigest()


def _ref(tid: str, i: int) -> ObjectRef:
    return ObjectRef(LAYOUT.payload(tid, R, _sha(i)), 1000 + i, _sha(i))


# --- seeds: what the writers really write (RoundStore.sign over the bodies they build) ------------


def _manifest_seeds() -> list[bytes]:
    out = []
    for i, (mode, sent) in enumerate((("pulseloco", 17), ("diloco", 0), ("pulseloco", 0))):
        m = Manifest("t1", R, _ref("t1", i), mode, sent, 1 << 20, _sha(99))
        out.append(_rs("t1").sign({"kind": KIND_MANIFEST, **asdict(m)}))
    return out


def _record_body(rec: Record) -> dict[str, Any]:
    return {
        "kind": KIND_RECORD, "round": rec.round, "writer": rec.writer,
        "participants": {t: asdict(r) for t, r in rec.participants.items()},
        "rejected": dict(rec.rejected), "unavailable": dict(rec.unavailable), "base_digest": rec.base_digest,
    }  # fmt: skip


def _record_seeds() -> list[bytes]:
    recs = [
        Record(
            R,
            "t0",
            {"t0": _ref("t0", 0), "t1": _ref("t1", 1)},
            {"t2": "PayloadError: norm 1e9 > 10 x median"},
        ),
        Record(R, "t1", {t: _ref(t, k) for k, t in enumerate(IDS)}, base_digest=_sha(7)),
        Record(R, "t2", {"t2": _ref("t2", 5)}, unavailable={"t0": "StoreTimeout: ..."}, rejected={"t1": "x"}),
    ]
    return [_rs(rec.writer).sign(_record_body(rec)) for rec in recs]


def _digest_seeds() -> list[bytes]:
    return [
        _rs("t2").sign({"kind": KIND_DIGEST, "trainer": "t2", "round": R, "digest": _sha(i)})
        for i in range(2)
    ]


def _joining_seeds() -> list[bytes]:
    return [_rs("t1").sign({"kind": KIND_JOINING, "trainer": "t1", "round": R})]


def _state_seeds() -> list[bytes]:
    refs = [StateRef(R, ObjectRef(f"state/{R:08d}/{_sha(i)[:16]}.safetensors", 10**6 + i, _sha(i)), _sha(9), w)
            for i, w in enumerate(("t0", "t2"))]  # fmt: skip
    return [_rs(s.writer).sign({"kind": KIND_STATE, "round": s.round, "state": asdict(s.state), "digest": s.digest,
                                "writer": s.writer}) for s in refs]  # fmt: skip


# --- decoders (the reader is trainer t2 of run "fuzz-run"), with the reader's promises checked ------


def _manifest(data: bytes) -> Manifest:
    rs, key = _rs(), _rs().layout.manifest("t1", R)
    return rs._manifest(key, rs._verify(key, data, KIND_MANIFEST, signer="t1"), "t1", R)


def _record(data: bytes) -> Record:
    rs, key = _rs(), _rs().layout.record(R)
    return rs._record(key, rs._verify(key, data, KIND_RECORD, signer=None), R)


def _digest(data: bytes) -> str:
    rs, key = _rs(), _rs().layout.digest("t2", R)
    return rs._digest(key, rs._verify(key, data, KIND_DIGEST, signer="t2"), R)


def _joining(data: bytes) -> bool:
    rs, key = _rs(), _rs().layout.joining("t1", R)
    return rs._joining(key, rs._verify(key, data, KIND_JOINING, signer="t1"), R)


def _state_ref(data: bytes) -> StateRef:
    rs, key = _rs(), _rs().layout.state_manifest(R)
    return rs._state_ref(key, rs._verify(key, data, KIND_STATE, signer=None), R)


def _ref_ok(ref: ObjectRef, prefix: str) -> bool:
    return (
        type(ref.size) is int and ref.size >= 0 and isinstance(ref.key, str) and ref.key.startswith(prefix)
        and len(ref.sha256) == 64 and set(ref.sha256) <= set("0123456789abcdef")
    )  # fmt: skip


def _checked(decode: Callable[[bytes], Any], ok: Callable[[Any], bool]) -> Callable[[bytes], Any]:
    def run(data: bytes) -> Any:
        out = decode(data)
        if not ok(out):
            raise AssertionError(f"decoded to a value the reader must never return: {out!r}"[:500])
        return out

    run.__name__ = decode.__name__
    return run


def _manifest_ok(m: Manifest) -> bool:
    return (
        m.trainer == "t1"
        and m.round == R
        and _ref_ok(m.payload, LAYOUT.round_prefix("t1", R))
        and type(m.sent) is int
    )


def _record_ok(rec: Record) -> bool:
    return (
        rec.round == R and rec.writer in IDS and bool(rec.participants) and set(rec.participants) <= set(IDS)
        and all(_ref_ok(r, LAYOUT.round_prefix(t, R)) for t, r in rec.participants.items())
        and all(isinstance(v, str) for v in (*rec.rejected.values(), *rec.unavailable.values()))
    )  # fmt: skip


def _digest_ok(d: str) -> bool:
    return isinstance(d, str) and len(d) == 64


def _state_ok(s: StateRef) -> bool:
    return s.round == R and s.writer in IDS and _ref_ok(s.state, f"state/{R:08d}/")


# --- mutators -------------------------------------------------------------------------------------


def _envelope(data: bytes) -> dict[str, Any] | None:
    """The envelope of a (possibly already mutated) document, or None if it no longer is one."""
    try:
        env = json.loads(data)
    except (ValueError, RecursionError):
        return None
    return env if isinstance(env, dict) and isinstance(env.get("body"), dict) else None


def _dump(env: Any, rng: random.Random) -> bytes:
    try:
        if rng.random() < 0.5:
            return json.dumps(env, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
        return json.dumps(env, indent=rng.choice((None, 1)), ensure_ascii=rng.random() < 0.5).encode()
    except (ValueError, RecursionError):  # lone surrogates (UTF-8), deep values: the escaped spelling
        return json.dumps(env, ensure_ascii=True).encode()


def _paths(obj: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix]
    if len(prefix) > 40:  # a deep value planted by an earlier mutation: its top is enough
        return out
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out += _paths(v, (*prefix, i))
    return out


def _set(obj: Any, path: tuple, value: Any) -> Any:
    if not path:
        return value
    parent = obj
    for p in path[:-1]:
        parent = parent[p]
    parent[path[-1]] = value
    return obj


def _hostile_value(rng: random.Random) -> Any:
    return copy.deepcopy(_hostile(rng))  # never share a list or dict between places (cycles)


def _hostile(rng: random.Random) -> Any:
    r = rng.random()
    if r < 0.1:
        deep: Any = 0
        for _ in range(rng.choice((31, 33, 200))):
            deep = [deep]
        return deep
    if r < 0.15:
        return {t: rng.choice(HOSTILE) for t in rng.sample(IDS, rng.randint(0, 3))}
    return rng.choice(HOSTILE)


def _mutate_body(body: dict[str, Any], rng: random.Random) -> dict[str, Any]:
    for _ in range(rng.choice((1, 1, 2, 3))):
        paths = _paths(body)[1:]
        op = rng.random()
        if op < 0.6 and paths:
            body = _set(body, rng.choice(paths), _hostile_value(rng))
        elif op < 0.8 and paths:
            path = rng.choice(paths)
            parent = body
            for p in path[:-1]:
                parent = parent[p]
            del parent[path[-1]]
        else:
            body[rng.choice(("extra", "trainer", "writer", "round", "run", "kind"))] = _hostile_value(rng)
    return body


def env_swap(data: bytes, rng: random.Random) -> bytes:
    """Keep the signature, change what it is claimed to cover: context, key id, body, signature."""
    env = _envelope(data)
    if env is None:
        return data
    field = rng.choice(("context", "key_id", "sig", "body", "body"))
    if field == "context":
        env["context"] = rng.choice((_rs(run="other-run").context, "pulseloco", f"{env.get('context')}/", ""))
    elif field == "key_id":
        env["key_id"] = key_id(_key(rng.choice(IDS)).public_key())
    elif field == "sig":
        sig = str(env.get("sig"))
        env["sig"] = rng.choice(("", "AA==", "!!!", sig[::-1], sig[:-4], None, 5))
    else:
        env["body"] = _mutate_body(env["body"], rng)
    return _dump(env, rng)


def env_reformat(data: bytes, rng: random.Random) -> bytes:
    """Same envelope, other JSON spelling (whitespace, escapes, key order): must verify the same."""
    env = _envelope(data)
    return data if env is None else _dump(env, rng)


def env_hostile_json(data: bytes, rng: random.Random) -> bytes:
    """Splice JSON a parser must not choke on: NaN, huge ints, lone surrogates, deep nesting, dup keys."""
    text = data.decode(errors="replace")
    i = text.index('"body":{') + len('"body":{') if '"body":{' in text else 1
    bad = rng.choice((
        '"round":NaN,', '"round":Infinity,', f'"round":{"9" * 5000},', '"trainer":"\\ud800",',
        '"x":' + "[" * 5000 + "]" * 5000 + ",", '"round":1,"round":3,', '"round":3e0,', '"round":-0,',
    ))  # fmt: skip
    return (text[:i] + bad + text[i:]).encode()


def _resign(data: bytes, rng: random.Random) -> bytes:
    """A hostile body signed with a trusted key: the right trainer's and context mostly, else not."""
    env = _envelope(data)
    if env is None:
        return data
    body = _mutate_body(env["body"], rng) if rng.random() < 0.9 else env["body"]
    r = rng.random()
    if r < 0.7:
        signer = env["body"].get("trainer") or env["body"].get("writer") or "t0"
        signer = signer if signer in IDS else "t0"
        context = _rs().context
    elif r < 0.9:
        signer, context = rng.choice(IDS), _rs().context
    else:
        signer, context = rng.choice(IDS), _rs(run="other-run").context
    try:
        return sign_document(body, _key(signer), context=context)
    except (ValueError, RecursionError):  # a body the signer cannot encode (ManifestError): keep the bytes
        return data


RESIGN = [_resign, _resign, env_hostile_json]
ENVELOPE = [env_swap, env_reformat, env_hostile_json]


# --- state files ------------------------------------------------------------------------------------

SHAPES = {"w": (3, 4), "b": (4,)}


def _tensors(seed: int) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(*s, generator=g) for n, s in SHAPES.items()}


def _trainer_state_seeds() -> list[bytes]:
    from pulsenet.loco.state import GlobalState, TrainerState

    out = []
    for k, error in enumerate((True, False)):
        g = GlobalState(5 + k, _tensors(k), _tensors(10 + k))
        inner = {"optimizer": {"state": {}, "param_groups": [{"lr": 1e-3, "params": [0, 1]}]},
                 "rng": {"python": (3, (1, 2, 3), None)}, "steps": 40}  # fmt: skip
        path = _dir() / f"seed-{k}.pt"
        TrainerState(g, _tensors(20) if error else None, inner).save(path)
        out.append(path.read_bytes())
    return out


def _trainer_state(data: bytes) -> Any:
    from pulsenet.loco.state import TrainerState

    path = _dir() / "case.pt"
    path.write_bytes(data)
    ts = TrainerState.load(path, SHAPES)
    for d in (ts.global_.theta, ts.global_.momentum, ts.error or ts.global_.theta):
        if {n: tuple(t.shape) for n, t in d.items()} != SHAPES:
            raise AssertionError("loaded a trainer state that does not match the model")
    return ts


def _global_state_seeds() -> list[bytes]:
    from pulsenet.loco.state import GlobalState

    out = []
    for k in range(2):
        path = _dir() / f"g-{k}.safetensors"
        GlobalState(k, _tensors(k), _tensors(5 + k)).save(path)
        out.append(path.read_bytes())
    return out


def _global_state(data: bytes) -> Any:
    from pulsenet.loco.state import GlobalState

    path = _dir() / "case.safetensors"
    path.write_bytes(data)
    g = GlobalState.load(path, SHAPES)
    if g.shapes() != SHAPES or type(g.round) is not int:
        raise AssertionError("loaded a global state that does not match the model")
    return g


def _zip_member_flip(data: bytes, rng: random.Random) -> bytes:
    """Flip bytes in the pickle member of a torch zip (where structure, not values, lives)."""
    i = data.find(b"data.pkl")
    if i < 0:
        return data
    j = min(len(data) - 1, i + 30 + rng.randrange(400))
    b = bytearray(data)
    b[j] ^= 1 << rng.randrange(8)
    return bytes(b)


def _safetensors_header(data: bytes, rng: random.Random) -> bytes:
    """Rewrite the JSON header of a safetensors file with hostile offsets, dtypes and shapes."""
    n = int.from_bytes(data[:8], "little")
    try:
        header = json.loads(data[8 : 8 + n])
    except ValueError:
        return data
    names = [k for k in header if k != "__metadata__"]
    if names:
        t = header[rng.choice(names)]
        what = rng.choice(("dtype", "shape", "data_offsets", "meta"))
        if what == "dtype":
            t["dtype"] = rng.choice(("F16", "BF16", "I64", "F64", "X"))
        elif what == "shape":
            t["shape"] = rng.choice(([], [2**40], [-1], [3, 4, 1], [0]))
        elif what == "data_offsets":
            t["data_offsets"] = rng.choice(([0, 2**40], [5, 1], [0, 0], [-1, 4]))
        else:
            header["__metadata__"] = rng.choice(({"format": "x"}, {"round": "-1"}, {"round": "9" * 50}, {}))
    raw = json.dumps(header).encode()
    return len(raw).to_bytes(8, "little") + raw + data[8 + n :]


def _any_seed(seeds: Callable[[], list[bytes]], decode: Callable[[bytes], Any]) -> Callable[[Any, Any], bool]:
    """Exact, modulo whose signature: a splice of two seeds can verify as the second one (a JSON
    object with a repeated key means its last value), so the output may be any seed's."""
    outputs = functools.cache(lambda: [decode(s) for s in seeds()])
    return lambda out, expected: out == expected or out in outputs()


TARGETS: list[dict] = []
for _name, _seeds, _decode, _ok in (
    ("loco.manifest", _manifest_seeds, _manifest, _manifest_ok),
    ("loco.record", _record_seeds, _record, _record_ok),
    ("loco.digest", _digest_seeds, _digest, _digest_ok),
    ("loco.state_ref", _state_seeds, _state_ref, _state_ok),
    ("loco.joining", _joining_seeds, _joining, lambda joined: joined is True),
):
    TARGETS.append(
        {"name": _name, "seeds": _seeds, "decode": _decode, "exact": True, "equal": _any_seed(_seeds, _decode),
         "mutators": ENVELOPE}
    )  # fmt: skip
    TARGETS.append(
        {"name": f"{_name}.resigned", "seeds": _seeds, "decode": _checked(_decode, _ok), "mutators": RESIGN}
    )
TARGETS += [
    {"name": "loco.trainer_state", "seeds": _trainer_state_seeds, "decode": _trainer_state,
     "mutators": [_zip_member_flip]},
    {"name": "loco.global_state", "seeds": _global_state_seeds, "decode": _global_state,
     "mutators": [_safetensors_header]},
]  # fmt: skip


# --- aggregation: hostile payload sets through the screen and the outer step (issue 21) ------------

AGG_MAGIC = b"PNAG"
AGG_SHAPES = {"b": (17,), "e": (4, 4), "w": (32, 20)}
AGG_SCREEN = alg.NormScreen(factor=10.0, weights_factor=1.0, min_payloads=3)
AGG_QUORUM = 1


@functools.cache
def _agg_state() -> tuple[dict[str, Any], dict[str, Any]]:
    import numpy as np
    import torch

    rng = np.random.default_rng(31)
    theta = {n: torch.from_numpy((rng.standard_normal(s) * 0.05).astype(np.float32)) for n, s in AGG_SHAPES.items()}
    momentum = {n: torch.from_numpy((rng.standard_normal(s) * 1e-3).astype(np.float32)) for n, s in AGG_SHAPES.items()}
    return theta, momentum


def _agg_pack(payloads: list[bytes]) -> bytes:
    return AGG_MAGIC + bytes([len(payloads)]) + b"".join(len(p).to_bytes(4, "little") + p for p in payloads)


def _agg_unpack(data: bytes) -> list[bytes]:
    if data[:4] != AGG_MAGIC or len(data) < 5:
        raise PayloadError("not a payload set")
    out, i = [], 5
    for _ in range(data[4]):
        n = int.from_bytes(data[i : i + 4], "little")
        if i + 4 + n > len(data) or n == 0:
            raise PayloadError("payload set truncated")
        out.append(data[i + 4 : i + 4 + n])
        i += 4 + n
    if i != len(data) or not 1 <= len(out) <= 8:
        raise PayloadError("payload set: trailing bytes or a bad count")
    return out


def _agg_seeds() -> list[bytes]:
    import numpy as np
    import torch

    theta, _ = _agg_state()
    rng = np.random.default_rng(32)
    honest = []
    for k in range(4):
        local = {n: t + torch.from_numpy((rng.standard_normal(t.shape) * 4e-3 * (1 + k)).astype(np.float32)) * t.abs()
                 for n, t in theta.items()}  # fmt: skip
        p, _ = alg.make_update(theta, local, None, round=R, sparse=True)
        honest.append(wire.encode(p, theta, threads=1))
    return [_agg_pack(honest[:1]), _agg_pack(honest[:2]), _agg_pack(honest[:3]), _agg_pack(honest)]


def _agg_decode(data: bytes) -> tuple[str, ...]:
    """The writer's and a reader's path over one payload set; returns what happened (not exact)."""
    theta, momentum = _agg_state()
    ids = [f"t{k}" for k in range(8)]
    norms, payloads = {}, {}
    for tid, blob in zip(ids, _agg_unpack(data), strict=False):
        try:
            p = wire.decode(blob, AGG_SHAPES, theta)
            norms[tid] = alg.validate(p, round=R, mode=wire.SPARSE)
            payloads[tid] = p
        except PayloadError:
            continue  # the writer records it as rejected
    # Screens or not (a run configured with huge factors), the outer step never leaves θ or m
    # non-finite: it applies, or it is void and changes nothing.
    outcomes = [_agg_apply(payloads, theta, momentum) if payloads else "none valid"]
    wn = alg.weights_norm(theta)
    excluded = AGG_SCREEN.exclude(norms, own="t0", weights_norm=wn)
    honest = {t: n for t, n in norms.items() if t not in excluded}
    if len(honest) < AGG_QUORUM:
        raise RoundError("no quorum of valid payloads")
    # An honest writer's set passes a reader that judged against the same reference.
    if refused := AGG_SCREEN.refuse(honest, own=honest.get("t0"), weights_norm=wn):
        raise AssertionError(f"the writer's own set fails the reader's check: {refused}")
    outcomes.append(_agg_apply({t: payloads[t] for t in honest}, theta, momentum))
    # A hostile writer that screened nothing: the reader (t1, if valid) must refuse or apply sanely.
    if refused := AGG_SCREEN.refuse(norms, own=norms.get("t1"), weights_norm=wn):
        raise RoundError(f"the reader refuses the record: {sorted(refused)}")
    if any(n > AGG_SCREEN.weights_factor * wn * AGG_SCREEN.slack for n in norms.values()):
        raise AssertionError("the reader follows a record averaging a payload over the weights' scale")
    outcomes.append(_agg_apply(payloads, theta, momentum))
    return tuple(outcomes)


def _agg_apply(payloads: dict[str, Any], theta: dict[str, Any], momentum: dict[str, Any]) -> str:
    import numpy as np

    th = {n: t.clone() for n, t in theta.items()}
    m = {n: t.clone() for n, t in momentum.items()}
    void = alg.apply_round(th, m, payloads, lr=0.7, mu=0.9)
    if void is not None:
        if alg.global_digest(th, m) != alg.global_digest(theta, momentum):
            raise AssertionError(f"a void step changed the state: {void}")
        return "void"
    if not all(np.isfinite(t.numpy()).all() for t in (*th.values(), *m.values())):
        raise AssertionError("applied a non-finite state")
    return "applied"


def _agg_rewrite(data: bytes, rng: random.Random, change: Callable[[Any, random.Random], Any]) -> bytes:
    """Decode one member of the set (raw or relative), ``change`` its payload, re-encode as raw FP32 bits."""
    try:
        members = _agg_unpack(data)
        k = rng.randrange(len(members))
        p = wire.decode(members[k], AGG_SHAPES, _agg_state()[0])
    except PayloadError:
        return data
    members[k] = wire.encode(change(p, rng), threads=1)
    return _agg_pack(members)


HOSTILE_SCALES = (1e30, -1e30, 3e38, -3e38, 1e6, 11.0, 101.0, 0.0, -0.0, 1e-45, float("inf"), float("nan"))


def _scale_all(p: Any, rng: random.Random) -> Any:
    import numpy as np

    f = rng.choice(HOSTILE_SCALES)
    with np.errstate(all="ignore"):
        ts = {n: wire.SparseTensor(t.shape, t.indices, (t.values.astype(np.float64) * f).astype(np.float32))
              for n, t in p.tensors.items()}  # fmt: skip
    return wire.Payload(p.round, p.mode, ts)


def _one_entry(p: Any, rng: random.Random) -> Any:
    import numpy as np

    ts = {n: wire.SparseTensor(t.shape, t.indices, t.values.copy()) for n, t in p.tensors.items()}
    hit = [t for t in ts.values() if t.values.size]
    if hit:
        t = rng.choice(hit)
        t.values[rng.randrange(t.values.size)] = np.float32(rng.choice((3.4e38, -3.4e38, 1e20, float("nan"))))
    return wire.Payload(p.round, p.mode, ts)


def _other_round(p: Any, rng: random.Random) -> Any:
    return wire.Payload(rng.choice((R - 1, R + 1, 0)), p.mode, p.tensors)


def agg_scale(data: bytes, rng: random.Random) -> bytes:
    """One member's values times a hostile factor (1e30, 3e38, inf, NaN, 0, 11, 101, ...)."""
    return _agg_rewrite(data, rng, _scale_all)


def agg_entry(data: bytes, rng: random.Random) -> bytes:
    """One value of one member set to the float32 extreme, 1e20 or NaN."""
    return _agg_rewrite(data, rng, _one_entry)


def agg_round(data: bytes, rng: random.Random) -> bytes:
    """One member claims another round."""
    return _agg_rewrite(data, rng, _other_round)


def agg_members(data: bytes, rng: random.Random) -> bytes:
    """Duplicate (a Sybil sending the same payload twice), drop or reorder members."""
    try:
        members = _agg_unpack(data)
    except PayloadError:
        return data
    op = rng.random()
    if op < 0.4 and len(members) < 8:
        members.insert(rng.randrange(len(members) + 1), rng.choice(members))
    elif op < 0.7 and len(members) > 1:
        del members[rng.randrange(len(members))]
    else:
        rng.shuffle(members)
    return _agg_pack(members)


TARGETS.append(
    {"name": "loco.aggregate", "seeds": _agg_seeds, "decode": _agg_decode,
     "mutators": [agg_scale, agg_scale, agg_scale, agg_entry, agg_round, agg_members, agg_members]}
)  # fmt: skip


# --- issue 29: planted round names, oversized payload claims, digest lies ---------------------------
#
# ``loco.head``: a store's ``rounds/`` holding real records and planted names (junk bytes, foreign
# or hostile documents, rounds far past the run's) through ``RoundStore.latest_record_round``, the
# catch-up target: it must name a record that verifies (or the round already known), never a
# planted one, and every round up to it must be listed. ``loco.payload_claim``: a manifest signed
# by t1, its payload's size a hostile claim, through ``Collector._fetch``: the store is never asked
# for more than the model's largest valid payload. ``loco.digest_votes``: the participants'
# digests of a round (some lying), less the trainers left out of the vote, through ``judge``: a
# strict majority is the only agreement, and a liar cannot outvote the honest majority.

import asyncio  # noqa: E402
import contextlib  # noqa: E402
import logging  # noqa: E402
from collections.abc import Iterator  # noqa: E402

from pulsenet.errors import ManifestError  # noqa: E402
from pulsenet.loco import recovery  # noqa: E402
from pulsenet.loco.collect import Collector  # noqa: E402
from pulsenet.loco.config import LocoConfig  # noqa: E402
from pulsenet.loco.layout import MAX_ROUND  # noqa: E402
from pulsenet.signed import is_sha256  # noqa: E402

HEAD_ROUNDS = 4
JUNK_DOCS = [b"", b"{}", b"x" * 100, b'{"body": {"kind": "pulseloco-round"}, "key_id": "00", "sig": "AA=="}']


def _case(data: bytes) -> dict[str, Any]:
    """A fuzz case's JSON object; a ManifestError (typed) if it no longer is one."""
    try:
        case = json.loads(data)
    except (ValueError, RecursionError) as e:
        raise ManifestError(f"not a case: {str(e)[:80]}") from None
    if not isinstance(case, dict):
        raise ManifestError("not a case: not an object")
    return case


def _head_record(r: int, writer: str, run: str = "fuzz-run") -> bytes:
    refs = {t: ObjectRef(LAYOUT.payload(t, r, _sha(r)), 100, _sha(r)) for t in ("t0", "t1")}
    return _head_rs(writer, run).sign(_record_body(Record(r, writer, refs)))


def _head_seeds() -> list[bytes]:
    records = {str(r): _head_record(r, IDS[r % 2]).decode() for r in range(1, HEAD_ROUNDS + 1)}
    return [json.dumps({"records": records}).encode(), json.dumps({"records": dict(list(records.items())[:2])}).encode()]


@functools.cache
def _head_rs(tid: str = "t2", run: str = "fuzz-run") -> RoundStore:
    """Trainer ``tid`` of ``run`` on the store ``loco.head`` plants its cases in."""
    keys = {t: _key(t).public_key() for t in IDS}
    return RoundStore(LocalStore(_dir() / "head"), tid, _key(tid), keys, run=run)


@contextlib.contextmanager
def _quiet(name: str) -> Iterator[None]:
    """The reader's warnings about what it ignores, off for a fuzz case (restored after)."""
    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _head(data: bytes) -> tuple[int, int]:
    case = _case(data)
    records = case.get("records")
    if not isinstance(records, dict) or not all(
        isinstance(k, str) and k.isdigit() and 0 < int(k) <= MAX_ROUND and isinstance(v, str) for k, v in records.items()
    ):
        raise ManifestError("not a case: records must map round numbers to documents")
    rs = _head_rs()
    shutil.rmtree(_dir() / "head", ignore_errors=True)

    async def run() -> tuple[int, int, bool]:
        for k, doc in records.items():
            await rs.store.put(LAYOUT.record(int(k)), doc.encode("utf-8", "surrogatepass"), timeout=10)
        head, ignored = await rs.latest_record_round(known=0)
        ok = head == 0
        if head:
            try:
                ok = await rs.read_record(head) is not None
            except ManifestError:
                ok = False
        return head, ignored, ok

    with _quiet("pulsenet.loco"):
        head, ignored, verifies = asyncio.run(run())
    if not verifies or not all(str(r) in records for r in range(1, head + 1)) or not 0 <= ignored <= len(records):
        raise AssertionError(f"catch-up aimed at round {head}, which no verified record backs ({ignored} ignored)")
    return head, ignored


def _plant_name(data: bytes, rng: random.Random) -> bytes:
    """A planted name: junk or a hostile document, at the next round, inside, or far past the run."""
    try:
        case = _case(data)
    except ManifestError:
        return data
    records = case.get("records") if isinstance(case.get("records"), dict) else {}
    top = max((int(k) for k in records if isinstance(k, str) and k.isdigit()), default=0)
    r = rng.choice((top + 1, top + 2, rng.randint(1, max(top, 1)), 99_999_999, MAX_ROUND, rng.randint(1, 10**6)))
    r = min(max(r, 1), MAX_ROUND)
    pick = rng.random()
    if pick < 0.4:
        doc = rng.choice(JUNK_DOCS).decode()
    elif pick < 0.7:  # a trusted key's hostile record (a compromised trainer): for another round
        doc = _head_record(rng.randint(1, HEAD_ROUNDS + 3), rng.choice(IDS)).decode()
    elif pick < 0.85:  # another run's record of this round
        doc = _head_record(r, "t0", run="other-run").decode()
    else:  # a valid record of this round by a trusted key: a claim it may make
        doc = _head_record(r, rng.choice(IDS)).decode()
    records[str(r)] = doc
    case["records"] = records
    return json.dumps(case).encode()


def _drop_name(data: bytes, rng: random.Random) -> bytes:
    try:
        case = _case(data)
    except ManifestError:
        return data
    records = case.get("records")
    if isinstance(records, dict) and records:
        del records[rng.choice(sorted(records))]
    return json.dumps(case).encode()


CLAIM_SHAPES = {"b": (17,), "w": (32, 20)}
CLAIM_OBJECTS = {i: bytes([i]) * (100 + 900 * i) for i in range(3)}
"""Objects at t1's round-R payload keys: the seeds name them exactly."""
CLAIM_BIG = bytes(1 << 20)
"""A real 1 MiB object under t1's prefix, far over the model's largest valid payload."""


def _claim_ref(data: bytes) -> ObjectRef:
    sha = hashlib.sha256(data).hexdigest()
    return ObjectRef(LAYOUT.payload("t1", R, sha), len(data), sha)


@functools.cache
def _claim_collector() -> tuple[Collector, dict[str, int | None]]:
    keys = {t: _key(t).public_key() for t in IDS}
    store = LocalStore(_dir() / "claim")
    rs = RoundStore(store, "t2", _key("t2"), keys, run="fuzz-run")
    asked: dict[str, int | None] = {}
    real = store.get

    async def get(key: str, **kw: Any) -> bytes:
        asked[key] = kw.get("max_bytes")
        return await real(key, **kw)

    async def plant() -> None:
        for obj in (*CLAIM_OBJECTS.values(), CLAIM_BIG):
            await store.put(_claim_ref(obj).key, obj, timeout=10)

    asyncio.run(plant())
    store.get = get  # type: ignore[method-assign]
    return Collector(rs, LocoConfig(workers_expected=3), CLAIM_SHAPES), asked


def _claim_seeds() -> list[bytes]:
    out = []
    for obj in CLAIM_OBJECTS.values():
        m = Manifest("t1", R, _claim_ref(obj), "pulseloco", 17, 657, _sha(99))
        out.append(_rs("t1").sign({"kind": KIND_MANIFEST, **asdict(m)}))
    return out


def _claim(data: bytes) -> str:
    manifest = _manifest(data)
    collector, asked = _claim_collector()
    asked.clear()
    try:
        got = asyncio.run(collector._fetch(manifest.payload))
    finally:
        over = {k: n for k, n in asked.items() if n is None or n > collector.max_payload}
        if over:
            raise AssertionError(f"asked the store for more than the largest valid payload: {over}")
    return hashlib.sha256(got).hexdigest()


def _claim_size(data: bytes, rng: random.Random) -> bytes:
    """t1 signs a manifest whose payload size (and object) is its own hostile claim."""
    env = _envelope(data)
    if env is None:
        return data
    body = env["body"]
    ref = body.get("payload") if isinstance(body.get("payload"), dict) else {}
    if rng.random() < 0.3:
        ref.update(_claim_ref(CLAIM_BIG).to_json())  # a real object, truly that large
    else:
        ref["size"] = rng.choice((0, 1, 4095, 512 << 20, 2**31, 2**62, 10**12, rng.randrange(1 << 40)))
    body["payload"] = ref
    try:
        return _rs("t1").sign(body)
    except (ValueError, RecursionError):
        return data


def _vote_seeds() -> list[bytes]:
    d = [_sha(i) for i in range(3)]
    cases = [
        {"own": "t0", "digests": {"t0": d[0], "t1": d[0]}, "distrusted": []},
        {"own": "t0", "digests": {"t0": d[0], "t1": d[1]}, "distrusted": []},  # two trainers, one lying
        {"own": "t0", "digests": {"t0": d[0], "t1": d[1]}, "distrusted": ["t1"]},
        {"own": "t1", "digests": {"t0": d[0], "t1": d[0], "t2": d[2]}, "distrusted": []},
        {"own": "t2", "digests": {"t0": d[0], "t1": d[1], "t2": d[2]}, "distrusted": ["t0"]},
    ]
    return [json.dumps(c).encode() for c in cases]


def _votes(data: bytes) -> tuple[str | None, bool, tuple[str, ...]]:
    """What ``recovery.settle`` judges: the digests heard less the distrusted (never ourselves)."""
    case = _case(data)
    own, digests, distrusted = case.get("own"), case.get("digests"), case.get("distrusted")
    if (
        not isinstance(digests, dict) or own not in IDS or own not in digests or not isinstance(distrusted, list)
        or not set(digests) <= set(IDS) or not all(is_sha256(v) for v in digests.values())
    ):  # fmt: skip
        raise ManifestError("not a case: digests must be trainer -> SHA-256, ours included")
    counted = {t: v for t, v in digests.items() if t == own or t not in distrusted}
    v = recovery.judge(counted, own)
    votes = sum(d == v.agreed for d in counted.values())
    honest = sum(d == counted[own] for d in counted.values())
    if (
        (v.agreed is not None and 2 * votes <= len(counted))
        or v.ours_agreed != (v.agreed == counted[own])
        or (2 * honest > len(counted)) != v.ours_agreed  # a liar never outvotes a strict majority
        or v.unanimous != (len(set(counted.values())) == 1)
        or (v.ours_agreed and list(v.odd) != sorted(t for t, d in counted.items() if d != counted[own]))
    ):
        raise AssertionError(f"judge broke its promise: {counted} -> {v}")
    return v.agreed, v.ours_agreed, tuple(v.odd)


def _lie(data: bytes, rng: random.Random) -> bytes:
    """A trainer publishes another digest, joins the vote, or is left out of it."""
    try:
        case = _case(data)
    except ManifestError:
        return data
    digests = case.get("digests") if isinstance(case.get("digests"), dict) else {}
    tid = rng.choice(IDS)
    op = rng.random()
    if op < 0.6:
        digests[tid] = rng.choice((_sha(rng.randrange(4)), "0" * 64, "x", None))
    elif op < 0.8 and isinstance(case.get("distrusted"), list):
        case["distrusted"].append(tid)
    else:
        case["own"] = tid
    case["digests"] = digests
    return json.dumps(case).encode()


TARGETS += [
    {"name": "loco.head", "seeds": _head_seeds, "decode": _head, "mutators": [_plant_name, _plant_name, _drop_name]},
    {"name": "loco.payload_claim", "seeds": _claim_seeds, "decode": _claim, "mutators": [_claim_size, _resign]},
    {"name": "loco.digest_votes", "seeds": _vote_seeds, "decode": _votes, "mutators": [_lie, _lie]},
]
