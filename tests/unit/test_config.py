"""Command settings from configs/*.toml, PULSENET_* environment variables and flags: one schema
(the commands' dataclasses, pulsenet/settings.py), checked value by value against the shipped files."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from pulsenet.cli import command_settings, main, parse_cli
from pulsenet.cli.loco_train import LocoTrainSettings
from pulsenet.cli.sync import LsSettings, PublishSettings, PullSettings
from pulsenet.errors import ConfigError
from pulsenet.loco.config import LocoConfig
from pulsenet.settings import load_toml

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def _load(argv: list[str], cls: type, env: dict[str, str]):
    """What ``pulsenet ARGV`` would run with, settings-wise."""
    return command_settings(parse_cli(argv, env), cls, env)


def _settings_value(got):
    """A loaded setting in the form TOML wrote it (paths as strings, lists of strings)."""
    if isinstance(got, list | tuple):
        return [str(g) if isinstance(g, Path) else g for g in got]
    return str(got) if isinstance(got, Path) else got


def _field(obj, key: str):
    """``obj.key``, looking into nested settings that add no prefix (``LocoTrainSettings.loco``)."""
    name = key.replace("-", "_")
    if hasattr(obj, name):
        return getattr(obj, name)
    flat = [getattr(obj, f.name) for f in dataclasses.fields(obj) if dataclasses.is_dataclass(getattr(obj, f.name))]
    found = [getattr(sub, name) for sub in flat if hasattr(sub, name)]
    assert len(found) == 1, f"{key}: {len(found)} settings of that name"
    return found[0]


def _check_value_by_value(name: str, obj, table: dict, where: str) -> None:
    assert table, f"{name} sets nothing in [{where}]"
    for key, value in table.items():
        if isinstance(value, dict):
            _check_value_by_value(name, _field(obj, key), value, f"{where}.{key}")
            continue
        got = _settings_value(_field(obj, key))
        assert got == value and type(got) is type(value), f"{name} [{where}] {key} = {value!r} arrived as {got!r}"


@pytest.mark.parametrize(
    ("name", "argv", "cls", "env"),
    [
        ("inference.toml", ["pull"], PullSettings, {}),
        ("trainer.toml", ["publish", "model-dir"], PublishSettings, {}),
        ("loco.toml", ["loco", "train"], LocoTrainSettings, {"PULSENET_ID": "t0", "PULSENET_KEY": "keys/t0.key"}),
    ],
)
def test_shipped_command_tables_load_value_by_value(name, argv, cls, env):
    """Every value a shipped file sets reaches the command's settings, typed (not just that it parses)."""
    s = _load(["--config", str(CONFIGS / name), *argv], cls, env)
    table = parse_cli(argv, env).settings_table
    data = load_toml(CONFIGS / name)
    for part in table.split("."):
        data = data[part]
    _check_value_by_value(name, s, data, table)
    if cls is PublishSettings:
        assert s.model == Path("model-dir")
    if cls is LocoTrainSettings:
        assert (s.id, s.key) == ("t0", Path("keys/t0.key"))


def test_loco_train_settings_are_the_loco_config(tmp_path):
    """``loco train`` fills the run's LocoConfig itself (no mapping): flags are its field names, the
    older spellings still work, and the store deadlines are one value for the store and the protocol."""
    from pulsenet.deadlines import SMALL_CALL_S, TRANSFER_S

    env = {"PULSENET_ID": "a", "PULSENET_KEY": "a.key", "PULSENET_TRUST": "a.pub", "PULSENET_STORE": "file:///x"}
    s = _load(["loco", "train"], LocoTrainSettings, env)
    assert s.loco == LocoConfig() and (s.loco.timeouts.small_s, s.loco.timeouts.transfer_s) == (SMALL_CALL_S, TRANSFER_S)
    argv = ["loco", "train", "--H", "4", "--deadline", "20", "--poll=0.1", "--store-timeout", "20",
            "--transfer-timeout", "60", "--outer-lr", "0.5", "--overlap", "--mode", "diloco", "--batch", "2"]  # fmt: skip
    s = _load(argv, LocoTrainSettings, {**env, "PULSENET_TIMEOUTS__SMALL_S": "5", "PULSENET_GATE_SCALE": "1.5"})
    assert (s.loco.inner_steps, s.loco.deadline_s, s.loco.poll_s, s.loco.outer_lr) == (4, 20.0, 0.1, 0.5)
    assert (s.loco.timeouts.small_s, s.loco.timeouts.transfer_s, s.loco.gate_scale) == (20.0, 60.0, 1.5)
    assert (s.loco.overlap, s.loco.mode, s.inner.batch) == (True, "diloco", 2)
    cfg = tmp_path / "l.toml"
    cfg.write_text("[loco.train]\nH = 8\n")  # an old key: the error names the field to use
    with pytest.raises(ConfigError, match=r"no setting 'H' \(known: .*inner-steps"):
        _load(["--config", str(cfg), "loco", "train"], LocoTrainSettings, env)
    cfg.write_text('[loco.train]\nmode = "sparse"\n')
    with pytest.raises(ConfigError, match=r"l\.toml \[loco.train\]: .*sparse.*--mode"):
        _load(["--config", str(cfg), "loco", "train"], LocoTrainSettings, env)


