"""The KV-cache example and benchmark run at tiny sizes, check what they claim, and
report every variant."""

import ast

import pytest
from _scripts import cached_script


@pytest.fixture(scope="module")
def bench():
    pytest.importorskip("matplotlib")
    return cached_script("benchmarks", "kv_cache", "_bench_kv_cache")


def test_decode_example_prints_tokens_and_matches_uncached(capsys):
    ex = cached_script("examples", "decode_kv_cache", "_decode_kv_cache_example")
    diff = ex.main(["--steps", "6", "--prompt-len", "3"])
    out = capsys.readouterr().out
    assert diff < 1e-5
    lines = {k.strip(): v for k, v in (ln.split(":", 1) for ln in out.splitlines())}
    value_tokens = ast.literal_eval(lines["value mode tokens"].strip())
    ref_tokens = ast.literal_eval(lines["ref mode tokens"].strip())
    assert len(value_tokens) == 6 and value_tokens == ref_tokens
    assert lines["value and ref modes decode the same tokens"].strip() == "True"
    printed = float(lines["max |cached - uncached| logits"].split()[2].rstrip(","))
    assert printed == pytest.approx(diff, rel=1e-2)
    assert "cursor after decoding: 8 / 9" in out


def test_kv_cache_benchmark_tiny(bench, tmp_path):
    rows = bench.main(["--tiny", "--out", str(tmp_path)])
    assert set(rows) == set(bench.VARIANTS)
    cfg = bench.TINY
    cache_mb = cfg.cache_bytes / 2**20
    for name, row in rows.items():
        assert row["checked"] is True, name
        assert row["max_abs_diff"] < 1e-5, name
        assert len(row["rounds_us"]) == 2
        assert 0 < row["min_us"] <= row["median_us"] <= row["max_us"]
        assert row["ratio"] > 0
        assert row["compile_s"] > 0
        assert row["peak_mb"] is not None  # Linux: VmHWM
        # in place: far less than a copy of the cache per call, except the control
        if name == "pure_jax_nodonate":
            assert row["xla_extra_mb"] >= cache_mb
        else:
            assert row["xla_extra_mb"] < 0.5 * cache_mb, name
    assert rows["pure_jax"]["ratio"] == 1.0
    assert rows["pure_jax_scan"]["ratio"] == 1.0
    table = (tmp_path / "results_kv_cache.md").read_text(encoding="utf-8")
    for name in rows:
        assert f"| {name}:" in table
    png = (tmp_path / "kv_cache.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"


def test_kv_cache_benchmark_check_catches_a_wrong_variant(bench, monkeypatch):
    """The correctness check is not vacuous: a variant that loses one prompt token
    is rejected before any timing."""
    cfg = bench.TINY
    model, prompt = bench.build(cfg)
    info = bench.check({"es_value_jit": bench.EsValueJit(cfg, model)}, model, prompt, 4)
    assert info["es_value_jit"]["checked"]

    original = bench.EsValueJit.prefill
    monkeypatch.setattr(bench.EsValueJit, "prefill", lambda s, p: original(s, p[1:]))
    bad = {"es_value_jit": bench.EsValueJit(cfg, model)}
    with pytest.raises(AssertionError, match="es_value_jit: "):
        bench.check(bad, model, prompt, 4)
