"""The core's semantics, one regression test per defect found from the outside
(issue 11): arrays are values, sharing is declared, each call reads what it is
given, Equinox's idioms are exact or refused.

References are independent of the library's machinery: a plain `eqx.filter_jit`
+ optax loop with the state threaded by hand, float64 NumPy, or the eager calls."""

import copy
import gc
import weakref
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import optax.contrib
import pytest
from _compiles import count_compiles

import eqx_state as es


MODES = ["value", "ref"]


def as_mode(model, mode):
    return es.to_refs(model) if mode == "ref" else model


class MLP(eqx.Module):
    layers: list
    steps: es.nn.Counter

    def __init__(self, key, width=8):
        k1, k2, k3 = jax.random.split(key, 3)
        self.layers = [
            eqx.nn.Linear(3, width, key=k1),
            eqx.nn.Linear(width, width, key=k2),
            eqx.nn.Linear(width, 2, key=k3),
        ]
        self.steps = es.nn.Counter()

    def __call__(self, x):
        for layer in self.layers[:-1]:
            x = jax.nn.tanh(jax.vmap(layer)(x))
        return jax.vmap(self.layers[-1])(x)


def loss_fn(model, x, y):
    model.steps.increment()
    return jnp.mean((model(x) - y) ** 2)


def pure_loss(model, x, y):
    """The same loss with no state write: for the hand-written reference loop."""
    return jnp.mean((model(x) - y) ** 2)


def data(n=6, batch=8, seed=0):
    kx, ky = jax.random.split(jax.random.key(seed))
    return jax.random.normal(kx, (n, batch, 3)), jax.random.normal(ky, (n, batch, 2))


def reference_loop(model, opt, xs, ys, on_step=None):
    """The plain Equinox loop: `eqx.filter_jit`, optax on `eqx.filter(model,
    eqx.is_inexact_array)`, no state (the counter's integer array is not trained)."""
    params = es.params(model)
    opt_state = opt.init(params)

    @eqx.filter_jit
    def step(model, opt_state, x, y):
        grads = eqx.filter_grad(pure_loss)(model, x, y)
        grads = es.params(grads)
        updates, opt_state = opt.update(grads, opt_state, es.params(model))
        return eqx.apply_updates(model, updates), opt_state

    for i in range(len(xs)):
        if on_step is not None:
            model, opt_state = on_step(i, model, opt_state)
        model, opt_state = step(model, opt_state, xs[i], ys[i])
    return model, opt_state


def assert_params_close(a, b, rtol=1e-6, atol=1e-7):
    la = jax.tree.leaves(es.params(es.freeze(a)))
    lb = jax.tree.leaves(es.params(es.freeze(b)))
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


# ------------------------------------------- 1. in-place changes between calls


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("donate", [True, False])
@pytest.mark.parametrize("as_python", [False, True])
def test_inject_hyperparams_change_takes_effect(mode, donate, as_python):
    """optax's documented way to change the learning rate between steps."""
    xs, ys = data()
    opt = optax.inject_hyperparams(optax.adam)(learning_rate=1e-2)

    def on_step(i, model, opt_state):
        if i == 3:
            opt_state.hyperparams["learning_rate"] = 0.0 if as_python else jnp.zeros(())
        return model, opt_state

    step = es.make_step(loss_fn, opt, donate=donate)
    model = as_mode(MLP(jax.random.key(0)), mode)
    opt_state = step.init(model)
    history = []
    for i in range(len(xs)):
        model, opt_state = on_step(i, model, opt_state)
        model, opt_state = step(model, opt_state, xs[i], ys[i])
        history.append(np.asarray(es.freeze(model).layers[0].weight))
    np.testing.assert_array_equal(history[3], history[2])  # lr 0: no move
    np.testing.assert_array_equal(history[5], history[2])
    assert float(opt_state.hyperparams["learning_rate"]) == 0.0
    ref, _ = reference_loop(MLP(jax.random.key(0)), opt, xs, ys, on_step)
    assert_params_close(model, ref)
    assert int(model.steps.value) == len(xs)


