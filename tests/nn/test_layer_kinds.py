"""Every stateful layer labels its cells with the kind of state they hold, so that a
filter by kind (and `es.reset(model, kind)`) selects exactly one layer's cells: a
BatchNorm recalibration must not wipe EMA weights, SpectralNorm's vectors or caches.
Each cell with a natural initial value carries it as its reset fill."""

import copy
import pickle

import equinox as eqx
import jax
import numpy as np
import pytest

import eqx_state as es


class Zoo(eqx.Module):
    lin: eqx.nn.Linear
    bn: es.nn.BatchNorm
    norm: es.nn.RunningNorm
    sn: es.nn.SpectralNorm
    attn: es.nn.CausalSelfAttention
    ema: es.nn.EMA
    steps: es.nn.Counter

    def __init__(self, key):
        k1, k2, k3, k4 = jax.random.split(key, 4)
        self.lin = eqx.nn.Linear(4, 4, key=k1)
        self.bn = es.nn.BatchNorm(4)
        self.norm = es.nn.RunningNorm(4)
        self.sn = es.nn.SpectralNorm(eqx.nn.Linear(4, 4, key=k2), key=k3)
        self.attn = es.nn.CausalSelfAttention(4, 2, max_len=8, key=k4)
        self.ema = es.nn.EMA(self.lin, decay=0.5, zero_debias=True)
        self.steps = es.nn.Counter()

    def __call__(self, x):
        self.steps.increment()
        self.ema.update(self.lin)
        h = self.sn(self.norm(self.bn(jax.vmap(self.lin)(x))))
        return self.attn(h)


def _cells(tree, kind):
    return [
        c for c in jax.tree.leaves(tree, is_leaf=es.is_state) if isinstance(c, kind)
    ]


EXPECTED = {
    es.BatchStat: ["bn"] * 3 + ["norm"] * 3,
    es.AverageState: ["ema"] * 3,  # weight, bias averages and the count
    es.PowerIterationState: ["sn"] * 2,
    es.Cache: ["attn"] * 3,
    es.CounterState: ["steps"],
}


@pytest.mark.parametrize("kind", list(EXPECTED), ids=lambda k: k.__name__)
def test_filter_by_kind_selects_exactly_one_layers_cells(kind):
    model = Zoo(jax.random.key(0))
    got = []
    for name in ("lin", "bn", "norm", "sn", "attn", "ema", "steps"):
        got += [name] * len(_cells(getattr(model, name), kind))
    assert got == EXPECTED[kind]
    # every cell is of exactly one of these kinds
    assert sum(len(_cells(model, k)) for k in EXPECTED) == len(_cells(model, es.Buffer))


def test_reset_fills():
    model = Zoo(jax.random.key(0))
    fills = {
        id(c): c.init
        for c in jax.tree.leaves(model, is_leaf=es.is_state)
        if es.is_state(c)
    }
    assert [fills[id(c)] for c in _cells(model.bn, es.Buffer)] == [0, 1, 0]
    assert [fills[id(c)] for c in _cells(model.norm, es.Buffer)] == [0, 1, 0]
    assert [fills[id(c)] for c in _cells(model.ema, es.Buffer)] == [0, 0, 0]
    assert [fills[id(c)] for c in _cells(model.sn, es.Buffer)] == [None, None]
    assert [fills[id(c)] for c in _cells(model.attn, es.Buffer)] == [0, 0, 0]
    assert [fills[id(c)] for c in _cells(model.steps, es.Buffer)] == [0]
    # a fill is the initial value: writing it back gives the fresh layer's cell
    fresh = Zoo(jax.random.key(0))
    for c in _cells(fresh, es.Buffer):
        if c.init is not None:
            np.testing.assert_array_equal(c[...], np.full(c.shape, c.init))


def _reset_kind(model, kind):
    return es.reset(model, kind)


@pytest.mark.parametrize("mode", ["value", "ref"])
def test_resetting_batch_stats_leaves_every_other_state_alone(mode):
    """A BatchNorm / RunningNorm recalibration (reset every BatchStat) after two
    training calls: those statistics are back to their initial values, and the EMA
    average, SpectralNorm vectors, KV cache and counter are untouched."""
    model = Zoo(jax.random.key(0))
    if mode == "ref":
        model = es.to_refs(model)
    x = jax.random.normal(jax.random.key(1), (3, 4))
    for _ in range(2):
        _, model = es.apply(lambda m, x: m(x), model, x)
    before = {
        k: [np.asarray(c[...]) for c in _cells(model, k)]
        for k in EXPECTED
        if k is not es.BatchStat
    }
    model = _reset_kind(model, es.BatchStat)
    fresh = Zoo(jax.random.key(0))
    for c, f in zip(_cells(model, es.BatchStat), _cells(fresh, es.BatchStat)):
        np.testing.assert_array_equal(c[...], f[...])
    for k, values in before.items():
        for c, v in zip(_cells(model, k), values):
            np.testing.assert_array_equal(c[...], v)
    assert int(model.steps.value) == 2 and int(model.ema.steps) == 2


