"""`es.reset(model, which)`: each selected cell back to its `init` fill, every other
cell and parameter untouched; by kind, tuple of kinds or predicate; both storage
modes, inside `es.apply` / `make_step`, under `eqx.filter_jit` and `vmap`."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import eqx_state as es
from eqx_state import metrics as esm


class Everything(eqx.Module):
    """One cell of each kind, each away from its initial value."""

    w: jax.Array
    stat: es.BatchStat
    count: es.CounterState
    avg: es.AverageState
    power: es.PowerIterationState
    cache: es.Cache
    no_init: es.Cache
    low: esm.Min
    mean: esm.Mean

    def __init__(self):
        self.w = jnp.full((2,), 7.0)
        self.stat = es.BatchStat(jnp.full((2, 3), 5.0, jnp.float16), init=1.0)
        self.count = es.CounterState(jnp.array(4, jnp.int32), init=0)
        self.avg = es.AverageState(jnp.array([3.0, 4.0]), init=0.0)
        self.power = es.PowerIterationState(jnp.array([0.5, 0.5]), init=1.0)
        self.cache = es.Cache(jnp.ones((2,), jnp.bfloat16) * 9, init=0.0)
        self.no_init = es.Cache(jnp.array([2.0, 2.0]))  # nothing to go back to
        self.low = esm.Min()
        self.mean = esm.Mean()

    def write(self):
        self.low.update(jnp.array([3.0, -2.0]))
        self.mean.update(jnp.array([1.0, 2.0]))


def _numpy_state(model):
    """Every cell's value (numpy, float64) and the parameter, by name."""
    m = es.freeze(model)
    return {
        "w": np.asarray(m.w, np.float64),
        "stat": np.asarray(m.stat.value, np.float64),
        "count": np.asarray(m.count.value),
        "avg": np.asarray(m.avg.value),
        "power": np.asarray(m.power.value),
        "cache": np.asarray(m.cache.value, np.float64),
        "no_init": np.asarray(m.no_init.value),
        "low": np.asarray(m.low.value.value),
        "low_count": np.asarray(m.low.count.value),
        "mean_total": np.asarray(m.mean.total.value),
        "mean_weight": np.asarray(m.mean.weight.value),
    }


def _written():
    model = Everything()
    _, model = es.apply(lambda m: m.write(), model)
    return model


# what each group of names is reset to (float64 numpy, written by hand)
INIT = {
    "stat": np.ones((2, 3)),
    "count": np.array(0),
    "avg": np.zeros(2),
    "power": np.ones(2),
    "cache": np.zeros(2),
    "low": np.array(np.inf),
    "low_count": np.array(0.0),
    "mean_total": np.array(0.0),
    "mean_weight": np.array(0.0),
}
METRIC_NAMES = {"low", "low_count", "mean_total", "mean_weight"}


def _check(before, after, reset_names):
    for name, old in before.items():
        want = INIT[name] if name in reset_names else old
        np.testing.assert_array_equal(after[name], want, err_msg=name)


def _reset(model, mode, which):
    """Reset in one of the ways a user can; returns the resulting model."""
    kwargs = {} if which is None else {"which": which}
    if mode == "value":
        return es.reset(model, **kwargs)
    if mode == "ref":
        ref = es.to_refs(model)
        out = es.reset(ref, **kwargs)
        assert out is ref  # written in place: the same model comes back
        return ref
    if mode == "apply":  # inside a step: cells hold refs made in the trace

        def fn(m):
            assert es.reset(m, **kwargs) is m  # written in place

        return es.apply(fn, model)[1]
    if mode == "filter_jit":
        return eqx.filter_jit(lambda m: es.reset(m, **kwargs))(model)
    if mode == "ref_filter_jit":
        ref = es.to_refs(model)
        eqx.filter_jit(lambda m: es.reset(m, **kwargs))(ref)
        return ref
    raise AssertionError(mode)


MODES = ["value", "ref", "apply", "filter_jit", "ref_filter_jit"]
SELECTIONS = [
    (None, METRIC_NAMES),  # the default: metrics only
    (es.MetricState, METRIC_NAMES),
    (es.BatchStat, {"stat"}),
    (es.AverageState, {"avg"}),
    (es.CounterState, {"count"}),
    ((es.BatchStat, es.PowerIterationState), {"stat", "power"}),
    (lambda c: isinstance(c, es.Cache) and c.init is not None, {"cache"}),
]


def _id(s):
    """A deterministic test id (sets are sorted: pytest-xdist needs equal ids)."""
    if isinstance(s, (set, frozenset)):
        return "{" + ",".join(sorted(s)) + "}"
    if isinstance(s, tuple):
        return "(" + ",".join(_id(x) for x in s) + ")"
    return getattr(s, "__name__", str(s))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("which,names", SELECTIONS, ids=_id)
