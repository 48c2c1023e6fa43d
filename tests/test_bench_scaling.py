"""benchmarks/scaling.py runs (tiny) and its correctness check passes on 1 and 2 devices."""

from _scripts import load_script


def test_scaling_benchmark_tiny():
    results = load_script("benchmarks", "scaling").main(
        ["--tiny", "--devices", "1", "2"]
    )
    assert set(results) == {1, 2}
    for times in results.values():
        assert set(times) == {"pure_jax", "es_value", "es_ref"}
        assert all(len(ts) == 2 and min(ts) > 0 for ts in times.values())
