"""Rollout rows: one completion as an inference node served it, the unit GRPO trains on.

The wire format of a batch of rows is Parquet (pyarrow, zstd), one row per completion (spec in
docs/format.md, "Rollout batch")::

    group: string   prompt_ids: list<int32>   completion_ids: list<int32>   logprobs: list<float32>
    reward: double  version: int64            model_digest: string         node: string   seed: int64

with ``pulsenet.format = "pulsenet-rollouts"`` and ``pulsenet.schema = "1"`` in the file's
key-value metadata. Logprobs travel as float32 (what engines compute); rewards as float64.

``decode_columns`` treats its bytes as hostile: the footer's row count and uncompressed sizes are
checked against the caller's limits before any column is read (``parquet_footer.py`` reads the
footer and page headers with its own bounded Thrift walk), then the schema, nulls, lengths,
ranges and finiteness, and that every row names the same version, digest and node (a batch is one
node's sampling at one version); anything wrong is a ``RolloutError``, never another exception.
It returns the batch as arrays (:class:`RolloutColumns`, ~8 bytes of memory per token), which is
what a trainer queues; ``decode_batch`` returns the same rows as ``Rollout`` objects. No I/O here.
"""

from __future__ import annotations

import io
import math
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pulsenet.codec.parquet_footer import check_chunk, column_leaves, read_footer
from pulsenet.errors import RolloutError

FORMAT = "pulsenet-rollouts"
SCHEMA = 1
FORMAT_KEY = b"pulsenet.format"
SCHEMA_KEY = b"pulsenet.schema"
ZSTD_LEVEL = 3
MAX_ROWS = 1 << 16
"""Default row limit of one decoded batch."""
MAX_TOKENS = 1 << 25
"""Default limit on prompt plus completion tokens of one decoded batch (32 Mi, ~400 MB decoded)."""
MAX_GROUP_CHARS = 256
MAX_TOKEN_ID = (1 << 31) - 1
_GROUP_STR_BYTES = sys.getsizeof("\U0001f600" * MAX_GROUP_CHARS)
_NODE = re.compile(r"[A-Za-z0-9._-]{1,64}")
_HEX64 = re.compile(r"[0-9a-f]{64}")
_INT64 = (-(1 << 63), (1 << 63) - 1)
_MAX_ROW_GROUPS = 1024
_THRIFT_STRING_LIMIT = 1 << 20
_THRIFT_CONTAINER_LIMIT = 1 << 16

_ARROW_SCHEMA = pa.schema(
    [
        pa.field("group", pa.string(), nullable=False),
        pa.field("prompt_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("completion_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("logprobs", pa.list_(pa.float32()), nullable=False),
        pa.field("reward", pa.float64(), nullable=False),
        pa.field("version", pa.int64(), nullable=False),
        pa.field("model_digest", pa.string(), nullable=False),
        pa.field("node", pa.string(), nullable=False),
        pa.field("seed", pa.int64(), nullable=False),
    ],
    metadata={FORMAT_KEY: FORMAT.encode(), SCHEMA_KEY: str(SCHEMA).encode()},
)
COLUMNS = tuple(_ARROW_SCHEMA.names)
_LISTS = ("prompt_ids", "completion_ids", "logprobs")
_STRINGS = {"group": MAX_GROUP_CHARS, "model_digest": 64, "node": 64}


@dataclass(frozen=True, slots=True, kw_only=True)
class Rollout:
    """One sampled completion with what the trainer needs to weigh it."""

    group: str
    """Id of its group: the G completions sampled for one prompt share it (and ``prompt_ids``)."""
    prompt_ids: tuple[int, ...]
    completion_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    """The engine's log-probability of each completion token at sampling time (same length)."""
    reward: float
    version: int
    """Policy version whose weights produced it."""
    model_digest: str
    """Model digest (codec/digest.py) of the weights that served it."""
    node: str
    """Id of the inference node that sampled it."""
    seed: int
    """Sampling seed: with the version and the prompt it makes the draw reproducible."""


def check_row(r: Rollout) -> None:
    """RolloutError if a row cannot travel exactly (the decoder's rules, applied at the source)."""
    if not isinstance(r, Rollout):
        raise RolloutError(f"rollout rows must be Rollout, got {type(r).__name__}")
    where = f"rollout row (group {r.group!r}, node {r.node!r})"
    if not isinstance(r.group, str) or not 0 < len(r.group) <= MAX_GROUP_CHARS:
        raise RolloutError(f"{where}: group must be a str of 1..{MAX_GROUP_CHARS} characters")
    if not isinstance(r.node, str) or not _NODE.fullmatch(r.node):
        raise RolloutError(f"{where}: node must match {_NODE.pattern}")
    if not isinstance(r.model_digest, str) or not _HEX64.fullmatch(r.model_digest):
        raise RolloutError(f"{where}: model_digest must be 64 lowercase hex digits")
    for name in ("version", "seed"):
        v = getattr(r, name)
        lo = 0 if name == "version" else _INT64[0]
        if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= _INT64[1]:
            raise RolloutError(f"{where}: {name} {v!r} is not an int in {lo}..{_INT64[1]}")
    for name in ("prompt_ids", "completion_ids"):
        ids = getattr(r, name)
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= MAX_TOKEN_ID for t in ids):
            raise RolloutError(f"{where}: {name} must be ints in 0..{MAX_TOKEN_ID}")
    if len(r.logprobs) != len(r.completion_ids):
        raise RolloutError(
            f"{where}: {len(r.logprobs)} logprobs for {len(r.completion_ids)} completion tokens"
        )
    if not all(isinstance(x, float | int) and math.isfinite(x) for x in r.logprobs):
        raise RolloutError(f"{where}: logprobs must be finite numbers")
    if not isinstance(r.reward, float | int) or isinstance(r.reward, bool) or not math.isfinite(r.reward):
        raise RolloutError(f"{where}: reward {r.reward!r} must be a finite number")


