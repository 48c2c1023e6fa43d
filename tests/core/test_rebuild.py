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
import dataclasses
import pickle
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import eqx_state as es
from eqx_state import _dispatch
from eqx_state._dispatch import _REBUILD_AFTER, Compiled
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
        "eqx layers": (
            eqx.nn.MLP(3, 2, 8, 2, key=key),
            eqx.nn.MultiheadAttention(2, 8, key=key),
            eqx.nn.Sequential((lin, eqx.nn.Lambda(jax.nn.relu))),
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
        "statics, None, empty nodes": WithStatics(lin, ["a"], maybe=(None, ())),
        "named tuples": (Adam(jnp.zeros(()), (lin, jnp.ones(2))), optax.EmptyState()),
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
    if isinstance(x, tuple):
        assert len(x) == len(y)
        return all(_built_alike(a, b, shared) for a, b in zip(x, y))
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


class _Pair(NamedTuple):
    a: Any
    b: Any


class CastingPair(_Pair):
    """A named tuple registered with an unflatten of its own (`_make`, which skips
    this `__new__`), not JAX's rule for named tuples (`cls(*children)`)."""

    __slots__ = ()

    def __new__(cls, a, b):
        if isinstance(a, jax.Array):
            a = a.astype(jnp.float32)
        return super().__new__(cls, a, b)


jax.tree_util.register_pytree_node(
    CastingPair, lambda p: (tuple(p), None), lambda _, ch: CastingPair._make(ch)
)


NEW_CALLS: list = []


class CountedPair(_Pair):
    """A named tuple (JAX's built-in rule) with a `__new__` of its own."""

    __slots__ = ()

    def __new__(cls, a, b):
        NEW_CALLS.append((a, b))
        return super().__new__(cls, a, b)


class Vec(tuple):
    """A registered tuple subclass whose constructor takes one iterable."""

    __slots__ = ()
    _fields = ("x", "y")

    def __new__(cls, items):
        return super().__new__(cls, items)


jax.tree_util.register_pytree_node(
    Vec, lambda v: (tuple(v), None), lambda _, ch: Vec(ch)
)


class Cast:
    """A data descriptor: Equinox's unflatten sets the field through it."""

    def __set_name__(self, owner, name):
        self.name = name

    def __get__(self, obj, owner=None):
        return 0.0 if obj is None else obj.__dict__[self.name]

    def __set__(self, obj, value):
        if isinstance(value, jax.Array):
            value = value.astype(jnp.float32)
        obj.__dict__[self.name] = value


class Described(eqx.Module):
    w: Any = Cast()


@jax.tree_util.register_pytree_node_class
class Doubled(tuple):
    __slots__ = ()
    _fields = ("x",)  # looks like a named tuple; its unflatten is its own

    def tree_flatten(self):
        return tuple(self), None

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls([2 * c for c in children])


@pytest.mark.parametrize(
    "tree",
    [
        Custom(jnp.ones(2)),
        (Odd(eqx.nn.Linear(2, 2, key=jax.random.key(0))),),
        [jnp.ones(2)],
        {"a": jnp.ones(2)},
        collections.OrderedDict(a=jnp.ones(2)),
        collections.defaultdict(list, a=jnp.ones(2)),
        CastingPair(jnp.ones(2, jnp.int32), jnp.ones(2)),
        CountedPair(jnp.ones(2), jnp.ones(2)),
        Vec([jnp.ones(2), jnp.zeros(2)]),
        Described(jnp.ones(2, jnp.int32)),
        Doubled([jnp.ones(())]),
    ],
    ids=[
        "custom node",
        "own __getattribute__",
        "list",
        "dict",
        "OrderedDict",
        "defaultdict",
        "named tuple with its own unflatten",
        "named tuple with its own __new__",
        "tuple node with its own constructor",
        "module field with a data descriptor",
        "unflatten that changes its leaves",
    ],
)
def test_a_node_it_cannot_rebuild_exactly_is_unflattened(tree):
    """No rebuild (and no error): the step unflattens such a structure, which
    here would build another object from the same leaves than the rebuild. The
    node types are refused before any unflatten: no user code runs on markers."""
    _, treedef = jax.tree_util.tree_flatten(tree)
    NEW_CALLS.clear()
    assert rebuilder(treedef) is None
    assert NEW_CALLS == []


class Node(eqx.Module):
    child: Any


def test_a_structure_too_deep_to_rebuild_is_unflattened():
    """`rebuilder` never raises: a structure nested past what Python compiles
    (or recurses through) is unflattened, and a step on it runs."""
    tree: Any = jnp.ones(())
    for _ in range(400):
        tree = Node(tree)
    _, treedef = jax.tree_util.tree_flatten(tree)
    rebuilder(treedef)  # None or a rebuild; not an error

    def innermost(m):
        while isinstance(m, Node):
            m = m.child
        return m

    step = es.make_step(lambda m, x: jnp.mean(innermost(m) * x), optax.sgd(0.1))
    opt_state = step.init(tree)
    for _ in range(_REBUILD_AFTER + 2):
        tree, opt_state = step(tree, opt_state, jnp.ones(()))
    np.testing.assert_allclose(
        innermost(tree), 1.0 - 0.1 * (_REBUILD_AFTER + 2), rtol=1e-6
    )


class Scaled(eqx.Module):
    w: jax.Array
    scale: Any = eqx.field(static=True)

    def __call__(self, x):
        scale = self.scale
        return self.w * x * getattr(scale, "scale", scale)


@dataclasses.dataclass(frozen=True)
class Config:
    scale: float


def test_a_loop_keeps_its_own_static_values():
    """Two loops on models whose static fields are equal but not the same object
    (`1` and `1.0`, two equal configs: one structure to JAX): each loop's models
    keep their own static objects, as JAX's unflatten of their structure gives
    them (a rebuild made for the first loop would give the second its values)."""
    step = es.make_step(lambda m, x: jnp.mean(m(x) ** 2), optax.sgd(0.1))
    for first, second in ((1, 1.0), (Config(1.0), Config(1.0))):
        for scale in (first, second):
            model = Scaled(jnp.ones(2), scale)
            opt_state = step.init(model)
            for _ in range(_REBUILD_AFTER + 2):  # the last calls are rebuilt
                model, opt_state = step(model, opt_state, jnp.ones(2))
                assert model.scale is scale


@pytest.mark.parametrize("mode", ["value", "ref"])
def test_a_step_rebuilds_its_carry_as_unflatten_does(mode, monkeypatch):
    """Once it has made `_REBUILD_AFTER` calls, a step loop rebuilds its carry (not
    the fallback) for a model with every kind of state: each carry it returns is
    built as JAX's unflatten of the same leaves builds it, and the numbers are those
    of the same step unflattening with JAX (the runners' numbers against a
    hand-threaded loop: `test_runners`)."""
    from tests.core.test_runners import data, loss_fn

    step = es.make_step(loss_fn, optax.adam(1e-2), donate=False)
    model = _net(mode)
    opt_state = step.init(model)
    compiled = step._compiled
    assert isinstance(compiled, Compiled)
    xs, ys = data()
    calls = [(xs[i % len(xs)], ys[i % len(ys)]) for i in range(_REBUILD_AFTER + 3)]
    for i, (x, y) in enumerate(calls):
        model, opt_state = step(model, opt_state, x, y)
        build = compiled._last[4]
        if i < _REBUILD_AFTER:
            assert build == i + 1  # the loop's calls so far: unflattened
            continue
        assert build.__code__.co_filename.startswith("<rebuild")
        leaves, treedef = compiled._last[1], compiled._last[2]  # what it was built from
        want = treedef.unflatten(leaves)
        got = (model, opt_state)
        assert _built_alike(got, want, [*leaves, *_statics(want)])
    # against the same step with the rebuild turned off (JAX's unflatten)
    monkeypatch.setattr(_dispatch, "rebuilder", lambda treedef: None)
    plain = es.make_step(loss_fn, optax.adam(1e-2), donate=False)
    ref_model = _net(mode)
    ref_state = plain.init(ref_model)
    for x, y in calls:
        ref_model, ref_state = plain(ref_model, ref_state, x, y)
    for a, b in zip(
        jax.tree.leaves(es.freeze((model, opt_state))),
        jax.tree.leaves(es.freeze((ref_model, ref_state))),
    ):
        np.testing.assert_array_equal(a, b)


def test_a_rebuilt_model_copies_and_pickles():
    """`copy.copy`, `copy.deepcopy` and a pickle round trip of a model a step
    rebuilt give an equal model of the same structure."""
    step = es.make_step(lambda m, x: jnp.mean(m(x) ** 2), optax.sgd(0.1))
    model = es.nn.Batched(eqx.nn.Linear(2, 2, key=jax.random.key(0)))
    opt_state = step.init(model)
    model, opt_state = step(model, opt_state, jnp.ones((3, 2)))
    for c in (
        copy.copy(model),
        copy.deepcopy(model),
        pickle.loads(pickle.dumps(model)),
    ):
        assert type(c) is type(model)
        np.testing.assert_array_equal(c.layer.weight, model.layer.weight)
        assert eqx.tree_equal(c, model)
    model, opt_state = step(model, opt_state, jnp.ones((3, 2)))
    assert hash(jax.tree_util.tree_structure(model)) == hash(
        jax.tree_util.tree_structure(copy.deepcopy(model))
    )
