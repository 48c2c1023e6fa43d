import jax
import pytest


# Equinox's tests use strict dtype and rank promotion; Optax's optimizers (and
# ordinary user code that these tests mirror) rely on standard promotion, so the
# defaults stay. jaxtyping + beartype check the package (see pyproject addopts).


@pytest.fixture
def getkey():
    keys = iter(jax.random.split(jax.random.key(0), 10_000))
    return lambda: next(keys)


# tests/multidevice/ needs 4 devices set up before JAX starts: it runs in its own
# process from tests/test_multidevice.py.
collect_ignore = ["multidevice"]
