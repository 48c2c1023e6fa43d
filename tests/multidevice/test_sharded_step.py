"""A data-parallel step on a 4-device mesh equals the same step on one device with
the whole batch: parameters, optimizer state, BatchNorm statistics, counters."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _net import Net as _Net, loss_fn

import eqx_state as es


def Net(key):
    return _Net(key, in_features=5)


def _data(n=4, batch=16):
    kx, ky = jax.random.split(jax.random.key(1))
    return jax.random.normal(kx, (n, batch, 5)), jax.random.normal(ky, (n, batch, 3))


def _assert_close(a, b):
    for x, y in zip(jax.tree.leaves(es.freeze(a)), jax.tree.leaves(es.freeze(b))):
        if isinstance(x, jax.Array):
            np.testing.assert_allclose(
                np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-5
            )


@pytest.mark.parametrize("mode", ["value", "ref"])
def test_sharded_equals_single_device(mesh, mode):
    xs, ys = _data()
    single_dev = jax.devices()[0]

    def run(step, on_mesh):
        model = Net(jax.random.key(0))
        if mode == "ref":
            rep = jax.sharding.NamedSharding(mesh, jax.P())
            model = es.to_refs(model, sharding=rep if on_mesh else None)
        opt_state = step.init(model)
        for i in range(len(xs)):
            x, y = xs[i], ys[i]
            if not on_mesh:
                x, y = jax.device_put(x, single_dev), jax.device_put(y, single_dev)
            model, opt_state = step(model, opt_state, x, y)
        return model, opt_state

    sharded_step = es.make_step(loss_fn, optax.adam(1e-2), mesh=mesh)
    sharded = run(sharded_step, True)
    single = run(es.make_step(loss_fn, optax.adam(1e-2)), False)
    assert sharded_step.trace_count == 1
    _assert_close(sharded, single)
    assert int(sharded[0].steps.value) == len(xs)
    w = sharded[0].l1.weight
    assert len(w.sharding.device_set) == 4 and w.sharding.is_fully_replicated
    if mode == "value":
        # the batch really is split: each device holds a quarter of it
        x = jax.device_put(xs[0], jax.sharding.NamedSharding(mesh, jax.P("data")))
        assert x.addressable_shards[0].data.shape == (4, 5)


def test_ref_mode_model_off_the_mesh_names_the_fix(mesh):
    model = es.to_refs(Net(jax.random.key(0)))  # refs on one device
    step = es.make_step(loss_fn, optax.adam(1e-2), mesh=mesh)
    xs, ys = _data()
    with pytest.raises(es.StepError, match=r"to_refs\(model, sharding="):
        step(model, step.init(model), xs[0], ys[0])


def test_wrong_axis_name(mesh):
    with pytest.raises(ValueError, match="not 'batch'"):
        es.make_step(loss_fn, optax.sgd(0.1), mesh=mesh, data_axis="batch")


def test_microbatches_on_the_mesh_equal_full_batch(mesh):
    """Gradient accumulation composes with the mesh (no BatchNorm: exact)."""

    class Plain(eqx.Module):
        lin: eqx.nn.Linear

        def __call__(self, x):
            return jax.vmap(self.lin)(x)

    def plain_loss(m, x, y):
        return jnp.mean((m(x) - y) ** 2)

    xs, ys = _data(batch=32)
    xs = xs[..., :3]
    full = es.make_step(plain_loss, optax.adam(1e-2), mesh=mesh)
    accum = es.make_step(plain_loss, optax.adam(1e-2), mesh=mesh, microbatches=2)
    m1 = Plain(eqx.nn.Linear(3, 3, key=jax.random.key(0)))
    m2 = Plain(eqx.nn.Linear(3, 3, key=jax.random.key(0)))
    s1, s2 = full.init(m1), accum.init(m2)
    for i in range(len(xs)):
        m1, s1 = full(m1, s1, xs[i], ys[i])
        m2, s2 = accum(m2, s2, xs[i], ys[i])
    _assert_close((m1, s1), (m2, s2))


@pytest.mark.parametrize("mode", ["value", "ref"])
def test_scan_on_the_mesh_equals_single_device_steps(mesh, mode):
    """`step.scan` on a 4-device mesh (each step's batch sharded over the devices)
    equals the same steps one by one on a single device."""
    xs, ys = _data()
    rep = jax.sharding.NamedSharding(mesh, jax.P())

    def fresh(on_mesh):
        model = Net(jax.random.key(0))
        if mode == "ref":
            model = es.to_refs(model, sharding=rep if on_mesh else None)
        return model

    scan_step = es.make_step(loss_fn, optax.adam(1e-2), mesh=mesh)
    model = fresh(True)
    model, opt_state = scan_step.scan(model, scan_step.init(model), xs, ys)
    single = es.make_step(loss_fn, optax.adam(1e-2))
    m = fresh(False)
    s = single.init(m)
    dev = jax.devices()[0]
    for i in range(len(xs)):
        m, s = single(m, s, jax.device_put(xs[i], dev), jax.device_put(ys[i], dev))
    _assert_close((model, opt_state), (m, s))
    assert int(model.steps.value) == len(xs)
