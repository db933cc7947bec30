"""Private key files (issue 21 item 10): keygen writes 0600 whatever the umask; a key that group or
others may read or write is refused, naming the file and the fix, unless explicitly allowed."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from pulsenet.cli import main
from pulsenet.cli.sync import PublishSettings
from pulsenet.errors import ConfigError
from pulsenet.settings import load_settings
from pulsenet.signing import generate_keypair, key_id, load_private_key, load_public_key


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def test_keygen_writes_the_private_key_0600_whatever_the_umask(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    old = os.umask(0)  # the most permissive umask a shell can have
    try:
        assert main(["keygen", "--out", str(tmp_path / "keys" / "t0.key")]) == 0
    finally:
        os.umask(old)
    key, pub = tmp_path / "keys" / "t0.key", tmp_path / "keys" / "t0.key.pub"
    assert (_mode(key), _mode(pub)) == (0o600, 0o644)
    assert key_id(load_private_key(key).public_key()) == key_id(load_public_key(pub))
    assert key_id(load_public_key(pub)) in capsys.readouterr().out


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660, 0o606, 0o620, 0o602, 0o610])
def test_a_key_open_to_group_or_others_is_refused_naming_the_file_and_the_fix(tmp_path: Path, mode: int) -> None:
    path = tmp_path / "site.key"
    generate_keypair(path)
    expected = load_private_key(path)
    path.chmod(mode)
    with pytest.raises(ConfigError) as e:
        load_private_key(path)
    assert str(path) in str(e.value) and f"chmod 600 {path}" in str(e.value) and f"{mode:04o}" in str(e.value)
    assert "--allow-open-key" in str(e.value)
    # Only an explicit choice loads it (the same key).
    assert key_id(load_private_key(path, allow_open=True).public_key()) == key_id(expected.public_key())


@pytest.mark.parametrize("mode", [0o600, 0o400])
def test_private_modes_load(tmp_path: Path, mode: int) -> None:
    path = tmp_path / "site.key"
    generate_keypair(path)
    path.chmod(mode)
    load_private_key(path)


def test_a_missing_or_unreadable_key_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"no\.key"):
        load_private_key(tmp_path / "no.key")
    (tmp_path / "bad.key").write_bytes(b"not a key")
    (tmp_path / "bad.key").chmod(0o600)
    with pytest.raises(ConfigError, match="not an unencrypted PEM"):
        load_private_key(tmp_path / "bad.key")


def test_commands_refuse_an_open_key_unless_told_to_accept_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``pulsenet publish`` (the same setting in ``pulsenet loco train``): refused with the fix on
    stderr; ``--allow-open-key`` or ``PULSENET_ALLOW_OPEN_KEY=true`` is the explicit choice."""
    key = tmp_path / "t0.key"
    generate_keypair(key)
    key.chmod(0o644)
    store = f"file://{tmp_path / 'store'}"
    assert main(["publish", "--store", store, "--key", str(key), str(tmp_path / "model.safetensors")]) == 2
    assert f"chmod 600 {key}" in capsys.readouterr().err
    # Allowed: the key loads and the command goes on to the next thing it lacks (the model file).
    assert main(["publish", "--store", store, "--key", str(key), "--allow-open-key", str(tmp_path / "model.safetensors")]) == 2
    err = capsys.readouterr().err
    assert "chmod" not in err and "model.safetensors" in err
    assert load_settings(PublishSettings, table="publish", environ={"PULSENET_ALLOW_OPEN_KEY": "true"}).allow_open_key
    assert not load_settings(PublishSettings, table="publish", environ={}).allow_open_key


def test_a_node_refuses_an_open_key(tmp_path: Path) -> None:
    """The node edge (``nodes/build.py``) loads its key strictly: an inference node with a 0644 key
    does not start."""
    from pulsenet.nodes.build import build_inference
    from pulsenet.nodes.config import InferenceConfig
    from pulsenet.store import LocalStore

    for site in ("t0", "i0"):
        generate_keypair(tmp_path / f"{site}.key")
    (tmp_path / "i0.key").chmod(0o644)
    config = InferenceConfig(
        store="file:///unused/i0", policy=["file:///unused/t0"], trust=[tmp_path / "t0.key.pub"], key=tmp_path / "i0.key"
    )
    with pytest.raises(ConfigError, match="chmod 600"):
        build_inference(config, open_store=lambda url: LocalStore(tmp_path / "s3" / url.rsplit("/", 1)[1]))
