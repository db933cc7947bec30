"""Command defaults from configs/*.toml and PULSENET_* environment variables."""

from __future__ import annotations

from pathlib import Path

import pytest

from pulsenet.cli import build_parser, main, parse_cli
from pulsenet.config import command_path, load_toml
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
    """Every value a shipped file sets reaches the command, typed (not just that it parses)."""
    args = parse_cli(["--config", str(CONFIGS / name), *argv], env)
    table = load_toml(CONFIGS / name)
    for part in argv[0:1] if argv[0] != "loco" else argv[:2]:
        table = table[part]
    assert table, f"{name} sets nothing for {argv}"
    parser = build_parser()
    command = command_path(parser, argv)[-1][1]
    dest = {o[2:]: a.dest for a in command._actions for o in a.option_strings if o.startswith("--")}
    for key, value in table.items():
        got = getattr(args, dest[key])
        got = [str(g) for g in got] if isinstance(value, list) else str(got) if isinstance(got, Path) else got
        assert got == value and type(got) is type(value), f"{name}: {key} = {value!r} arrived as {got!r}"


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


def test_help_says_what_pulsenet_is_and_where_to_start(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "PULSESync" in out and "PULSELoCo" in out and "first steps:" in out
    assert "``" not in out  # no reST markup from a module docstring
    for command in ("keygen", "s3 serve", "publish", "pull", "bench sync"):
        assert f"pulsenet {command}" in out


def _settings_value(got):
    """A loaded setting in the form TOML wrote it (paths as strings, lists of strings)."""
    if isinstance(got, list | tuple):
        return [str(g) if isinstance(g, Path) else g for g in got]
    return str(got) if isinstance(got, Path) else got


@pytest.mark.parametrize(("name", "table"), [("trainer.toml", "trainer"), ("inference.toml", "inference")])
def test_shipped_node_tables_load_value_by_value(name, table):
    """``pulsenet trainer|inference --config configs/...``: every value of the table reaches the
    node's settings, typed, through the one schema (pulsenet.settings.load_settings)."""
    from pulsenet.nodes.inference import InferenceConfig
    from pulsenet.nodes.trainer import TrainerConfig
    from pulsenet.settings import load_settings

    cls = TrainerConfig if table == "trainer" else InferenceConfig
    c = load_settings(cls, table=table, config=CONFIGS / name, environ={})
    data = load_toml(CONFIGS / name)[table]
    assert data.get("store") and data.get("key")

    def check(obj, tbl, where):
        for key, value in tbl.items():
            if isinstance(value, dict):
                check(getattr(obj, key.replace("-", "_")), value, f"{where}.{key}")
                continue
            got = _settings_value(getattr(obj, key.replace("-", "_")))
            assert got == value and type(got) is type(value), f"{name} [{where}] {key} = {value!r} arrived as {got!r}"

    check(c, data, table)


def test_node_table_site_overrides_by_env():
    """What docs/deploy.md and docker/compose.yaml set per site wins over the shipped file."""
    from pulsenet.nodes.inference import InferenceConfig
    from pulsenet.nodes.trainer import TrainerConfig
    from pulsenet.settings import load_settings

    env = {
        "PULSENET_ID": "i1",
        "PULSENET_STORE": "s3://pulsenet-i1",
        "PULSENET_POLICY": "s3://pulsenet-t0, s3://pulsenet-t1",
        "PULSENET_TRUST": "keys/t0.key.pub,keys/t1.key.pub",
        "PULSENET_STATUS_PORT": "9000",
    }
    c = load_settings(InferenceConfig, table="inference", config=CONFIGS / "inference.toml", environ=env)
    assert (c.id, c.store, c.policy, c.status_port) == ("i1", "s3://pulsenet-i1", ["s3://pulsenet-t0", "s3://pulsenet-t1"], 9000)
    assert c.trust == [Path("keys/t0.key.pub"), Path("keys/t1.key.pub")]
    t = load_settings(TrainerConfig, table="trainer", config=CONFIGS / "trainer.toml", environ={"PULSENET_GRPO__LR": "3e-6"})
    assert t.grpo.lr == 3e-6 and t.model == "tiny"
    t = load_settings(TrainerConfig, table="trainer", config=CONFIGS / "trainer.toml", argv=["--grpo.lr", "1e-5"], environ={"PULSENET_GRPO__LR": "3e-6"})
    assert t.grpo.lr == 1e-5
