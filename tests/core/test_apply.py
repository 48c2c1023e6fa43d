"""es.make_apply: a compiled es.apply that keeps ties, donates only state, stays on
the fast path, and equals es.apply."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import eqx_state as es


MODES = ["value", "ref"]


class Net(eqx.Module):
    lin: eqx.nn.Linear
    bn: es.nn.BatchNorm
    mean: es.metrics.Mean

    def __init__(self):
        self.lin = eqx.nn.Linear(3, 4, key=jax.random.key(0))
        self.bn = es.nn.BatchNorm(4)
        self.mean = es.metrics.Mean()

    def __call__(self, x):
        y = self.bn(jax.vmap(self.lin)(x))
        self.mean.update(y)
        return y


def forward(model, x):
    return model(x)


def fresh(mode):
    m = Net()
    return es.to_refs(m) if mode == "ref" else m


@pytest.mark.parametrize("mode", MODES)
def test_equals_apply_and_compiles_once(mode):
    xs = jax.random.normal(jax.random.key(1), (4, 8, 3))
    run = es.make_apply(forward)
    a, b = fresh(mode), fresh(mode)
    for x in xs:
        ya, a = run(a, x)
        yb, b = es.apply(forward, b, x)
        np.testing.assert_allclose(ya, yb, rtol=1e-6)
    np.testing.assert_allclose(a.bn.running_var[...], b.bn.running_var[...], rtol=1e-6)
    np.testing.assert_allclose(a.mean.compute(), b.mean.compute(), atol=1e-6)
    assert int(a.bn.num_batches_tracked[...]) == 4
    assert run.trace_count == 1
    # a structurally equal model (not the one it returned) reuses the compilation
    run(fresh(mode), xs[0])
    assert run.trace_count == 1


def test_donates_state_but_not_parameters():
    model = Net()
    run = es.make_apply(forward)
    weight = model.lin.weight
    _, new = run(model, jnp.ones((8, 3)))
    assert not weight.is_deleted()  # parameters are not donated
    np.testing.assert_array_equal(new.lin.weight, weight)
    _, newer = run(new, jnp.ones((8, 3)))
    assert newer.lin.weight is new.lin.weight  # ... and are returned as they came
    with pytest.raises(es.StaleModelError, match="donate=False"):
        run(model, jnp.ones((8, 3)))
    keep = es.make_apply(forward, donate=False)
    _, m1 = keep(newer, jnp.ones((8, 3)))
    _, m2 = keep(newer, jnp.ones((8, 3)))  # the old model stays a valid snapshot
    np.testing.assert_array_equal(m1.bn.running_mean[...], m2.bn.running_mean[...])


def _copy(x):
    return jnp.copy(x) if eqx.is_array(x) else x


def _b(pair):
    return pair.b


def _a(pair):
    return pair.a


class Pair(eqx.Module):
    a: es.Buffer
    b: es.Buffer

    def __call__(self):
        self.a[...] = self.a[...] + 1.0
        self.b[...] = self.b[...] + 10.0
        return self.a[...]


@pytest.mark.parametrize("mode", MODES)
def test_declared_shared_cell_is_one_state(mode):
    """`eqx.nn.Shared` ties `b` to `a`: one state, under every way of running."""
    model = eqx.nn.Shared(
        Pair(es.Buffer(jnp.zeros(())), es.Buffer(jnp.zeros(()))), _b, _a
    )
    if mode == "ref":
        model = es.to_refs(model)
    runs = [
        es.make_apply(lambda m: m()()),
        eqx.filter_jit(lambda m: es.apply(lambda m: m()(), m)),
    ]
    for run in runs:
        m = model if mode == "ref" else jax.tree.map(_copy, model)
        start = float(m.pytree.a[...])
        for _ in range(2):
            out, m = run(m)
        # one cell: +1 then +10, twice; read after both
        assert float(out) == start + 22.0
        assert float(m().a[...]) == float(m().b[...]) == start + 22.0


def test_inference_mode_model_writes_nothing_and_needs_no_state():
    model = eqx.nn.inference_mode(Net())
    run = es.make_apply(lambda m, x: jnp.sum(m.bn(x)))
    out, new = run(model, jnp.ones((2, 4)))
    assert int(new.bn.num_batches_tracked[...]) == 0
    assert out.shape == ()


@pytest.mark.both_modes  # under a trace, ref mode writes the given refs
@pytest.mark.parametrize("mode", ["value", "ref"])
def test_a_traced_call_stages_no_dead_operations_for_cells(mode):
    """What a compiled call adds per cell is its ref's operations, nothing dead:
    no zero-size shape witness is computed in the program (a step and an apply
    make one per cell; a constant is used, staged only where a transformation
    uses it), and an integer count's write stops no gradient (it has none)."""
    model = es.nn.BatchNorm(3)
    if mode == "ref":
        model = es.to_refs(model)
    x = jnp.arange(12.0).reshape(4, 3)

    def call(model, x):
        return es.make_apply(lambda m, x: m(x))(model, x)

    jaxpr = eqx.filter_make_jaxpr(call)(model, x)[0]
    eqns = []

    def walk(j):
        for e in j.eqns:
            eqns.append(e)
            for sub in jax.extend.core.jaxprs_in_params(e.params):
                walk(sub)

    walk(jaxpr.jaxpr)
    assert any(e.primitive.name == "swap" for e in eqns)  # the cells are written
    zero_size = [e for e in eqns if any(0 in v.aval.shape for v in e.outvars)]
    assert not zero_size, zero_size
    int_stops = [
        e
        for e in eqns
        if e.primitive.name == "stop_gradient"
        and not jnp.issubdtype(e.outvars[0].aval.dtype, jnp.inexact)
    ]
    assert not int_stops, int_stops


def test_a_step_traces_under_a_transfer_guard():
    """A step traced inside `jax.transfer_guard("disallow")` (a user checking a loop
    for hidden transfers) transfers nothing of the library's own: the constant
    shape witnesses a trace makes (a cell shape seen for the first time here) are
    made with transfers allowed, as the staged zeros they stand for needed none."""

    class Net(eqx.Module):
        lin: eqx.nn.Linear
        cell: es.Buffer

        def __call__(self, x):
            self.cell[...] = self.cell[...] + 1
            return self.lin(x)

    model = Net(
        eqx.nn.Linear(3, 2, key=jax.random.key(0)), es.Buffer(jnp.zeros((5, 11, 3)))
    )
    step = es.make_step(lambda m, x: jnp.sum(m(x)), optax.sgd(0.1), donate=False)
    opt_state = step.init(model)
    x = jnp.ones(3)
    with jax.transfer_guard("disallow"):
        model, opt_state = step(model, opt_state, x)
    assert float(model.cell[...][0, 0, 0]) == 1.0