@dataclass(frozen=True, slots=True, eq=False)
class RolloutColumns:
    """A decoded batch as arrays: one per column, list columns as flat values plus row offsets.

    Why: a trainer queues batches for seconds to minutes, and as ``Rollout`` objects (a tuple of
    Python ints and floats per row) a queued token costs ~65 bytes; here it costs 4 (prompt) or 8
    (completion: id and logprob) plus ~36 bytes per row. Rows are made only for what a step takes.
    Every row of a batch shares ``version``, ``model_digest`` and ``node`` (the decoder checks it).
    """

    version: int
    model_digest: str
    node: str
    groups: tuple[str, ...]
    """Distinct group ids, in order of first appearance."""
    group: np.ndarray
    """int32 ``[rows]``: each row's index into ``groups``."""
    prompt_offsets: np.ndarray
    """int64 ``[rows + 1]``: row ``i``'s prompt is ``prompt_ids[prompt_offsets[i]:prompt_offsets[i+1]]``."""
    prompt_ids: np.ndarray
    """int32, every row's prompt tokens back to back."""
    completion_offsets: np.ndarray
    """int64 ``[rows + 1]``, the same for ``completion_ids`` and ``logprobs``."""
    completion_ids: np.ndarray
    """int32."""
    logprobs: np.ndarray
    """float32, one per completion token."""
    reward: np.ndarray
    """float64 ``[rows]``."""
    seed: np.ndarray
    """int64 ``[rows]``."""

    def __len__(self) -> int:
        return len(self.reward)

    @property
    def prompt_lengths(self) -> np.ndarray:
        return np.diff(self.prompt_offsets)

    @property
    def completion_lengths(self) -> np.ndarray:
        return np.diff(self.completion_offsets)

    @property
    def tokens(self) -> int:
        """Prompt plus completion tokens over all rows (what a manifest's ``tokens`` counts)."""
        return len(self.prompt_ids) + len(self.completion_ids)

    @property
    def nbytes(self) -> int:
        """Memory held: the arrays' bytes plus the group id strings."""
        arrays = (
            self.group, self.prompt_offsets, self.prompt_ids, self.completion_offsets,
            self.completion_ids, self.logprobs, self.reward, self.seed,
        )  # fmt: skip
        return sum(a.nbytes for a in arrays) + sum(sys.getsizeof(g) for g in self.groups)

    @staticmethod
    def bound_nbytes(*, rows: int, groups: int, tokens: int) -> int:
        """The most ``nbytes`` a batch of these counts can have (what a manifest declares, before
        download): 8 bytes per token, 36 per row (offsets, group, reward, seed), a 256-character
        group id in 4-byte characters per group."""
        return 8 * tokens + 36 * rows + 16 + groups * _GROUP_STR_BYTES

    def to_rows(self, group_prefix: str = "") -> list[Rollout]:
        """The rows as ``Rollout`` objects; ``group_prefix`` is put before every group id (a trainer
        qualifies groups with their node and batch, so no two batches can share a group)."""
        p, po = self.prompt_ids.tolist(), self.prompt_offsets.tolist()
        c, co = self.completion_ids.tolist(), self.completion_offsets.tolist()
        lp, reward, seed = self.logprobs.tolist(), self.reward.tolist(), self.seed.tolist()
        groups = [group_prefix + g for g in self.groups]
        return [
            Rollout(
                group=groups[g],
                prompt_ids=tuple(p[po[i] : po[i + 1]]),
                completion_ids=tuple(c[co[i] : co[i + 1]]),
                logprobs=tuple(lp[co[i] : co[i + 1]]),
                reward=reward[i],
                version=self.version,
                model_digest=self.model_digest,
                node=self.node,
                seed=seed[i],
            )
            for i, g in enumerate(self.group.tolist())
        ]


