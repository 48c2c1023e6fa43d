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
import functools
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


def _built_alike_or_kept(x, y, old, shared, reused):
    """`_built_alike(x, y, shared)`, except that a module of `x` may be the very
    module of `old` (the carry the call was given) at its place, if its leaves
    are the same objects as unflatten's there (appended to `reused`)."""
    if isinstance(x, eqx.Module) and x is old:
        got, want = jax.tree.leaves(x), jax.tree.leaves(y)
        assert len(got) == len(want) and all(a is b for a, b in zip(got, want))
        assert jax.tree.structure(x) == jax.tree.structure(y)
        reused.append(x)
        return True
    if any(x is s for s in shared) or x is None or (type(x) is tuple and not x):
        return _built_alike(x, y, shared)
    assert x is not y and x is not old
    assert type(x) is type(y)
    if isinstance(x, tuple):
        return all(
            _built_alike_or_kept(a, b, c, shared, reused) for a, b, c in zip(x, y, old)
        )
    dx, dy, do = (object.__getattribute__(z, "__dict__") for z in (x, y, old))
    assert list(dx) == list(dy)
    return all(_built_alike_or_kept(dx[k], dy[k], do[k], shared, reused) for k in dx)


@pytest.mark.parametrize("mode", ["value", "ref"])
def test_a_step_rebuilds_its_carry_as_unflatten_does(mode, monkeypatch):
    """Once it has made `_REBUILD_AFTER` calls, a step loop rebuilds its carry (not
    the fallback) for a model with every kind of state: each carry it returns is
    built as JAX's unflatten of the same leaves builds it, and the numbers are those
    of the same step unflattening with JAX (the runners' numbers against a
    hand-threaded loop: `test_runners`). A module whose leaves the call returns as
    given (a ref-mode cell: its ref and witness) may be the given carry's own: the
    same leaves at the same place, so what unflatten builds from them is equal to
    it; in ref mode every cell is."""
    from tests.core.test_runners import data, loss_fn

    step = es.make_step(loss_fn, optax.adam(1e-2), donate=False)
    model = _net(mode)
    opt_state = step.init(model)
    compiled = step._compiled
    assert isinstance(compiled, Compiled)
    xs, ys = data()
    calls = [(xs[i % len(xs)], ys[i % len(ys)]) for i in range(_REBUILD_AFTER + 3)]
    cells = sum(map(es.is_state, jax.tree.leaves(model, is_leaf=es.is_state)))
    for i, (x, y) in enumerate(calls):
        given = (model, opt_state)
        model, opt_state = step(model, opt_state, x, y)
        build = compiled._last[4]
        if i < _REBUILD_AFTER:
            assert build == i + 1  # the loop's calls so far: unflattened
            continue
        assert build.__code__.co_filename.startswith("<rebuild")
        leaves, treedef = compiled._last[1], compiled._last[2]  # what it was built from
        want = treedef.unflatten(leaves)
        got = (model, opt_state)
        reused: list = []
        assert _built_alike_or_kept(
            got, want, given, [*leaves, *_statics(want)], reused
        )
        kept_cells = sum(  # the cells in or at the kept modules
            sum(map(es.is_state, jax.tree.leaves(m, is_leaf=es.is_state)))
            for m in reused
        )
        if mode == "ref":  # every cell (a layer all of whose leaves are refs too)
            assert kept_cells == cells > 0, {type(m) for m in reused}
        else:
            assert kept_cells == 0, {type(m) for m in reused}
    # against the same step with the rebuild turned off (JAX's unflatten)
    monkeypatch.setattr(_dispatch, "rebuilder", lambda treedef, kept=None: None)
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


@pytest.mark.parametrize("mode", ["value", "ref"])
def test_a_loop_whose_calls_keep_different_leaves_matches_pytorch(mode):
    """A model rebuilt from the carry it was given keeps the given carry's
    modules only where the call returned their leaves as given. Here a static
    argument alternates between a call that writes the BatchNorm's statistics
    (training) and one that writes nothing (evaluation: without donation, value
    mode returns the cells as given), past `_REBUILD_AFTER` calls of each, in runs
    and one at a time: a rebuild made for the calls that keep the cells must not
    serve the calls that write them. Reference: `torch.nn.BatchNorm1d` given the
    same batches in the same modes (the learning rate is 0: the weights stay)."""
    import torch

    def loss_fn(model, x, train):
        bn = model if train else es.inference_mode(model)
        return jnp.mean(bn(x) ** 2)

    step = es.make_step(loss_fn, optax.sgd(0.0), donate=False)
    model = es.nn.BatchNorm(3)
    model = es.to_refs(model) if mode == "ref" else model
    opt_state = step.init(model)
    tbn = torch.nn.BatchNorm1d(3).double()
    rng = np.random.default_rng(0)
    pattern = [False] * 6 + [True] * 6 + [False, True] * 4 + [True] * 5 + [False] * 3
    for train in pattern:
        x = rng.normal(2.0, 3.0, (5, 3)).astype(np.float32)
        given = model
        model, opt_state = step(model, opt_state, jnp.asarray(x), train)
        tbn.train(train)
        tbn(torch.from_numpy(x.astype(np.float64)))
        np.testing.assert_allclose(
            np.asarray(model.running_mean[...]), tbn.running_mean.numpy(), rtol=1e-5
        )
        np.testing.assert_allclose(
            np.asarray(model.running_var[...]), tbn.running_var.numpy(), rtol=1e-5
        )
        assert int(model.num_batches_tracked[...]) == int(tbn.num_batches_tracked)
        if mode == "value" and train:  # the cells a call wrote are new modules
            assert model.running_mean is not given.running_mean


class _Ids(eqx.Module):
    ids: jax.Array


