"""Datasets as tasks: local JSONL, JSON, Parquet, CSV or a ``datasets`` ``save_to_disk`` directory.

Loaded with the ``datasets`` library (its JSON, Parquet and CSV builders, or ``load_from_disk``)
into a temporary cache that is removed once the rows are in memory, so nothing is written under
``~/.cache`` and nothing is fetched: these builders are local.

Columns. The prompt comes from ``prompt_column`` or the first of ``prompt``, ``question``,
``problem``; the answer from ``answer_column`` or the first of ``answer``, ``solution``. The gold
answer is what ``rewards.reference_answer`` extracts (after GSM8K's ``####``, a MATH solution's last
``\\boxed{}``, else the value as is); the whole row stays with each problem, so a custom reward gets
every column by name. A missing column, a row whose prompt is not a non-empty string or whose answer
is missing, or an empty split is a ConfigError naming the file (and the columns it has).

Held-out split: a second file (``eval_path``), or a fraction of the rows chosen by SHA-256 of
(data key, row index): the same rows on every machine, whatever the library versions.

The key (``ProblemSet.key``) is the SHA-256 of the files' bytes and of the settings that select
rows: two nodes agree on an assignment (``tasks.assign_problems``) only if they load the same data.
"""

from __future__ import annotations

import hashlib
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pulsenet.errors import ConfigError
from pulsenet.rl.rewards import reference_answer

PROMPT_COLUMNS = ("prompt", "question", "problem")
ANSWER_COLUMNS = ("answer", "solution")
BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}


@dataclass(frozen=True, slots=True)
class Row:
    """One problem of a dataset: prompt text, gold answer, and the row as loaded."""

    prompt: str
    answer: str
    columns: dict[str, Any]


@dataclass(frozen=True, slots=True)
class ProblemSet:
    train: list[Row]
    eval: list[Row] | None
    """Held-out rows (None: neither eval_path nor eval_fraction given)."""
    key: str
    """``data:<sha256>`` of the data and the settings that select it."""
    prompt_column: str
    answer_column: str


def is_dataset_path(source: str) -> bool:
    """Whether a task setting names data (a known file suffix, or a directory) rather than a generator."""
    path = Path(source).expanduser()
    return path.suffix.lower() in BUILDERS or path.is_dir()


def load_problem_set(
    path: str | Path,
    *,
    prompt_column: str = "",
    answer_column: str = "",
    split: str = "train",
    eval_path: str | Path | None = None,
    eval_split: str = "test",
    eval_fraction: float = 0.0,
) -> ProblemSet:
    """The rows of ``path`` (and of the held-out data), mapped and checked; see the module docstring.

    ``split``/``eval_split``: which split of a ``save_to_disk`` DatasetDict (a directory holding
    several); a DatasetDict with an ``eval_split`` split gives the held-out rows when neither
    ``eval_path`` nor ``eval_fraction`` is set.
    """
    if not 0.0 <= eval_fraction < 1.0:
        raise ConfigError(f"eval_fraction must be in [0, 1), got {eval_fraction}")
    if eval_path and eval_fraction:
        raise ConfigError("give eval_path or eval_fraction, not both")
    path = Path(path).expanduser()
    table, held_out = _load(path, split, eval_split if not (eval_path or eval_fraction) else None)
    pcol, acol = _columns(path, table, prompt_column, answer_column)
    rows = _rows(path, table, pcol, acol)
    digest = hashlib.sha256()
    digest.update(json.dumps(["pulsenet-data/1", pcol, acol, split, eval_fraction, eval_split]).encode())
    _hash_path(path, digest)
    eval_rows: list[Row] | None = None
    if eval_path:
        eval_path = Path(eval_path).expanduser()
        eval_table, _ = _load(eval_path, eval_split if eval_path.is_dir() else split, None)
        _columns(eval_path, eval_table, pcol, acol)
        eval_rows = _rows(eval_path, eval_table, pcol, acol)
        _hash_path(eval_path, digest)
    elif held_out is not None:
        _columns(path, held_out, pcol, acol)
        eval_rows = _rows(path, held_out, pcol, acol, what=f"split {eval_split!r} of")
    key = "data:" + digest.hexdigest()
    if eval_fraction:
        order = sorted(range(len(rows)), key=lambda i: hashlib.sha256(f"{key}:{i}".encode()).digest())
        n_eval = round(eval_fraction * len(rows))
        if n_eval == 0 or n_eval == len(rows):
            raise ConfigError(
                f"{path}: eval_fraction {eval_fraction} of {len(rows)} rows leaves an empty "
                f"{'eval' if n_eval == 0 else 'training'} split"
            )
        held = set(order[:n_eval])
        eval_rows = [rows[i] for i in sorted(held)]
        rows = [r for i, r in enumerate(rows) if i not in held]
    return ProblemSet(train=rows, eval=eval_rows, key=key, prompt_column=pcol, answer_column=acol)


