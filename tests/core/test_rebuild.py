"""A step rebuilds its new carry from leaves with one generated function per
structure (`_rebuild.rebuilder`). The reference is JAX's own `treedef.unflatten`
(Equinox's generated unflatten for each module): for every structure the library
meets, the rebuild gives objects built exactly alike (the same types, the same
`__dict__` in the same order, the same leaf objects, the very static values), made
fresh at every call; for a structure it cannot rebuild exactly it gives `None` and
the step unflattens."""

from __future__ import annotations

import collections
import copy
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import eqx_state as es
from eqx_state._dispatch import Compiled
from eqx_state._rebuild import rebuilder


class Adam(NamedTuple):
    count: Any
    mu: Any


class WithStatics(eqx.Module):
    lin: eqx.nn.Linear
    names: list = eqx.field(static=True)  # a mutable static value: shared, as stored
    act: Any = eqx.field(static=True, default=jax.nn.relu)
    maybe: Any = None


class Odd(eqx.Module):
    lin: eqx.nn.Linear

    def __getattribute__(self, name):  # may give Equinox's flatten its own dict
        return super().__getattribute__(name)


@jax.tree_util.register_pytree_node_class
class Custom:
    def __init__(self, x):
        self.x = x

    def tree_flatten(self):
        return (self.x,), None

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children)


def _net(mode):
    from tests.core.test_runners import Net  # every kind of state a step writes

    net = Net(jax.random.key(0))
    return es.to_refs(net) if mode == "ref" else net


def _structures():
    key = jax.random.key(0)
    lin = eqx.nn.Linear(3, 4, key=key)
    value_net = _net("value")
    return {
        "step carry, adam": (value_net, optax.adam(1e-3).init(es.params(value_net))),
        "ref-mode model": (_net("ref"),),
        "inject_hyperparams (a dict)": optax.inject_hyperparams(optax.adam)(
            learning_rate=0.1
        ).init(es.params(value_net)),
        "eqx layers": (
            eqx.nn.MLP(3, 2, 8, 2, key=key),
            eqx.nn.MultiheadAttention(2, 8, key=key),
            eqx.nn.Sequential([lin, eqx.nn.Lambda(jax.nn.relu)]),
            eqx.nn.Conv2d(2, 3, 3, key=key),
            eqx.nn.LayerNorm(4),
        ),
        "eqx_state layers": (
            es.nn.CausalSelfAttention(8, 2, key=key),
            es.nn.SpectralNorm(lin, key=key),
            es.nn.Counter(),
            es.nn.RunningNorm(3),
            es.metrics.Accuracy(),
        ),
        "a wrapped function (wrapper fields)": (eqx.filter_jit(lambda x: x), lin),
        "statics, None, empty nodes": WithStatics(lin, ["a"], maybe=(None, (), [])),
        "named tuples, lists, dicts": (
            Adam(jnp.zeros(()), [lin, {"b": 1.0, "a": jnp.ones(2)}]),
            {"z": (), "y": None},
        ),
        "one leaf": jnp.ones(3),
        "no leaves": (None, ()),
    }


def _built_alike(x, y, shared):
    """`x` (the rebuild's) and `y` (unflatten's) built alike; `shared`: the leaves
    and static values, the only objects they may share."""
    if any(x is s for s in shared):
        return x is y
    if x is None or (type(x) is tuple and not x):  # singletons
        return x is y
    assert x is not y, f"{type(x).__name__} not built fresh"
    assert type(x) is type(y)
    if isinstance(x, (tuple, list)):
        assert len(x) == len(y)
        return all(_built_alike(a, b, shared) for a, b in zip(x, y))
    if type(x) is dict:
        assert list(x) == list(y)
        return all(_built_alike(x[k], y[k], shared) for k in x)
    dx, dy = (
        object.__getattribute__(x, "__dict__"),
        object.__getattribute__(y, "__dict__"),
    )
    assert list(dx) == list(dy)
    return all(_built_alike(dx[k], dy[k], shared) for k in dx)


