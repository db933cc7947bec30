"""Rollout rows: one completion as an inference node served it, the unit GRPO trains on.

The wire format of a batch of rows is Parquet (pyarrow, zstd), one row per completion (spec in
docs/format.md, "Rollout batch")::

    group: string   prompt_ids: list<int32>   completion_ids: list<int32>   logprobs: list<float32>
    reward: double  version: int64            model_digest: string         node: string   seed: int64

with ``pulsenet.format = "pulsenet-rollouts"`` and ``pulsenet.schema = "1"`` in the file's
key-value metadata. Logprobs travel as float32 (what engines compute); rewards as float64.

``decode_columns`` treats its bytes as hostile: the footer's row count and uncompressed sizes are
checked against the caller's limits before any column is read, then the schema, nulls, lengths,
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
    # Our own walk of the footer and page headers first: pyarrow aborts the whole process on some
    # malformed footers (a C++ exception it does not translate), and trusts page headers' sizes.
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


# Thrift ids of the Parquet footer (parquet.thrift) that this format reads or tolerates.
_FILE_FIELDS = {
    1,
    2,
    3,
    4,
    5,
    6,
    7,
}  # version, schema, num_rows, row_groups, key_value_metadata, created_by, column_orders
_CHUNK_FIELDS = {2, 3}  # file_offset, meta_data: no external file_path, page index or encryption
_META_FIELDS = {1, 2, 3, 4, 5, 6, 7, 9, 11, 13, 16}  # no statistics, bloom filters or index pages
_CODECS = {0, 6}  # uncompressed, zstd
_OPTIONAL, _REPEATED = 1, 2


def _check_footer(data: bytes, max_rows: int, max_tokens: int) -> None:
    """Validate the footer and bound what decoding can allocate, before pyarrow reads anything.

    The footer is parsed here (Thrift compact) and must have exactly this format's shape: our
    key-value metadata only, the nine leaf columns in order, ZSTD or no compression, no external
    files, page indexes, statistics or encryption, and level histograms of the sizes the schema
    implies. Then each column chunk's pages are walked the way Arrow's page reader walks them
    (from its first page until the footer's value count): a chunk's uncompressed size in the
    footer does not bound its decoded size (RLE and dictionary encodings expand, a few bytes can
    declare billions of values), so every page's declared value count and size are summed and
    checked against the limits. Decompression never exceeds a page's declared size, and decoding
    never yields more values than a page declares.
    """
    if len(data) < 12 or data[:4] != b"PAR1" or data[-4:] != b"PAR1":
        raise RolloutError("rollout batch is not a Parquet file (no PAR1 magic at both ends)")
    size = int.from_bytes(data[-8:-4], "little")
    if not 0 < size <= len(data) - 12:
        raise RolloutError(f"rollout batch footer length {size} does not fit a {len(data)}-byte file")
    meta, end = _thrift_struct(data, len(data) - 8 - size, 0)
    if end != len(data) - 8 or not set(meta) <= _FILE_FIELDS:
        raise RolloutError("rollout batch footer has trailing bytes or fields this format does not use")
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
    leaves = _leaves(meta.get(2))
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
        for chunk, (name, path, max_rep, max_def) in zip(chunks, leaves, strict=True):
            col = chunk.get(3) if isinstance(chunk, dict) else None
            if not isinstance(col, dict) or not set(chunk) <= _CHUNK_FIELDS or not set(col) <= _META_FIELDS:
                raise RolloutError(f"rollout batch column {name!r} has fields this format does not use")
            if col.get(3) != path or col.get(4) not in _CODECS:
                raise RolloutError(
                    f"rollout batch column {name!r} is at {col.get(3)} with codec {col.get(4)}"
                )
            _check_histograms(name, col.get(16), max_rep, max_def)
            seen, used = _walk_pages(data, name, col)
            values[name] += seen
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


def _leaves(schema: object) -> list[tuple[str, list[bytes], int, int]]:
    """(column, path, max repetition level, max definition level) of each leaf, checked against COLUMNS."""
    if not isinstance(schema, list) or not schema or not all(isinstance(e, dict) for e in schema):
        raise RolloutError("rollout batch footer has no schema")
    leaves: list[tuple[str, list[bytes], int, int]] = []
    pos = 1

    def walk(path: list[bytes], rep: int, dfn: int, depth: int) -> None:
        nonlocal pos
        if pos >= len(schema) or depth > 3:
            raise RolloutError("rollout batch schema is truncated or nests too deep")
        e = schema[pos]
        pos += 1
        name, kind, children = e.get(4), e.get(3), e.get(5)
        if not isinstance(name, bytes) or kind not in (0, _OPTIONAL, _REPEATED):
            raise RolloutError("rollout batch schema has a malformed element")
        rep, dfn = rep + (kind == _REPEATED), dfn + (kind != 0)
        if children is None:
            leaves.append(
                (
                    path[0].decode(errors="replace") if path else name.decode(errors="replace"),
                    [*path, name],
                    rep,
                    dfn,
                )
            )
            return
        if not isinstance(children, int) or not 0 < children <= len(schema):
            raise RolloutError("rollout batch schema has a malformed group")
        for _ in range(children):
            walk([*path, name], rep, dfn, depth + 1)

    root = schema[0].get(5)
    if not isinstance(root, int) or root != len(COLUMNS):
        raise RolloutError(f"rollout batch schema has {root} columns, expected {len(COLUMNS)}")
    for _ in range(root):
        walk([], 0, 0, 0)
    if pos != len(schema) or tuple(leaf[0] for leaf in leaves) != COLUMNS:
        raise RolloutError(
            f"rollout batch columns are {[leaf[0] for leaf in leaves]}, expected {list(COLUMNS)}"
        )
    return leaves


def _check_histograms(name: str, stats: object, max_rep: int, max_def: int) -> None:
    """Level histograms (SizeStatistics) must have max level + 1 entries, or none."""
    if stats is None:
        return
    if not isinstance(stats, dict):
        raise RolloutError(f"rollout batch column {name!r} has malformed size statistics")
    for field, level in ((2, max_rep), (3, max_def)):
        h = stats.get(field)
        if h is not None and (not isinstance(h, list) or len(h) not in (0, level + 1)):
            raise RolloutError(f"rollout batch column {name!r} has a level histogram of the wrong size")


def _walk_pages(data: bytes, name: str, col: dict) -> tuple[int, int]:
    """(values, uncompressed bytes) the pages of one column chunk declare; see _check_footer."""
    num_values, length = col.get(5), col.get(7)
    start, dict_start = col.get(9), col.get(11)
    if not all(isinstance(v, int) and v >= 0 for v in (num_values, length, start)):
        raise RolloutError(f"rollout batch column {name!r} has malformed offsets or counts")
    if isinstance(dict_start, int) and 0 < dict_start < start:
        start = dict_start
    end = start + length
    if not 4 <= start <= end <= len(data) - 8:
        raise RolloutError(f"rollout batch column {name!r} lies outside the file")
    pos, seen, decoded = start, 0, 0
    while pos < end and seen < num_values:
        header, pos = _thrift_struct(data, pos, 0)
        usize, csize = header.get(2), header.get(3)
        if not (isinstance(usize, int) and isinstance(csize, int) and usize >= 0 and csize >= 0):
            raise RolloutError(f"rollout batch column {name!r} has a malformed page header")
        page = header.get({0: 5, 3: 8}.get(header.get(1), -1))  # data page v1 / v2 header
        if isinstance(page, dict):
            n = page.get(1)
            if not isinstance(n, int) or n < 0:
                raise RolloutError(f"rollout batch column {name!r} has a page of {n!r} values")
            seen += n
        decoded += usize
        pos += csize
    if seen != num_values:
        raise RolloutError(
            f"rollout batch column {name!r}: pages hold {seen} values, the footer says {num_values}"
        )
    return seen, decoded


_MAX_THRIFT_DEPTH = 8


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    out = shift = 0
    while True:
        if pos >= len(data) or shift > 63:
            raise RolloutError("rollout batch footer or page header is truncated or has a runaway varint")
        b = data[pos]
        pos += 1
        out |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return out, pos


def _zigzag(data: bytes, pos: int) -> tuple[int, int]:
    v, pos = _varint(data, pos)
    return (v >> 1) ^ -(v & 1), pos


def _thrift_struct(data: bytes, pos: int, depth: int) -> tuple[dict[int, object], int]:
    """A Thrift compact-protocol struct as ``field id -> value`` (ints, nested structs; the rest skipped)."""
    if depth > _MAX_THRIFT_DEPTH:
        raise RolloutError("rollout batch footer or page header nests too deep")
    fields: dict[int, object] = {}
    last = 0
    while True:
        if pos >= len(data):
            raise RolloutError("rollout batch footer or page header is truncated")
        b = data[pos]
        pos += 1
        kind = b & 0x0F
        if kind == 0:
            return fields, pos
        if b >> 4:
            fid = last + (b >> 4)
        else:
            fid, pos = _zigzag(data, pos)
        last = fid
        fields[fid], pos = _thrift_value(data, pos, kind, depth)


def _thrift_value(data: bytes, pos: int, kind: int, depth: int) -> tuple[object, int]:
    if kind in (1, 2):  # booleans carry their value in the type
        return kind == 1, pos
    if kind == 3:
        if pos >= len(data):
            raise RolloutError("rollout batch footer or page header is truncated")
        return data[pos], pos + 1
    if kind in (4, 5, 6):
        return _zigzag(data, pos)
    if kind == 7:
        return None, pos + 8
    if kind == 8:
        n, pos = _varint(data, pos)
        if pos + n > len(data):
            raise RolloutError("rollout batch footer or page header is truncated")
        return data[pos : pos + n], pos + n
    if kind in (9, 10):  # list, set: structs, ints and binaries come back as a list, the rest is skipped
        if pos >= len(data):
            raise RolloutError("rollout batch footer or page header is truncated")
        head = data[pos]
        pos += 1
        n, elem = head >> 4, head & 0x0F
        if n == 15:
            n, pos = _varint(data, pos)
        if elem in (4, 5, 6, 8, 12):
            if n > len(data) - pos:
                raise RolloutError("rollout batch footer or page header declares more items than bytes")
            items = []
            for _ in range(n):
                item, pos = _thrift_value(data, pos, elem, depth + 1)
                items.append(item)
            return items, pos
        return _skip_items(data, pos, [elem], n, depth)
    if kind == 11:  # map
        n, pos = _varint(data, pos)
        if n == 0:
            return None, pos
        if pos >= len(data):
            raise RolloutError("rollout batch footer or page header is truncated")
        kv = data[pos]
        return _skip_items(data, pos + 1, [kv >> 4, kv & 0x0F], n, depth)
    if kind == 12:
        return _thrift_struct(data, pos, depth + 1)
    raise RolloutError(f"rollout batch footer or page header has an unknown thrift type {kind}")


def _skip_items(data: bytes, pos: int, kinds: list[int], n: int, depth: int) -> tuple[None, int]:
    if n > len(data) - pos:  # every element takes at least a byte (booleans in a list do too)
        raise RolloutError("rollout batch footer or page header declares more items than bytes")
    for _ in range(n):
        for k in kinds:
            if k in (1, 2):  # a boolean inside a container is one byte
                pos += 1
            else:
                _, pos = _thrift_value(data, pos, k, depth + 1)
    return None, pos


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