@pytest.mark.parametrize("mode", MODES)
def test_replacing_a_list_item_between_steps_takes_effect(mode):
    xs, ys = data()
    new_head = eqx.nn.Linear(8, 2, key=jax.random.key(7))

    def on_step(i, model, opt_state):
        if i == 2:
            model.layers[-1] = new_head  # in place, on the list inside the module
            opt_state = opt.init(es.params(model))
        return model, opt_state

    opt = optax.sgd(0.1)
    step = es.make_step(loss_fn, opt)
    model = as_mode(MLP(jax.random.key(0)), mode)
    opt_state = step.init(model)
    for i in range(len(xs)):
        model, opt_state = on_step(i, model, opt_state)
        model, opt_state = step(model, opt_state, xs[i], ys[i])
    new_head = eqx.nn.Linear(8, 2, key=jax.random.key(7))  # the first was donated
    ref, _ = reference_loop(MLP(jax.random.key(0)), opt, xs, ys, on_step)
    assert_params_close(model, ref)


@pytest.mark.parametrize("mode", MODES)
def test_tree_at_replacement_and_dict_mutation_take_effect(mode):
    """`eqx.tree_at` on a parameter and on a cell, and a dict item changed in
    place: the next call uses each."""

    class Net(eqx.Module):
        table: dict
        bn: es.nn.BatchNorm

        def __call__(self, x):
            return self.bn(x * self.table["scale"])

    net = as_mode(Net({"scale": jnp.ones(())}, es.nn.BatchNorm(2, momentum=0.5)), mode)
    run = es.make_apply(lambda m, x: m(x))
    x = jnp.array([[1.0, 2.0], [3.0, 6.0]])
    _, net = run(net, x)
    net.table["scale"] = jnp.full((), 3.0)
    if mode == "value":
        net = eqx.tree_at(lambda m: m.bn.running_mean.value, net, jnp.full(2, 10.0))
    else:
        net.bn.running_mean[...] = jnp.full(2, 10.0)
    _, net = run(net, x)
    # running_mean = 0.5 * 10 + 0.5 * mean(3 x)
    np.testing.assert_allclose(net.bn.running_mean[...], [5.0 + 3.0, 5.0 + 6.0])


# --------------------------------------- 2. optimizer state holding parameters


@pytest.mark.parametrize(
    "make_opt",
    [
        lambda: optax.contrib.cocob(),
        lambda: optax.contrib.prodigy(1.0),
        lambda: optax.contrib.mechanize(optax.sgd(0.1)),
    ],
    ids=["cocob", "prodigy", "mechanize"],
)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.split
def test_optimizers_that_keep_the_initial_params_in_their_state(make_opt, mode):
    """Their `init` stores `params` itself: the same arrays sit in the model and in
    the optimizer state, and each position must get its own output."""
    xs, ys = data(n=8)
    opt = make_opt()
    step = es.make_step(loss_fn, opt)
    model = as_mode(MLP(jax.random.key(0)), mode)
    opt_state = step.init(model)
    for i in range(len(xs)):
        model, opt_state = step(model, opt_state, xs[i], ys[i])
    ref, ref_state = reference_loop(MLP(jax.random.key(0)), opt, xs, ys)
    assert_params_close(model, ref, rtol=2e-5, atol=1e-6)
    for a, b in zip(jax.tree.leaves(opt_state), jax.tree.leaves(ref_state)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=1e-6)


# ---------------------------------------- 3. one cell at two places, every runner


class Twice(eqx.Module):
    a: es.nn.Counter
    b: es.nn.Counter

    def __call__(self):
        return self.a.increment(), self.b.increment()


def _copy_arrays(tree):
    return jax.tree.map(lambda v: jnp.copy(v) if eqx.is_array(v) else v, tree)


def _runners():
    apply = lambda m: es.apply(lambda m: m(), m)  # noqa: E731

    def jax_jit(m):
        arrays, static = eqx.partition(m, eqx.is_array)

        @jax.jit
        def run(arrays):
            out, new = es.apply(lambda m: m(), eqx.combine(arrays, static))
            return out, eqx.filter(new, eqx.is_array)

        out, new = run(arrays)
        return out, eqx.combine(new, static)

    return {
        "apply": apply,
        "make_apply": es.make_apply(lambda m: m()),
        "filter_jit(apply)": eqx.filter_jit(apply),
        "jax.jit(apply)": jax_jit,
        "tree.map(copy)": lambda m: apply(_copy_arrays(m)),
    }


