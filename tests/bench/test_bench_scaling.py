"""benchmarks/scaling.py runs (tiny) and its correctness check passes on 1 and 2
devices in one process and on 2 processes (JAX's distributed runtime on localhost);
its collective byte count reads a compiled program right."""

import jax
import jax.numpy as jnp
import pytest
from _scripts import load_script


scaling = load_script("benchmarks", "scaling")


@pytest.mark.slow
def test_scaling_benchmark_tiny():
    results = scaling.main(["--tiny", "--devices", "1", "2", "--multi", "2x1"])
    assert set(results) == {"1", "2", "2x1"}
    for times in results.values():
        assert set(times) == {"pure_jax", "es_value", "es_ref"}
        assert all(len(ts) == 2 and min(ts) > 0 for ts in times.values())


def test_collective_bytes_of_a_program():
    """No collective on one device; a hand-written HLO line is counted by its result
    shape (tuples included)."""
    hlo = jax.jit(lambda x: x.sum()).lower(jnp.ones(8)).compile().as_text()
    assert scaling.collective_bytes(hlo) == 0
    text = (
        "%all-reduce.1 = f32[8,5]{1,0} all-reduce(f32[8,5]{1,0} %x), channel_id=1\n"
        "%ar = (f32[8]{0}, s32[]) all-reduce(%a, %b), channel_id=2\n"
        "%ag = bf16[4,2]{1,0} all-gather(%c), dimensions={0}\n"
        "%fusion = f32[100]{0} fusion(%all-reduce.1), kind=kLoop\n"
    )
    assert scaling.collective_bytes(text) == 8 * 5 * 4 + 8 * 4 + 4 + 4 * 2 * 2
