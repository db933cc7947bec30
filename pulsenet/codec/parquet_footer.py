"""A bounded reader of the Parquet footer and page headers of a rollout batch, run before pyarrow
sees the bytes (``codec/rollout.py`` decides what the batch may declare; this module reads it).

Why our own reader: pyarrow aborts the whole process on some malformed footers (a C++ exception it
does not translate), and trusts page headers' sizes. Here the footer is parsed as Thrift compact
protocol (parquet.thrift's field ids) with every length, count and nesting depth bounded by the
bytes at hand, and each column chunk's pages are walked the way Arrow's page reader walks them
(from its first page until the footer's value count): a chunk's uncompressed size in the footer
does not bound its decoded size (RLE and dictionary encodings expand, a few bytes can declare
billions of values), so every page's declared value count and size are summed for the caller's
limits. Decompression never exceeds a page's declared size, and decoding never yields more values
than a page declares.

Anything malformed is a ``RolloutError`` (Parquet is the rollout batch's format and nothing
else's here). Pure: bytes in, field ids and counts out.
"""

from __future__ import annotations

from pulsenet.errors import RolloutError

# Thrift ids of the Parquet footer (parquet.thrift) that a rollout batch reads or tolerates.
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
_MAX_THRIFT_DEPTH = 8


def read_footer(data: bytes) -> dict[int, object]:
    """The file's footer (FileMetaData) as ``field id -> value``: PAR1 magic at both ends, a footer
    length that fits, no trailing bytes and no fields but :data:`_FILE_FIELDS`; RolloutError otherwise."""
    if len(data) < 12 or data[:4] != b"PAR1" or data[-4:] != b"PAR1":
        raise RolloutError("rollout batch is not a Parquet file (no PAR1 magic at both ends)")
    size = int.from_bytes(data[-8:-4], "little")
    if not 0 < size <= len(data) - 12:
        raise RolloutError(f"rollout batch footer length {size} does not fit a {len(data)}-byte file")
    meta, end = thrift_struct(data, len(data) - 8 - size, 0)
    if end != len(data) - 8 or not set(meta) <= _FILE_FIELDS:
        raise RolloutError("rollout batch footer has trailing bytes or fields this format does not use")
    return meta


def check_chunk(
    data: bytes, chunk: object, leaf: tuple[str, list[bytes], int, int]
) -> tuple[int, int]:
    """(values, uncompressed bytes) that one column chunk's pages declare, for the column ``leaf``
    (from :func:`column_leaves`): no fields but the ones a rollout batch writes (no external file, page
    index, statistics or encryption), the leaf's path, ZSTD or no compression, level histograms of
    the sizes the schema implies, and pages that hold exactly the footer's value count."""
    name, path, max_rep, max_def = leaf
    col = chunk.get(3) if isinstance(chunk, dict) else None
    if (
        not isinstance(chunk, dict)
        or not isinstance(col, dict)
        or not set(chunk) <= _CHUNK_FIELDS
        or not set(col) <= _META_FIELDS
    ):
        raise RolloutError(f"rollout batch column {name!r} has fields this format does not use")
    if col.get(3) != path or col.get(4) not in _CODECS:
        raise RolloutError(
            f"rollout batch column {name!r} is at {col.get(3)} with codec {col.get(4)}"
        )
    _check_histograms(name, col.get(16), max_rep, max_def)
    return _walk_pages(data, name, col)


def column_leaves(schema: object, columns: tuple[str, ...]) -> list[tuple[str, list[bytes], int, int]]:
    """(column, path, max repetition level, max definition level) of each leaf of the footer's
    ``schema``; RolloutError unless the leaves are ``columns``, in order."""
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
    if not isinstance(root, int) or root != len(columns):
        raise RolloutError(f"rollout batch schema has {root} columns, expected {len(columns)}")
    for _ in range(root):
        walk([], 0, 0, 0)
    if pos != len(schema) or tuple(leaf[0] for leaf in leaves) != columns:
        raise RolloutError(
            f"rollout batch columns are {[leaf[0] for leaf in leaves]}, expected {list(columns)}"
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
    """(values, uncompressed bytes) the pages of one column chunk declare; see :func:`check_chunk`."""
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
        header, pos = thrift_struct(data, pos, 0)
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


def thrift_struct(data: bytes, pos: int, depth: int) -> tuple[dict[int, object], int]:
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
        return thrift_struct(data, pos, depth + 1)
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
