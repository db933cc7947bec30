"""``pulsenet bench sync``, ``e2e`` and ``rl`` end to end on the tiny model (the demo's code path),
and the benches' settings."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


def run_bench(tmp_path, *args: str) -> dict:
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "pulsenet", "bench", *args, "--json", str(out)],
        capture_output=True, text=True, timeout=240,  # inside pytest's 300 s, so a hang reports its stderr
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_bench_sync_tiny(tmp_path):
    result = run_bench(tmp_path, "sync", "--model", "tiny", "--steps", "2", "--workdir", str(tmp_path / "w"))
    assert result["schema"] == "pulsenet.bench.sync/1"
    assert [r["pair"] for r in result["pairs"]] == ["step0->step1", "step1->step2", "step0->step2"]
    assert result["summary"]["bit_exact"] is True
    for row in result["pairs"]:
        assert 0 < row["changed_fraction"] < 1
        assert row["bytes"]["pulsenet_v1"] < row["bytes"]["full_bf16"]
        assert row["pulsenet_v1"]["encode_MBps"] > 0 and row["pulsenet_v1"]["decode_apply_verify_MBps"] > 0
    assert sorted(p.name for p in (tmp_path / "w").iterdir()) == [f"step{k}.safetensors" for k in range(3)]


def test_bench_e2e_tiny(tmp_path):
    result = run_bench(tmp_path, "e2e", "--model", "tiny", "--versions", "2", "--subscribers", "1")
    summary = result["summary"]
    assert summary["all_digests_match"] is True
    assert summary["patch_bytes_mean"] < summary["full_checkpoint_bytes"]


def test_bench_rl_tiny(tmp_path):
    """Asynchronous GRPO through the real embedded S3 server: every engine served only verified
    weights (digests equal the published ones), staleness stays within its bound, real numbers."""
    result = run_bench(
        tmp_path, "rl", "--model", "tiny", "--steps", "4", "--inference", "2", "--max-staleness", "1",
        "--rows-per-step", "64", "--prompts", "4", "--group-size", "8", "--workdir", str(tmp_path / "w"),
    )  # fmt: skip
    assert result["schema"] == "pulsenet.bench.rl/1"
    s = result["summary"]
    assert s["digests_equal"] is True and s["final_version"] == 4
    assert len(s["reward"]) == 4 and all(0.0 <= r <= 1.0 for r in s["reward"])
    assert all(int(lag) <= 1 for lag in s["staleness"]) and sum(s["staleness"].values()) >= 4
    assert all(kl >= -1e-6 for kl in s["mismatch_kl"])
    b = s["bytes"]
    assert b["rollouts"] > 0 and 0 < b["pulsesync"] < b["full_sync"]
    assert s["update_apply_s"] and all(t > 0 for t in s["update_apply_s"])
    for node, versions in s["versions_served"].items():
        assert versions[0] == 0 and versions == sorted(versions), node


def test_bench_rl_two_trainers_pulseloco(tmp_path):
    """GRPO with PULSELoCo among two trainers: every trainer publishes every version with the same
    digest, engines follow one channel (each patch downloaded once), payloads were exchanged."""
    result = run_bench(
        tmp_path, "rl", "--model", "tiny", "--trainers", "2", "--inner-steps", "2", "--steps", "2",
        "--inference", "2", "--rows-per-step", "32", "--prompts", "4", "--group-size", "8",
        "--workdir", str(tmp_path / "w"),
    )  # fmt: skip
    s = result["summary"]
    assert s["digests_equal"] is True and s["final_version"] == 2
    assert s["pulseloco_bytes"] > 0 and len(s["reward"]) == 2
    b = s["bytes"]
    # One channel followed per engine: at most one download of each published patch per engine.
    assert 0 < b["pulsesync"] <= 2 * b["pulsesync_published"]  # 2 engines x each version once


def test_bench_replay_tiny(tmp_path):
    """The replay's cost against the GRPO step on the same batches, and honest rows replayed in full:
    every figure measured (not zero), ratios consistent with the times, 0 refusals, every replayed
    token's margins within the default tolerances."""
    result = run_bench(tmp_path, "replay", "--model", "tiny", "--rows", "96", "--repeats", "2", "--rows-per-step", "16")
    assert result["schema"] == "pulsenet.bench.replay/1"
    assert result["replay_config"] == {"share": 0.375, "min_rows": 8, "engine": "torch:float32", "cdf_tolerance": 1e-5,
                                       "logprob_tolerance": 5e-3, "mean_logprob_tolerance": 1e-3}  # fmt: skip
    c = result["cost"]
    assert c["batches"] == 2 and c["rows_per_batch"] == 16 and c["rows_replayed"] == 8  # min_rows of a 16-row batch
    assert c["sample_refused"] == 0
    t = c["median_s"]
    assert set(t) == {"gen_s", "step_s", "replay_s", "replay_loaded_s", "replay_all_s", "forward_s"}
    assert all(x > 0 for x in t.values()) and all(len(v) == 2 for v in c["all_s"].values())
    assert c["ratio"]["replay"] == pytest.approx(t["replay_s"] / t["step_s"], rel=1e-2)
    assert c["ratio"]["replay_all"] == pytest.approx(t["replay_all_s"] / t["step_s"], rel=1e-2)
    assert c["detect_one_row_default"] == 0.5
    for b in (c["budget_10pct"], c["budget_10pct_cpu"]):
        assert 0 <= b["rows"] <= b["rows_if_loaded"] <= 16 and b["share"] == round(b["rows"] / 16, 4) and b["per_row_s"] > 0
    m = result["margins"]
    assert m["rows"] >= 96 and m["batches"] == m["rows"] // 16 and m["tokens"] >= m["rows"]
    assert m["refused"] == {} and m["refusals"] == []
    assert 0 <= m["logprob_diff"]["q50"] <= m["logprob_diff"]["q99.9"] <= m["logprob_diff"]["max"] < 0.05
    assert -0.02 < m["cdf_margin"]["min"] <= m["cdf_margin"]["q0.1"] <= m["cdf_margin"]["q50"] <= 0.5
    assert m["batch_mean_logprob_diff"]["max"] < 0.01


