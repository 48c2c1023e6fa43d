"""The KV-cache example and benchmark run at tiny sizes, check what they claim, and
report every variant."""

import ast

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from _scripts import cached_script

import eqx_state as es


@pytest.fixture(scope="module")
def bench():
    pytest.importorskip("matplotlib")
    return cached_script("benchmarks", "kv_cache", "_bench_kv_cache")


def _example():
    return cached_script("examples", "decode_kv_cache", "_decode_kv_cache_example")


@pytest.mark.parametrize("steps", [1, pytest.param(4, marks=pytest.mark.slow)])
@pytest.mark.slow
def test_decode_example_prints_tokens_and_matches_uncached(capsys, steps):
    """`--steps 1` generates one token (the prefill's argmax) and still compares
    the prompt's logits; the batch rows decode what each prompt decodes alone."""
    diff = _example().main(["--steps", str(steps), "--prompt-len", "3"])
    out = capsys.readouterr().out
    assert diff < 1e-5
    lines = {k.strip(): v for k, v in (ln.split(":", 1) for ln in out.splitlines())}
    value_tokens = ast.literal_eval(lines["value mode tokens"].strip())
    ref_tokens = ast.literal_eval(lines["ref mode tokens"].strip())
    assert len(value_tokens) == steps and value_tokens == ref_tokens
    assert lines["value and ref modes decode the same tokens"].strip() == "True"
    words = lines["max |cached - uncached| logits"].split()
    batch_line = lines["batch rows decode as alone"]
    printed = max(  # value mode, ref mode, the batch's rows: what main returns
        float(words[2].rstrip(",")),
        float(words[5]),
        float(batch_line.split("max diff ")[1].rstrip(")")),
    )
    assert printed == pytest.approx(diff, rel=1e-2, abs=1e-9)
    assert f"cursor after decoding: {3 + steps - 1} / {3 + steps}" in out
    batch = ast.literal_eval(lines["batch tokens"].strip())
    assert len(batch) == 3 and all(len(row) == steps for row in batch)
    assert batch[0] == value_tokens  # row 0 is the same prompt


@pytest.mark.slow  # the example again; its own check runs by default above
def test_decode_example_first_token_is_the_uncached_argmax():
    """Independent of the example's own check: the generated tokens are the argmax
    of the uncached forward, step by step (plain loop, no cache)."""
    ex = _example()
    model = ex.TinyTransformer(16, 16, 2, 1, 8, key=jax.random.key(0))
    prompt = jnp.array([3, 1, 4])
    forward = eqx.filter_jit(lambda m, s: m(s))
    for steps in (1, 3):
        cached = es.nn.with_kv_cache(model, 3 + steps)
        (tokens, _), _ = ex.decode_value_mode(cached, prompt, steps)
        # causal: position j of a zero-padded sequence sees tokens 0..j only
        seq = jnp.concatenate([prompt, jnp.zeros(steps, prompt.dtype)])
        for k in range(steps):
            token = jnp.argmax(forward(model, seq)[2 + k]).astype(seq.dtype)
            seq = seq.at[3 + k].set(token)
        assert tokens.tolist() == seq[3:].tolist()


def test_decode_example_refuses_zero_steps(capsys):
    """`--steps 0` used to crash with a bare MLIRError; now a usage error."""
    with pytest.raises(SystemExit) as e:
        _example().main(["--steps", "0"])
    assert e.value.code == 2
    assert "--steps and --prompt-len must be at least 1" in capsys.readouterr().err
    with pytest.raises(ValueError, match="steps must be at least 1"):
        _example().greedy_decode(None, jnp.zeros(3, jnp.int32), 0)


def test_decode_example_check_fails_when_nothing_is_compared():
    """The example's comparison refuses empty (or mismatched) inputs, where a max
    over nothing would report a perfect match."""
    ex = _example()
    with pytest.raises(AssertionError, match="nothing to compare"):
        ex.max_abs_diff(jnp.zeros((0, 4)), jnp.zeros((0, 4)), "logits")
    with pytest.raises(AssertionError, match="nothing to compare"):
        ex.max_abs_diff(jnp.zeros((2, 4)), jnp.zeros((3, 4)), "logits")
    assert ex.max_abs_diff(jnp.zeros(2), jnp.array([0.0, -0.5]), "x") == 0.5


@pytest.mark.slow
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


@pytest.mark.slow
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