@pytest.mark.parametrize("runner", list(_runners()))
def test_one_counter_at_two_places_counts_the_same_everywhere(runner):
    """Two places are two states (as in Equinox): each counts 1 per call, under
    every way of running the model, and eagerly in ref mode."""
    run = _runners()[runner]
    c = es.nn.Counter()
    model = Twice(c, c)
    for i in range(1, 4):
        (a, b), model = run(model)
        assert (int(a), int(b)) == (i, i)
        assert (int(model.a.value), int(model.b.value)) == (i, i)
    c = es.nn.Counter()
    eager = es.to_refs(Twice(c, c))
    for i in range(1, 4):
        a, b = eager()
        assert (int(a), int(b)) == (i, i)


def _shared_b(t):
    return t.b


def _shared_a(t):
    return t.a


@pytest.mark.parametrize("runner", list(_runners()))
def test_declared_shared_counter_is_one_state_everywhere(runner):
    run = _runners()[runner]
    shared = eqx.nn.Shared(
        Twice(es.nn.Counter(), es.nn.Counter()), _shared_b, _shared_a
    )
    for i in range(1, 4):
        (a, b), shared = _run_shared(run, shared)
        assert (int(a), int(b)) == (2 * i - 1, 2 * i)
    eager = es.to_refs(
        eqx.nn.Shared(Twice(es.nn.Counter(), es.nn.Counter()), _shared_b, _shared_a)
    )
    for i in range(1, 4):
        a, b = eager()()
        assert (int(a), int(b)) == (2 * i - 1, 2 * i)


def _run_shared(run, shared):
    class Call(eqx.Module):
        s: eqx.nn.Shared

        def __call__(self):
            return self.s()()

    out, new = run(Call(shared))
    return out, new.s


# ------------------------------------------ 4. identically built models, deepcopy


class WithRng(eqx.Module):
    lin: eqx.nn.Linear
    drop: es.nn.Dropout

    def __init__(self, seed):
        self.lin = eqx.nn.Linear(3, 3, key=jax.random.key(seed))
        self.drop = es.nn.Dropout(0.5, key=seed)

    def __call__(self, x):
        return self.drop(jax.vmap(self.lin)(x))


def test_identically_built_models_have_one_structure_and_one_compilation():
    m1, m2 = WithRng(0), WithRng(0)
    assert jax.tree.structure(m1) == jax.tree.structure(m2)
    assert bool(eqx.tree_equal(m1, m2))
    jax.tree.map(lambda a, b: a, m1, m2)  # same structure: no error
    step = es.make_step(lambda m, x: jnp.mean(m(x)), optax.sgd(0.1))
    x = jnp.ones((4, 3))
    with count_compiles() as compiles:
        step(m1, step.init(m1), x)
        step(WithRng(1), step.init(WithRng(1)), x)
        step(m2, step.init(m2), x)
    assert step.trace_count == 1 and len(compiles) == 1


@pytest.mark.parametrize(
    "runner", ["eager", "apply", "make_apply", "filter_jit", "jax.jit", "make_step"]
)
def test_a_map_over_every_leaf_gives_one_clear_error(runner):
    """`jax.tree.map(jnp.copy, model)` turns the layers' `inference` flags into
    arrays: every runner raises the same TypeError naming the arrays-only copy
    (Equinox's own flags are Python bools too). Value mode: `jnp.copy` refuses a
    ref-mode model's refs itself."""
    model = jax.tree.map(jnp.copy, es.nn.BatchNorm(3))
    x = jnp.ones((4, 3))
    fwd = lambda m, x: m(x)  # noqa: E731
    runs = {
        "eager": lambda m: fwd(m, x),
        "apply": lambda m: es.apply(fwd, m, x),
        "make_apply": lambda m: es.make_apply(fwd)(m, x),
        "filter_jit": lambda m: eqx.filter_jit(es.apply)(fwd, m, x),
        "jax.jit": lambda m: jax.jit(lambda d: es.apply(fwd, eqx.combine(d, st), x))(
            eqx.filter(m, es.is_array_or_ref)
        ),
        "make_step": lambda m: (lambda s: s(m, s.init(m), x))(
            es.make_step(lambda m, x: jnp.sum(m(x)), optax.sgd(0.1))
        ),
    }
    st = eqx.filter(model, es.is_array_or_ref, inverse=True)
    with pytest.raises(TypeError, match=r"inference` must be a Python bool.*is_array"):
        runs[runner](model)


