"""Fixtures shared by the benchmarks' tests."""

import pytest


@pytest.fixture
def fast_compiles():
    """Most XLA optimisations off, as in `run.py --tiny` (numbers, not timings)."""
    import jax

    before = jax.config.values["jax_disable_most_optimizations"]
    jax.config.update("jax_disable_most_optimizations", True)
    yield
    jax.config.update("jax_disable_most_optimizations", before)
