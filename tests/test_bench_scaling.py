"""benchmarks/scaling.py runs (tiny) and its correctness check passes on 1 and 2 devices."""

import importlib.util
import pathlib


def test_scaling_benchmark_tiny():
    path = pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "scaling.py"
    spec = importlib.util.spec_from_file_location("scaling", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    results = module.main(["--tiny", "--devices", "1", "2"])
    assert set(results) == {1, 2}
    for times in results.values():
        assert set(times) == {"pure_jax", "es_value", "es_ref"}
        assert all(len(ts) == 2 and min(ts) > 0 for ts in times.values())
