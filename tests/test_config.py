"""Command defaults from configs/*.toml and PULSENET_* environment variables."""

from __future__ import annotations

from pathlib import Path

import pytest

from pulsenet.cli import main, parse_cli
from pulsenet.errors import ConfigError

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


@pytest.mark.parametrize(
    ("name", "argv", "env"),
    [
        ("inference.toml", ["pull"], {}),
        ("trainer.toml", ["publish", "model-dir"], {}),
        ("loco.toml", ["loco", "train"], {"PULSENET_ID": "t0", "PULSENET_KEY": "keys/t0.key"}),
    ],
)
def test_shipped_configs_parse(name, argv, env):
    args = parse_cli(["--config", str(CONFIGS / name), *argv], env)
    assert args.store.startswith("s3://")


def test_precedence_flag_over_env_over_file(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text('[pull]\nstore = "s3://from-file"\ntrust = ["a.pub"]\nout = "o"\ninterval = 5\n')
    args = parse_cli(["--config", str(cfg), "pull"], {})
    assert (args.store, args.interval, [str(t) for t in args.trust]) == ("s3://from-file", 5.0, ["a.pub"])
    env = {"PULSENET_STORE": "s3://from-env", "PULSENET_TRUST": "x.pub,y.pub", "PULSENET_FOLLOW": "yes"}
    args = parse_cli(["--config", str(cfg), "pull"], env)
    assert (args.store, [str(t) for t in args.trust], args.follow) == ("s3://from-env", ["x.pub", "y.pub"], True)
    args = parse_cli(["--config", str(cfg), "pull", "--store", "s3://from-flag"], env)
    assert args.store == "s3://from-flag"
    args = parse_cli(["--config", str(cfg), "pull", "--trust", "z.pub"], env)  # repeatable: replaced
    assert [str(t) for t in args.trust] == ["z.pub"]


def test_env_alone_satisfies_required_options():
    args = parse_cli(["pull"], {"PULSENET_STORE": "file:///tmp/x", "PULSENET_TRUST": "k.pub", "PULSENET_OUT": "o"})
    assert args.store == "file:///tmp/x"
    with pytest.raises(SystemExit):  # still required when nobody gives it
        parse_cli(["pull"], {})


@pytest.mark.parametrize(
    ("toml", "env", "message"),
    [
        ('[pull]\nstor = "s3://x"\n', {}, "has no option 'stor'"),
        ('[pull]\ninterval = "soon"\n', {}, "'soon' is not valid"),
        ('[pull]\nfollow = "yes"\n', {}, "expected true or false"),
        ('[publish]\ndtype = "fp8"\n', {}, "not one of"),
        ("[pull\n", {}, "not valid TOML"),
        ("", {"PULSENET_FOLLOW": "maybe"}, "PULSENET_FOLLOW"),
        ("", {"PULSENET_INTERVAL": "x"}, "PULSENET_INTERVAL"),
    ],
)
def test_bad_config_is_a_clear_error(tmp_path, toml, env, message):
    cfg = tmp_path / "c.toml"
    cfg.write_text(toml)
    cmd = ["publish", "m"] if "publish" in toml else ["pull"]
    with pytest.raises(ConfigError, match=message):
        parse_cli(["--config", str(cfg), *cmd], env)


def test_missing_config_file_exits_2(tmp_path, capsys):
    assert main(["--config", str(tmp_path / "absent.toml"), "pull"]) == 2
    assert "does not exist" in capsys.readouterr().err
