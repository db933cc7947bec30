"""Command defaults from a TOML file (``configs/``) and the environment, for nodes in containers.

One table per command, named by its path: ``[pull]``, ``[publish]``, ``[loco.train]``. Keys are the
command's long options (``anchor-every`` or ``anchor_every``); values are TOML-typed. Any option
can also come from ``PULSENET_<DEST>`` (``PULSENET_STORE``, ``PULSENET_TRUST``: the option's name in
``--help``'s namespace, upper-cased), which is what a compose file or an orchestrator sets per site.

Precedence, highest first: command line, environment, config file, built-in default. Options a
command requires are satisfied by a value from the file or the environment.
"""

from __future__ import annotations

import argparse
import os
import tomllib
from collections.abc import Callable, Mapping
from pathlib import Path

from pulsenet.errors import ConfigError

ENV_PREFIX = "PULSENET_"
_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off", ""}


def load_toml(path: str | Path) -> dict:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None


def command_path(parser: argparse.ArgumentParser, argv: list[str]) -> list[tuple[str, argparse.ArgumentParser]]:
    """The chain of (name, subparser) that ``argv`` selects, e.g. [("loco", p1), ("train", p2)]."""
    chain, current = [], parser
    for token in argv:
        sub = _subcommands(current)
        if token in sub:
            current = sub[token]
            chain.append((token, current))
    return chain


def apply_defaults(
    parser: argparse.ArgumentParser,
    argv: list[str],
    config: Mapping | None,
    environ: Mapping[str, str],
    source: str = "config",
) -> Callable[[argparse.Namespace], argparse.Namespace]:
    """Set the selected command's defaults from ``config`` (its table) and ``environ``.

    Returns the step to run on the parsed namespace: argparse appends a repeatable option's
    command-line values to its default list, where the command line should replace it.
    """
    chain = command_path(parser, argv)
    if not chain or chain[-1][1].get_default("settings_table"):  # nodes: pulsenet/settings.py reads it
        return lambda args: args
    name = ".".join(n for n, _ in chain)
    target = chain[-1][1]
    options = {a.dest: a for a in target._actions if a.option_strings and a.dest != "help"}
    by_key = {s[2:].replace("-", "_"): a for a in options.values() for s in a.option_strings if s.startswith("--")}
    values: dict[str, object] = {}
    table = _table(config or {}, [n for n, _ in chain], source)
    for key, value in table.items():
        action = by_key.get(key.replace("-", "_"))
        if action is None:
            known = ", ".join(sorted(k.replace("_", "-") for k in by_key))
            raise ConfigError(f"{source}: [{name}] has no option {key!r} (known: {known})")
        values[action.dest] = _check(action, value, f"{source}: [{name}] {key}")
    for dest, action in options.items():
        var = ENV_PREFIX + dest.upper()
        if var in environ:
            values[dest] = _from_env(action, environ[var], var)
    for dest, value in values.items():
        options[dest].required = False
        options[dest].default = value
    appended = {
        dest: len(value)
        for dest, value in values.items()
        if isinstance(options[dest], argparse._AppendAction)
        and any(t == o or t.startswith(o + "=") for t in argv for o in options[dest].option_strings)
    }

    def replace_appended(args: argparse.Namespace) -> argparse.Namespace:
        for dest, n in appended.items():
            setattr(args, dest, getattr(args, dest)[n:])
        return args

    return replace_appended


def _table(config: Mapping, path: list[str], source: str) -> Mapping:
    node: object = config
    for part in path:
        if not isinstance(node, Mapping):
            raise ConfigError(f"{source}: [{'.'.join(path)}] must be a table")
        node = node.get(part, {})
    if not isinstance(node, Mapping):
        raise ConfigError(f"{source}: [{'.'.join(path)}] must be a table")
    return {k: v for k, v in node.items() if not isinstance(v, Mapping)}  # nested: subcommands


def _check(action: argparse.Action, value: object, where: str) -> object:
    """TOML values are typed already; run strings through the option's own type and choices."""
    if isinstance(action, argparse._StoreTrueAction | argparse._StoreFalseAction):
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true or false, got {value!r}")
        return value
    if action.nargs in ("*", "+") or isinstance(action, argparse._AppendAction):
        items = value if isinstance(value, list) else [value]
        return [_convert(action, v, where) for v in items]
    return _convert(action, value, where)


def _convert(action: argparse.Action, value: object, where: str) -> object:
    if isinstance(value, str) and callable(action.type):
        try:
            value = action.type(value)
        except (TypeError, ValueError, argparse.ArgumentTypeError) as e:
            raise ConfigError(f"{where}: {value!r} is not valid: {e}") from None
    elif isinstance(value, int | float) and action.type is float:
        value = float(value)
    if action.choices is not None and value not in action.choices:
        raise ConfigError(f"{where}: {value!r} is not one of {list(action.choices)}")
    return value


def _from_env(action: argparse.Action, raw: str, var: str) -> object:
    if isinstance(action, argparse._StoreTrueAction | argparse._StoreFalseAction):
        low = raw.strip().lower()
        if low not in _TRUE | _FALSE:
            raise ConfigError(f"{var}={raw!r}: expected one of {sorted(_TRUE | _FALSE)}")
        return (low in _TRUE) == isinstance(action, argparse._StoreTrueAction)
    if action.nargs in ("*", "+") or isinstance(action, argparse._AppendAction):
        return [_convert(action, v, var) for v in raw.replace(",", " ").split()]
    return _convert(action, raw, var)


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def config_from_argv(argv: list[str], environ: Mapping[str, str] = os.environ) -> tuple[dict | None, str]:
    """The ``--config FILE`` given before the command (or ``PULSENET_CONFIG``), loaded."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config")
    known, _ = pre.parse_known_args(argv)
    path = known.config or environ.get(ENV_PREFIX + "CONFIG")
    if not path:
        return None, ""
    if not Path(path).is_file():
        raise ConfigError(f"config file {path} does not exist")
    return load_toml(path), str(path)
