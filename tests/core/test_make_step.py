"""make_step against a hand-threaded pure-JAX loop, in both storage modes, and under
transforms (remat, vmap over an ensemble, grad through a step)."""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _compiles import count_compiles

import eqx_state as es
from eqx_state import _compat


W, B, IN, OUT = 6, 8, 5, 3
MODES = ["value", "ref"]


class Net(eqx.Module):
    l1: eqx.nn.Linear
    bn: es.nn.BatchNorm
    l2: eqx.nn.Linear
    steps: es.nn.Counter

    def __init__(self, key, momentum=0.1):
        k1, k2 = jax.random.split(key)
        # no bias before BatchNorm: its gradient is zero up to rounding, which Adam
        # would amplify into noise that no two implementations share
        self.l1 = eqx.nn.Linear(IN, W, use_bias=False, key=k1)
        self.bn = es.nn.BatchNorm(W, momentum=momentum)
        self.l2 = eqx.nn.Linear(W, OUT, key=k2)
        self.steps = es.nn.Counter()

    def __call__(self, x):
        h = jax.nn.relu(self.bn(jax.vmap(self.l1)(x)))
        return jax.vmap(self.l2)(h)


def loss_fn(model, x, y):
    model.steps.increment()
    return jnp.mean((model(x) - y) ** 2)


def data(n_steps, seed=1):
    kx, ky = jax.random.split(jax.random.key(seed))
    return (
        jax.random.normal(kx, (n_steps, B, IN)),
        jax.random.normal(ky, (n_steps, B, OUT)),
    )


def pure_params(model):
    return {
        "w1": model.l1.weight,
        "g": model.bn.weight,
        "beta": model.bn.bias,
        "w2": model.l2.weight,
        "b2": model.l2.bias,
    }


def pure_step(opt, momentum=0.1):
    """The same training step, written by hand: state threaded as values."""

    def step(p, stats, opt_state, x, y):
        def loss(p):
            h = x @ p["w1"].T
            mean = h.mean(0)
            var = ((h - mean) ** 2).mean(0)
            hn = (h - mean) / jnp.sqrt(var + 1e-5) * p["g"] + p["beta"]
            out = jax.nn.relu(hn) @ p["w2"].T + p["b2"]
            return jnp.mean((out - y) ** 2), (mean, var)

        (_, (mean, var)), g = jax.value_and_grad(loss, has_aux=True)(p)
        rm, rv, n, count = stats
        rm = (1 - momentum) * rm + momentum * mean
        rv = (1 - momentum) * rv + momentum * var * (B / (B - 1))
        updates, opt_state = opt.update(g, opt_state, p)
        return optax.apply_updates(p, updates), (rm, rv, n + 1, count + 1), opt_state

    return jax.jit(step)


def fresh(mode, seed=0, **kw):
    m = Net(jax.random.key(seed), **kw)
    return es.to_refs(m) if mode == "ref" else m