def _library_layers():
    import eqx_state.metrics
    import eqx_state.nn  # noqa: F401  (every layer class defined)

    def below(cls):
        for sub in cls.__subclasses__():
            yield sub
            yield from below(sub)

    return sorted(
        {
            c
            for c in below(eqx.Module)
            if c.__module__.startswith("eqx_state.")
            and not issubclass(c, (es.Buffer, es.metrics.Statistic))
        },
        key=lambda c: c.__qualname__,
    )


def test_library_layers_flatten_through_the_fast_dict_read_and_keep_bound_methods():
    # Every library layer reads `__dict__` (what Equinox's flatten reads per module,
    # per step) without Equinox's bound-method hook; everything else goes through the
    # hook, so a method taken from a layer is still a pytree (`jax.jit(layer.method)`
    # traces the layer's arrays instead of baking them in).
    from eqx_state._buffer import _PLAIN_DICT_READ, _LayerBase

    layers = _library_layers()
    assert {"BatchNorm", "Metric", "Metrics", "EMA", "KVCache", "Batched"} <= {
        c.__name__ for c in layers
    }
    slow = [c.__qualname__ for c in layers if not issubclass(c, _LayerBase)]
    assert not slow, f"layers flattened through Equinox's hook: {slow}"

    class Scaled(es.nn.BatchNorm):  # a user's subclass with a method of its own
        def scaled(self, x):
            return x * self.weight

    bn = Scaled(3)
    jax.tree_util.tree_flatten(bn)
    assert _PLAIN_DICT_READ[Scaled] is True  # the fast read is the one taken
    method = bn.scaled
    assert type(method) is type(eqx.Module.__getattribute__(bn, "scaled"))
    assert jax.tree.leaves(method), "a bound method must carry the layer's arrays"
    out = eqx.filter_jit(lambda f, x: f(x))(method, np.ones(3, np.float32))
    np.testing.assert_array_equal(out, np.ones(3, np.float32))
    new = eqx.tree_at(lambda m: m.weight, bn, 2 * bn.weight)
    out = eqx.filter_jit(lambda f, x: f(x))(new.scaled, np.ones(3, np.float32))
    np.testing.assert_array_equal(out, np.full(3, 2, np.float32))  # not baked in

    model = Zoo(jax.random.key(0))
    leaves, treedef = jax.tree_util.tree_flatten(model)
    back = jax.tree_util.tree_unflatten(treedef, leaves)
    assert eqx.tree_equal(back, model)
    assert jax.tree_util.tree_structure(back) == treedef
    for copied in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert eqx.tree_equal(copied, model)
        assert jax.tree_util.tree_structure(copied) == treedef


class _Seen:
    names: list = []


class _TracedModule(eqx.Module):  # a user's module with an attribute hook
    def __getattribute__(self, name):
        _Seen.names.append(name)
        return super().__getattribute__(name)


class _TracedMixin:  # a plain mixin with an attribute hook (after Module in the MRO)
    def __getattribute__(self, name):
        _Seen.names.append(name)
        return super().__getattribute__(name)


class _PlainCounter(eqx.Module):  # the same fields as es.nn.Counter, plain Equinox
    count: es.CounterState
    inference: bool = False


@pytest.mark.parametrize("hook", [_TracedModule, _TracedMixin])
def test_a_users_attribute_hook_below_a_layer_sees_what_it_sees_below_a_module(hook):
    # The fast `__dict__` read applies only where nothing but Equinox's hook lies
    # below it: a user's hook further down the method resolution order sees every
    # read, exactly as under a plain `eqx.Module`.
    class Mine(es.nn.Counter, hook):
        pass

    class Reference(_PlainCounter, hook):
        pass

    seen = {}
    made = {Mine: Mine, Reference: lambda: Reference(es.CounterState(np.int32(0)))}
    for cls in (Mine, Reference):
        layer = made[cls]()
        _Seen.names = []
        leaves, treedef = jax.tree_util.tree_flatten(layer)
        layer.count  # noqa: B018
        seen[cls] = (list(_Seen.names), len(leaves))
        back = jax.tree_util.tree_unflatten(treedef, leaves)
        assert back.count.value is layer.count.value
    assert seen[Mine] == seen[Reference]
    names, _ = seen[Mine]
    assert names.count("__dict__") == 2 and "count" in names