def test_jax_jit_over_a_whole_model_names_filter_jit():
    """`jax.jit` over the whole model traces its Python `inference` flag: the error
    names that cause and its fixes, not a NumPy bool or a tree map alone."""
    x = jnp.ones((4, 3))
    for fn in (
        jax.jit(lambda m, x: m(x)),
        jax.jit(lambda m, x: es.apply(lambda m, x: m(x), m, x)),
    ):
        with pytest.raises(
            TypeError, match=r"traced bool.*`jax\.jit`.*eqx\.filter_jit"
        ):
            fn(es.to_refs(es.nn.BatchNorm(3)), x)


@pytest.mark.parametrize("mode", MODES)
def test_deepcopy_gives_an_independent_model(mode):
    """A target network built with `copy.deepcopy` is its own model: drawing from the
    online network's stream leaves the target's untouched."""

    class Agent(eqx.Module):
        online: WithRng
        target: WithRng

    online = as_mode(WithRng(3), mode)
    agent = Agent(online, copy.deepcopy(online))
    key0 = np.asarray(agent.target.drop.rng.key[...])
    x = jnp.ones((4, 3))
    if mode == "ref":
        agent.online(x)
        agent.online(x)
    else:
        _, agent = es.apply(lambda a, x: (a.online(x), a.online(x)), agent, x)
    np.testing.assert_array_equal(agent.target.drop.rng.key[...], key0)
    assert not np.array_equal(agent.online.drop.rng.key[...], key0)


# ------------------------------------------------------- 5. scan over layers


class Block(eqx.Module):
    lin: eqx.nn.Linear
    bn: es.nn.BatchNorm

    def __init__(self, key):
        self.lin = eqx.nn.Linear(4, 4, key=key)
        self.bn = es.nn.BatchNorm(4)

    def __call__(self, x):
        return jax.nn.relu(self.bn(jax.vmap(self.lin)(x)))


def scan_layers(stack, x, filter_spec):
    dynamic, static = eqx.partition(stack, filter_spec)

    def body(h, layer):
        return eqx.combine(layer, static)(h), None

    return jax.lax.scan(body, x, dynamic)[0]


def numpy_stack(weights, biases, x, n_steps):
    """Float64 reference: each layer Linear -> BatchNorm (batch stats, PyTorch
    momentum 0.1, unbiased running var) -> relu; the running statistics."""
    means = [np.zeros(4) for _ in weights]
    vars_ = [np.ones(4) for _ in weights]
    for _ in range(n_steps):
        h = np.asarray(x, np.float64)
        for i, (w, b) in enumerate(zip(weights, biases)):
            z = h @ w.T + b
            mu, var = z.mean(0), z.var(0)
            means[i] = 0.9 * means[i] + 0.1 * mu
            vars_[i] = 0.9 * vars_[i] + 0.1 * z.var(0, ddof=1)
            h = np.maximum((z - mu) / np.sqrt(var + 1e-5), 0.0)
    return means, vars_


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("runner", ["apply", "make_apply", "make_step"])
def test_scan_over_layers_with_es_is_array_is_exact(mode, runner):
    stack = eqx.filter_vmap(Block)(jax.random.split(jax.random.key(0), 3))
    weights = [np.asarray(stack.lin.weight[i], np.float64) for i in range(3)]
    biases = [np.asarray(stack.lin.bias[i], np.float64) for i in range(3)]
    stack = as_mode(stack, mode)
    x = jax.random.normal(jax.random.key(1), (16, 4)) + 2.0
    fwd = lambda m, x: scan_layers(m, x, es.is_array_or_ref)  # noqa: E731
    for _ in range(2):
        if runner == "apply":
            _, stack = es.apply(fwd, stack, x)
        elif runner == "make_apply":
            _, stack = es.make_apply(fwd)(stack, x)
        else:
            step = es.make_step(lambda m, x: jnp.sum(fwd(m, x)), optax.sgd(0.0))
            stack, _ = step(stack, step.init(stack), x)
    means, vars_ = numpy_stack(weights, biases, x, 2)
    np.testing.assert_allclose(stack.bn.running_mean[...], np.stack(means), atol=1e-5)
    np.testing.assert_allclose(stack.bn.running_var[...], np.stack(vars_), rtol=1e-5)
    assert stack.bn.num_batches_tracked[...].tolist() == [2, 2, 2]