def _statics(tree) -> list:
    """Every non-node value the structure holds (static fields, dict keys...):
    what unflatten gives as the same object at every call."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    a = treedef.unflatten([object() for _ in leaves])
    b = treedef.unflatten([object() for _ in leaves])
    out: list = []

    def walk(u, v):
        if u is v:
            out.append(u)
        elif isinstance(u, (tuple, list)):
            for p, q in zip(u, v):
                walk(p, q)
        elif isinstance(u, dict):
            out.extend(u)
            for k in u:
                walk(u[k], v[k])
        elif hasattr(u, "__dict__"):
            du, dv = vars(u), vars(v)
            for k in du:
                walk(du[k], dv[k])

    walk(a, b)
    return out


@pytest.mark.parametrize("name", list(_structures()))
def test_the_rebuild_builds_what_unflatten_builds(name):
    tree = _structures()[name]
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    build = rebuilder(treedef)
    assert build is not None, f"{name}: no rebuild"
    new_leaves = [object() for _ in leaves]  # any objects: a step's new arrays
    got, want = build(new_leaves), treedef.unflatten(new_leaves)
    assert _built_alike(got, want, [*new_leaves, *_statics(tree)])
    # the same leaf objects at the same places, the same structure
    got_leaves, got_def = jax.tree_util.tree_flatten(got)
    assert got_def == treedef
    assert all(a is b for a, b in zip(got_leaves, new_leaves))
    # fresh at every call: two rebuilds share no node
    again = build(new_leaves)
    assert _built_alike(again, got, [*new_leaves, *_statics(tree)])


def test_a_static_value_is_the_structures_own_object():
    """A mutable static value is the one the structure holds, as unflatten gives
    it (changing it changes every rebuild, as it changes every unflatten)."""
    names = ["a"]
    tree = WithStatics(eqx.nn.Linear(2, 2, key=jax.random.key(0)), names)
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    build = rebuilder(treedef)
    assert build is not None
    got = build(leaves)
    assert got.names is treedef.unflatten(leaves).names is names
    assert got.act is jax.nn.relu


@pytest.mark.parametrize(
    "tree",
    [
        Custom(jnp.ones(2)),
        (Odd(eqx.nn.Linear(2, 2, key=jax.random.key(0))),),
        collections.OrderedDict(a=jnp.ones(2)),
        collections.defaultdict(list, a=jnp.ones(2)),
    ],
    ids=["custom node", "own __getattribute__", "OrderedDict", "defaultdict"],
)
def test_a_node_it_cannot_rebuild_exactly_is_unflattened(tree):
    _, treedef = jax.tree_util.tree_flatten(tree)
    assert rebuilder(treedef) is None


def test_an_unflatten_that_changes_its_leaves_is_not_rebuilt():
    @jax.tree_util.register_pytree_node_class
    class Scaled(tuple):
        __slots__ = ()
        _fields = ("x",)  # looks like a named tuple; its unflatten is its own

        def tree_flatten(self):
            return tuple(self), None

        @classmethod
        def tree_unflatten(cls, aux, children):
            return cls([2 * c for c in children])

    _, treedef = jax.tree_util.tree_flatten(Scaled([jnp.ones(())]))
    assert rebuilder(treedef) is None


@pytest.mark.parametrize("mode", ["value", "ref"])
def test_a_step_rebuilds_its_carry_as_unflatten_does(mode):
    """The step uses the rebuild (not the fallback) for a model with every kind of
    state, and at each call its carry is built as JAX's unflatten of the same
    leaves builds it; the numbers are those of the same step unflattening with JAX
    (the runners' numbers against a hand-threaded loop: `test_runners`)."""
    from tests.core.test_runners import data, loss_fn

    step = es.make_step(loss_fn, optax.adam(1e-2), donate=False)
    model = _net(mode)
    opt_state = step.init(model)
    compiled = step._compiled
    assert isinstance(compiled, Compiled)
    xs, ys = data()
    for x, y in zip(xs, ys):
        model, opt_state = step(model, opt_state, x, y)
        leaves, treedef = jax.tree_util.tree_flatten((model, opt_state))
        frozen, build = compiled._structures[treedef]
        assert frozen and build is not treedef.unflatten
        want = treedef.unflatten(leaves)
        assert _built_alike(build(leaves), want, [*leaves, *_statics(want)])
    # against the same step with the rebuild turned off (JAX's unflatten)
    plain = es.make_step(loss_fn, optax.adam(1e-2), donate=False)
    ref_model = _net(mode)
    ref_state = plain.init(ref_model)
    plain._compiled._structure = lambda td: (False, td.unflatten)
    for x, y in zip(xs, ys):
        ref_model, ref_state = plain(ref_model, ref_state, x, y)
    for a, b in zip(
        jax.tree.leaves(es.freeze((model, opt_state))),
        jax.tree.leaves(es.freeze((ref_model, ref_state))),
    ):
        np.testing.assert_array_equal(a, b)


def test_copies_of_a_rebuilt_model_are_independent():
    """`copy.copy`/`copy.deepcopy` of a model a step rebuilt behave as Equinox's."""
    step = es.make_step(lambda m, x: jnp.mean(m(x) ** 2), optax.sgd(0.1))
    model = es.nn.Batched(eqx.nn.Linear(2, 2, key=jax.random.key(0)))
    opt_state = step.init(model)
    model, opt_state = step(model, opt_state, jnp.ones((3, 2)))
    for c in (copy.copy(model), copy.deepcopy(model)):
        assert type(c) is type(model)
        np.testing.assert_array_equal(c.layer.weight, model.layer.weight)
        assert eqx.tree_equal(c, model)
    model, opt_state = step(model, opt_state, jnp.ones((3, 2)))
    assert hash(jax.tree_util.tree_structure(model)) == hash(
        jax.tree_util.tree_structure(copy.deepcopy(model))
    )
