"""Tests that need several devices. They run in their own process, started by
tests/distributed/test_multidevice.py with XLA_FLAGS=--xla_force_host_platform_device_count=4 set
before JAX is imported."""

import jax
import pytest


@pytest.fixture(scope="session")
def mesh():
    if jax.device_count() < 4:
        pytest.skip(
            "needs 4 devices (run through tests/distributed/test_multidevice.py)"
        )
    return jax.make_mesh((4,), ("data",))
