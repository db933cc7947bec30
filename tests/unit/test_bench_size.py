"""``pulsenet bench size`` at a tiny shape of the same code (the budgets' arithmetic, the CLI
children's peak memory, publish/pull through throttled link relays): seconds, not minutes."""

from __future__ import annotations

import gc

import pytest

from pulsenet.bench import fixtures, size
from pulsenet.bench.size import SizeBenchSettings, run
from pulsenet.codec.threads import codec_threads
from pulsenet.errors import ConfigError
from pulsenet.nodes.memory import GiB
from pulsenet.sync import Subscriber

TINY = fixtures.Shape("test", 64, 128, 2, 4, 2, 10000.0, 256)


@pytest.fixture
def tiny_size(monkeypatch, tmp_path):
    monkeypatch.setitem(fixtures.SIZES, "test", TINY)
    monkeypatch.setattr(fixtures, "CACHE", tmp_path / "fixtures")
    return "test"


def test_codec_threads_take_the_callers_share(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cores = codec_threads()
    assert cores >= 1 and codec_threads(3) == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert codec_threads() == 1 and codec_threads(0) == 1 and codec_threads(2) == 2


@pytest.mark.timeout(300)
def test_bench_size_end_to_end_at_a_tiny_size(tiny_size, tmp_path):
    gc.collect()  # earlier tests' garbage, Subscribers in cycles included, goes first
    before = {id(o) for o in gc.get_objects() if isinstance(o, Subscriber)}  # any that another test still holds
    gc.disable()  # a session's subscribers must go when it ends, not whenever the cyclic GC runs (a 3B OOM)
    try:
        r = run(SizeBenchSettings(params=tiny_size, repeat=1, link_mbps=[50.0], subscribers=2, workdir=tmp_path))
        assert not [o for o in gc.get_objects() if isinstance(o, Subscriber) and id(o) not in before]
    finally:
        gc.enable()
    pair = r["fixture"]["pair"]
    assert pair["method"] == "adamw" and len(pair["losses"]) == 2 and 0 < pair["changed_fraction"] < 0.2
    assert r["bytes"]["patch"] < r["bytes"]["model_bf16"] / 5 and r["bytes"]["changed_entries"] == pair["changed"]
    assert r["sha256"]["one_core_GBps"] > 0
    assert r["machine"]["cpu_stolen_s"] >= 0  # Linux: read from /proc/stat
    assert set(r["codec"]) == {"encode_known_base", "encode_hash_base", "apply_verify", "apply_verify_fresh"}
    for c in r["codec"].values():
        assert c["one_thread_s"] > 0 and c["all_threads_s"] > 0
    for k in ("encode", "apply", "apply_known_base"):
        rss = r["cli"][k]["peak_rss_bytes"]
        assert 50e6 < rss < 4e9  # a real child's peak (python + torch), counted by the kernel
    versions = r["e2e"]["versions"]
    assert [v["kind"] for v in versions] == ["anchor", "patch", "patch", "patch", "patch"]  # warm-up 1, repeat 3
    assert [v["warmup"] for v in versions] == [False, True, False, False, False]
    for v in versions[1:]:
        assert v["budget_s"] == pytest.approx(1.25 * v["payload_bytes"]["patch"] * 8 / 50e6 + 2.0)
        assert v["link"].startswith("chaos link relay")  # a relay process per subscriber, the store unthrottled
        assert v["all_verified_s"] >= v["link_time_s"]  # the relay did hold it to 50 Mbit/s
    judged = versions[2:]  # the warm-up version is reported, not judged
    b = r["budgets"]
    latencies = sorted(v["all_verified_s"] for v in judged)
    assert b["latency_50mbps"]["value"] == latencies[1] and b["latency_50mbps"]["each"] == [
        v["all_verified_s"] for v in judged
    ]
    assert b["latency_50mbps"]["pass"] == (latencies[1] <= sorted(v["budget_s"] for v in judged)[1])
    assert {"memory_cli_encode", "memory_cli_apply", "rate_encode_known_base", "rate_apply_verify"} <= set(b)


def test_scaling_table_fits_and_projects():
    from pulsenet.bench.size_table import constants, fit_through_origin, table

    assert fit_through_origin([1.0, 2.0], [2.0, 4.0]) == 2.0

    def result(params: int, enc_s: float, patch: int, changed: int) -> dict:
        codec = {"one_thread_s": 2 * enc_s, "all_threads_s": enc_s, "ratio_to_sha_floor_x_threads": 0.4,
                 "ratio_to_sha_floor_one_thread": 0.5}
        return {
            "config": {"params": f"{params}"}, "machine": {"threads_used": 2, "load_average_start": [1.0]},
            "fixture": {"pair": {"params": params, "changed_fraction": changed / params, "method": "adamw"}},
            "bytes": {"model_bf16": 2 * params, "patch": patch, "ratio": 2 * params / patch, "changed_entries": changed},
            "codec": {"encode_known_base": codec, "encode_hash_base": codec, "apply_verify": codec},
            "cli": None, "e2e": None,
        }

    rows = [result(10**8, 1.0, 2_000_000, 10**6), result(10**9, 10.0, 20_000_000, 10**7)]
    c = constants(rows)
    assert c["encode_known_base"] == pytest.approx(1e-8) and c["bytes_per_changed_entry"] == pytest.approx(2.0)
    md = table(rows)
    assert "fresh memory" not in md  # older runs did not measure it
    rows[0]["codec"]["apply_verify_fresh"] = {"ratio_to_sha_floor_one_thread": 0.25, "ratio_to_sha_floor_x_threads": 0.3}
    rows[0]["machine"]["cpu_stolen_s"] = 2.3
    assert "0.50 / 0.40 (fresh memory 0.25 / 0.30) |" in table(rows) and "| 1.0; 2.3 s stolen |" in table(rows)
    assert "| 7B (projected) | 7B | 14 GB | 1% (assumed) | 140 MB |" in md  # 2 B x 1% x 7e9
    assert "- / 70 |" in md and "108 MB" in md


def test_publish_pull_that_cannot_fit_is_refused_at_start_naming_the_flag(tiny_size, tmp_path, monkeypatch):
    # 3B (5.94 GB of BF16) beside this VM's 22 GiB: runs (it peaked at 21.1 GiB); beside 16 GiB: refused
    assert size.e2e_refusal(5_940_000_000, 22 * GiB) is None
    why = size.e2e_refusal(5_940_000_000, 16 * GiB)
    assert why is not None and "--no-e2e" in why and "18.1 GiB" in why
    assert size.e2e_refusal(10**12, None) is None  # no /proc/meminfo: nothing to judge by

    monkeypatch.setattr(size, "available_memory", lambda: 1 << 20)
    with pytest.raises(ConfigError, match="--no-e2e"):
        run(SizeBenchSettings(params=tiny_size, workdir=tmp_path))
    assert not (fixtures.CACHE / "test-s0" / "pair").exists()  # refused before the pair was made
    r = run(SizeBenchSettings(params=tiny_size, repeat=1, cli=False, e2e=False, workdir=tmp_path))
    assert r["e2e"] is None and r["codec"]["apply_verify"]["all_threads_s"] > 0