@pytest.mark.split
def test_reset_selects_exactly_the_chosen_cells(mode, which, names):
    model = _written()
    before = _numpy_state(model)
    assert before["low"] == -2.0 and before["count"] == 4  # away from init
    after = _reset(model, mode, which)
    _check(before, _numpy_state(after), names)
    if mode in ("value", "filter_jit"):
        _check(before, _numpy_state(model), set())  # the input is unchanged
    # dtypes and shapes are kept
    frozen = es.freeze(after)
    assert frozen.stat.value.dtype == jnp.float16 and frozen.stat.shape == (2, 3)
    assert frozen.cache.value.dtype == jnp.bfloat16
    assert frozen.count.value.dtype == jnp.int32


def test_reset_metrics_then_update_counts_from_scratch():
    for mode in ("value", "ref"):
        model = _written()
        model = _reset(model, mode, None)
        if mode == "ref":
            model.write()
        else:
            _, model = es.apply(lambda m: m.write(), model)
        assert float(model.low.compute()) == -2.0  # restarted at +inf, not 0
        assert float(model.mean.compute()) == 1.5


def test_reset_inside_make_step_and_with_kind_filter():
    class Model(eqx.Module):
        w: jax.Array
        seen: esm.Sum
        stat: es.BatchStat

    def loss_fn(model, x):
        es.reset(model)  # the metric records this step only
        model.seen.update(x)
        model.stat[...] = model.stat[...] + 1.0  # BatchStat: untouched by reset
        return jnp.sum(model.w * x)

    for ref_mode in (False, True):
        model = Model(jnp.ones(3), esm.Sum(), es.BatchStat(jnp.zeros(()), init=0.0))
        if ref_mode:
            model = es.to_refs(model)
        step = es.make_step(loss_fn, optax.sgd(0.1))
        opt_state = step.init(model)
        for i in range(3):
            model, opt_state = step(model, opt_state, jnp.full(3, float(i)))
            assert float(model.seen.compute()) == 3.0 * i
            assert float(model.stat[...]) == i + 1.0
        assert step.trace_count == 1


def test_every_position_is_its_own_value():
    class Two(eqx.Module):
        a: es.BatchStat
        b: es.BatchStat

    arr = jnp.array([3.0, 4.0])
    model = Two(es.BatchStat(arr, init=0.0), es.BatchStat(arr, init=1.0))
    out = es.reset(model, es.BatchStat)
    np.testing.assert_array_equal(out.a.value, [0.0, 0.0])
    np.testing.assert_array_equal(out.b.value, [1.0, 1.0])
    assert out.a.value is not out.b.value


def test_reset_under_vmap_of_an_ensemble():
    ens = eqx.filter_vmap(lambda _: _written())(jnp.arange(3))
    out = eqx.filter_vmap(lambda m: es.reset(m, es.BatchStat))(ens)
    np.testing.assert_array_equal(out.stat.value, np.ones((3, 2, 3)))
    np.testing.assert_array_equal(out.avg.value, np.asarray(ens.avg.value))


def test_no_init_raises_naming_the_path():
    model = _written()
    with pytest.raises(ValueError, match=r"Cache cell at `model\.no_init`.*init"):
        es.reset(model, es.Cache)
    ref = es.to_refs(model)
    before = _numpy_state(ref)
    with pytest.raises(ValueError, match="no_init"):
        es.reset(ref, lambda c: True)
    # nothing was written: the cells before the one refused were reset in place
    _check(before, _numpy_state(ref), set())
    with pytest.raises(ValueError, match="no_init"):  # inside a step's trace too
        es.apply(lambda m: es.reset(m, lambda c: True), model)


def test_bad_which_is_refused():
    for bad in (int, (es.BatchStat, str), "BatchStat", ()):
        with pytest.raises(TypeError, match="which"):
            es.reset(_written(), bad)


def test_one_reset_function():
    with pytest.warns(DeprecationWarning, match=r"use `eqx_state\.reset`"):
        assert es.metrics.reset is es.reset
    assert not hasattr(es.metrics.Metric, "_reset")