def encode_batch(rows: Sequence[Rollout], *, zstd_level: int = ZSTD_LEVEL) -> bytes:
    """Parquet bytes of ``rows`` (at least one). Logprobs are stored as float32."""
    if not rows:
        raise RolloutError("a rollout batch needs at least one row")
    for r in rows:
        check_row(r)
    first = rows[0]
    if any((r.version, r.model_digest, r.node) != (first.version, first.model_digest, first.node) for r in rows):
        raise RolloutError("every row of a rollout batch must have the same version, model_digest and node")
    columns = {
        "group": [r.group for r in rows],
        "prompt_ids": [r.prompt_ids for r in rows],
        "completion_ids": [r.completion_ids for r in rows],
        "logprobs": [np.asarray(r.logprobs, dtype=np.float32) for r in rows],
        "reward": [float(r.reward) for r in rows],
        "version": [r.version for r in rows],
        "model_digest": [r.model_digest for r in rows],
        "node": [r.node for r in rows],
        "seed": [r.seed for r in rows],
    }
    if not all(np.isfinite(lp).all() for lp in columns["logprobs"]):
        raise RolloutError("a logprob overflows float32")
    table = pa.table(columns, schema=_ARROW_SCHEMA)
    sink = io.BytesIO()
    # No ARROW:schema, statistics or page index: the decoder accepts only this format's own
    # metadata, so none of those parsers is ever reachable from hostile bytes.
    with pq.ParquetWriter(
        sink,
        table.schema,
        compression="zstd",
        compression_level=zstd_level,
        write_statistics=False,
        store_schema=False,
        write_page_index=False,
    ) as writer:
        writer.write_table(table, row_group_size=len(rows))
        writer.add_key_value_metadata({FORMAT_KEY: FORMAT.encode(), SCHEMA_KEY: str(SCHEMA).encode()})
    return sink.getvalue()


def decode_batch(data: bytes, *, max_rows: int = MAX_ROWS, max_tokens: int = MAX_TOKENS) -> list[Rollout]:
    """The rows of a Parquet rollout batch, fully validated; RolloutError for anything else."""
    return decode_columns(data, max_rows=max_rows, max_tokens=max_tokens).to_rows()