@pytest.mark.parametrize("mode", MODES)
def test_matches_hand_threaded_loop(mode):
    """20 steps of adamw (weight decay 0.5: it must not touch statistics or counters)."""
    n_steps = 20
    xs, ys = data(n_steps)
    opt = optax.adamw(1e-2, weight_decay=0.5)
    model = fresh(mode)
    p = jax.tree.map(jnp.copy, pure_params(model))
    stats = (jnp.zeros(W), jnp.ones(W), jnp.int32(0), jnp.int32(0))
    popt = opt.init(p)
    ref_step = pure_step(opt)
    step = es.make_step(loss_fn, opt)
    opt_state = step.init(model)
    for i in range(n_steps):
        model, opt_state = step(model, opt_state, xs[i], ys[i])
        p, stats, popt = ref_step(p, stats, popt, xs[i], ys[i])
    assert step.trace_count == 1
    for a, b in zip(jax.tree.leaves(pure_params(model)), jax.tree.leaves(p)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(
        model.bn.running_mean[...], stats[0], rtol=1e-5, atol=1e-5
    )
    np.testing.assert_allclose(
        model.bn.running_var[...], stats[1], rtol=1e-5, atol=1e-5
    )
    assert int(model.bn.num_batches_tracked[...]) == n_steps
    assert int(model.steps.value) == n_steps
    # optimizer state: same leaves (adam's mu, nu, count), in the same order
    ours = jax.tree.leaves(opt_state)
    theirs = jax.tree.leaves(popt)
    assert len(ours) == len(theirs)
    mu_ours = pure_params(opt_state[0].mu)
    mu_ref = popt[0].mu
    for k in mu_ref:
        np.testing.assert_allclose(mu_ours[k], mu_ref[k], rtol=1e-5, atol=1e-6)
    assert int(opt_state[0].count) == int(popt[0].count) == n_steps


def test_ref_mode_compiles_the_value_mode_program():
    """Ref mode is a layer over value mode: a step on a ref-mode model compiles the
    very program of the value-mode step (its refs' arrays go in as the value-mode
    cells, donated, and come back out), so its compile time and run time are value
    mode's. The lowered StableHLO texts are equal, device annotations included:
    the refs' arrays stay uncommitted, as a fresh value-mode model's are."""
    xs, ys = data(2)
    step = es.make_step(loss_fn, optax.adam(1e-2))

    def program(mode):
        model = fresh(mode)
        opt_state = step.init(model)
        model, opt_state = step(model, opt_state, xs[0], ys[0])  # a loop's carry
        return step.lower(model, opt_state, xs[1], ys[1]).as_text()

    value, ref = program("value"), program("ref")
    assert "stablehlo.dot_general" in value  # the whole step, not a stub
    assert "tf.aliasing_output" in value  # the cells are donated in both
    assert ref == value


def _ref_run_and_reference(opt):
    """A fresh ref-mode model with its step and optimizer state, and the
    hand-threaded loop's parameters, statistics, optimizer state and step."""
    model = fresh("ref")
    p = jax.tree.map(jnp.copy, pure_params(model))
    stats = (jnp.zeros(W), jnp.ones(W), jnp.int32(0), jnp.int32(0))
    step = es.make_step(loss_fn, opt)
    return model, step, step.init(model), p, stats, opt.init(p), pure_step(opt)


def test_ref_mode_carry_stays_uncommitted(tmp_path):
    """A ref-mode step takes its refs' arrays as a value-mode step takes its cells:
    uncommitted, as a fresh model's arrays are (`jax.jit` compiles separately for
    committed inputs, and each costs a call more). Eager whole-cell reads and
    writes between steps (logging a statistic, resetting a counter, saving a
    checkpoint) keep them so,
    where JAX's own eager ref operations would commit them. A read is a snapshot
    that a later step (which donates the ref's array) leaves valid; a write takes
    a copy, so the caller's array survives the step. Checked against the
    hand-threaded loop, at one compilation."""
    n = 6
    xs, ys = data(n)
    opt = optax.adam(1e-2)
    model, step, opt_state, p, stats, popt, ref_step = _ref_run_and_reference(opt)
    snapshots, zero = [], jnp.zeros((), jnp.int32)
    with count_compiles() as compiles:
        for i in range(n):
            model, opt_state = step(model, opt_state, xs[i], ys[i])
            p, stats, popt = ref_step(p, stats, popt, xs[i], ys[i])
            snapshots.append((model.bn.running_mean[...], stats[0]))
            if i == 2:
                model.steps.count[...] = zero  # the caller keeps `zero`
                stats = (*stats[:3], jnp.int32(0))
            if i == 4:
                model.steps.count[...] = 1  # a Python number
                stats = (*stats[:3], jnp.int32(1))
                es.save(tmp_path / "model.eqx", model)  # reads every cell
    assert len(compiles) == 1, compiles
    cells = [c for c in jax.tree.leaves(model, is_leaf=es.is_state) if es.is_state(c)]
    assert len(cells) == 4
    assert not any(_compat.ref_buffer(c.value).committed for c in cells)
    arrays = jax.tree.leaves(eqx.filter(model, eqx.is_array))
    assert arrays and not any(x.committed for x in arrays)
    for got, want in snapshots:  # each still readable, as it was then
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert int(zero) == 0
    for a, b in zip(jax.tree.leaves(pure_params(model)), jax.tree.leaves(p)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(model.bn.running_var[...], stats[1], rtol=1e-5)
    assert int(model.bn.num_batches_tracked[...]) == n
    assert int(model.steps.value) == int(stats[3]) == 2


def test_ref_mode_step_after_an_eager_write_jax_commits():
    """An eager write JAX runs itself (a part of a cell: `cell[i] = v`) commits the
    ref's array; the next step then commits the whole carry once (one more
    compilation, then none), and the numbers are the hand-threaded loop's. A
    ref laid out by `to_refs(sharding=...)` keeps its layout through an eager
    whole-cell write of an uncommitted value (not the copy's placement)."""
    xs, ys = data(5)
    opt = optax.sgd(1e-2)
    model, step, opt_state, p, stats, popt, ref_step = _ref_run_and_reference(opt)
    with count_compiles() as compiles:
        for i in range(5):
            model, opt_state = step(model, opt_state, xs[i], ys[i])
            p, stats, popt = ref_step(p, stats, popt, xs[i], ys[i])
            if i == 1:
                model.bn.running_mean[0] = 2.0
                stats = (stats[0].at[0].set(2.0), *stats[1:])
                assert _compat.ref_buffer(model.bn.running_mean.value).committed
    assert len(compiles) == 2, compiles
    np.testing.assert_allclose(model.bn.running_mean[...], stats[0], rtol=1e-5)
    for a, b in zip(jax.tree.leaves(pure_params(model)), jax.tree.leaves(p)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("d",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    bn = es.to_refs(es.nn.BatchNorm(3), sharding=sharding)
    bn.running_mean[...] = jnp.arange(3.0)
    assert _compat.ref_buffer(bn.running_mean.value).sharding == sharding
    np.testing.assert_array_equal(bn.running_mean[...], [0.0, 1.0, 2.0])


def _filter_remat_loss(model, x, y):
    return eqx.filter_checkpoint(loss_fn)(model, x, y)


def _closure_remat_loss(model, x, y):
    return jax.checkpoint(lambda x: loss_fn(model, x, y))(x)


@pytest.mark.parametrize("remat_loss", [_filter_remat_loss, _closure_remat_loss])
@pytest.mark.parametrize("mode", MODES)
def test_remat_writes_once(mode, remat_loss):
    """jax.checkpoint under grad replays the forward; state must still advance once."""

    xs, ys = data(3)
    model_a, model_b = fresh(mode), fresh(mode)
    step_a = es.make_step(remat_loss, optax.sgd(1e-2))
    step_b = es.make_step(loss_fn, optax.sgd(1e-2))
    sa, sb = step_a.init(model_a), step_b.init(model_b)
    for i in range(3):
        model_a, sa = step_a(model_a, sa, xs[i], ys[i])
        model_b, sb = step_b(model_b, sb, xs[i], ys[i])
    assert int(model_a.steps.value) == 3
    assert int(model_a.bn.num_batches_tracked[...]) == 3
    np.testing.assert_allclose(model_a.bn.running_var[...], model_b.bn.running_var[...])
    np.testing.assert_allclose(model_a.l1.weight, model_b.l1.weight, rtol=1e-6)


def test_vmap_ensemble_equals_solo_runs():
    keys = jax.random.split(jax.random.key(3), 4)
    xs, ys = data(3)
    step = es.make_step(loss_fn, optax.adam(1e-2), donate=False)
    solo = []
    for k in keys:
        m = Net(k)
        s = step.init(m)
        for i in range(3):
            m, s = step(m, s, xs[i], ys[i])
        solo.append(m)
    ens = eqx.filter_vmap(Net)(keys)
    ens_opt = eqx.filter_vmap(step.init)(ens)
    vstep = eqx.filter_vmap(
        step, in_axes=(eqx.if_array(0), eqx.if_array(0), None, None)
    )
    for i in range(3):
        ens, ens_opt = vstep(ens, ens_opt, xs[i], ys[i])
    for j, m in enumerate(solo):
        np.testing.assert_allclose(
            ens.bn.running_mean[...][j], m.bn.running_mean[...], rtol=1e-5
        )
        np.testing.assert_allclose(
            ens.bn.running_var[...][j], m.bn.running_var[...], rtol=1e-5
        )
        np.testing.assert_allclose(ens.l2.weight[j], m.l2.weight, rtol=1e-5, atol=1e-6)
        assert int(ens.steps.count[...][j]) == 3


def _ref_ensemble(n, seed):
    """A ref-mode ensemble of `n` Nets and its step, with the hand-threaded
    reference: its state `(params, stats, opt_state)` and its vmapped step."""
    keys = jax.random.split(jax.random.key(seed), n)
    opt = optax.adam(1e-2)
    step = es.make_step(loss_fn, opt)
    ens = es.to_refs(eqx.filter_vmap(Net)(keys))
    p = jax.tree.map(jnp.copy, pure_params(eqx.filter_vmap(Net)(keys)))
    stats = (jnp.zeros((n, W)), jnp.ones((n, W)), jnp.zeros(n, int), jnp.zeros(n, int))
    popt = jax.vmap(opt.init)(p)
    ref_step = jax.vmap(pure_step(opt), in_axes=(0, 0, 0, None, None))
    return step, ens, (p, stats, popt), ref_step


def _assert_ensemble_equals(ens, p, stats, n_steps):
    """The ensemble's parameters, statistics and step counts equal the reference's."""
    for a, b in zip(jax.tree.leaves(pure_params(ens)), jax.tree.leaves(p)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ens.bn.running_mean[...], stats[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ens.bn.running_var[...], stats[1], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(ens.steps.count[...], [n_steps] * len(stats[2]))


def test_a_ref_mode_ensemble_steps_under_vmap_like_a_hand_threaded_loop():
    """A ref-mode ensemble trains under `jax.vmap` over `eqx.partition(model,
    es.is_array_or_ref)`, which returns the refs themselves (reference: `vmap` of
    the hand-threaded step). `eqx.filter_vmap` of the step cannot return refs
    (Equinox's filters treat them as static): reading the model it returns raised
    JAX's bare UnexpectedTracerError; it names what happened and the fix."""
    n, n_steps = 3, 3
    step, ens, (p, stats, popt), ref_step = _ref_ensemble(n, 5)
    xs, ys = data(n_steps)
    dyn, static = eqx.partition(ens, es.is_array_or_ref)
    ens_opt = jax.vmap(lambda d: step.init(eqx.combine(d, static)))(dyn)

    def member(d, o, x, y):
        m, o = step(eqx.combine(d, static), o, x, y)
        return eqx.filter(m, es.is_array_or_ref), o

    for i in range(n_steps):
        dyn, ens_opt = jax.vmap(member, in_axes=(0, 0, None, None))(
            dyn, ens_opt, xs[i], ys[i]
        )
        p, stats, popt = ref_step(p, stats, popt, xs[i], ys[i])
    ens = eqx.combine(dyn, static)
    _assert_ensemble_equals(ens, p, stats, n_steps)

    in_axes = (lambda x: 0 if es.is_array_or_ref(x) else None, 0, None, None)
    x, y = xs[0], ys[0]
    escaped, ens_opt = eqx.filter_vmap(step, in_axes=in_axes)(ens, ens_opt, x, y)
    p, stats, popt = ref_step(p, stats, popt, x, y)
    with pytest.raises(es.StateError, match=r"escaped the transformation.*partition"):
        escaped.bn.running_mean[...]
    # the recovery the message names loses nothing
    ens = eqx.combine(
        eqx.filter(escaped, eqx.is_array),
        eqx.filter(ens, lambda x: isinstance(x, jax.Ref)),
    )
    for a, b in zip(jax.tree.leaves(pure_params(ens)), jax.tree.leaves(p)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ens.bn.running_var[...], stats[1], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(ens.steps.count[...], [n_steps + 1] * n)


def test_a_ref_mode_ensemble_steps_under_jit_of_vmap_like_a_hand_threaded_loop():
    """docs/equinox.md's recipe: under `jax.jit` (which cannot return a ref) the
    mapped step returns the arrays only, and the refs passed in, updated in place,
    are put back with `eqx.combine` (reference: `vmap` of the hand-threaded step)."""
    n, n_steps = 3, 3
    step, ens, (p, stats, popt), ref_step = _ref_ensemble(n, 6)
    xs, ys = data(n_steps)
    dyn, static = eqx.partition(ens, es.is_array_or_ref)
    refs = eqx.filter(dyn, lambda v: isinstance(v, jax.Ref))
    ens_opt = jax.vmap(lambda d: step.init(eqx.combine(d, static)))(dyn)

    @jax.jit
    @functools.partial(jax.vmap, in_axes=(0, 0, None, None))
    def members(d, o, x, y):
        m, o = step(eqx.combine(d, static), o, x, y)
        return eqx.filter(m, eqx.is_array), o

    for i in range(n_steps):
        arrays, ens_opt = members(dyn, ens_opt, xs[i], ys[i])
        dyn = eqx.combine(arrays, refs)
        p, stats, popt = ref_step(p, stats, popt, xs[i], ys[i])
    ens = eqx.combine(dyn, static)
    _assert_ensemble_equals(ens, p, stats, n_steps)


@pytest.mark.parametrize("mode", MODES)
def test_weak_scalars_compute_and_compile_as_under_filter_jit(mode):
    """A weakly typed parameter (`jnp.asarray(1.0)`) comes back strongly typed from
    adam: the step returns it as computed, as an `eqx.filter_jit` loop does, so the
    following steps compute what that loop computes and compile as often as it
    does (then never again)."""

    class Scale(eqx.Module):
        a: jax.Array
        seen: es.nn.Counter

        def __call__(self, x):
            self.seen.increment()
            return self.a * x

    x = (jnp.arange(1, 4.0) / 3).astype(jnp.bfloat16)  # weak * bf16 is bf16

    def loss(a, x):
        return jnp.mean((a * x).astype(jnp.float32) - 1.0) ** 2

    opt = optax.adam(1e-1)
    traces = []

    @eqx.filter_jit
    def ref_step(a, s, x):
        traces.append(1)
        g = jax.grad(loss)(a, x)
        u, s = opt.update(g, s, a)
        return optax.apply_updates(a, u), s

    a = jnp.asarray(1.3)
    assert a.weak_type
    s = opt.init(a)
    for _ in range(5):
        a, s = ref_step(a, s, x)

    model = Scale(jnp.asarray(1.3), es.nn.Counter())
    if mode == "ref":
        model = es.to_refs(model)
    step = es.make_step(lambda m, x: loss(m.a, x) + 0 * m(x).sum(), opt)
    opt_state = step.init(model)
    for _ in range(4):
        model, opt_state = step(model, opt_state, x)
    # a fresh flatten of a new model of the same types also hits the cache
    model = jax.tree.map(lambda x: x, model)
    model, opt_state = step(model, opt_state, x)
    assert float(model.a) == float(a) and model.a.weak_type == a.weak_type
    assert step.trace_count == len(traces) <= 3
    assert int(model.seen.value) == 5


def test_grad_through_one_step_matches_finite_differences():
    """A value-mode step is a pure function: differentiate the loss after one step with
    respect to the initial parameters."""
    xs, ys = data(2)
    model0 = Net(jax.random.key(5))
    opt = optax.sgd(0.1)
    step = es.make_step(loss_fn, opt, donate=False)
    diff0, static = eqx.partition(model0, eqx.is_inexact_array, is_leaf=es.is_state)

    def after_one_step(diff):
        model = eqx.combine(diff, static, is_leaf=es.is_state)
        model, _ = step(model, step.init(model), xs[0], ys[0])
        return loss_fn(eqx.nn.inference_mode(model), xs[1], ys[1])

    g = jax.grad(after_one_step)(diff0)
    w = diff0.l2.weight
    eps = 1e-3
    for idx in [(0, 0), (1, 3), (2, 5)]:
        bump = jnp.zeros_like(w).at[idx].set(eps)
        hi = eqx.tree_at(lambda d: d.l2.weight, diff0, w + bump)
        lo = eqx.tree_at(lambda d: d.l2.weight, diff0, w - bump)
        fd = (after_one_step(hi) - after_one_step(lo)) / (2 * eps)
        np.testing.assert_allclose(g.l2.weight[idx], fd, rtol=2e-2, atol=1e-4)
    # the input model is still valid (donate=False) and untouched
    assert int(model0.steps.value) == 0


@pytest.mark.parametrize("runner", ["step", "scan", "own"])
def test_grad_through_a_donating_step_equals_a_hand_written_optax_loop(runner):
    """Under `jax.grad` (eager, no outer `jit`) a step donates nothing: JAX keeps
    inputs of the call for the backward pass, which a donation would delete (found by
    an outside review: `RuntimeError: Array has been deleted`)."""
    lin0 = eqx.nn.Linear(4, 3, key=jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (2, 8, 4))
    y = jnp.ones((2, 8))
    opt = optax.sgd(0.1, momentum=0.9)

    def loss(m, x, y):
        return jnp.mean((jax.vmap(m)(x).sum(-1) - y) ** 2)

    def by_hand(a):
        m, o = lin0, opt.init(lin0)
        for t in range(2):
            g = jax.grad(loss)(m, a * x[t], y[t])
            u, o = opt.update(g, o, m)
            m = eqx.apply_updates(m, u)
        return loss(m, x[0], y[0])

    step = es.make_step(loss, opt)  # donates by default

    def with_step(a):
        m, o = lin0, step.init(lin0)
        if runner == "step":
            for t in range(2):
                m, o = step(m, o, a * x[t], y[t])
        elif runner == "scan":
            m, o = step.scan(m, o, a * x, y)
        else:
            loop = step.own(m, o)
            for t in range(2):
                loop(a * x[t], y[t])
            m, o = loop.release()
        return loss(m, x[0], y[0])

    want = jax.grad(by_hand)(1.0)
    np.testing.assert_allclose(jax.grad(with_step)(1.0), want, rtol=1e-5)
    np.testing.assert_allclose(jax.grad(with_step)(1.0), want, rtol=1e-5)  # again
    assert not lin0.weight.is_deleted()  # the closed-over model stays usable


def test_an_ensemble_step_vmapped_eagerly_still_donates():
    """Only differentiation keeps a call's inputs: under an eager `vmap` (an
    ensemble, `eqx.filter_vmap` of the step) the step donates what it replaces."""
    keys = jax.random.split(jax.random.key(0), 3)
    models = eqx.filter_vmap(lambda k: eqx.nn.Linear(4, 3, key=k))(keys)
    step = es.make_step(
        lambda m, x, y: jnp.mean((jax.vmap(m)(x).sum(-1) - y) ** 2), optax.adam(1e-2)
    )
    opt_states = eqx.filter_vmap(step.init)(models)
    weight = models.weight
    in_axes = (eqx.if_array(0), eqx.if_array(0), None, None)
    eqx.filter_vmap(step, in_axes=in_axes)(
        models, opt_states, jnp.ones((8, 4)), jnp.ones(8)
    )
    assert weight.is_deleted()


@pytest.mark.parametrize("mode", ["value", "ref"])
@pytest.mark.parametrize("runner", ["step", "make_apply"])
def test_an_ensemble_consumed_under_eager_vmap_is_named_stale(runner, mode):
    """Reusing the ensemble an eager `vmap` of a step (or apply) consumed gave
    JAX's bare errors, a different one per mode ("Buffer has been deleted or
    donated", "Array has been deleted"): the consumed check did not look through
    the batch tracers. Now the `StaleModelError` of a plain call."""
    keys = jax.random.split(jax.random.key(0), 2)
    models = eqx.filter_vmap(lambda k: Net(k))(keys)
    models = es.to_refs(models) if mode == "ref" else models
    x = jnp.ones((B, IN))
    mapped = lambda v: 0 if es.is_array_or_ref(v) else None  # noqa: E731
    if runner == "step":
        step = es.make_step(lambda m, x: jnp.mean(m(x) ** 2), optax.sgd(0.1))
        opt_states = eqx.filter_vmap(step.init)(models)
        in_axes = (mapped, mapped, None)
        call = eqx.filter_vmap(step, in_axes=in_axes)
        args = (models, opt_states, x)
    else:
        apply = es.make_apply(lambda m, x: m(x))
        call = eqx.filter_vmap(apply, in_axes=(mapped, None))
        args = (models, x)
    call(*args)  # consumes the ensemble's arrays
    if runner == "make_apply" and mode == "ref":  # its refs are written in place:
        call(*args)  # nothing was consumed: both calls wrote every member's cells
        assert models.bn.num_batches_tracked[...].tolist() == [2, 2]
        return
    with pytest.raises(es.StaleModelError, match=r"^The model holds.*Consumed: `"):
        call(*args)


def test_an_ensemble_with_tied_arrays_steps_under_eager_vmap_like_a_hand_loop():
    """One array at two places of an ensemble (tied, as `Tied(w, w)`): under an
    eager `vmap` the step donates it once (each place is a batch tracer of its own;
    found by a review: 'Attempt to donate the same buffer twice')."""

    class Tied(eqx.Module):
        a: jax.Array
        b: jax.Array

        def __call__(self, x):
            return x @ self.a + x @ self.b

    def loss(m, x, y):
        return jnp.mean((jax.vmap(m)(x).sum(-1) - y) ** 2)

    opt = optax.sgd(0.1)
    w = jax.random.normal(jax.random.key(0), (3, 4, 2))
    x, y = jnp.ones((8, 4)), jnp.ones(8)

    def by_hand(m):
        g = jax.grad(loss)(m, x, y)
        return eqx.apply_updates(m, opt.update(g, opt.init(m), m)[0])

    want = jax.vmap(by_hand)(Tied(w, w))
    step = es.make_step(loss, opt)
    models = Tied(jnp.array(w), None)
    models = Tied(models.a, models.a)  # tied: one array at two places
    in_axes = (eqx.if_array(0), eqx.if_array(0), None, None)
    got, _ = eqx.filter_vmap(step, in_axes=in_axes)(
        models, eqx.filter_vmap(step.init)(models), x, y
    )
    np.testing.assert_allclose(got.a, want.a, rtol=1e-6)
    np.testing.assert_allclose(got.b, want.b, rtol=1e-6)


def test_a_step_on_a_concrete_model_inside_a_differentiated_function_donates_nothing():
    """Under `jax.grad`, a step whose leaves are all concrete (the model closed
    over, not differentiated) must not donate them either: the function still
    holds them."""
    lin0 = eqx.nn.Linear(4, 3, key=jax.random.key(0))
    step = es.make_step(
        lambda m, x, y: jnp.mean((jax.vmap(m)(x).sum(-1) - y) ** 2), optax.sgd(0.1)
    )
    x, y = jnp.ones((8, 4)), jnp.ones(8)

    def f(a):
        pre = jnp.sum(lin0.weight * a)
        model, _ = step(lin0, step.init(lin0), x, y)
        return pre + jnp.sum(model.weight)

    np.testing.assert_allclose(jax.grad(f)(1.0), jnp.sum(lin0.weight), rtol=1e-6)
    assert not lin0.weight.is_deleted()


def test_has_aux():
    xs, ys = data(1)
    step = es.make_step(
        lambda m, x, y: (loss_fn(m, x, y), m(x).mean()), optax.sgd(0.1), has_aux=True
    )
    model = Net(jax.random.key(0))
    opt_state = step.init(model)
    model, opt_state, aux = step(model, opt_state, xs[0], ys[0])
    assert aux.shape == ()


def test_step_under_outer_jit_ref_mode_writes_once():
    """Under an outer transformation ref-mode cells travel as refs; writes land once."""
    xs, ys = data(2)
    model = fresh("ref")
    step = es.make_step(loss_fn, optax.sgd(0.1))
    opt_state = step.init(model)
    ref_model, ref_state = fresh("ref"), None
    ref_step = es.make_step(loss_fn, optax.sgd(0.1))
    ref_state = ref_step.init(ref_model)

    @eqx.filter_jit
    def outer(model, opt_state, x, y):
        return step(model, opt_state, x, y)

    for i in range(2):
        model, opt_state = outer(model, opt_state, xs[i], ys[i])
        ref_model, ref_state = ref_step(ref_model, ref_state, xs[i], ys[i])
    assert int(model.steps.value) == 2
    np.testing.assert_allclose(
        model.bn.running_mean[...], ref_model.bn.running_mean[...], rtol=1e-6
    )
    np.testing.assert_allclose(model.l1.weight, ref_model.l1.weight, rtol=1e-6)


class Plain(eqx.Module):
    lin: eqx.nn.Linear
    calls: es.nn.Counter

    def __call__(self, x):
        self.calls.increment()
        return jax.vmap(self.lin)(x)


def plain_loss(model, x, y):
    return jnp.mean((model(x) - y) ** 2)


@pytest.mark.parametrize("mode", MODES)
def test_microbatches_equal_the_full_batch_step(mode):
    xs, ys = data(3)

    def fresh_plain():
        m = Plain(eqx.nn.Linear(IN, OUT, key=jax.random.key(0)), es.nn.Counter())
        return es.to_refs(m) if mode == "ref" else m

    full = es.make_step(plain_loss, optax.adam(1e-2))
    accum = es.make_step(plain_loss, optax.adam(1e-2), microbatches=4)
    m1, m2 = fresh_plain(), fresh_plain()
    s1, s2 = full.init(m1), accum.init(m2)
    for i in range(3):
        m1, s1 = full(m1, s1, xs[i], ys[i])
        m2, s2 = accum(m2, s2, xs[i], ys[i])
    np.testing.assert_allclose(m1.lin.weight, m2.lin.weight, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(
        s1[0].nu.lin.weight, s2[0].nu.lin.weight, rtol=1e-4, atol=1e-9
    )
    assert int(m1.calls.value) == 3 and int(m2.calls.value) == 12  # once per slice
    assert accum.trace_count == 1


def test_microbatches_batchnorm_statistics_are_per_slice():
    """Documented behaviour: BatchNorm sees each slice as a batch (as in PyTorch)."""
    xs, ys = data(1)
    model = Net(jax.random.key(0))
    ref = es.nn.BatchNorm(W)
    h = jax.vmap(model.l1)(xs[0])
    for part in jnp.split(h, 2):
        _, ref = es.apply(lambda m, x: m(x), ref, part)
    step = es.make_step(loss_fn, optax.sgd(0.0), microbatches=2)
    model, _ = step(model, step.init(model), xs[0], ys[0])
    np.testing.assert_allclose(
        model.bn.running_var[...], ref.running_var[...], rtol=1e-6
    )
    assert int(model.bn.num_batches_tracked[...]) == 2


def test_microbatches_return_aux_arrays_per_slice_and_python_values_as_they_are():
    """`aux` arrays come back one per slice (stacked); a Python value in `aux` comes
    back as the loss returned it, as from a step without microbatches and from
    `step.scan` (it came back as `k` stacked copies in an array)."""
    xs, ys = data(1)

    def loss(model, x, y):
        return plain_loss(model, x, y), {"n": 3, "rows": jnp.sum(x)}

    m = Plain(eqx.nn.Linear(IN, OUT, key=jax.random.key(0)), es.nn.Counter())
    step = es.make_step(loss, optax.sgd(0.1), has_aux=True, microbatches=2)
    _, _, aux = step(m, step.init(m), xs[0], ys[0])
    assert aux["n"] == 3 and type(aux["n"]) is int
    want = np.asarray([np.sum(part) for part in np.split(np.asarray(xs[0]), 2)])
    np.testing.assert_allclose(np.asarray(aux["rows"]), want, rtol=1e-6)


def test_microbatches_need_divisible_batches():
    step = es.make_step(plain_loss, optax.sgd(0.1), microbatches=3)
    m = Plain(eqx.nn.Linear(IN, OUT, key=jax.random.key(0)), es.nn.Counter())
    xs, ys = data(1)
    with pytest.raises(
        es.StepError, match=r"does not\s+split into 3 equal microbatches"
    ):
        step(m, step.init(m), xs[0], ys[0])


@pytest.mark.parametrize("mode", MODES)
def test_reading_state_between_steps_does_not_recompile(mode):
    """jit caches on whether inputs are committed to a device; eager reads of
    ref-mode cells commit them. The step must not compile again because of it."""
    xs, ys = data(4)
    model = fresh(mode)
    step = es.make_step(loss_fn, optax.adam(1e-2))
    opt_state = step.init(model)
    model, opt_state = step(model, opt_state, xs[0], ys[0])
    with count_compiles() as compiles:
        for i in range(1, 4):
            model, opt_state = step(model, opt_state, xs[i], ys[i])
            float(model.bn.running_mean[...][0])  # an eager read of a cell
            float(model.l1.weight[0, 0])
    assert compiles == [], compiles