def test_config_after_the_command(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text('[ls]\nstore = "s3://from-file"\njson = true\n')
    s = _load(["ls", "--config", str(cfg)], LsSettings, {})
    assert (s.store, s.json) == ("s3://from-file", True)
    s = _load(["ls"], LsSettings, {"PULSENET_CONFIG": str(cfg)})
    assert s.store == "s3://from-file"


def test_precedence_flag_over_env_over_file(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text('[pull]\nstore = "s3://from-file"\ntrust = ["a.pub"]\nout = "o"\ninterval = 5\n')
    s = _load(["--config", str(cfg), "pull"], PullSettings, {})
    assert (s.store, s.interval, s.trust, s.out) == ("s3://from-file", 5.0, [Path("a.pub")], Path("o"))
    env = {"PULSENET_STORE": "s3://from-env", "PULSENET_TRUST": "x.pub,y.pub", "PULSENET_FOLLOW": "yes"}
    s = _load(["--config", str(cfg), "pull"], PullSettings, env)
    assert (s.store, s.trust, s.follow, s.interval) == ("s3://from-env", [Path("x.pub"), Path("y.pub")], True, 5.0)
    s = _load(["--config", str(cfg), "pull", "--store", "s3://from-flag", "--no-follow"], PullSettings, env)
    assert (s.store, s.follow) == ("s3://from-flag", False)
    s = _load(["--config", str(cfg), "pull", "--trust", "z.pub"], PullSettings, env)  # a list flag replaces
    assert s.trust == [Path("z.pub")]
    s = _load(["pull", "--trust", "a.pub", "--interval", "1", "--trust", "b.pub", "c.pub"], PullSettings, {})
    assert (s.trust, s.interval) == ([Path("a.pub"), Path("b.pub"), Path("c.pub")], 1.0)  # repeated: all kept


def test_required_settings_from_any_source(tmp_path, capsys):
    env = {"PULSENET_STORE": "file:///tmp/x", "PULSENET_TRUST": "k.pub", "PULSENET_OUT": "o"}
    s = _load(["pull"], PullSettings, env)
    assert (s.store, s.trust, s.out) == ("file:///tmp/x", [Path("k.pub")], Path("o"))
    # Still required when nobody gives it: the error says every way to give it.
    assert main(["pull", "--store", "file:///tmp/x", "--trust", "k.pub"]) == 2
    assert "pull needs --out (or PULSENET_OUT, or out in [pull] of --config)" in capsys.readouterr().err
    assert main(["publish", "--store", "file:///tmp/x", "--key", "k"]) == 2
    assert "publish needs --model" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("toml", "env", "message"),
    [
        ('[pull]\nstor = "s3://x"\n', {}, r"c\.toml \[pull\]: no setting 'stor' \(known: .*store"),
        ('[pull]\ninterval = "soon"\n', {}, r"c\.toml \[pull\]: .*--interval.*soon"),
        ('[pull]\nfollow = "yes"\n', {}, r"c\.toml \[pull\]: follow must be true or false"),
        ('[publish]\ndtype = "fp8"\n', {}, r"c\.toml \[publish\]: .*fp8.*--dtype"),
        ("[pull\n", {}, "not valid TOML"),
        ("", {"PULSENET_FOLLOW": "maybe"}, "PULSENET_FOLLOW='maybe'"),
        ("", {"PULSENET_INTERVAL": "x"}, r"PULSENET_INTERVAL='x': .*--interval"),
    ],
)
def test_bad_config_is_a_clear_error(tmp_path, toml, env, message):
    cfg = tmp_path / "c.toml"
    cfg.write_text(toml)
    cmd, cls = (["publish", "m"], PublishSettings) if "publish" in toml else (["pull"], PullSettings)
    with pytest.raises(ConfigError, match=message):
        _load(["--config", str(cfg), *cmd], cls, env)


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


def test_command_help_is_the_field_docstrings(capsys):
    with pytest.raises(SystemExit) as e:
        main(["pull", "--help"])
    assert e.value.code == 0
    out = " ".join(capsys.readouterr().out.replace("│", " ").split())
    assert "--interval" in out and "Seconds between polls." in out and "--no-follow" in out


@pytest.mark.parametrize(("name", "table"), [("trainer.toml", "trainer"), ("inference.toml", "inference")])
def test_shipped_node_tables_load_value_by_value(name, table):
    """``pulsenet trainer|inference --config configs/...``: every value of the table reaches the
    node's settings, typed, through the one schema (pulsenet.settings.load_settings)."""
    from pulsenet.nodes.config import InferenceConfig, TrainerConfig
    from pulsenet.settings import load_settings

    cls = TrainerConfig if table == "trainer" else InferenceConfig
    c = load_settings(cls, table=table, config=CONFIGS / name, environ={})
    data = load_toml(CONFIGS / name)[table]
    assert data.get("store") and data.get("key")
    _check_value_by_value(name, c, data, table)


def test_node_table_site_overrides_by_env():
    """What docs/deploy.md and docker/compose.yaml set per site wins over the shipped file."""
    from pulsenet.nodes.config import InferenceConfig, TrainerConfig
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
    t = load_settings(
        TrainerConfig, table="trainer", config=CONFIGS / "trainer.toml", argv=["--grpo.lr", "1e-5"],
        environ={"PULSENET_GRPO__LR": "3e-6"},
    )
    assert t.grpo.lr == 1e-5