@pytest.mark.parametrize("mode", MODES)
def test_indexing_stacked_layers_names_the_scan_idiom(mode):
    """`jax.tree.map(lambda a: a[i], stack)` reads a copy of every ref: a write
    into it would be lost, and the error says to scan with `es.is_array_or_ref`."""
    stack = as_mode(
        eqx.filter_vmap(Block)(jax.random.split(jax.random.key(0), 3)), mode
    )

    def unrolled(m, x):
        for i in range(3):
            layer = jax.tree.map(lambda a, i=i: a[i] if es.is_array_or_ref(a) else a, m)
            x = layer(x)
        return x

    with pytest.raises(
        es.StateWriteError, match=r"a\[i\].*lax\.scan.*es\.is_array_or_ref"
    ):
        es.apply(unrolled, stack, jnp.ones((8, 4)))
    assert stack.bn.num_batches_tracked[...].tolist() == [0, 0, 0]


@pytest.mark.parametrize(
    "mode,runner",
    [(m, r) for m in MODES for r in ("apply", "make_step")] + [("ref", "eager")],
)
@pytest.mark.parametrize(
    "filter_",
    [eqx.is_array, eqx.is_inexact_array],
    ids=lambda f: f.__name__,
)
def test_scan_over_layers_with_equinox_filters_is_refused(mode, runner, filter_):
    """`eqx.partition(stack, eqx.is_array)` (or `eqx.is_inexact_array`)
    leaves the refs in the static half: every layer would write the whole stacked
    statistic. It raises, naming `es.is_array_or_ref`, and writes nothing. (An eager call
    of a value-mode model refuses every write, scanned or not.)"""
    stack = as_mode(
        eqx.filter_vmap(Block)(jax.random.split(jax.random.key(0), 3)), mode
    )
    x = jnp.ones((8, 4))
    fwd = lambda m, x: scan_layers(m, x, filter_)  # noqa: E731
    with pytest.raises(
        es.StateError, match=r"eqx\.partition\(model, es\.is_array_or_ref\)"
    ):
        if runner == "apply":
            es.apply(fwd, stack, x)
        elif runner == "eager":
            fwd(stack, x)
        else:
            step = es.make_step(lambda m, x: jnp.sum(fwd(m, x)), optax.sgd(0.1))
            step(stack, step.init(stack), x)
    assert stack.bn.num_batches_tracked[...].tolist() == [0, 0, 0]


# ------------------------------------------------- 6. the step holds nothing


def test_the_step_keeps_no_model_alive():
    xs, ys = data(n=2)
    step = es.make_step(loss_fn, optax.adam(1e-2), donate=False)
    model = MLP(jax.random.key(0))
    opt_state = step.init(model)
    new_model, new_state = step(model, opt_state, xs[0], ys[0])
    objs = (model, new_model, *jax.tree.leaves((opt_state, new_state)))
    refs = [weakref.ref(x) for x in objs]
    del model, opt_state, new_model, new_state, objs
    gc.collect()
    assert all(r() is None for r in refs)


