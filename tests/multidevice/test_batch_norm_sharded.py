"""BatchNorm(axis_name=...) per device under `jax.shard_map` on 4 devices: the
two-pass statistics over the global batch equal float64 NumPy and torch on the whole
batch, far from zero (offset 2e4, where E[x^2] - E[x]^2 gave an output std of 19),
and with padded (masked) rows."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from jax.sharding import NamedSharding, PartitionSpec as P

import eqx_state as es


def _sharded_call(mesh, bn, x, mask=None):
    """One training call of `bn` per device (its quarter of the batch), through
    es.apply inside shard_map; returns (y, bn)."""
    arrays, static = eqx.partition(bn, eqx.is_array)

    def per_device(arrays, x, mask):
        m = eqx.combine(arrays, static)
        if mask is None:
            y, m = es.apply(lambda m, x: m(x), m, x)
        else:
            y, m = es.apply(lambda m, x, k: m(x, mask=k), m, x, mask)
        return y, eqx.filter(m, eqx.is_array)

    batch = NamedSharding(mesh, P("data"))
    args = (arrays, jax.device_put(x, batch))
    specs = (P(), P("data"))
    if mask is not None:
        args += (jax.device_put(mask, batch),)
        specs += (P("data"),)
    else:
        args += (None,)
        specs += (None,)
    run = jax.jit(
        jax.shard_map(per_device, mesh=mesh, in_specs=specs, out_specs=(P("data"), P()))
    )
    y, arrays = run(*args)
    return y, eqx.combine(arrays, static)


def test_offset_2e4_on_four_devices_is_exact(mesh):
    rng = np.random.default_rng(0)
    bn = es.nn.BatchNorm(3, axis_name="data")
    tbn = torch.nn.BatchNorm1d(3)
    tol = 4 * 2e4 * np.finfo(np.float32).eps + 1e-5
    for step in range(2):
        x = (rng.normal(size=(32, 3)) * (step + 1) + 2e4).astype(np.float32)
        y, bn = _sharded_call(mesh, bn, jnp.asarray(x))
        x64 = x.astype(np.float64)
        want = (x64 - x64.mean(0)) / np.sqrt(x64.var(0) + 1e-5)
        np.testing.assert_allclose(np.asarray(y), want, rtol=0, atol=tol)
        ty = tbn(torch.from_numpy(x)).detach().numpy()
        np.testing.assert_allclose(np.asarray(y), ty, rtol=0, atol=2 * tol)
        np.testing.assert_allclose(bn.running_var[...], tbn.running_var, rtol=1e-4)
        np.testing.assert_allclose(bn.running_mean[...], tbn.running_mean, rtol=1e-6)
    assert np.std(np.asarray(y), axis=0) == pytest.approx(np.ones(3), rel=1e-3)


def test_mask_on_four_devices_equals_torch_on_the_unpadded_batch(mesh):
    """Each device holds padding in a different amount (one device only padding):
    the statistics are those of the real rows."""
    rng = np.random.default_rng(1)
    x = (rng.normal(size=(16, 3)) * 2 + 1e3).astype(np.float32)
    keep = np.array([1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 1, 1, 0, 1], bool)
    x[~keep] = np.nan
    bn = es.nn.BatchNorm(3, axis_name="data")
    y, bn = _sharded_call(mesh, bn, jnp.asarray(x), jnp.asarray(keep[:, None]))
    tbn = torch.nn.BatchNorm1d(3)
    ty = tbn(torch.from_numpy(x[keep])).detach().numpy()
    np.testing.assert_allclose(np.asarray(y)[keep], ty, rtol=0, atol=1e-3)
    np.testing.assert_allclose(bn.running_var[...], tbn.running_var, rtol=1e-4)
    np.testing.assert_allclose(bn.running_mean[...], tbn.running_mean, rtol=1e-6)