def test_reset_of_a_consumed_model_raises_stale():
    """`es.reset` of a model a donating step consumed used to return a model that
    looked reset and failed at its first read of anything else with JAX's bare
    "Array has been deleted"; it raises `StaleModelError`, as every function given
    a consumed model does. The model the step returned resets to the fills."""

    class Net(eqx.Module):
        w: jax.Array
        stat: es.BatchStat
        mean: esm.Mean

        def __call__(self, x):
            self.stat[...] = self.stat[...] + 1.0
            self.mean.update(x)
            return jnp.sum(self.w * x)

    step = es.make_step(lambda m, x: m(x), optax.sgd(0.1))
    model = Net(jnp.ones(3), es.BatchStat(jnp.zeros(()), init=0.0), esm.Mean())
    new, _ = step(model, step.init(model), jnp.arange(3.0))
    for which in (es.BatchStat, es.MetricState, lambda c: False):
        with pytest.raises(es.StaleModelError, match="donate=False") as info:
            es.reset(model, which)
        assert "The model holds an array" in str(info.value)
        assert "Consumed: `model.w`." in str(info.value)
    # `make_apply` donates the cells only: the model is consumed all the same
    apply = es.make_apply(lambda m, x: m(x))
    _, newer = apply(new, jnp.ones(3))
    with pytest.raises(es.StaleModelError, match="donate=False"):
        es.reset(new, es.BatchStat)
    out = es.reset(newer, (es.BatchStat, es.MetricState))
    assert float(out.stat[...]) == 0.0 and float(out.mean.weight[...]) == 0.0
    np.testing.assert_allclose(out.w, newer.w)  # parameters untouched
    assert float(newer.stat[...]) == 2.0  # value mode: the input is unchanged


class _Net(eqx.Module):
    fc: es.nn.Batched
    bn: es.nn.BatchNorm
    loss: esm.Mean
    gain: jax.Array

    def __call__(self, x):
        return self.bn(self.fc(x)) * self.gain


@pytest.mark.parametrize(
    "how", ["es.reset", "es.load", "es.load_state_dict", "eager es.apply"]
)
@pytest.mark.parametrize("committed", [False, True])
@pytest.mark.parametrize("mode", ["value", "ref"])
def test_new_state_is_committed_as_the_array_it_replaces(
    mode, how, committed, tmp_path
):
    """A reset, a load or an eager `es.apply` makes each new array (a ref's too)
    placed and committed as the one it replaces (`_compat.put_as`; `es.apply`
    froze its refs with JAX's eager `jax.freeze`, which commits): a fresh model's
    arrays are
    uncommitted, and `jax.jit` compiles again for committed inputs, so a reset of
    the metrics between steps (a training loop's logging) cost the step two more
    compilations: the call that took the committed cells, then the next, whose
    inputs that call had all committed. Reference: JAX's own `committed` flags
    and its compilation events."""
    from _compiles import count_compiles

    def loss_fn(model, x):
        y = model(x)
        model.loss.update(jnp.mean(y**2))
        return jnp.mean(y**2)

    model = _Net(
        es.nn.Batched(eqx.nn.Linear(3, 4, key=jax.random.key(0))),
        es.nn.BatchNorm(4),
        esm.Mean(),
        jnp.asarray(1.5),
    )
    if committed:
        device = jax.devices()[0]
        model = jax.tree.map(
            lambda a: jax.device_put(a, device) if eqx.is_array(a) else a, model
        )
    if mode == "ref":
        model = es.to_refs(model)
    step = es.make_step(loss_fn, optax.sgd(0.1))
    opt_state = step.init(model)
    x = jnp.ones((5, 3))
    for _ in range(2):  # (the first step makes the weak `gain` strong: compiles again)
        model, opt_state = step(model, opt_state, x)
    if how == "es.reset":
        new = es.reset(model, es.MetricState)
    elif how == "es.load":
        es.save(tmp_path / "m.eqx", model)
        new = es.load(tmp_path / "m.eqx", model)
    elif how == "es.load_state_dict":
        sd = {k: np.asarray(v) + 1 for k, v in es.state_dict(model).items()}
        new = es.load_state_dict(model, sd)
    else:  # writes the BatchNorm's statistics
        _, new = es.apply(lambda m, x: m(x), model, x)
    arrays = [x for x in jax.tree.leaves(new) if isinstance(x, jax.Array)]
    assert arrays and {a.committed for a in arrays} == {committed}
    assert {d for a in arrays for d in a.devices()} == {jax.devices()[0]}
    assert jax.typeof(new.gain) == jax.typeof(model.gain)
    with count_compiles() as compiles:
        for _ in range(3):
            new, opt_state = step(new, opt_state, x)
    assert compiles == []
    # the metric's weight: reset to 0, 2 + 1 in the state dict, else 2; then three
    # steps
    weight = {"es.reset": 3, "es.load_state_dict": 6}.get(how, 5)
    np.testing.assert_array_equal(new.loss.weight[...], weight)