def test_bench_settings_from_config_env_and_flags(tmp_path, capsys):
    """``bench loco`` (like every bench) is one schema: ``[bench.loco]`` of --config, then
    PULSENET_*, then flags, with LoCo train's inner loop and LocoConfig's outer-step settings under
    their own names (--H still spells --inner-steps); a bad value names the field and its source."""
    from pulsenet.bench import config_of
    from pulsenet.bench.loco import LocoBenchSettings
    from pulsenet.cli import command_settings, parse_cli
    from pulsenet.errors import ConfigError

    cfg = tmp_path / "bench.toml"

    def load(argv: list[str], env: dict[str, str]) -> LocoBenchSettings:
        return command_settings(parse_cli(["bench", "loco", "--config", str(cfg), *argv], env), LocoBenchSettings, env)

    cfg.write_text('[bench.loco]\ntask = "grpo"\nworkers = 3\nouter-lr = 0.5\nbatch = 5\noverlap = true\n')
    s = load([], {})
    assert (s.task, s.workers, s.outer.outer_lr, s.inner.batch, s.outer.overlap, s.rounds) == ("grpo", 3, 0.5, 5, True, 3)
    env = {"PULSENET_WORKERS": "6", "PULSENET_LINK_MBPS": "20", "PULSENET_OVERLAP": "false", "PULSENET_SEQ": "16"}
    s = load([], env)
    assert (s.workers, s.link_mbps, s.outer.overlap, s.inner.seq, s.outer.outer_lr) == (6, 20.0, False, 16, 0.5)
    s = load(["--workers", "2", "--H", "2", "--link-mbps", "5", "--model", "tiny", "--json", "o.json"], env)
    assert (s.workers, s.outer.inner_steps, s.link_mbps, s.inner.model, s.json) == (2, 2, 5.0, "tiny", Path("o.json"))
    assert load(["--H=4", "--overlap"], {}).outer.inner_steps == 4

    # the defaults and the JSON's "config" keys are the argparse options' of before the schema (plus plot)
    d = LocoBenchSettings()
    assert (d.workers, d.rounds, d.outer.inner_steps, d.inner.batch, d.inner.seq, d.inner.model) == (4, 3, 8, 2, 32, None)
    assert set(config_of(d)) == {
        "task", "model", "workers", "inner_steps", "rounds", "lr", "prompts", "group", "max_new_tokens",
        "eval_prompts", "batch", "seq", "outer_lr", "outer_momentum", "gate_scale", "overlap", "seed", "forward",
        "eval_batches", "modes", "threads", "link_mbps", "workdir", "json", "plot",
    }  # fmt: skip

    cfg.write_text('[bench.loco]\nworkers = "many"\n')
    with pytest.raises(ConfigError, match=r"bench\.toml \[bench\.loco\]: .*--workers.*many"):
        load([], {})
    cfg.write_text("[bench.loco]\nworkerz = 3\n")
    with pytest.raises(ConfigError, match=r"no setting 'workerz'.*workers"):
        load([], {})
    cfg.write_text("")
    with pytest.raises(ConfigError, match=r"PULSENET_OUTER_LR='fast': .*--outer-lr"):
        load([], {"PULSENET_OUTER_LR": "fast"})
    with pytest.raises(SystemExit):
        load(["--task", "ppo"], {})
    err = capsys.readouterr().err
    assert "--task" in err and "ppo" in err


def test_help_imports_no_benchmark():
    """The benches are imported when they run: ``pulsenet --help`` (every command's parser) imports no torch."""
    code = "import sys; from pulsenet.cli import build_parser; build_parser(); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "False"
