import jax
import pytest


jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")


@pytest.fixture
def getkey():
    keys = iter(jax.random.split(jax.random.key(0), 10_000))
    return lambda: next(keys)
