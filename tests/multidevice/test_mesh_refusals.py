"""On a mesh: what JAX cannot split evenly over Explicit axes is refused with an
error naming the fix (nothing consumed), and the Auto-axes form equals one device."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType

import eqx_state as es


def _auto():
    return jax.make_mesh((4,), ("data",), axis_types=(AxisType.Auto,))


def _per_example_loss(m, x):
    return jnp.mean(es.vmap(m, axis_name="b")(x) ** 2)


def test_es_vmap_on_explicit_axes_is_refused_and_auto_axes_equal_one_device(mesh):
    x = jax.random.normal(jax.random.key(1), (8, 3)) + 1
    runs = {}
    for name, m in [("one", None), ("auto", _auto())]:
        bn = es.nn.BatchNorm(3, channel_axis=0, axis_name="b")
        step = es.make_step(_per_example_loss, optax.sgd(0.1), mesh=m, return_loss=True)
        bn, _, loss = step(bn, step.init(bn), x)
        runs[name] = (float(loss), np.asarray(bn.running_var[...]))
    np.testing.assert_allclose(runs["auto"][0], runs["one"][0], rtol=1e-6)
    np.testing.assert_allclose(runs["auto"][1], runs["one"][1], rtol=1e-6)
    # the float64 reference of the running variance: 0.9 + 0.1 * unbiased var
    want = 0.9 + 0.1 * np.asarray(x, np.float64).var(0, ddof=1)
    np.testing.assert_allclose(runs["one"][1], want, rtol=1e-5)
    bn = es.nn.BatchNorm(3, channel_axis=0, axis_name="b")
    step = es.make_step(_per_example_loss, optax.sgd(0.1), mesh=mesh)
    opt_state = step.init(bn)
    with pytest.raises(es.StateError, match=r"Explicit axes 'data'.*AxisType\.Auto"):
        step(bn, opt_state, x)
    assert int(bn.num_batches_tracked[...]) == 0  # nothing consumed


def test_microbatches_too_small_to_split_are_refused_and_auto_axes_work(mesh):
    x = jax.random.normal(jax.random.key(0), (8, 3)) * 2 + 1
    loss = lambda m, x: jnp.mean(m(x) ** 2)  # noqa: E731
    means = {}
    for name, m in [("one", None), ("auto", _auto())]:
        bn = es.nn.BatchNorm(3)
        step = es.make_step(loss, optax.sgd(0.1), microbatches=4, mesh=m)
        bn, _ = step(bn, step.init(bn), x)
        means[name] = np.asarray(bn.running_mean[...])
        assert int(bn.num_batches_tracked[...]) == 4
    np.testing.assert_allclose(means["auto"], means["one"], rtol=1e-6)
    # float64: four momentum-0.1 updates with the microbatches' means, in order
    want = np.zeros(3)
    for piece in np.asarray(x, np.float64).reshape(4, 2, 3):
        want = 0.9 * want + 0.1 * piece.mean(0)
    np.testing.assert_allclose(means["one"], want, rtol=1e-5)
    bn = es.nn.BatchNorm(3)
    step = es.make_step(loss, optax.sgd(0.1), microbatches=4, mesh=mesh)
    opt_state = step.init(bn)
    with pytest.raises(es.StepError, match=r"microbatch of 2 examples.*multiple of 16"):
        step(bn, opt_state, x)
    with pytest.warns(es.RecompileWarning):  # 16: each slice has 4 examples
        bn, _ = step(bn, opt_state, jnp.concatenate([x, x]))
    assert int(bn.num_batches_tracked[...]) == 4


def test_a_batch_the_devices_do_not_divide_names_the_fix(mesh):
    bn = es.nn.BatchNorm(3)
    step = es.make_step(lambda m, x: jnp.mean(m(x) ** 2), optax.sgd(0.1), mesh=mesh)
    opt_state = step.init(bn)
    with pytest.raises(es.StepError, match=r"10 examples.*drop_last.*mask="):
        step(bn, opt_state, jnp.ones((10, 3)))
    bn, opt_state = step(bn, opt_state, jnp.ones((8, 3)))  # still usable
    assert int(bn.num_batches_tracked[...]) == 1
    # after a step compiled for 8 examples: the same error, nothing consumed
    with pytest.raises(es.StepError, match=r"10 examples.*drop_last.*mask="):
        step(bn, opt_state, jnp.ones((10, 3)))
    bn, _ = step(bn, opt_state, jnp.ones((8, 3)))
    assert int(bn.num_batches_tracked[...]) == 2


@pytest.mark.parametrize("placed", [False, True], ids=["as built", "es.place"])
def test_a_consumed_model_on_a_mesh_is_refused_before_the_call(mesh, placed):
    """Reusing the model a mesh step consumed: XLA crashed the process (exit 139)
    on the deleted sharded buffers, where off a mesh JAX's error becomes a
    `StaleModelError`. On a mesh it is refused before the call, with the same
    message (the consumed leaves named), on every runner."""
    step = es.make_step(lambda m, x: jnp.mean(m(x) ** 2), optax.sgd(0.1), mesh=mesh)
    bn = es.nn.BatchNorm(3)
    if placed:
        bn = es.place(bn, mesh)
    x = jnp.ones((8, 3))
    opt_state = step.init(bn)
    new, new_state = step(bn, opt_state, x)  # consumes `bn`
    for call in (
        lambda: step(bn, new_state, x),
        lambda: step.scan(bn, new_state, x[None]),
    ):
        with pytest.raises(es.StaleModelError, match=r"Consumed: `model\.weight`"):
            call()
    new, _ = step(new, new_state, x)  # the returned model still trains
    assert int(new.num_batches_tracked[...]) == 2
