"""One config schema: plain dataclasses, filled from a TOML table, then ``PULSENET_*``, then flags.

The dataclass *is* the schema: field types validate, field docstrings are the ``--help`` text
(``tyro`` reads them), defaults are the built-in values. A node's settings come, lowest first, from

1. the dataclass defaults;
2. the command's table in the ``--config`` TOML file (``[trainer]``, nested tables for nested
   dataclasses: ``[trainer.grpo]``); keys are field names, ``-`` and ``_`` alike;
3. ``PULSENET_<FIELD>`` environment variables (nested: ``PULSENET_GRPO__LR``), what a compose file
   or an orchestrator sets per site; lists are comma- or space-separated, booleans true/false;
4. command-line flags (``--max-staleness 3``, ``--grpo.lr 1e-5``).

Each source is parsed on its own, so a bad value raises a ``ConfigError`` that names the field and
where it came from. Every value is turned into the flag it would be on the command line and parsed
by ``tyro``, so all four sources share one parser and one set of conversions.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import re
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import tyro

from pulsenet.errors import ConfigError

ENV_PREFIX = "PULSENET_"
T = TypeVar("T")
_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off"}


def load_settings(
    cls: type[T],
    *,
    table: str,
    argv: Sequence[str] = (),
    config: str | Path | None = None,
    environ: Mapping[str, str] = os.environ,
    prog: str | None = None,
) -> T:
    """``cls`` filled from defaults, ``config``'s ``[table]``, ``environ`` and ``argv``, in that order."""
    fields = _flags(cls)
    value: T = cls()
    if config is not None:
        data = _table(load_toml(config), table, str(config))
        value = _parse(cls, value, _toml_args(data, fields, f"{config} [{table}]"), f"{config} [{table}]")
    for name, (flag, kind) in fields.items():
        var = ENV_PREFIX + name.upper().replace(".", "__")
        if var in environ:
            value = _parse(cls, value, _env_args(flag, kind, environ[var], var), f"{var}={environ[var]!r}")
    return tyro.cli(cls, default=value, args=list(argv), prog=prog)


def load_toml(path: str | Path) -> dict:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as e:
        raise ConfigError(f"config file {path}: {e.strerror or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None


def to_toml_table(value: Any) -> dict[str, Any]:
    """A dataclass as the TOML table that reproduces it (what ``pulsenet up`` writes per node)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(value):
        v = getattr(value, f.name)
        if dataclasses.is_dataclass(v):
            out[f.name] = to_toml_table(v)
        elif v is not None:
            out[f.name] = [str(x) for x in v] if isinstance(v, list | tuple) else str(v) if isinstance(v, Path) else v
    return out


# --- internals ---------------------------------------------------------------------------------


def _flags(cls: type, prefix: str = "") -> dict[str, tuple[str, str]]:
    """``dotted field name -> (flag, kind)`` with kind "bool", "list" or "value"."""
    out: dict[str, tuple[str, str]] = {}
    for f in dataclasses.fields(cls):
        name = prefix + f.name
        typ = f.type if not isinstance(f.type, str) else f.type.replace(" ", "")
        if f.default_factory is not dataclasses.MISSING:
            made = f.default_factory()  # a class or a lambda (``lambda: GRPOConfig(lr=1e-3)``)
            if dataclasses.is_dataclass(made):
                out |= _flags(type(made), name + ".")
                continue
        kind = "bool" if typ in (bool, "bool") else "list" if re.match(r"(list|tuple)\[", str(typ)) else "value"
        out[name] = ("--" + name.replace("_", "-"), kind)
    return out


def _table(data: Mapping, table: str, source: str) -> Mapping:
    node: Any = data
    for part in table.split("."):
        node = node.get(part, {}) if isinstance(node, Mapping) else None
        if not isinstance(node, Mapping):
            raise ConfigError(f"{source}: [{table}] must be a table")
    return node


def _toml_args(data: Mapping, fields: dict[str, tuple[str, str]], source: str, prefix: str = "") -> list[str]:
    args: list[str] = []
    for key, v in data.items():
        name = prefix + key.replace("-", "_")
        if isinstance(v, Mapping):
            args += _toml_args(v, fields, source, name + ".")
            continue
        if name not in fields:
            known = ", ".join(sorted(n.replace("_", "-") for n in fields if n.startswith(prefix)))
            raise ConfigError(f"{source}: no setting {prefix + key!r} (known: {known})")
        flag, kind = fields[name]
        if kind == "bool":
            if not isinstance(v, bool):
                raise ConfigError(f"{source}: {key} must be true or false, got {v!r}")
            args.append(flag if v else _negate(flag))
        elif kind == "list":
            args += [flag, *(str(x) for x in (v if isinstance(v, list) else [v]))]
        else:
            args += [flag, str(v)]
    return args


def _env_args(flag: str, kind: str, raw: str, var: str) -> list[str]:
    if kind == "bool":
        low = raw.strip().lower()
        if low not in _TRUE | _FALSE:
            raise ConfigError(f"{var}={raw!r}: expected one of {sorted(_TRUE | _FALSE)}")
        return [flag if low in _TRUE else _negate(flag)]
    if kind == "list":
        return [flag, *raw.replace(",", " ").split()]
    return [flag, raw]


def _negate(flag: str) -> str:
    head, _, last = flag[2:].rpartition(".")
    return f"--{head + '.' if head else ''}no-{last}"


def _parse(cls: type[T], default: T, args: list[str], source: str) -> T:
    if not args:
        return default
    out = io.StringIO()
    try:
        with contextlib.redirect_stderr(out), contextlib.redirect_stdout(out):
            return tyro.cli(cls, default=default, args=args)
    except SystemExit:
        lines = [ln.replace("\u2502", " ").strip() for ln in out.getvalue().splitlines()]
        reason = next((ln.strip() for ln in lines if ln.strip().startswith(("Error", "Unrecognized", "Invalid"))), "")
        raise ConfigError(f"{source}: {reason or ' '.join(' '.join(lines).split())[:300]}") from None