def test_vmapped_step_leaks_no_tracer():
    xs, ys = data(n=2)
    step = es.make_step(loss_fn, optax.adam(1e-2))
    models = eqx.filter_vmap(MLP)(jax.random.split(jax.random.key(0), 3))
    opt_states = eqx.filter_vmap(step.init)(models)
    with jax.checking_leaks():
        in_axes = (eqx.if_array(0), eqx.if_array(0), None, None)
        models, opt_states = eqx.filter_vmap(step, in_axes=in_axes)(
            models, opt_states, xs[0], ys[0]
        )
    assert models.steps.value.tolist() == [1, 1, 1]


# ------------------- 6b. the carry a call returned is not flattened again (issue 23)


class TupleMLP(eqx.Module):
    """MLP with its layers in a tuple: every node of the model and of Adam's state
    is immutable, so a step takes the leaves of the carry it returned."""

    layers: tuple
    bn: es.nn.BatchNorm
    steps: es.nn.Counter

    def __init__(self, key, width=8):
        k1, k2 = jax.random.split(key)
        self.layers = (eqx.nn.Linear(3, width, key=k1), eqx.nn.Linear(width, 2, key=k2))
        self.bn = es.nn.BatchNorm(width, momentum=0.1)
        self.steps = es.nn.Counter()

    def __call__(self, x):
        x = jax.nn.tanh(self.bn(jax.vmap(self.layers[0])(x)))
        return jax.vmap(self.layers[1])(x)


@jax.tree_util.register_pytree_node_class
class Box:
    """A user's mutable pytree node: its content may change in place."""

    def __init__(self, item):
        self.item = item

    def tree_flatten(self):
        return (self.item,), None

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children)


class Scaled(eqx.Module):
    net: TupleMLP
    scale: Box

    def __call__(self, x):
        return self.net(x) * self.scale.item


def _scaled_loss(model, x, y):
    model.net.steps.increment()
    return jnp.mean((model(x) - y) ** 2)


