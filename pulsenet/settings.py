"""One config schema: plain dataclasses, filled from a TOML table, then ``PULSENET_*``, then flags.

The dataclass *is* the schema: field types validate, field docstrings are the ``--help`` text
(``tyro`` reads them), defaults are the built-in values. A node's settings come, lowest first, from

1. the dataclass defaults;
2. the command's table in the ``--config`` TOML file (``[trainer]``, nested tables for nested
   dataclasses: ``[trainer.grpo]``); keys are field names, ``-`` and ``_`` alike;
3. ``PULSENET_<FIELD>`` environment variables (nested: ``PULSENET_GRPO__LR``), what a compose file
   or an orchestrator sets per site; lists are comma- or space-separated, booleans true/false;
4. command-line flags (``--max-staleness 3``, ``--grpo.lr 1e-5``); a list flag given twice
   (``--trust a.pub --trust b.pub``) takes both.

A nested dataclass annotated ``tyro.conf.arg(name="")`` lends its fields to the parent under their
own names (``pulsenet loco train``: ``--inner-steps``, key ``inner-steps``, ``PULSENET_INNER_STEPS``
for ``LocoConfig.inner_steps``). A ``tyro.conf.Positional`` field is the bare argument on the command
line and its field name elsewhere. ``fields_of(cls, *names)`` makes a dataclass of some of another
schema's fields, for a command that takes those settings and not the rest (``pulsenet bench loco``:
``LocoConfig``'s outer step). Required settings have an empty default and are checked with
``require`` once every source is in, so any source may give them.

Each source is parsed on its own, so a bad value raises a ``ConfigError`` that names the field and
where it came from. Every value is turned into the flag it would be on the command line and parsed
by ``tyro``, so all four sources share one parser and one set of conversions.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import inspect
import io
import itertools
import json
import os
import textwrap
import tomllib
import typing
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
    aliases: Mapping[str, str] | None = None,
    parsed: Mapping[str, Any] | None = None,
) -> T:
    """``cls`` filled from defaults, ``config``'s ``[table]``, ``environ`` and ``argv``, in that order.

    ``aliases`` maps older flag spellings to the schema's (``{"--H": "--inner-steps"}``); they are
    accepted on the command line only. ``parsed``: ``config``'s contents, already read
    (``load_toml``), for a caller that takes several tables from one file."""
    fields = _flags(cls)
    argv = [_alias(a, aliases or {}) for a in argv]
    value: T = cls()
    if config is not None:
        data = _table(load_toml(config) if parsed is None else parsed, table, str(config))
        value = _parse(cls, value, _toml_args(data, fields, f"{config} [{table}]"), f"{config} [{table}]")
    for name, (flag, kind) in fields.items():
        var = ENV_PREFIX + name.upper().replace(".", "__")
        if var in environ:
            value = _parse(cls, value, _env_args(flag, kind, environ[var], var), f"{var}={environ[var]!r}")
    return tyro.cli(cls, default=value, args=_merge_repeated(list(argv), fields), prog=prog)


def _alias(token: str, aliases: Mapping[str, str]) -> str:
    flag, eq, value = token.partition("=")
    return aliases[flag] + eq + value if flag in aliases else token


def require(value: Any, *names: str, table: str) -> None:
    """Raise ``ConfigError`` for the first of ``names`` that no source set (empty or None)."""
    for name in names:
        if getattr(value, name) in (None, "", [], ()):
            flag = "--" + name.replace("_", "-")
            raise ConfigError(
                f"{table.replace('.', ' ')} needs {flag} (or {ENV_PREFIX}{name.upper()}, "
                f"or {name.replace('_', '-')} in [{table}] of --config)"
            )


def fields_of(cls: type, *names: str) -> type:
    """A dataclass of ``cls``'s fields ``names``, with their types, defaults and docstrings (as help).

    For a command that takes a few of another schema's settings and not the rest (``pulsenet bench
    loco`` takes ``LocoConfig``'s outer-step knobs; it sets the protocol's deadlines itself): each
    setting stays declared once, and its flag, key and ``PULSENET_*`` name are the field's."""
    hints = typing.get_type_hints(cls, include_extras=True)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    docs = _field_docs(cls)
    specs = []
    for name in names:
        f, typ = fields[name], hints[name]
        if name in docs:
            typ = typing.Annotated[typ, tyro.conf.arg(help=docs[name])]
        specs.append((name, typ, dataclasses.field(default=f.default, default_factory=f.default_factory)))
    made = dataclasses.make_dataclass(f"{cls.__name__}Fields", specs, kw_only=True)
    made.__doc__ = f"Settings of ``{cls.__module__}.{cls.__qualname__}``: {', '.join(names)}."
    return made


def inherit(child: Any, **values: Any) -> None:
    """Copy a parent's shared settings into a nested component config (``run`` into every
    component of a node): set once at the top, the same everywhere below.

    A parent lists the copied fields in its ``INHERITED`` class attribute (dotted names:
    ``{"loco.run"}``); ``_flags`` leaves them out, so a TOML key or a ``PULSENET_*`` variable for one is an unknown setting
    rather than a value silently overwritten here."""
    for name, value in values.items():
        setattr(child, name, value)