class _WithIds(eqx.Module):
    w: jax.Array
    sub: _Ids


def test_a_rebuild_for_one_plan_does_not_serve_another():
    """Which carry leaves a call returns as given depends on its plan: an integer
    array (not a parameter) is donated and returned anew, except in a call given
    that very array as an argument too (an array is not donated where the call
    also reads it as an argument), where the call returns it as given and the
    module holding it is the given one. A loop that switches plans after its
    rebuild was made must not keep that module from the given carry: its array
    was donated (deleted). Reference: NumPy (the array's values) and JAX's
    `is_deleted`."""

    def loss_fn(m, x, ids):
        return jnp.mean((m.w * x) ** 2) + 0.0 * jnp.sum(ids) + 0.0 * jnp.sum(m.sub.ids)

    step = es.make_step(loss_fn, optax.sgd(0.1))
    model = _WithIds(jnp.ones(3), _Ids(jnp.arange(3)))
    opt_state = step.init(model)
    kept = 0
    w = np.ones(3, np.float32)
    for same in [True] * (_REBUILD_AFTER + 3) + [False, False, True, False, True]:
        given = model
        arg = model.sub.ids if same else jnp.arange(3)
        model, opt_state = step(model, opt_state, jnp.ones(3), arg)
        w = w - 0.1 * (2 * w / 3)
        kept += model.sub is given.sub
        assert not model.sub.ids.is_deleted()
        np.testing.assert_array_equal(model.sub.ids, np.arange(3))
        np.testing.assert_allclose(model.w, w, rtol=1e-6)
    assert kept > 0  # the rebuild kept the module where it could


@pytest.mark.parametrize("name", list(_structures()))
@pytest.mark.parametrize("share", [0.0, 0.5, 1.0])
def test_a_rebuild_keeping_leaves_builds_what_unflatten_builds(name, share):
    """`rebuilder(treedef, kept)`: given the old carry `C` whose leaves at `kept`
    are the new ones, a module all of whose leaves are at `kept` is `C`'s own
    (its leaves the same objects as unflatten's there); everything else is built
    as unflatten builds it. Kept positions drawn at random, for every
    structure."""
    tree = _structures()[name]
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    rng = np.random.default_rng(len(name))
    kept = frozenset(i for i in range(len(leaves)) if rng.random() < share)
    build = rebuilder(treedef, kept)
    assert build is not None, f"{name}: no rebuild"
    new_leaves = [object() for _ in leaves]
    old_leaves = [new_leaves[i] if i in kept else object() for i in range(len(leaves))]
    old = treedef.unflatten(old_leaves)
    got, want = build(new_leaves, old), treedef.unflatten(new_leaves)
    reused: list = []
    assert _built_alike_or_kept(got, want, old, [*new_leaves, *_statics(tree)], reused)
    got_leaves, got_def = jax.tree_util.tree_flatten(got)
    assert got_def == treedef
    assert all(a is b for a, b in zip(got_leaves, new_leaves))
    if share == 1.0 and isinstance(tree, eqx.Module):
        assert got is old  # every leaf kept: the whole model is the old one


class _Tally(eqx.Module):
    n: es.Buffer

    def __init__(self):
        self.n = es.Buffer(jnp.zeros((), jnp.int32))

    @functools.cached_property
    def seen(self):  # computed once per module object, kept in its `__dict__`
        return int(self.n[...])


class _WithTally(eqx.Module):
    w: jax.Array
    tally: _Tally


@pytest.mark.parametrize("read", ["each call", "once"])
def test_a_module_with_a_cached_property_is_built_fresh(read):
    """A `functools.cached_property` writes into the module's `__dict__` (Equinox
    allows it). A ref-mode cell's module is otherwise kept from the carry given
    to a step (its ref and witness are the given ones), but one with a cached
    value would carry it, read from an older model, into the new one, and its
    longer `__dict__` flattens differently: such a module is built fresh, as
    unflatten builds it. Reference: the cell's count (the property read on each
    new model gives the count it holds) and the structure of a fresh model."""

    def loss_fn(m, x):
        m.tally.n[...] = m.tally.n[...] + 1
        return jnp.sum((m.w * x) ** 2)

    model = es.to_refs(_WithTally(jnp.ones(2), _Tally()))
    step = es.make_step(loss_fn, optax.sgd(0.1))
    opt_state = step.init(model)
    structure = jax.tree.structure(model)
    for i in range(1, _REBUILD_AFTER + 5):
        model, opt_state = step(model, opt_state, jnp.ones(2))
        assert jax.tree.structure(model) == structure
        if read == "each call" or i == _REBUILD_AFTER:
            assert model.tally.seen == int(model.tally.n[...]) == i


class _Indexed(NamedTuple):
    a: Any
    b: Any

    def __getitem__(self, i):  # user code: never run by a step's rebuild
        GETITEM_CALLS.append(i)
        return tuple.__getitem__(self, i)


GETITEM_CALLS: list = []


def test_a_named_tuples_own_getitem_is_not_run():
    """A module kept from the given carry is found through its parents; a named
    tuple among them is read with `tuple.__getitem__`, not a `__getitem__` of its
    own (user code a rebuild by unflatten does not run)."""

    def loss_fn(m, x):
        m.a.increment()
        return jnp.sum((m.b * x) ** 2)

    step = es.make_step(loss_fn, optax.sgd(0.1))
    model = es.to_refs(_Indexed(es.nn.Counter(), jnp.ones(2)))
    opt_state = step.init(model)
    GETITEM_CALLS.clear()
    for i in range(1, _REBUILD_AFTER + 4):
        given = model
        model, opt_state = step(model, opt_state, jnp.ones(2))
        assert int(model.a.value) == i
    assert model.a is given.a  # kept: found through the named tuple
    assert GETITEM_CALLS == []