def _load(path: Path, split: str, eval_split: str | None) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """Rows of ``path`` as dicts (and of ``eval_split`` of a DatasetDict directory, if it has one)."""
    import datasets

    datasets.disable_progress_bars()
    if not path.exists():
        raise ConfigError(f"task data {path} does not exist")
    try:
        if path.is_dir():
            obj = datasets.load_from_disk(str(path), keep_in_memory=True)
            if isinstance(obj, datasets.DatasetDict):
                if split not in obj:
                    raise ConfigError(f"{path}: no split {split!r} (it has {sorted(obj)})")
                held = obj[eval_split].to_list() if eval_split is not None and eval_split in obj else None
                return obj[split].to_list(), held
            return obj.to_list(), None
        builder = BUILDERS.get(path.suffix.lower())
        if builder is None:
            raise ConfigError(f"{path}: task data must be {', '.join(BUILDERS)} or a save_to_disk directory")
        if builder != "parquet" and _blank(path):  # the builders fail obscurely on an empty file
            raise ConfigError(f"{path}: no rows")
        with tempfile.TemporaryDirectory(prefix="pulsenet-data-") as cache:
            ds = datasets.load_dataset(builder, data_files=str(path), split="train", cache_dir=cache)
            return ds.to_list(), None
    except ConfigError:
        raise
    except (datasets.exceptions.DatasetsError, OSError, ValueError, KeyError, TypeError, StopIteration) as e:
        raise ConfigError(f"{path}: cannot load it with the datasets library: {str(e)[:300]}") from None


def _blank(path: Path) -> bool:
    with path.open("rb") as f:
        while chunk := f.read(1 << 16):
            if chunk.strip():
                return False
    return True


def _columns(path: Path, table: list[dict[str, Any]], prompt: str, answer: str) -> tuple[str, str]:
    if not table:
        raise ConfigError(f"{path}: no rows")
    have = list(table[0])

    def pick(given: str, candidates: tuple[str, ...], what: str) -> str:
        if given:
            if given not in have:
                raise ConfigError(f"{path}: no {what} column {given!r}; its columns are {have}")
            return given
        for c in candidates:
            if c in have:
                return c
        raise ConfigError(
            f"{path}: no {what} column ({' / '.join(candidates)}); its columns are {have}: "
            f"name it with {what}_column"
        )

    return pick(prompt, PROMPT_COLUMNS, "prompt"), pick(answer, ANSWER_COLUMNS, "answer")


def _rows(path: Path, table: list[dict[str, Any]], pcol: str, acol: str, what: str = "") -> list[Row]:
    where = f"{what} {path}".strip()
    if not table:
        raise ConfigError(f"{where}: no rows")
    out = []
    for n, row in enumerate(table, 1):
        prompt, answer = row.get(pcol), row.get(acol)
        if not isinstance(prompt, str) or not prompt.strip():
            raise ConfigError(f"{where} row {n}: {pcol!r} must be a non-empty string, got {prompt!r:.80}")
        if isinstance(answer, bool) or not isinstance(answer, str | int | float) or str(answer).strip() == "":
            raise ConfigError(f"{where} row {n}: {acol!r} must be a string or number, got {answer!r:.80}")
        out.append(Row(prompt=prompt, answer=reference_answer(str(answer)), columns=row))
    return out


def _hash_path(path: Path, digest: Any) -> None:
    """The bytes of a file (not its name), or the relative names and bytes of every file under a directory."""
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for f in files:
        if path.is_dir():
            digest.update(str(f.relative_to(path)).encode() + b"\0")
        with f.open("rb") as fh:
            while chunk := fh.read(1 << 20):
                digest.update(chunk)