def decode_columns(data: bytes, *, max_rows: int = MAX_ROWS, max_tokens: int = MAX_TOKENS) -> RolloutColumns:
    """:func:`decode_batch` as arrays (:class:`RolloutColumns`); RolloutError for anything else."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise RolloutError(f"rollout batch must be bytes, got {type(data).__name__}")
    try:
        return _decode(bytes(data), max_rows, max_tokens)
    except RolloutError:
        raise
    # Arrow's own errors (ArrowInvalid is a ValueError, ArrowIOError an OSError), a thrift footer
    # that parses to nonsense, text that is not UTF-8: every one means the bytes are not a batch.
    except (pa.ArrowException, OSError, ValueError, TypeError, IndexError, KeyError, OverflowError) as e:
        raise RolloutError(f"not a valid rollout batch: {type(e).__name__}: {str(e)[:200]}") from None


def _decode(data: bytes, max_rows: int, max_tokens: int) -> RolloutColumns:
    # Our own walk of the footer and page headers first (parquet_footer.py): pyarrow aborts the whole
    # process on some malformed footers (a C++ exception it does not translate), and trusts page
    # headers' sizes.
    _check_footer(data, max_rows, max_tokens)
    pf = pq.ParquetFile(
        pa.BufferReader(data),
        thrift_string_size_limit=_THRIFT_STRING_LIMIT,
        thrift_container_size_limit=_THRIFT_CONTAINER_LIMIT,
        # Strings stay dictionary-encoded until their lengths are checked: a dictionary of one
        # long string repeated per row would otherwise materialise rows x length bytes.
        read_dictionary=list(_STRINGS),
    )
    md = pf.metadata
    _check_schema(pf.schema_arrow)
    table = pf.read(use_threads=False)
    _check_strings(table)
    table = table.cast(_ARROW_SCHEMA.remove_metadata())
    _check_schema(table.schema)
    n = table.num_rows
    if n != md.num_rows:
        raise RolloutError(f"rollout batch holds {n} rows but its footer says {md.num_rows}")
    cols = {name: table.column(name).combine_chunks() for name in COLUMNS}
    for name, col in cols.items():
        if col.null_count or (name in _LISTS and col.flatten().null_count):
            raise RolloutError(f"rollout batch column {name!r} has nulls")
    lens = {name: pc.list_value_length(cols[name]).to_numpy(zero_copy_only=False) for name in _LISTS}
    if not np.array_equal(lens["completion_ids"], lens["logprobs"]):
        raise RolloutError("rollout batch: a row's logprobs and completion_ids differ in length")
    tokens = int(lens["prompt_ids"].sum()) + int(lens["completion_ids"].sum())
    if tokens > max_tokens:
        raise RolloutError(f"rollout batch holds {tokens} tokens, over the {max_tokens}-token limit")
    # Owned copies (np.array copies): nothing keeps the decoded Arrow table alive afterwards.
    flat = {
        "prompt_ids": np.array(cols["prompt_ids"].flatten().to_numpy(zero_copy_only=False), dtype=np.int32),
        "completion_ids": np.array(cols["completion_ids"].flatten().to_numpy(zero_copy_only=False), dtype=np.int32),
        "logprobs": np.array(cols["logprobs"].flatten().to_numpy(zero_copy_only=False), dtype=np.float32),
        "reward": np.array(cols["reward"].to_numpy(zero_copy_only=False), dtype=np.float64),
    }
    for name in ("prompt_ids", "completion_ids"):
        if flat[name].size and int(flat[name].min()) < 0:
            raise RolloutError(f"rollout batch column {name!r} has a negative token id")
    for name in ("logprobs", "reward"):
        if not np.isfinite(flat[name]).all():
            raise RolloutError(f"rollout batch column {name!r} has a non-finite value")
    version, digest, node = (_uniform(cols[name], name) for name in ("version", "model_digest", "node"))
    if not isinstance(version, int) or version < 0:
        raise RolloutError(f"rollout batch version {version} is negative")
    if not _HEX64.fullmatch(digest):
        raise RolloutError("rollout batch model_digest is not 64 lowercase hex digits")
    if not _NODE.fullmatch(node):
        raise RolloutError(f"rollout batch node {node[:80]!r} does not match {_NODE.pattern}")
    encoded = cols["group"].dictionary_encode()
    groups = tuple(encoded.dictionary.to_pylist())
    if not all(0 < len(g) <= MAX_GROUP_CHARS for g in groups):
        raise RolloutError(f"a rollout batch group id is not 1..{MAX_GROUP_CHARS} characters")
    return RolloutColumns(
        version=version,
        model_digest=digest,
        node=node,
        groups=groups,
        group=np.array(encoded.indices.to_numpy(zero_copy_only=False), dtype=np.int32),
        prompt_offsets=_offsets(lens["prompt_ids"]),
        prompt_ids=flat["prompt_ids"],
        completion_offsets=_offsets(lens["completion_ids"]),
        completion_ids=flat["completion_ids"],
        logprobs=flat["logprobs"],
        reward=flat["reward"],
        seed=np.array(cols["seed"].to_numpy(zero_copy_only=False), dtype=np.int64),
    )


def _offsets(lengths: np.ndarray) -> np.ndarray:
    out = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=out[1:])
    return out


def _uniform(col: pa.Array, name: str) -> object:
    """The one value every row has in ``col``; RolloutError if rows differ."""
    if pc.count_distinct(col).as_py() != 1:
        raise RolloutError(f"rollout batch rows differ in {name!r}: a batch is one node, version and digest")
    return col[0].as_py()


def _check_footer(data: bytes, max_rows: int, max_tokens: int) -> None:
    """Validate the footer and bound what decoding can allocate, before pyarrow reads anything.

    The footer (read by ``parquet_footer.py``'s own bounded Thrift walk) must have exactly this
    format's shape: our key-value metadata only, the nine leaf columns in order, ZSTD or no
    compression, no external files, page indexes, statistics or encryption, and level histograms of
    the sizes the schema implies. The values and decoded bytes every page declares are summed and
    checked against the limits (see ``parquet_footer.py`` for why the footer's sizes are not enough).
    """
    meta = read_footer(data)
    kv = meta.get(5)
    pairs = (
        {p.get(1): p.get(2) for p in kv}
        if isinstance(kv, list) and all(isinstance(p, dict) for p in kv)
        else {}
    )
    if (
        pairs.get(FORMAT_KEY) != FORMAT.encode()
        or pairs.get(SCHEMA_KEY) != str(SCHEMA).encode()
        or len(pairs) != 2
        or len(kv) != 2
    ):
        raise RolloutError(
            f"not a {FORMAT} v{SCHEMA} batch (format {pairs.get(FORMAT_KEY)!r}, "
            f"schema {pairs.get(SCHEMA_KEY)!r}, {len(pairs)} metadata keys)"
        )
    num_rows = meta.get(3)
    if not isinstance(num_rows, int) or not 0 < num_rows <= max_rows:
        raise RolloutError(f"rollout batch declares {num_rows} rows; allowed 1..{max_rows}")
    leaves = column_leaves(meta.get(2), COLUMNS)
    groups = meta.get(4)
    if not isinstance(groups, list) or not 0 < len(groups) <= _MAX_ROW_GROUPS:
        raise RolloutError("rollout batch has no row groups or too many")
    max_decoded = 16 * max_tokens + (4 * MAX_GROUP_CHARS + 256) * max_rows + (1 << 20)
    decoded = 0
    values = dict.fromkeys(COLUMNS, 0)
    rows_in_groups = 0
    for rg in groups:
        chunks = rg.get(1) if isinstance(rg, dict) else None
        if not isinstance(chunks, list) or len(chunks) != len(COLUMNS) or not isinstance(rg.get(3), int):
            raise RolloutError(f"a rollout batch row group does not hold the {len(COLUMNS)} columns")
        rows_in_groups += rg[3]
        for chunk, leaf in zip(chunks, leaves, strict=True):
            seen, used = check_chunk(data, chunk, leaf)
            values[leaf[0]] += seen
            decoded += used
    if rows_in_groups != num_rows:
        raise RolloutError(f"rollout batch row groups hold {rows_in_groups} rows, the footer says {num_rows}")
    if decoded > max_decoded:
        raise RolloutError(
            f"rollout batch declares {decoded} decoded bytes, over the {max_decoded}-byte limit"
        )
    # A list column has one level per element, and one per empty list.
    if values["prompt_ids"] + values["completion_ids"] > max_tokens + 2 * num_rows:
        raise RolloutError(f"rollout batch declares over {max_tokens} tokens")
    if values["logprobs"] > max_tokens + num_rows:
        raise RolloutError(f"rollout batch declares over {max_tokens} logprobs")
    for name in COLUMNS:
        if name not in _LISTS and values[name] != num_rows:
            raise RolloutError(
                f"rollout batch column {name!r} declares {values[name]} values for {num_rows} rows"
            )


def _check_schema(schema: pa.Schema) -> None:
    if tuple(schema.names) != COLUMNS:
        raise RolloutError(f"rollout batch columns are {schema.names}, expected {list(COLUMNS)}")
    for field, want in zip(schema, _ARROW_SCHEMA, strict=True):
        t, w = field.type, want.type
        if pa.types.is_dictionary(t) and field.name in _STRINGS:
            t = t.value_type
        ok = pa.types.is_list(t) and t.value_type == w.value_type if pa.types.is_list(w) else t == w
        if not ok:
            raise RolloutError(f"rollout batch column {field.name!r} is {t}, expected {w}")


def _check_strings(table: pa.Table) -> None:
    for name, most in _STRINGS.items():
        col = table.column(name)
        for chunk in col.chunks:
            if not pa.types.is_dictionary(chunk.type) or not pa.types.is_string(chunk.type.value_type):
                raise RolloutError(f"rollout batch column {name!r} is {chunk.type}, expected strings")
            lengths = pc.binary_length(chunk.dictionary).to_numpy(zero_copy_only=False)
            if lengths.size and int(lengths.max()) > 4 * most:
                raise RolloutError(f"rollout batch column {name!r} has a string over {4 * most} bytes")
