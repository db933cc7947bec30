"""The one config schema: dataclass defaults <- TOML table <- PULSENET_* <- flags."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Annotated

import pytest
import tyro

from pulsenet.errors import ConfigError
from pulsenet.settings import fields_of, load_settings, load_toml, require, write_toml


@dataclasses.dataclass(kw_only=True)
class Inner:
    lr: float = 3e-6
    """Learning rate."""
    clip: bool = True
    """Clip."""


@dataclasses.dataclass(kw_only=True)
class Node:
    store: str = ""
    """Store URL."""
    rounds: int = 3
    """Rounds to run."""
    trust: list[Path] = dataclasses.field(default_factory=list)
    """Trusted keys."""
    follow: bool = False
    """Keep following."""
    max_staleness: int = 2
    """Versions of lag allowed."""
    inner: Inner = dataclasses.field(default_factory=Inner)


def test_sources_apply_in_order(tmp_path: Path) -> None:
    cfg = tmp_path / "n.toml"
    cfg.write_text(
        '[node]\nstore = "s3://file"\nrounds = 5\ntrust = ["a.pub"]\nmax-staleness = 4\n'
        "[node.inner]\nlr = 1e-4\nclip = false\n"
    )
    n = load_settings(Node, table="node", config=cfg, environ={})
    assert (n.store, n.rounds, n.trust, n.max_staleness, n.inner.lr, n.inner.clip) == (
        "s3://file", 5, [Path("a.pub")], 4, 1e-4, False
    )
    env = {"PULSENET_STORE": "s3://env", "PULSENET_TRUST": "x.pub,y.pub", "PULSENET_FOLLOW": "yes", "PULSENET_INNER__LR": "2e-5"}
    n = load_settings(Node, table="node", config=cfg, environ=env)
    assert (n.store, n.trust, n.follow, n.rounds, n.inner.lr) == ("s3://env", [Path("x.pub"), Path("y.pub")], True, 5, 2e-5)
    n = load_settings(Node, table="node", config=cfg, environ=env, argv=["--store", "s3://flag", "--inner.lr", "0.5"])
    assert (n.store, n.inner.lr, n.rounds) == ("s3://flag", 0.5, 5)
    assert load_settings(Node, table="node", environ={}) == Node()


def test_bad_values_name_field_and_source(tmp_path: Path) -> None:
    cfg = tmp_path / "n.toml"
    cfg.write_text('[node]\nrounds = "many"\n')
    with pytest.raises(ConfigError, match=r"n\.toml \[node\].*rounds"):
        load_settings(Node, table="node", config=cfg, environ={})
    cfg.write_text("[node]\nroundz = 3\n")
    with pytest.raises(ConfigError, match=r"no setting 'roundz'.*rounds"):
        load_settings(Node, table="node", config=cfg, environ={})
    with pytest.raises(ConfigError, match=r"PULSENET_MAX_STALENESS=.*max-staleness"):
        load_settings(Node, table="node", environ={"PULSENET_MAX_STALENESS": "x"})
    with pytest.raises(ConfigError, match="PULSENET_FOLLOW"):
        load_settings(Node, table="node", environ={"PULSENET_FOLLOW": "maybe"})


@dataclasses.dataclass(kw_only=True)
class Flat:
    steps: int = 8
    """Steps."""
    timeouts: Inner = dataclasses.field(default_factory=Inner)


@dataclasses.dataclass(kw_only=True)
class Cmd:
    model: Annotated[Path | None, tyro.conf.Positional] = None
    """The model."""
    trust: list[Path] = dataclasses.field(default_factory=list)
    """Trusted keys."""
    flat: Annotated[Flat, tyro.conf.arg(name="")] = dataclasses.field(default_factory=Flat)


def test_positional_flat_nesting_aliases_and_repeated_lists(tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text('[cmd]\nmodel = "m-file"\nsteps = 3\n[cmd.timeouts]\nlr = 0.25\n')
    c = load_settings(Cmd, table="cmd", config=cfg, environ={})
    assert (c.model, c.flat.steps, c.flat.timeouts.lr) == (Path("m-file"), 3, 0.25)
    c = load_settings(Cmd, table="cmd", config=cfg, environ={"PULSENET_MODEL": "m-env", "PULSENET_TIMEOUTS__LR": "0.5"})
    assert (c.model, c.flat.timeouts.lr) == (Path("m-env"), 0.5)
    argv = ["m-flag", "--trust", "a", "--S", "4", "--trust", "b", "c", "--timeouts.lr=1"]
    c = load_settings(Cmd, table="cmd", config=cfg, environ={}, argv=argv, aliases={"--S": "--steps"})
    assert (c.model, c.trust, c.flat.steps, c.flat.timeouts.lr) == (Path("m-flag"), [Path("a"), Path("b"), Path("c")], 4, 1.0)
    with pytest.raises(SystemExit):  # an alias is the command line's only
        load_settings(Cmd, table="cmd", environ={}, argv=["--S", "4"])


def test_require_names_every_source() -> None:
    with pytest.raises(ConfigError, match=r"^pull needs --store \(or PULSENET_STORE, or store in \[pull\] of --config\)$"):
        require(Node(), "store", table="pull")
    require(Node(store="s3://x"), "store", table="pull")


def test_fields_of_takes_some_settings_with_their_docstrings(capsys) -> None:
    """A command that takes some of another schema's settings (bench loco: LocoConfig's outer step)
    gets them with their types, defaults and help, under their own names, and not the others."""
    part = fields_of(Node, "rounds", "follow")
    assert [f.name for f in dataclasses.fields(part)] == ["rounds", "follow"]
    p = load_settings(part, table="part", environ={"PULSENET_ROUNDS": "5"}, argv=["--follow"])
    assert (p.rounds, p.follow) == (5, True)
    assert load_settings(part, table="part", environ={}) == part(rounds=3, follow=False)
    with pytest.raises(ConfigError, match=r"PULSENET_ROUNDS='x': .*--rounds"):
        load_settings(part, table="part", environ={"PULSENET_ROUNDS": "x"})
    with pytest.raises(SystemExit):
        load_settings(part, table="part", environ={}, argv=["--help"])
    out = capsys.readouterr().out
    assert "Rounds to run." in out and "Keep following." in out and "--store" not in out


def test_write_toml_writes_a_table_that_reads_back_as_given(tmp_path: Path) -> None:
    """The one TOML writer (``pulsenet up``'s node configs): strings with quotes and backslashes,
    numbers, booleans, lists and nested tables read back as the table given."""
    table = {
        "trainer": {
            "id": 't0 "quoted" \\ back',
            "lr": 1e-05,
            "steps": 3,
            "resume": False,
            "stop": ["\n", "x"],
            "loco": {"deadline_s": 120.0, "peers": []},
        }
    }
    path = write_toml(tmp_path / "t0.toml", table)
    assert load_toml(path) == table