@pytest.mark.parametrize("mode", MODES)
def test_a_loop_over_returned_carries_equals_a_hand_threaded_loop(mode):
    """`model, opt_state = step(model, opt_state, ...)` with an immutable
    structure (the fast path) against `eqx.filter_jit` + optax with BatchNorm's
    statistics computed by hand in float64 NumPy (PyTorch's rule)."""
    xs, ys = data(n=5)
    # sgd: Adam would scale the rounding-level gradient of the bias before
    # BatchNorm up to full steps (a comparison of roundings, not of the library)
    opt = optax.sgd(0.1, momentum=0.9)
    step = es.make_step(
        lambda m, x, y: (m.steps.increment(), jnp.mean((m(x) - y) ** 2))[1], opt
    )
    model = as_mode(TupleMLP(jax.random.key(0)), mode)
    opt_state = step.init(model)
    for i in range(len(xs)):
        model, opt_state = step(model, opt_state, xs[i], ys[i])

    ref = es.params(TupleMLP(jax.random.key(0)))

    def forward(p, x):
        h = jax.vmap(p.layers[0])(x)
        mu, var = jnp.mean(h, 0), jnp.var(h, 0)
        h = (h - mu) / jnp.sqrt(var + 1e-5) * p.bn.weight + p.bn.bias
        return jax.vmap(p.layers[1])(jax.nn.tanh(h))

    @eqx.filter_jit
    def ref_step(p, s, x, y):
        g = eqx.filter_grad(lambda p: jnp.mean((forward(p, x) - y) ** 2))(p)
        u, s = opt.update(g, s, p)
        return eqx.apply_updates(p, u), s

    s = opt.init(eqx.filter(ref, eqx.is_inexact_array))
    mean, var = np.zeros(8), np.ones(8)
    for i in range(len(xs)):
        h = np.asarray(jax.vmap(ref.layers[0])(xs[i]), np.float64)
        mean = 0.9 * mean + 0.1 * h.mean(0)
        var = 0.9 * var + 0.1 * h.var(0, ddof=1)
        ref, s = ref_step(ref, s, xs[i], ys[i])
    frozen = es.freeze(model)
    for got, want in zip(jax.tree.leaves(es.params(frozen)), jax.tree.leaves(ref)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(frozen.bn.running_mean.value, mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(frozen.bn.running_var.value, var, rtol=1e-5)
    assert int(frozen.steps.value) == len(xs)


@pytest.mark.parametrize("mode", MODES)
def test_a_mutable_node_in_a_returned_carry_is_read_on_every_call(mode):
    """A user's own pytree node (mutable) inside an otherwise immutable model:
    changing it in place between calls of a step and of an apply takes effect."""
    xs, ys = data(n=3)
    step = es.make_step(_scaled_loss, optax.sgd(0.0), return_loss=True)
    model = as_mode(Scaled(TupleMLP(jax.random.key(0)), Box(jnp.ones(()))), mode)
    opt_state = step.init(model)
    model, opt_state, loss1 = step(model, opt_state, xs[0], jnp.zeros_like(ys[0]))
    model.scale.item = jnp.full((), 2.0)  # in place, on the returned model
    model, opt_state, loss2 = step(model, opt_state, xs[0], jnp.zeros_like(ys[0]))
    # sgd(0): the same parameters; BatchNorm normalises with batch statistics
    np.testing.assert_allclose(loss2, 4.0 * loss1, rtol=1e-6)
    run = es.make_apply(lambda m, x: m(x))
    out1, model = run(model, xs[1])
    model.scale.item = jnp.full((), 3.0)
    out2, model = run(model, xs[1])
    np.testing.assert_allclose(out2, 1.5 * out1, rtol=1e-6)


def test_a_module_reading_its_fields_its_own_way_is_flattened_on_every_call():
    """A module class with a `__getattribute__` of its own may give Equinox's
    flatten another `__dict__` each time: no carry with it is taken as returned."""
    calls = []

    class Odd(eqx.Module):
        lin: eqx.nn.Linear

        def __getattribute__(self, name):
            if name == "__dict__":
                calls.append(name)
            return super().__getattribute__(name)

        def __call__(self, x):
            return jax.vmap(self.lin)(x)

    step = es.make_step(lambda m, x: jnp.mean(m(x) ** 2), optax.sgd(0.1))
    model = Odd(eqx.nn.Linear(2, 2, key=jax.random.key(0)))
    opt_state = step.init(model)
    for _ in range(3):
        model, opt_state = step(model, opt_state, jnp.ones((4, 2)))
        before = len(calls)
    model, opt_state = step(model, opt_state, jnp.ones((4, 2)))
    assert len(calls) > before  # flattened again (reads `__dict__`)


def test_the_step_keeps_no_returned_carry_alive():
    """The carry a step returned is remembered for the next call only while the
    caller holds the model: dropping it frees every array of the carry."""
    xs, ys = data(n=2)
    step = es.make_step(
        lambda m, x, y: jnp.mean((m(x) - y) ** 2), optax.adam(1e-2), donate=False
    )
    model = TupleMLP(jax.random.key(0))
    opt_state = step.init(model)
    model, opt_state = step(model, opt_state, xs[0], ys[0])
    model, opt_state = step(model, opt_state, xs[1], ys[1])
    arrays = jax.tree.leaves(eqx.filter((model, opt_state), eqx.is_array))
    refs = [weakref.ref(x) for x in (model, *arrays)]
    del arrays
    del model, opt_state
    gc.collect()
    assert all(r() is None for r in refs)
    assert step.trace_count == 1
    # the optimizer state alone, the model kept (a fresh one after training)
    model = TupleMLP(jax.random.key(0))
    model, opt_state = step(model, step.init(model), xs[0], ys[0])
    model, opt_state = step(model, opt_state, xs[1], ys[1])
    moments = [weakref.ref(x) for x in jax.tree.leaves(opt_state)]
    del opt_state
    gc.collect()
    assert all(r() is None for r in moments)


class _Scale(NamedTuple):
    value: Any


@jax.tree_util.register_pytree_node_class
class _DictScale(_Scale):
    """A named tuple subclass with an instance `__dict__` that its own flatten
    reads: not a JAX named tuple, and mutable."""

    def tree_flatten(self):
        return (self.__dict__.get("scale", self.value),), None

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children)


def test_a_named_tuple_with_a_dict_of_its_own_is_read_on_every_call():
    """(a review's finding) Changed through its `__dict__` between calls of an
    apply: the next call reads it, as `jax.tree.leaves` does."""

    class Net(eqx.Module):
        p: Any

        def __call__(self, x):
            return x * self.p.value

    run = es.make_apply(lambda m, x: m(x))
    net = Net(_DictScale(jnp.ones(())))
    _, net = run(net, jnp.ones(()))
    net.p.__dict__["scale"] = jnp.full((), 5.0)
    assert float(jax.tree.leaves(net)[0]) == 5.0
    out, net = run(net, jnp.ones(()))
    assert float(out) == 5.0


# ------------------------------------------------ 7. a step that fails at run time


class Guarded(eqx.Module):
    lin: eqx.nn.Linear
    bn: es.nn.BatchNorm

    def __init__(self):
        self.lin = eqx.nn.Linear(3, 2, key=jax.random.key(0))
        self.bn = es.nn.BatchNorm(2)

    def __call__(self, x):
        x = eqx.error_if(x, jnp.any(jnp.isnan(x)), "NaN in the input")
        return self.bn(jax.vmap(self.lin)(x))


def guarded_loss(model, x):
    return jnp.mean(model(x) ** 2)


def test_failing_step_without_donation_leaves_the_model_usable():
    step = es.make_step(guarded_loss, optax.sgd(0.1), donate=False)
    model = Guarded()
    opt_state = step.init(model)
    bad = jnp.full((4, 3), jnp.nan, jnp.float32)
    with pytest.raises(eqx.EquinoxRuntimeError, match="NaN in the input"):
        out = step(model, opt_state, bad)
        jax.block_until_ready(out)
    model, opt_state = step(model, opt_state, jnp.ones((4, 3)))  # still usable
    assert int(model.bn.num_batches_tracked[...]) == 1


def test_failing_donating_step_consumes_the_model_as_documented():
    step = es.make_step(guarded_loss, optax.sgd(0.1))
    model = Guarded()
    opt_state = step.init(model)
    with pytest.raises(eqx.EquinoxRuntimeError, match="NaN in the input"):
        jax.block_until_ready(
            step(model, opt_state, jnp.full((4, 3), jnp.nan, jnp.float32))
        )
    with pytest.raises(es.StaleModelError, match="fails at run time"):
        step(model, opt_state, jnp.ones((4, 3)))
    with pytest.raises(es.StaleModelError, match="donate=False"):
        eqx.nn.inference_mode(model).bn(jnp.ones((4, 2)))
    # switching a consumed model to evaluation names the first consumed leaf
    with pytest.raises(
        es.StaleModelError, match=r"donate=False.*Consumed: `model\.lin\.weight`"
    ):
        es.inference_mode(model)


# ------------------------------------------------------- 8. extra arguments


def test_non_array_arguments_are_static():
    class Net(eqx.Module):
        lin: eqx.nn.Linear

        def __call__(self, x):
            return jax.vmap(self.lin)(x)

    def loss(model, x, *, square, reduce, scale):
        y = model(x) * scale
        y = y**2 if square else jnp.abs(y)  # a Python bool in an `if`
        return reduce(y)  # a callable

    step = es.make_step(loss, optax.sgd(0.0), return_loss=True)
    model = Net(eqx.nn.Linear(2, 2, key=jax.random.key(0)))
    x = jnp.ones((3, 2))
    y = jax.vmap(model.lin)(x)
    opt_state = step.init(model)
    for square, reduce, scale in [
        (True, jnp.sum, 1.0),
        (False, jnp.mean, 2.0),
        (True, jnp.sum, jnp.asarray(3.0)),
        (True, jnp.sum, jnp.asarray(4.0)),  # an array: traced, no new compilation
    ]:
        model, opt_state, value = step(
            model, opt_state, x, square=square, reduce=reduce, scale=scale
        )
        want = reduce((y * scale) ** 2 if square else jnp.abs(y * scale))
        np.testing.assert_allclose(value, want, rtol=1e-6)
    assert step.trace_count == 3
