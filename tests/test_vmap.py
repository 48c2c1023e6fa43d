"""Per-example (Equinox-style) calls under es.vmap with axis_name: state written once,
equal to the batched call."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import eqx_state as es


MODES = ["value", "ref"]


class PerExample(eqx.Module):
    lin: eqx.nn.Linear
    bn: es.nn.BatchNorm
    seen: es.nn.Counter

    def __init__(self, key, axis_name):
        self.lin = eqx.nn.Linear(4, 3, key=key)
        self.bn = es.nn.BatchNorm(3, channel_axis=0, axis_name=axis_name)
        self.seen = es.nn.Counter()

    def __call__(self, x):  # one example
        self.seen.increment()
        return self.bn(self.lin(x))


class Batched(eqx.Module):
    lin: eqx.nn.Linear
    bn: es.nn.BatchNorm

    def __call__(self, x):
        return self.bn(jax.vmap(self.lin)(x))


def _pair(mode):
    key = jax.random.key(0)
    per = PerExample(key, "batch")
    bat = Batched(eqx.nn.Linear(4, 3, key=key), es.nn.BatchNorm(3))
    if mode == "ref":
        per, bat = es.to_refs(per), es.to_refs(bat)
    return per, bat


@pytest.mark.parametrize("mode", MODES)
def test_per_example_batchnorm_equals_batched(mode):
    per, bat = _pair(mode)
    xs = jax.random.normal(jax.random.key(1), (3, 8, 4))
    for x in xs:
        y1, per = es.apply(lambda m, x: es.vmap(m, axis_name="batch")(x), per, x)
        y2, bat = es.apply(lambda m, x: m(x), bat, x)
        np.testing.assert_allclose(y1, y2, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(
        per.bn.running_mean[...], bat.bn.running_mean[...], rtol=1e-5
    )
    np.testing.assert_allclose(
        per.bn.running_var[...], bat.bn.running_var[...], rtol=1e-5
    )
    assert int(per.bn.num_batches_tracked[...]) == 3
    assert int(per.seen.value) == 3  # once per vmapped call, not per example


@pytest.mark.parametrize("mode", MODES)
def test_per_example_in_make_step(mode):
    per, bat = _pair(mode)
    xs = jax.random.normal(jax.random.key(1), (3, 8, 4))
    ys = jax.random.normal(jax.random.key(2), (3, 8, 3))

    def loss_per(m, x, y):
        return jnp.mean((es.vmap(m, axis_name="batch")(x) - y) ** 2)

    def loss_bat(m, x, y):
        return jnp.mean((m(x) - y) ** 2)

    s1 = es.make_step(loss_per, optax.adam(1e-2))
    s2 = es.make_step(loss_bat, optax.adam(1e-2))
    o1, o2 = s1.init(per), s2.init(bat)
    for i in range(3):
        per, o1 = s1(per, o1, xs[i], ys[i])
        bat, o2 = s2(bat, o2, xs[i], ys[i])
    np.testing.assert_allclose(per.lin.weight, bat.lin.weight, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(
        per.bn.running_var[...], bat.bn.running_var[...], rtol=1e-5
    )
    assert s1.trace_count == 1


def test_unsynced_per_example_write_is_an_error():
    class Last(eqx.Module):
        cell: es.Buffer

        def __call__(self, x):
            self.cell[...] = x  # a per-example value, not reduced
            return x

    m = es.to_refs(Last(es.Buffer(jnp.zeros(2))))
    with pytest.raises(Exception, match="wrote different values into one state cell"):
        es.vmap(m)(jnp.arange(6.0).reshape(3, 2))
    # the same value from every example is fine
    es.vmap(m)(jnp.ones((3, 2)))
    np.testing.assert_array_equal(m.cell[...], [1.0, 1.0])


def test_plain_jax_vmap_names_es_vmap():
    per, _ = _pair("ref")
    with pytest.raises(es.StateWriteError, match=r"eqx_state\.vmap"):
        jax.vmap(per, axis_name="batch")(jnp.ones((4, 4)))