def load_toml(path: str | Path) -> dict:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except OSError as e:
        raise ConfigError(f"config file {path}: {e.strerror or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None


def to_toml_table(value: Any, _hidden: frozenset[str] | None = None, _prefix: str = "") -> dict[str, Any]:
    """A dataclass as the TOML table that reproduces it (what ``pulsenet up`` writes per node);
    inherited fields (``INHERITED``) are left to the parent's value, as ``load_settings`` wants."""
    hidden = _hidden if _hidden is not None else getattr(type(value), "INHERITED", frozenset())
    out: dict[str, Any] = {}
    for f in dataclasses.fields(value):
        v = getattr(value, f.name)
        if _prefix + f.name in hidden:
            continue
        if dataclasses.is_dataclass(v):
            out[f.name] = to_toml_table(v, hidden, f"{_prefix}{f.name}.")
        elif v is not None:
            out[f.name] = [str(x) for x in v] if isinstance(v, list | tuple) else str(v) if isinstance(v, Path) else v
    return out


def write_toml(path: str | Path, table: Mapping[str, Any]) -> Path:
    """Write ``table`` (``to_toml_table``'s output) to ``path`` as TOML and read it back: the one way
    config TOML is written (``pulsenet up``'s node configs). Strings, numbers, booleans, lists and
    nested tables; what does not read back raises ``ConfigError`` here, not in the node."""
    path = Path(path)
    path.write_text(_toml(table))
    load_toml(path)  # what we wrote must read back
    return path


def _toml(data: Mapping[str, Any], prefix: str = "") -> str:
    lines = [f"{k} = {_toml_value(v)}" for k, v in data.items() if not isinstance(v, Mapping)]
    for k, v in data.items():
        if isinstance(v, Mapping):
            lines += ["", f"[{prefix}{k}]", _toml(v, f"{prefix}{k}.")]
    return "\n".join(lines).strip("\n") + "\n"


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, list | tuple):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return json.dumps(str(v))  # a JSON string is a valid TOML basic string


# --- internals ---------------------------------------------------------------------------------


def _flags(cls: type, prefix: str = "", hidden: frozenset[str] | None = None) -> dict[str, tuple[str, str]]:
    """``dotted field name -> (flag, kind)`` with kind "bool", "list", "positional" or "value".

    A nested dataclass field annotated ``tyro.conf.arg(name="")`` adds no prefix (its fields are
    the command's own: ``--inner-steps``, key ``inner-steps``); otherwise its name is a prefix
    (``--grpo.lr``, table ``[trainer.grpo]``, ``PULSENET_GRPO__LR``)."""
    out: dict[str, tuple[str, str]] = {}
    hints = typing.get_type_hints(cls, include_extras=True)
    hidden = hidden if hidden is not None else getattr(cls, "INHERITED", frozenset())
    for f in dataclasses.fields(cls):
        name = prefix + f.name
        if name in hidden:
            continue
        typ, marks = hints[f.name], ()
        if typing.get_origin(typ) is typing.Annotated:
            typ, *marks = typing.get_args(typ)
        if any(m is tyro.conf.Suppress for m in marks):
            continue
        if f.default_factory is not dataclasses.MISSING:
            made = f.default_factory()  # a class or a lambda (``lambda: GRPOConfig(lr=1e-3)``)
            if dataclasses.is_dataclass(made):
                flat = any(getattr(m, "name", None) == "" for m in marks)
                out |= _flags(type(made), prefix if flat else name + ".", hidden)
                continue
        origin = typing.get_origin(typ)
        if any(m is tyro.conf.Positional or getattr(m, "__name__", "") == "Positional" for m in marks):
            kind = "positional"
        elif typ is bool:
            kind = "bool"
        elif origin in (list, tuple):
            kind = "list"
        else:
            kind = "value"
        out[name] = ("--" + name.replace("_", "-"), kind)
    return out


def _field_docs(cls: type) -> dict[str, str]:
    """``field name -> docstring`` (the string under the field in ``cls``'s source), what tyro shows."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0]
    body = tree.body if isinstance(tree, ast.ClassDef) else []  # a class's source is a ClassDef
    docs = {}
    for node, after in itertools.pairwise(body):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = inspect.cleandoc(after.value.value)
    return docs


def _merge_repeated(argv: list[str], fields: dict[str, tuple[str, str]]) -> list[str]:
    """``--trust a --trust b`` -> ``--trust a b``: a repeated list flag keeps every value (tyro
    would keep the last); a flag's values run to the next token that starts with ``-``."""
    lists = {flag for flag, kind in fields.values() if kind == "list"}
    segments: list[list[str]] = []
    first: dict[str, list[str]] = {}  # list flag -> its one segment
    i = 0
    while i < len(argv):
        if argv[i] == "--":
            segments.append(argv[i:])
            break
        if argv[i] not in lists:
            segments.append([argv[i]])
            i += 1
            continue
        j = i + 1
        while j < len(argv) and not argv[j].startswith("-"):
            j += 1
        if argv[i] in first:
            first[argv[i]] += argv[i + 1 : j]
        else:
            first[argv[i]] = argv[i:j]
            segments.append(first[argv[i]])
        i = j
    return [token for segment in segments for token in segment]


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
        if kind == "positional":
            args.append(str(v))
        elif kind == "bool":
            if not isinstance(v, bool):
                raise ConfigError(f"{source}: {key} must be true or false, got {v!r}")
            args.append(flag if v else _negate(flag))
        elif kind == "list":
            args += [flag, *(str(x) for x in (v if isinstance(v, list) else [v]))]
        else:
            args += [flag, str(v)]
    return args


def _env_args(flag: str, kind: str, raw: str, var: str) -> list[str]:
    if kind == "positional":
        return [raw]
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
        raise ConfigError(f"{source}: {_reason(out.getvalue())}") from None


def _reason(printed: str) -> str:
    """tyro's error box on one line: its title and message (which name the flag and the value)."""
    kept = []
    for line in printed.splitlines():
        text = line.strip().strip("\u2502\u256d\u2570\u256e\u256f").strip(" -\u2500")
        if text.startswith(("For full helptext", "Argument helptext")):
            break
        if text:
            kept.append(text)
    return " ".join(" ".join(kept).split())[:300]
