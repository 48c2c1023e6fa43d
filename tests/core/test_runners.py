"""Every runner goes through one compiled entry point, so each gives the same result
and each misuse the same error: K calls of a step, `step.scan` over K, the owned loop
(`step.own`), and, for forward-only work, `make_apply` calls, `make_apply(...).scan`
and `eqx.filter_jit(es.apply)` — in both storage modes.

The model has every kind of state a step writes: BatchNorm statistics, a Dropout
stream, a metric updated in the loss and an EMA of a layer. The reference for the
training runners is a hand-threaded pure-JAX loop over the same Equinox layers (the
statistics, the key stream, the metric and the average threaded by hand)."""

from __future__ import annotations

import copy
import gc
import re
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import eqx_state as es


K = 3


class Net(eqx.Module):
    lin1: es.nn.Batched
    bn: es.nn.BatchNorm
    drop: es.nn.Dropout
    lin2: es.nn.Batched
    ema: es.nn.EMA
    seen: es.metrics.Mean

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.lin1 = es.nn.Batched(eqx.nn.Linear(3, 8, key=k1))
        self.bn = es.nn.BatchNorm(8)
        self.drop = es.nn.Dropout(0.25, key=7)
        self.lin2 = es.nn.Batched(eqx.nn.Linear(8, 2, key=k2))
        self.ema = es.nn.EMA(self.lin1, decay=0.5)
        self.seen = es.metrics.Mean()

    def __call__(self, x):
        return self.lin2(self.drop(jax.nn.relu(self.bn(self.lin1(x)))))


def loss_fn(model, x, y):
    model.ema.update(model.lin1)
    loss = optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()
    model.seen.update(loss)
    return loss


def data():
    kx, ky = jax.random.split(jax.random.key(1))
    xs = jax.random.normal(kx, (K, 8, 3))
    ys = jax.random.randint(ky, (K, 8), 0, 2)
    return xs, ys


def arrays(tree):
    return [
        np.asarray(x)
        for x in jax.tree.leaves(eqx.filter(es.freeze(tree), eqx.is_array))
    ]


def run(runner, mode, optimizer=None, make_opt_state=None, loss=loss_fn):
    model = Net(jax.random.key(0))
    if mode == "ref":
        model = es.to_refs(model)
    step = es.make_step(loss, optimizer or optax.adam(1e-2), return_loss=True)
    opt_state = (
        step.init(model) if make_opt_state is None else make_opt_state(step, model)
    )
    xs, ys = data()
    if runner == "step":
        losses = []
        for x, y in zip(xs, ys):
            model, opt_state, loss = step(model, opt_state, x, y)
            losses.append(loss)
        losses = jnp.stack(losses)
    elif runner == "scan":
        model, opt_state, losses = step.scan(model, opt_state, xs, ys)
    else:
        loop = step.own(model, opt_state)
        losses = jnp.stack([loop(x, y) for x, y in zip(xs, ys)])
        model, opt_state = loop.release()
    return model, opt_state, losses


def first_call(runner, step, model, opt_state, *stacked):
    """The runner's first call on `stacked` arguments (`[K, ...]`): one step on
    slice 0, the scan over all K, or the owned loop's first step."""
    if runner == "step":
        return step(model, opt_state, *(a[0] for a in stacked))
    if runner == "scan":
        return step.scan(model, opt_state, *stacked)
    return step.own(model, opt_state)(*(a[0] for a in stacked))


def call_runner(runner, bad, extra=None):
    """Give `bad` (a model) to `runner`: a training runner (its first call), a
    forward-only one (`apply`, `make_apply`, `make_apply.scan`), or one of `extra`
    (name -> a function of the model, the first batch and the stacked batches)."""
    step = es.make_step(loss_fn, optax.sgd(0.1))
    opt_state = step.init(Net(jax.random.key(0)))
    xs, ys = data()
    apply = es.make_apply(forward)
    calls = {
        "apply": lambda: es.apply(forward, bad, xs[0]),
        "make_apply": lambda: apply(bad, xs[0]),
        "make_apply.scan": lambda: apply.scan(bad, xs),
        **{k: (lambda f=f: f(bad, xs[0], xs)) for k, f in (extra or {}).items()},
    }
    if runner in calls:
        return calls[runner]()
    return first_call(runner, step, bad, opt_state, xs, ys)


def reference(opt, lrs=None):
    """The same K steps, threaded by hand in pure JAX over the same layers (with
    `lrs`: the learning rate of an `optax.inject_hyperparams` state set before each
    step, as optax's docs set it)."""
    net = Net(jax.random.key(0))
    lin1, lin2 = net.lin1.layer, net.lin2.layer
    params = (lin1, lin2, jnp.ones(8), jnp.zeros(8))  # BatchNorm's affine too
    mean, var = jnp.zeros(8), jnp.ones(8)
    key = net.drop.rng.peek()
    ema = jax.tree.map(jnp.asarray, eqx.filter(lin1, eqx.is_inexact_array))
    total, count = 0.0, 0.0
    opt_state = opt.init(eqx.filter(params, eqx.is_inexact_array))
    xs, ys = data()
    losses = []
    for i, (x, y) in enumerate(zip(xs, ys)):
        if lrs is not None:
            opt_state.hyperparams["learning_rate"] = lrs[i]
        ema = jax.tree.map(
            lambda h, p: 0.5 * h + 0.5 * p,
            ema,
            eqx.filter(params[0], eqx.is_inexact_array),
        )
        key, key_now = jax.random.split(key)  # the stream: `k, sub = split(k)`

        def loss(p, x, y, key_now):
            h = jax.vmap(p[0])(x)
            mu, v = h.mean(0), h.var(0)
            h = (h - mu) / jnp.sqrt(v + 1e-5) * p[2] + p[3]
            h = jax.nn.relu(h)
            keep = jax.random.bernoulli(key_now, 0.75, h.shape)
            h = jnp.where(keep, h / 0.75, 0.0)
            logits = jax.vmap(p[1])(h)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), (
                mu,
                v,
            )

        (value, (mu, v)), g = jax.value_and_grad(loss, has_aux=True)(
            params, x, y, key_now
        )
        updates, opt_state = opt.update(g, opt_state, params)
        params = optax.apply_updates(params, updates)
        n = x.shape[0]
        mean = 0.9 * mean + 0.1 * mu
        var = 0.9 * var + 0.1 * v * n / (n - 1)
        total, count = total + value, count + 1
        losses.append(value)
    return params, mean, var, float(total / count), ema, jnp.stack(losses)


RUNNERS = ["step", "scan", "own"]
MODES = ["value", "ref"]


@pytest.fixture(scope="module")
def results():
    return {(r, m): run(r, m) for r in RUNNERS for m in MODES}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("runner", RUNNERS)
def test_every_runner_gives_the_same_bits(results, runner, mode):
    model, opt_state, losses = results[(runner, mode)]
    ref_model, ref_opt, ref_losses = results[("step", "value")]
    assert np.array_equal(losses, ref_losses)
    for a, b in zip(arrays(model), arrays(ref_model)):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    for a, b in zip(jax.tree.leaves(opt_state), jax.tree.leaves(ref_opt)):
        assert np.array_equal(a, b)
    assert int(model.bn.num_batches_tracked[...]) == K


def test_the_step_equals_a_hand_threaded_loop():
    # SGD: the first layer's bias feeds a BatchNorm, so its gradient is rounding
    # noise, which Adam would scale up to full steps of either sign
    model, _, losses = run("step", "value", optax.sgd(0.1))
    params, mean, var, seen, ema, ref_losses = reference(optax.sgd(0.1))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(model.bn.running_mean[...], mean, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(model.bn.running_var[...], var, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(float(model.seen.compute()), seen, rtol=1e-5)
    np.testing.assert_allclose(
        model.lin1.layer.weight, params[0].weight, rtol=1e-4, atol=1e-6
    )
    averaged = model.ema.averaged(model.lin1)
    np.testing.assert_allclose(averaged.layer.weight, ema.weight, rtol=1e-5, atol=1e-6)


def forward(model, x):
    out = model(x)
    model.seen.update(jnp.mean(out))
    return out


@pytest.mark.parametrize("mode", MODES)
def test_forward_only_runners_agree(mode):
    xs, _ = data()

    def fresh():
        model = Net(jax.random.key(0))
        return es.to_refs(model) if mode == "ref" else model

    apply_fn = es.make_apply(forward)
    model, outs = fresh(), []
    for x in xs:
        out, model = apply_fn(model, x)
        outs.append(out)
    by_call = (jnp.stack(outs), arrays(model))

    outs2, model2 = apply_fn.scan(fresh(), xs)
    jitted = eqx.filter_jit(lambda m, x: es.apply(forward, m, x))
    model3, outs3 = fresh(), []
    for x in xs:
        out, model3 = jitted(model3, x)
        outs3.append(out)
    for outs_, model_ in ((outs2, model2), (jnp.stack(outs3), model3)):
        assert np.array_equal(outs_, by_call[0])
        for a, b in zip(arrays(model_), by_call[1]):
            assert np.array_equal(a, b)


# -- the same misuse, the same answer on every runner ------------------------------


def _float_lr(step, model):
    opt_state = step.init(model)
    opt_state.hyperparams["learning_rate"] = 0.05  # a Python float, set in place
    return opt_state


@pytest.mark.parametrize("runner", RUNNERS)
def test_python_float_hyperparameter_is_accepted_by_every_runner(runner):
    opt = optax.inject_hyperparams(optax.adam)(learning_rate=jnp.asarray(0.01))
    _, _, losses = run(runner, "value", opt, _float_lr)
    _, _, want = run("step", "value", opt, _float_lr)
    assert np.array_equal(losses, want)
    # and the float took effect: a hand-set array of the same value gives the same
    _, _, as_array = run(
        "step",
        "value",
        opt,
        lambda s, m: _with(s.init(m), jnp.asarray(0.05)),
    )
    np.testing.assert_allclose(losses, as_array, rtol=1e-6)


@pytest.mark.parametrize("runner", RUNNERS)
def test_a_weakly_typed_learning_rate_is_accepted_by_every_runner(runner):
    """`jnp.asarray(0.05)` (weakly typed) as the learning rate: the optimizer returns
    it strongly typed, so K steps compute the later ones with the strong type;
    `scan` runs its first step alone and equals them bit for bit."""
    opt = optax.inject_hyperparams(optax.adam)(learning_rate=0.01)

    def weak_lr(s, m):
        return _with(s.init(m), jnp.asarray(0.05))

    model, _, losses = run(runner, "value", opt, weak_lr)
    want_model, _, want = run("step", "value", opt, weak_lr)
    assert np.array_equal(losses, want)
    for a, b in zip(arrays(model), arrays(want_model), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("k", [1, 2])
def test_scan_whose_first_step_runs_alone_keeps_python_values_of_aux(k):
    """A Python float hyperparameter makes `scan` run its first step alone; an `aux`
    holding a Python value comes back as K steps give it, for every K (K = 1 lost
    the first step's result to an error after it had run)."""
    opt = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)

    def loss(model, x, y):
        return loss_fn(model, x, y), {"n": 3, "v": jnp.sum(x)}

    step = es.make_step(loss, opt, has_aux=True, return_loss=True)
    xs, ys = (a[:k] for a in data())
    model = Net(jax.random.key(0))
    model, opt_state, losses, aux = step.scan(model, _float_lr(step, model), xs, ys)
    ref = Net(jax.random.key(0))
    ref_state = _float_lr(step, ref)
    for x, y in zip(xs, ys):
        ref, ref_state, loss_k, aux_k = step(ref, ref_state, x, y)
    assert aux["n"] == aux_k["n"] == 3
    np.testing.assert_array_equal(np.asarray(aux["v"]), np.sum(xs, axis=(1, 2)))
    assert np.asarray(losses)[-1] == np.asarray(loss_k)
    for a, b in zip(arrays(model), arrays(ref), strict=True):
        np.testing.assert_array_equal(a, b)


def _with(opt_state, lr):
    opt_state.hyperparams["learning_rate"] = lr
    return opt_state


class _PhaseState(eqx.Module):
    phase: int  # a Python value of the optimizer state, advanced by every update


def _phased_sgd(lrs=(0.1, 0.03, 0.01)):
    """SGD whose learning rate is picked by a Python counter in its state (a
    schedule kept on the Python side): each call compiles with the phase it gets
    and returns the next one."""

    def update(grads, state, params=None):
        lr = lrs[min(state.phase, len(lrs) - 1)]
        return jax.tree.map(lambda g: -lr * g, grads), _PhaseState(state.phase + 1)

    return optax.GradientTransformation(lambda params: _PhaseState(0), update)


@pytest.mark.parametrize("runner", RUNNERS)
def test_a_python_value_the_optimizer_advances_reaches_every_call(runner):
    """`scan` carried its first call's Python value into every call (and returned
    it unchanged): here the learning rate stayed at phase 0 for K steps. Every
    runner equals K calls, which equal the hand-threaded loop with optax's
    `update`."""
    with warnings.catch_warnings():  # a new Python value each call: a new program
        warnings.simplefilter("ignore", es.RecompileWarning)
        model, opt_state, losses = run(runner, "value", _phased_sgd())
        want_model, _, want = run("step", "value", _phased_sgd())
    assert opt_state.phase == K
    assert np.array_equal(losses, want)
    for a, b in zip(arrays(model), arrays(want_model), strict=True):
        np.testing.assert_array_equal(a, b)
    params, mean, *_, ref_losses = reference(_phased_sgd())
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(
        model.lin1.layer.weight, params[0].weight, rtol=1e-4, atol=1e-6
    )
    np.testing.assert_allclose(model.bn.running_mean[...], mean, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("as_array", [False, True], ids=["float", "array"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("runner", RUNNERS)
@pytest.mark.split(every=4)
def test_a_learning_rate_set_in_place_before_each_step_takes_effect_on_every_runner(
    runner, mode, as_array
):
    """Arrays are values and each call reads what it is given: a learning rate set
    in place (`opt_state.hyperparams[...] = lr`) before each step is the one that
    step uses, on K calls, K scans of one step, and the owned loop (which took the
    optimizer state over: the loop read its first value only, and trained at 0.1
    where the schedule said 0.0). Reference: the hand-threaded loop, setting the
    rate as optax's docs do."""
    lrs = (0.1, 0.0, 0.05)
    opt = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
    model = Net(jax.random.key(0))
    if mode == "ref":
        model = es.to_refs(model)
    step = es.make_step(loss_fn, opt, return_loss=True)
    opt_state = step.init(model)
    xs, ys = data()
    lr = (lambda v: jnp.asarray(v, jnp.float32)) if as_array else float
    losses = []
    with warnings.catch_warnings():  # a new Python float each step: a new program
        warnings.simplefilter("ignore", es.RecompileWarning)
        if runner == "own":
            loop = step.own(model, opt_state)
            for i, (x, y) in enumerate(zip(xs, ys)):
                opt_state.hyperparams["learning_rate"] = lr(lrs[i])  # the given one
                losses.append(loop(x, y))
            model, opt_state = loop.release()
        else:
            for i, (x, y) in enumerate(zip(xs, ys)):
                opt_state.hyperparams["learning_rate"] = lr(lrs[i])
                if runner == "step":
                    model, opt_state, loss = step(model, opt_state, x, y)
                else:
                    model, opt_state, loss = step.scan(
                        model, opt_state, x[None], y[None]
                    )
                    loss = loss[0]
                losses.append(loss)
    params, mean, *_, ref_losses = reference(opt, lrs)
    np.testing.assert_allclose(jnp.stack(losses), ref_losses, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(
        model.lin1.layer.weight, params[0].weight, rtol=1e-4, atol=1e-6
    )
    np.testing.assert_allclose(model.bn.running_mean[...], mean, rtol=1e-4, atol=1e-6)
    assert np.float32(opt_state.hyperparams["learning_rate"]) == np.float32(lrs[-1])


def test_the_owned_loop_refuses_a_change_of_structure_in_place():
    """An entry added to (or removed from) a dict whose numbers the loop reads
    cannot be taken into its flat arrays: a `StepError` names the entry and says
    to release first; the loop still holds what it had, and `release()` hands it
    back (with a warning that the change is not in it)."""
    opt = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
    model = Net(jax.random.key(0))
    step = es.make_step(loss_fn, opt, return_loss=True)
    opt_state = step.init(model)
    xs, ys = data()
    loop = step.own(model, opt_state)
    loop(xs[0], ys[0])
    opt_state.hyperparams["momentum"] = 0.9
    with pytest.raises(
        es.StepError,
        match=r"`opt_state\.hyperparams\['learning_rate'\]` .* left in a dict whose "
        r"entries were added or removed.*`release\(\)` the loop",
    ):
        loop(xs[1], ys[1])
    del opt_state.hyperparams["momentum"]
    loop(xs[1], ys[1])
    opt_state.hyperparams["learning_rate"] = {"a": 0.1}  # a subtree: not a number
    with pytest.raises(es.StepError, match=r"set to a dict"):
        loop(xs[2], ys[2])
    with pytest.warns(UserWarning, match=r"returns the model .* without that change"):
        model, opt_state = loop.release()
    assert int(model.bn.num_batches_tracked[...]) == 2
    assert float(opt_state.hyperparams["learning_rate"]) == np.float32(0.1)


def test_the_owned_loop_keeps_nothing_of_the_given_carry_alive():
    """With `donate=False` the given carry's arrays are not consumed: once the
    loop has run a step, it holds none of them (only the lists and dicts that
    hold numbers, which it reads), so a carry the caller dropped is freed."""
    import weakref

    opt = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
    step = es.make_step(loss_fn, opt, donate=False)
    model = Net(jax.random.key(0))
    opt_state = step.init(model)
    weight = weakref.ref(model.lin1.layer.weight)
    loop = step.own(model, opt_state)
    del model, opt_state
    xs, ys = data()
    loop(xs[0], ys[0])
    gc.collect()
    assert weight() is None


class _Scale(eqx.Module):
    a: jax.Array

    def __call__(self, x):
        return x * self.a


@pytest.mark.parametrize("case", ["array lr", "python lr", "weak parameter"])
def test_a_scan_over_no_batch_changes_nothing_on_every_path(case):
    """K = 0: nothing runs and nothing changes, and the losses are empty, also
    where a call would change the carry's types (a Python float learning rate, a
    weakly typed parameter), which raised a bare `IndexError` there."""
    lr = {"python lr": 0.1, "weak parameter": jnp.asarray(0.1, jnp.float32)}
    opt = optax.inject_hyperparams(optax.sgd)(learning_rate=jnp.asarray(0.1))
    step = es.make_step(
        lambda m, x: jnp.mean(m(x) ** 2), opt, return_loss=True, donate=False
    )
    a = jnp.asarray(1.5) if case == "weak parameter" else jnp.float32(1.5)
    model = _Scale(a)
    opt_state = _with(step.init(model), lr.get(case, jnp.float32(0.1)))
    new, new_state, losses = step.scan(model, opt_state, jnp.zeros((0, 4)))
    assert losses.shape == (0,) and losses.dtype == jnp.float32
    assert new.a is model.a or np.array_equal(new.a, model.a)
    assert jax.tree.structure(new_state) == jax.tree.structure(opt_state)
    assert new_state.hyperparams["learning_rate"] is opt_state.hyperparams[
        "learning_rate"
    ] or np.array_equal(
        new_state.hyperparams["learning_rate"], opt_state.hyperparams["learning_rate"]
    )


def _aux_cell(model, x, y):
    return loss_fn(model, x, y), model.bn  # a module holding cells, as aux


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("runner", RUNNERS)
def test_a_cell_in_aux_is_refused_by_every_runner(runner, mode):
    model = Net(jax.random.key(0))
    model = es.to_refs(model) if mode == "ref" else model
    step = es.make_step(_aux_cell, optax.sgd(0.1), has_aux=True)
    opt_state = step.init(model)
    xs, ys = data()
    with pytest.raises(es.StepError, match=r"`aux` holds a state cell"):
        first_call(runner, step, model, opt_state, xs, ys)


@pytest.mark.parametrize("mode", MODES)
def test_a_cell_in_an_apply_output_is_refused_alike(mode):
    """In both modes: eager `es.apply` in ref mode returned the live cell while
    `make_apply` refused it."""
    for call in (
        lambda m, x: es.make_apply(lambda m, x: m.bn)(m, x),
        lambda m, x: es.make_apply(lambda m, x: m.bn).scan(m, x[None]),
        lambda m, x: es.apply(lambda m, x: m.bn, m, x),
    ):
        model = Net(jax.random.key(0))
        model = es.to_refs(model) if mode == "ref" else model
        with pytest.raises(es.StepError, match=r"holds a state cell"):
            call(model, data()[0][0])


@eqx.filter_jit
def _jitted_loss(model, x, y):
    return loss_fn(model, x, y)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("runner", RUNNERS)
def test_a_loss_decorated_with_filter_jit_trains_as_the_plain_loss(
    results, runner, mode
):
    """`@eqx.filter_jit` on the loss (an Equinox habit) changes nothing: inside
    the compiled step its body is traced directly. Its wrapper, given the model
    whose cells are refs of the step's trace, raised JAX's "Non-hashable static
    arguments are not supported"."""
    model, opt_state, losses = run(runner, mode, loss=_jitted_loss)
    ref_model, ref_opt, ref_losses = results[(runner, mode)]
    assert np.array_equal(losses, ref_losses)
    for a, b in zip(arrays(model), arrays(ref_model), strict=True):
        assert np.array_equal(a, b)
    for a, b in zip(jax.tree.leaves(opt_state), jax.tree.leaves(ref_opt), strict=True):
        assert np.array_equal(a, b)


def _inner_jit_given_the_model(model, x, y):
    return eqx.filter_jit(loss_fn)(model, x, y)


def _inner_jit_closing_over_the_model(model, x, y):
    return eqx.filter_jit(lambda x, y: loss_fn(model, x, y))(x, y)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("runner", [*RUNNERS, "make_apply", "make_apply.scan"])
def test_an_inner_filter_jit_given_the_model_is_refused_with_the_fix(runner, mode):
    """Inside a compiled call the cells are refs of its trace, which Equinox's
    filters hash as static leaves: every compiled runner names the fix (close
    over the model) instead of JAX's bare `ValueError`; closing over works."""
    model = Net(jax.random.key(0))
    model = es.to_refs(model) if mode == "ref" else model
    xs, ys = data()
    if runner.startswith("make_apply"):
        apply = es.make_apply(_inner_jit_given_the_model)
        call = apply if runner == "make_apply" else apply.scan
        args = (xs[0], ys[0]) if runner == "make_apply" else (xs, ys)
        with pytest.raises(es.StepError, match=r"close over it") as info:
            call(model, *args)
    else:
        step = es.make_step(_inner_jit_given_the_model, optax.sgd(0.1))
        with pytest.raises(es.StepError, match=r"close over it") as info:
            first_call(runner, step, model, step.init(model), xs, ys)
    assert "Non-hashable static arguments" in str(info.value.__cause__)
    if runner == "step":  # the fix: the same numbers as the loss itself
        out = []
        for loss in (_inner_jit_closing_over_the_model, loss_fn):
            model = Net(jax.random.key(0))
            model = es.to_refs(model) if mode == "ref" else model
            step = es.make_step(loss, optax.sgd(0.1), return_loss=True)
            out.append(step(model, step.init(model), xs[0], ys[0]))
        for a, b in zip(arrays(out[0]), arrays(out[1]), strict=True):
            assert np.array_equal(a, b)


def test_the_optimizer_of_a_step_is_read_only():
    step = es.make_step(loss_fn, optax.sgd(0.1))
    for name, value in (("optimizer", optax.adam(1.0)), ("loss_fn", len)):
        with pytest.raises(AttributeError, match=r"cannot be changed.*make_step"):
            setattr(step, name, value)
        with pytest.raises(es.EqxStateError):
            setattr(step, name, value)
        with pytest.raises(es.EqxStateError, match=r"cannot be changed.*make_step"):
            delattr(step, name)  # accepted before; `step.init` then failed
    assert isinstance(step.optimizer, optax.GradientTransformation)
    assert step.loss_fn is loss_fn


def test_the_function_of_a_make_apply_is_read_only():
    """`apply_fn.fn = other` was accepted and ignored: the compiled call kept
    running the function it was built from."""

    def fn(m, x):
        return m(x)

    apply_fn = es.make_apply(fn)
    for change in (
        lambda: setattr(apply_fn, "fn", len),
        lambda: delattr(apply_fn, "fn"),
    ):
        with pytest.raises(es.EqxStateError, match=r"cannot be changed.*make_apply"):
            change()
        with pytest.raises(AttributeError):
            change()
    assert apply_fn.fn is fn


@pytest.mark.parametrize("twin", ["same layer", "copied refs"])
@pytest.mark.parametrize("runner", [*RUNNERS, "apply", "make_apply", "freeze"])
def test_shared_refs_are_refused_by_every_runner(runner, twin):
    """One ref at two places: the same layer twice, or two layers holding
    `copy.copy`s of its refs (a copied `jax.Ref` reads and writes the same array:
    one state; each place's write would be put back and one of them lost)."""
    bn = es.to_refs(es.nn.BatchNorm(3))
    if twin == "same layer":
        other = bn
    else:
        other = jax.tree.map(
            lambda x: copy.copy(x) if isinstance(x, jax.Ref) else x, bn
        )
        assert other.running_mean.value is not bn.running_mean.value
    model = [bn, other]  # one state at two places: only constructible by hand

    def forward2(m, x):
        return m[1](m[0](x))

    step = es.make_step(lambda m, x: jnp.mean(forward2(m, x) ** 2), optax.sgd(0.1))
    x = jnp.ones((K, 4, 3))
    calls = {
        "apply": lambda: es.apply(forward2, model, x[0]),
        "make_apply": lambda: es.make_apply(forward2)(model, x[0]),
        "freeze": lambda: es.freeze(model),
    }
    with pytest.raises(
        es.StateError, match=r"same ref is at two places of the model: `model\[0\]"
    ):
        if runner in calls:
            calls[runner]()
        else:
            first_call(runner, step, model, step.init(model), x)


@pytest.mark.parametrize("runner", RUNNERS)
def test_a_cell_of_the_model_passed_as_an_argument_is_refused_by_name(runner):
    """A ref-mode model's own ref passed again as an argument (bare, or inside the
    whole model) is refused before anything runs, naming both places; it gave
    JAX's "Attempt to donate the same buffer twice" (or a path like `0.0.layers`)."""
    model = es.to_refs(Net(jax.random.key(0)))
    xs, ys = data()
    step = es.make_step(lambda m, x, y, extra: loss_fn(m, x, y), optax.sgd(0.1))
    opt_state = step.init(model)
    for extra, where in (
        (model.bn.running_mean.value, r"`args\[2\]`"),
        (model, r"`args\[2\]\.bn\.running_mean`"),
    ):
        stacked = extra if runner == "scan" else [extra] * K  # `first_call` takes [0]
        with pytest.raises(
            es.StateError,
            match=rf"passed at two places: `model\.bn\.running_mean` and {where}",
        ):
            first_call(runner, step, model, opt_state, xs, ys, stacked)
    assert int(model.bn.num_batches_tracked[...]) == 0  # nothing ran


@pytest.mark.parametrize(
    "runner", ["apply", "make_apply", "make_apply.scan", "filter_jit(apply)"]
)
def test_one_ref_at_two_places_is_refused_alike_by_the_forward_runners(runner):
    """Eager `es.apply` ran a call whose ref sat at two places (the model's ref
    passed again as an argument, or one ref as two arguments) as one state, which
    every compiled runner refuses: now the same error, naming both places, before
    anything runs."""
    model = es.to_refs(Net(jax.random.key(0)))
    xs, _ = data()

    def forward(m, x, a, b):
        return m(x).sum() + a[...].sum() + b[...].sum()

    calls = {
        "apply": lambda *a: es.apply(forward, *a),
        "make_apply": es.make_apply(forward),
        "make_apply.scan": lambda m, x, a, b: es.make_apply(forward).scan(
            m, x[None], a, b
        ),
        "filter_jit(apply)": eqx.filter_jit(lambda *a: es.apply(forward, *a)),
    }
    mean = model.bn.running_mean
    other = es.to_refs(es.metrics.Mean()).total
    cases = [
        ((mean, other), r"`model\.bn\.running_mean` and `args\[1\]`.*as an argument"),
        ((other, mean.value), r"`model\.bn\.running_mean` and `args\[2\]`"),
        ((other, other), r"`args\[1\]` and `args\[2\]`.*takes each ref once"),
    ]
    for (a, b), message in cases:
        with pytest.raises(es.StateError, match=message):
            calls[runner](model, xs[0], a, b)
    assert int(model.bn.num_batches_tracked[...]) == 0  # nothing ran
    twice = [model, model]  # one ref at two places of the model itself
    with pytest.raises(es.StateError, match=r"at two places of the model: `model\[0\]"):
        calls[runner](twice, xs[0], other, mean)


def test_a_python_float_loss_is_returned_as_an_array_by_every_runner():
    """A `loss_fn` returning a Python float (a constant loss while debugging): a
    step returned the float as it was and `step.scan` over K gave one float, not
    K losses. Every runner now returns arrays, K of them from the scan."""
    model = eqx.nn.Linear(3, 2, key=jax.random.key(0))
    step = es.make_step(
        lambda m, x: 0.5, optax.sgd(0.1), return_loss=True, donate=False
    )
    xs = jnp.ones((K, 3))
    _, _, loss = step(model, step.init(model), xs[0])
    assert isinstance(loss, jax.Array) and loss.shape == () and float(loss) == 0.5
    _, _, losses = step.scan(model, step.init(model), xs)
    assert isinstance(losses, jax.Array) and losses.tolist() == [0.5] * K
    loop = step.own(model, step.init(model))
    assert [float(loop(x)) for x in xs] == [0.5] * K


@pytest.mark.parametrize("value", [0, [0], "0"], ids=["int", "list", "str"])
@pytest.mark.parametrize(
    "runner", [*RUNNERS, "apply", "make_apply", "make_apply.scan", "to_refs"]
)
def test_a_cell_holding_no_array_is_named_alike_by_every_runner(runner, value):
    """`eqx.tree_at(lambda m: m.bn.num_batches_tracked.value, model, 0)` (the
    `.value` route misuse.md gives, with a Python number): every runner raised
    Python's or JAX's error ("'int' object has no attribute 'shape'", "Error
    interpreting argument to new_ref"), naming no place. Now one `TypeError` of
    the library's, naming the cell, from the one walk over cells every runner
    takes."""
    model = Net(jax.random.key(0))
    bad = eqx.tree_at(lambda m: m.bn.num_batches_tracked.value, model, value)
    with pytest.raises(
        TypeError, match=r"cell `model\.bn\.num_batches_tracked` holds .* as its value"
    ) as caught:
        call_runner(runner, bad, {"to_refs": lambda m, x, xs: es.to_refs(m)})
    assert isinstance(caught.value, es.EqxStateError)


def _tagged_sgd(lr):
    """optax.sgd(lr) whose state also holds a Python string, which changes at the
    first update (an optimizer's phase)."""

    def init(params):
        return {"phase": "warm", "n": jnp.zeros((), jnp.int32)}

    def update(grads, state, params=None):
        updates = jax.tree.map(lambda g: -lr * g, grads)
        return updates, {"phase": "main", "n": state["n"] + 1}

    return optax.GradientTransformation(init, update)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("runner", RUNNERS)
def test_an_optimizer_state_may_hold_a_python_value(runner, mode):
    """A string in the optimizer's state (as `eqx.filter_jit` takes it): every
    runner failed on the per-trace check of the state (`jax.eval_shape` of
    `optimizer.init` cannot return a string) with JAX's bare `TypeError`. The
    steps are optax.sgd's, bit for bit, and the string is the update's."""
    model, opt_state, losses = run(runner, mode, _tagged_sgd(0.1))
    want_model, _, want = run("step", "value", optax.sgd(0.1))
    assert opt_state["phase"] == "main" and int(opt_state["n"]) == K
    assert np.array_equal(losses, want)
    for a, b in zip(arrays(model), arrays(want_model), strict=True):
        assert np.array_equal(a, b)


class _Masked(eqx.Module):
    w: jax.Array
    mask: np.ndarray  # an integer NumPy leaf: not trained, handed back as it is


_BIG = np.full((300, 300), 0.001, np.float32)


def _slow_loss(model, x):
    # x and the mask are read after a long computation: a change made to them in
    # place just after the call returns reaches them while the call still runs
    y = jnp.asarray(_BIG)
    for _ in range(20):
        y = jnp.tanh(y @ _BIG)
    return jnp.sum(model.w * x * model.mask * (y[0, 0] * 0 + 1))


@pytest.mark.parametrize(
    "runner", [*RUNNERS, "make_apply", "vmapped step", "grad of make_apply"]
)
def test_a_numpy_array_is_read_as_it_was_given(runner):
    """A NumPy batch, or a NumPy leaf of the model, changed in place right after a
    call returns: on the CPU JAX may read the array's own buffer while the call
    runs on (jax-ml/jax#37830), and about a third of the calls read the later
    values (in the optimizer state's learning rate, as optax's docs set it in
    place, too). Every runner passes a private copy: each call reads what it was
    given."""
    step = es.make_step(_slow_loss, optax.sgd(0.0), return_loss=True, donate=False)
    for trial in range(12):
        model = _Masked(jnp.ones((64, 64)), np.ones((64, 64), np.int32))
        opt_state = step.init(model)
        x = np.ones((1, 64, 64), np.float32)
        if runner == "step":
            loss = step(model, opt_state, x[0])[2]
        elif runner == "scan":
            loss = step.scan(model, opt_state, x)[2][0]
        elif runner == "make_apply":
            loss = es.make_apply(_slow_loss, donate=False)(model, x[0])[0]
        elif runner == "vmapped step":  # an ensemble of 2 sharing the batch: the
            # call runs under an eager vmap (a signature made for tracers)
            models = eqx.filter_vmap(lambda _, m=model: m)(jnp.arange(2))
            opts = eqx.filter_vmap(step.init)(models)
            losses = eqx.filter_vmap(step, in_axes=(0, 0, None))(models, opts, x[0])[2]
            loss = losses[1]
        elif runner == "grad of make_apply":
            evaluate = es.make_apply(_slow_loss, donate=False)
            grad = eqx.filter_grad(lambda m, f=evaluate, b=x[0]: f(m, b)[0])(model)
            loss = grad.w[0, 0] * 4096  # d loss / d w = x * mask
        else:
            loop = step.own(model, opt_state)
            loss = loop(x[0])
        x[...] = 0.0
        model.mask[...] = 0
        assert float(loss) == 64 * 64, trial
        if runner == "own":
            loop.release()


@pytest.mark.parametrize("runner", [*RUNNERS, "make_apply"])
def test_odd_numpy_batches_are_read_as_numpy_reads_them(runner):
    """A big-endian batch after a native one was read as zeros by the compiled
    step (JAX's own cache); a masked batch is refused (JAX's refusal), not passed
    with its mask dropped."""
    step = es.make_step(
        lambda m, x: jnp.sum(m.w * x), optax.sgd(0.0), return_loss=True, donate=False
    )
    evaluate = es.make_apply(lambda m, x: jnp.sum(m.w * x), donate=False)

    def loss_of(x):
        model = _Masked(jnp.ones(3), np.ones(3, np.int32))
        if runner == "step":
            return step(model, step.init(model), x)[2]
        if runner == "scan":
            return step.scan(model, step.init(model), x[None])[2][0]
        if runner == "make_apply":
            return evaluate(model, x)[0]
        loop = step.own(model, step.init(model))
        try:
            return loop(x)
        finally:
            loop.release()

    assert float(loss_of(np.arange(1, 4, dtype="<f4"))) == 6.0
    assert float(loss_of(np.arange(1, 4, dtype=">f4"))) == 6.0
    masked = np.ma.masked_array([1.0, 100.0, 1.0], mask=[0, 1, 0], dtype=np.float32)
    with pytest.raises(ValueError, match="masked arrays"):
        loss_of(masked)


@pytest.mark.parametrize("init", ["step.init", "optimizer.init"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("runner", RUNNERS)
def test_an_array_given_to_the_optimizer_outlives_the_first_step(runner, mode, init):
    """`optax.inject_hyperparams(optax.adam)(learning_rate=jnp.float32(1e-3))`:
    optax's eager `init` puts that array itself into the state, and the first step
    donated it, so the optimizer held a deleted array and every later
    `step.init` failed with JAX's "deleted or donated". `step.init` builds the
    state in new buffers, and a step does not donate the optimizer state's
    scalars (a state made by hand, `optimizer.init(es.params(model))`, holds the
    array itself): the array lives on, and a second `init` equals optax's own
    `init` of the new parameters."""
    lr = jnp.float32(0.05)
    optimizer = optax.inject_hyperparams(optax.adam)(learning_rate=lr)
    model = Net(jax.random.key(0))
    model = es.to_refs(model) if mode == "ref" else model
    step = es.make_step(loss_fn, optimizer)
    if init == "step.init":
        opt_state = step.init(model)
    else:
        opt_state = optimizer.init(es.params(model))
        assert opt_state.hyperparams["learning_rate"] is lr  # why it matters
    xs, ys = data()
    if runner == "own":
        loop = step.own(model, opt_state)
        loop(xs[0], ys[0])
        new, _ = loop.release()
    else:
        new = first_call(runner, step, model, opt_state, xs, ys)[0]
    assert not lr.is_deleted()
    again = step.init(new)
    want = optimizer.init(es.params(new))  # optax's own, eagerly
    for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(want), strict=True):
        assert a.dtype == b.dtype and np.array_equal(a, b)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "runner",
    [*RUNNERS, "apply", "make_apply", "make_apply.scan", "init", "freeze", "params"],
)
def test_a_stale_model_is_refused_by_every_runner(runner, mode):
    """One message, naming the consumed leaves by path, from every runner and
    every entry point that takes a model (`step.init`, `es.apply`, `es.freeze`:
    they said "The model's leaf `...` holds ..." where the runners said "The model
    holds ... Consumed: `...`")."""
    model = Net(jax.random.key(0))
    model = es.to_refs(model) if mode == "ref" else model
    step = es.make_step(loss_fn, optax.sgd(0.1))
    opt_state = step.init(model)
    xs, ys = data()
    step(model, opt_state, xs[0], ys[0])  # consumes the arrays given to it
    apply = es.make_apply(forward)
    calls = {
        "apply": lambda: es.apply(forward, model, xs[0]),
        "make_apply": lambda: apply(model, xs[0]),
        "make_apply.scan": lambda: apply.scan(model, xs),
        "init": lambda: step.init(model),
        "freeze": lambda: es.freeze(model),
        # `optax.adam(...).init(es.params(stale))` succeeded on deleted arrays
        "params": lambda: es.params(model),
    }
    with pytest.raises(es.StaleModelError) as caught:
        if runner in calls:
            calls[runner]()
        else:
            first_call(runner, step, model, opt_state, xs, ys)
    message = str(caught.value)
    assert message.startswith("The model holds an array that was consumed"), message
    assert re.search(r"Consumed: `model\.(lin1|bn|lin2|drop|ema|seen)", message)


@pytest.mark.parametrize("runner", RUNNERS)
def test_a_model_an_owned_loop_took_over_names_release(runner):
    """The stale-model error of a model handed to `step.own` names the way back,
    `loop.release()` (the loop's calls return the loss, not the model)."""
    model = Net(jax.random.key(0))
    step = es.make_step(loss_fn, optax.sgd(0.1))
    opt_state = step.init(model)
    xs, ys = data()
    loop = step.own(model, opt_state)
    loop(xs[0], ys[0])
    with pytest.raises(es.StaleModelError, match=r"loop\.release\(\)"):
        first_call(runner, step, model, opt_state, xs, ys)
    model, opt_state = loop.release()
    first_call(runner, step, model, opt_state, xs, ys)  # what it gives back runs


@pytest.mark.parametrize("replacement", ["array", "float"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "runner", [*RUNNERS, "apply", "make_apply", "make_apply.scan", "eager"]
)
def test_a_cell_replaced_by_a_plain_value_is_named_alike_by_every_runner(
    runner, mode, replacement
):
    """`eqx.tree_at(lambda m: m.bn.running_mean, model, array)` (a PyTorch habit:
    setting the buffer itself) left BatchNorm an array or a float where it keeps a
    cell: JAX's "arrays are immutable" or Python's "not subscriptable" came out of
    the layer. Every runner names the field, the cause and how to set a cell's
    value, and writes nothing; the fix it names works."""
    if runner == "eager" and mode == "value":
        pytest.skip("an eager value-mode call writes nothing by design")
    model = Net(jax.random.key(0))
    model = es.to_refs(model) if mode == "ref" else model
    new = jnp.full(8, 0.5) if replacement == "array" else 0.5
    bad = eqx.tree_at(lambda m: m.bn.running_mean, model, new)
    kind = r"an array of shape \(8,\)" if replacement == "array" else "a float"
    match = (
        rf"`model\.bn\.running_mean` holds {kind}, but its layer keeps a state "
        r"cell there \(a `BatchStat`\).*"
        r"`eqx\.tree_at\(lambda model: model\.bn\.running_mean\.value, model, array\)`"
    )
    if runner == "eager":  # the layer, named as the layer
        match = (
            rf"`BatchNorm\.running_mean` holds {kind}.*"
            r"`eqx\.tree_at\(lambda layer: layer\.running_mean\.value, layer, array\)`"
        )
    with pytest.raises(TypeError, match=match) as caught:
        call_runner(runner, bad, {"eager": lambda m, x, xs: forward(m, x)})
    assert isinstance(caught.value, es.EqxStateError)
    xs, _ = data()
    if mode == "ref":  # `bad` shares the other cells' refs: nothing was written
        before = arrays(Net(jax.random.key(0)))
        for a, b in zip(arrays(model), before, strict=True):
            np.testing.assert_array_equal(a, b)
    if mode == "value":  # the fix the message names
        fixed = eqx.tree_at(lambda m: m.bn.running_mean.value, model, jnp.full(8, 0.5))
        out, fixed = es.apply(forward, fixed, xs[0])
        mean = 0.9 * 0.5 + 0.1 * jnp.mean(fixed.lin1(xs[0]), axis=0)
        np.testing.assert_allclose(fixed.bn.running_mean[...], mean, rtol=1e-6)


@pytest.mark.parametrize("mode", MODES)
def test_a_replaced_cell_is_named_by_a_path_python_can_follow(mode):
    """Inside lists and dicts (the fix's lambda is Python: `m.seq.layers[1]`,
    `m.d['head 1']`), and inside a tuple of cells (`EMA.hidden`); the named fix
    works."""

    class M(eqx.Module):
        seq: eqx.nn.Sequential
        d: dict

        def __call__(self, x):
            x = self.seq(x)
            self.d["acc"].update(jnp.mean(x))
            return self.d["head 1"](x)

    def build():
        m = M(
            eqx.nn.Sequential([eqx.nn.Lambda(jnp.tanh), es.nn.BatchNorm(3)]),
            {"head 1": es.nn.BatchNorm(3), "acc": es.metrics.Mean()},
        )
        return es.to_refs(m) if mode == "ref" else m

    x = jnp.arange(12.0).reshape(4, 3)
    cases = {
        r"model\.seq\.layers\[1\]\.running_mean": lambda m: (
            m.seq.layers[1].running_mean
        ),
        r"model\.d\['head 1'\]\.running_var": lambda m: m.d["head 1"].running_var,
        r"model\.d\['acc'\]\.total": lambda m: m.d["acc"].total,
    }
    for access, where in cases.items():
        bad = eqx.tree_at(where, build(), jnp.zeros(3))
        with pytest.raises(TypeError, match=rf"lambda model: {access}\.value, model"):
            es.apply(lambda m, x: m(x), bad, x)
    model = build()
    fixed = eqx.tree_at(
        lambda m: m.seq.layers[1].running_mean.value, model, jnp.ones(3)
    )
    _, fixed = es.apply(lambda m, x: m(x), fixed, x)
    batch_mean = jnp.mean(jnp.tanh(x), axis=0)
    np.testing.assert_allclose(
        fixed.seq.layers[1].running_mean[...], 0.9 + 0.1 * batch_mean, rtol=1e-6
    )

    lin = eqx.nn.Linear(2, 2, key=jax.random.key(0))
    ema = es.nn.EMA(lin, decay=0.5)
    ema = es.to_refs(ema) if mode == "ref" else ema
    bad = eqx.tree_at(lambda e: e.hidden[0], ema, jnp.zeros((2, 2)))
    with pytest.raises(TypeError, match=r"`model\.hidden\[0\]` holds an array"):
        es.apply(lambda e, m: e.update(m), bad, lin)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("runner", ["apply", "make_apply", "make_apply.scan"])
def test_a_stale_model_is_refused_by_every_forward_runner_before_it_writes(
    runner, mode
):
    """A ref-mode model consumed by a step still holds live refs (the new model's)
    beside its donated parameters: eager `es.apply` ran on it, wrote the new
    model's statistics, then failed with XLA's bare "deleted" error."""
    model = Net(jax.random.key(0))
    model = es.to_refs(model) if mode == "ref" else model
    step = es.make_step(loss_fn, optax.sgd(0.1))
    xs, ys = data()
    new, _ = step(model, step.init(model), xs[0], ys[0])  # consumes `model`
    before = arrays(new)
    apply = es.make_apply(forward)
    calls = {
        "apply": lambda: es.apply(forward, model, xs[0]),
        "make_apply": lambda: apply(model, xs[0]),
        "make_apply.scan": lambda: apply.scan(model, xs),
    }
    with pytest.raises(es.StaleModelError, match="consumed"):
        calls[runner]()
    for a, b in zip(arrays(new), before, strict=True):  # nothing was written
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("mode", MODES)
def test_every_conversion_refuses_a_consumed_model_alike(mode):
    """`freeze`, `to_refs`, `reset`, `inference_mode` and `step.init` of a model a
    step consumed name its first consumed leaf; in ref mode `freeze` and `to_refs` handed back
    its dead parameters beside the live refs of the model the step returned."""
    model = Net(jax.random.key(0))
    model = es.to_refs(model) if mode == "ref" else model
    step = es.make_step(loss_fn, optax.sgd(0.1))
    xs, ys = data()
    step(model, step.init(model), xs[0], ys[0])  # consumes `model`
    # `step.init` too: on one device Adam's init read only the shapes and made a
    # state for a dead model; on a mesh it raised JAX's "Array has been deleted"
    for convert in (es.freeze, es.to_refs, es.reset, es.inference_mode, step.init):
        with pytest.raises(
            es.StaleModelError,
            match=r"^The model holds.*Consumed: `model\.lin1\.layer\.weight`",
        ):
            convert(model)


@pytest.mark.parametrize("mode", MODES)
def test_own_refuses_a_consumed_carry_when_it_takes_it_over(mode):
    """`step.own` took a consumed model or optimizer state without a word; the
    loop failed at its first call, and `release()` handed the dead carry back."""
    model = Net(jax.random.key(0))
    model = es.to_refs(model) if mode == "ref" else model
    step = es.make_step(loss_fn, optax.adam(1e-2))
    xs, ys = data()
    opt_state = step.init(model)
    new, new_opt = step(model, opt_state, xs[0], ys[0])  # consumes both
    # the message a step call gives (`test_what_was_consumed_is_named_alike...`)
    with pytest.raises(
        es.StaleModelError, match=r"^The model holds.*Consumed: `model\.lin1\.layer"
    ):
        step.own(model, new_opt)
    with pytest.raises(
        es.StaleModelError, match=r"^The optimizer state holds.*Consumed: `opt_state"
    ):
        step.own(new, opt_state)
    loop = step.own(new, new_opt)  # what the step returned is taken
    loop(xs[1], ys[1])
    model, _ = loop.release()
    assert int(model.bn.num_batches_tracked[...]) == 2


@pytest.mark.parametrize("runner", RUNNERS)
def test_an_optimizer_state_of_other_shapes_is_named_alike_by_every_runner(runner):
    """The same structure with arrays of other sizes (made for a model whose sizes
    are not static): optax's update failed on a bare broadcasting `TypeError`."""
    model = Net(jax.random.key(0))
    step = es.make_step(loss_fn, optax.adam(1e-2))
    wider = jax.tree.map(
        lambda a: jnp.concatenate([a, a]) if a.ndim else a, step.init(model)
    )
    xs, ys = data()
    with pytest.raises(
        es.StepError,
        match=r"leaf `opt_state\[0\]\.mu\.lin1\.layer\.weight` has shape \(16, 3\), "
        r"where `step\.init\(model\)` makes \(8, 3\)",
    ):
        first_call(runner, step, model, wider, xs, ys)
    assert int(model.bn.num_batches_tracked[...]) == 0  # nothing ran


@pytest.mark.parametrize("runner", RUNNERS)
def test_an_optimizer_state_of_another_structure_is_named_alike_by_every_runner(
    runner,
):
    """An optimizer state made for another `trainable` selection (here: the
    matrices only; the step trains the biases too) names its first difference by
    path."""
    model = Net(jax.random.key(0))
    matrices = es.make_step(loss_fn, optax.adam(1e-2), trainable=lambda x: x.ndim == 2)
    step = es.make_step(loss_fn, optax.adam(1e-2))
    xs, ys = data()
    with pytest.raises(
        es.StepError,
        match=r"at `opt_state\[0\]\.mu\.lin1\.layer\.bias` it holds nothing, "
        r"where the state for what this step trains holds a leaf",
    ):
        first_call(runner, step, model, matrices.init(model), xs, ys)
    assert int(model.bn.num_batches_tracked[...]) == 0  # nothing ran
    # a predicate that answers by identity selects differently at `init` and in
    # the traced step: the message said to do what had been done
    ids = {id(model.bn.weight), id(model.bn.bias)}
    by_id = es.make_step(loss_fn, optax.adam(1e-2), trainable=lambda p: id(p) in ids)
    with pytest.raises(es.StepError, match=r"selects differently at `init`.*`id\(\)`"):
        first_call(runner, by_id, model, by_id.init(model), xs, ys)


@pytest.mark.parametrize("runner", RUNNERS)
def test_an_optimizer_state_for_other_sizes_or_another_optimizer_is_named(runner):
    """Equinox keeps a layer's sizes in static fields, so a state made for a model
    with a wider head differs in structure, not in shapes: the message said "its
    leaves are at the same paths, in nodes of other types" (not so) and named no
    place. It names the node and the static field; a state of another optimizer
    (adamw's, for an adam step) names the node whose item count differs."""
    model = Net(jax.random.key(0))
    step = es.make_step(loss_fn, optax.adam(1e-2))
    wide = eqx.tree_at(
        lambda m: m.lin2.layer, model, eqx.nn.Linear(8, 5, key=jax.random.key(3))
    )
    xs, ys = data()
    with pytest.raises(
        es.StepError,
        match=r"at `opt_state\[0\]\.mu\.lin2\.layer` the Linear's static fields "
        r"differ: `out_features` 5 where it is 2",
    ):
        first_call(runner, step, model, step.init(wide), xs, ys)
    adamw = optax.adamw(1e-2).init(es.params(model))
    with pytest.raises(
        es.StepError,
        match=r"at `opt_state` it holds a tuple of 3 items, where the state for "
        r"what this step trains holds 2",
    ):
        first_call(runner, step, model, adamw, xs, ys)
    # a multi_transform state for other labels (inner states without leaves)
    by = lambda name: lambda p: jax.tree.map(lambda _: name, p)  # noqa: E731
    multi = es.make_step(loss_fn, optax.multi_transform({"a": optax.sgd(0.1)}, by("a")))
    other = optax.multi_transform({"b": optax.sgd(0.1)}, by("b"))
    with pytest.raises(
        es.StepError,
        match=r"at `opt_state\.inner_states` it has the keys \['b'\], where the "
        r"state for what this step trains has \['a'\]",
    ):
        first_call(runner, multi, model, other.init(es.params(model)), xs, ys)
    assert int(model.bn.num_batches_tracked[...]) == 0  # nothing ran


@pytest.mark.parametrize("runner", RUNNERS)
def test_what_was_consumed_is_named_alike_by_every_runner(runner):
    """A stale optimizer state with a fresh model names the optimizer state and its
    leaves; a deleted argument names the argument and leaves the model alone (it
    was blamed on "the model or optimizer state")."""
    step = es.make_step(loss_fn, optax.adam(1e-2))
    xs, ys = data()
    model = Net(jax.random.key(0))
    opt_state = step.init(model)
    model, _ = step(model, opt_state, xs[0], ys[0])  # consumes `opt_state`
    with pytest.raises(
        es.StaleModelError, match=r"^The optimizer state holds.*Consumed: `opt_state"
    ):
        first_call(runner, step, model, opt_state, xs, ys)
    opt_state = step.init(model)
    gone = jnp.array(xs if runner == "scan" else xs[0])
    gone.delete()
    gone = gone if runner == "scan" else [gone]  # `first_call` takes item 0
    with pytest.raises(es.StaleModelError, match=r"^The argument `args\[0\]`.*intact"):
        first_call(runner, step, model, opt_state, gone, ys)
    assert int(model.bn.num_batches_tracked[...]) == 1  # still alive, as it was


def test_ref_mode_steps_interleaved_with_eager_writes_equal_value_mode():
    """A ref-mode step puts its new arrays back into the same refs: eager reads and
    writes between steps (a BatchNorm recalibration, a metric reset) see and
    change what the next step reads, as the value-mode equivalent does."""
    xs, ys = data()
    step = es.make_step(loss_fn, optax.sgd(0.1))
    ref = es.to_refs(Net(jax.random.key(0)))
    val = Net(jax.random.key(0))
    ref_opt, val_opt = step.init(ref), step.init(val)
    alias = ref.bn  # another holder of the same refs
    for x, y in zip(xs, ys):
        ref, ref_opt = step(ref, ref_opt, x, y)
        val, val_opt = step(val, val_opt, x, y)
        np.testing.assert_array_equal(alias.running_mean[...], val.bn.running_mean[...])
        ref.bn(ref.lin1(x))  # an eager training-mode call: writes in place
        _, val = es.apply(lambda m, x: m.bn(m.lin1(x)), val, x)
        es.reset(ref)  # the metric starts over, in place
        val = es.reset(val)
    for a, b in zip(arrays(ref), arrays(val)):
        np.testing.assert_array_equal(a, b)
    assert int(alias.num_batches_tracked[...]) == 2 * K


def test_ref_mode_steps_leave_the_source_model_and_a_deepcopy_alone():
    """A ref-mode step writes new arrays into its refs, never into arrays anyone
    else holds: the value-mode model `to_refs` started from (committed arrays,
    which `device_put` does not copy) stays as it was, and a `copy.deepcopy` of the
    ref-mode model is an independent state (checked against float64 NumPy)."""
    import copy

    x = jnp.arange(12.0, dtype=jnp.float32).reshape(4, 3)
    source = jax.tree.map(
        lambda a: jax.device_put(a, jax.devices()[0]) if eqx.is_array(a) else a,
        es.nn.BatchNorm(3),
    )
    model = es.to_refs(source)
    step = es.make_step(lambda m, x: jnp.mean(m(x) ** 2), optax.sgd(0.1))
    model, _ = step(model, step.init(model), x)
    np.testing.assert_array_equal(source.running_mean[...], np.zeros(3))
    twin = copy.deepcopy(model)
    twin, _ = step(twin, step.init(twin), 5 * jnp.ones((4, 3)))
    first = 0.1 * np.asarray(x, np.float64).mean(0)
    np.testing.assert_allclose(model.running_mean[...], first, rtol=1e-6)
    np.testing.assert_allclose(twin.running_mean[...], 0.9 * first + 0.5, rtol=1e-6)


@jax.tree_util.register_pytree_node_class
class _Spy:
    """A pytree node with no leaves that records whether the collector is on
    whenever it is flattened."""

    seen: list[bool] = []

    def tree_flatten(self):
        _Spy.seen.append(gc.isenabled())
        return (), None

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls()

    def __eq__(self, other):
        return isinstance(other, _Spy)

    def __hash__(self):
        return 0


@pytest.mark.parametrize("runner", [*RUNNERS, "apply", "lower"])
def test_the_collector_is_paused_during_every_call_and_restored_after(runner):
    """Every runner's call (its trace, and each later call: flattening, the compiled
    call, rebuilding) runs with Python's cyclic garbage collector paused: a
    collection then scans every object of the process and frees next to nothing.
    It is given back as it was: on after the call, still off if the user had turned
    it off, and on again when the trace raises."""
    seen = []

    def loss(m, x, spy, fail=False):
        seen.append(gc.isenabled())
        if fail:
            raise RuntimeError("in the loss")
        return jnp.mean(m(x) ** 2)

    def call(fail=False, calls=1):
        bn = es.nn.BatchNorm(3)
        x = jnp.ones((K, 4, 3))
        if runner == "apply":
            f = es.make_apply(lambda m, x, spy: loss(m, x, spy, fail))
            for _ in range(calls):
                _, bn = f(bn, x[0], _Spy())
            return
        step = es.make_step(lambda m, x, spy: loss(m, x, spy, fail), optax.sgd(0.1))
        if runner == "lower":
            return step.lower(bn, step.init(bn), x[0], _Spy())
        opt_state = step.init(bn)
        if runner == "own":
            loop = step.own(bn, opt_state)
            return [loop(x[0], _Spy()) for _ in range(calls)]
        for _ in range(calls):
            if runner == "step":
                bn, opt_state = step(bn, opt_state, x[0], _Spy())
            else:
                bn, opt_state = step.scan(bn, opt_state, x, _Spy())

    assert gc.isenabled()
    _Spy.seen = []
    call(calls=3)
    assert seen == [False] and gc.isenabled()  # traced once, paused, restored
    assert _Spy.seen and not any(_Spy.seen)  # every call's flattening: paused
    with pytest.raises(RuntimeError, match="in the loss"):
        call(fail=True)
    assert gc.isenabled()
    gc.disable()  # the user's choice stands
    try:
        call()
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_a_ref_mode_model_closed_over_by_an_outer_jit_is_written_each_call():
    """A ref-mode model and a concrete batch closed over by an outer `jax.jit` (or a
    loop body): no leaf of the call is a tracer, and still each run of the outer
    program reads and writes the refs, as eager `es.apply` does in the same place
    (the value at trace time was baked in: three runs counted 1, 1, 1)."""
    count = es.make_apply(lambda c: c.increment())
    _counts_each_run(lambda c: count(c)[0])
    _counts_each_run(lambda c: es.apply(lambda c: c.increment(), c)[0])
    xs, ys = data()
    model = es.to_refs(Net(jax.random.key(0)))
    step = es.make_step(loss_fn, optax.sgd(0.1), donate=False)
    opt_state = step.init(model)
    outer = jax.jit(
        lambda: step(model, opt_state, xs[0], ys[0])[0].bn.num_batches_tracked[...]
    )
    assert [int(outer()) for _ in range(3)] == [1, 2, 3]
    assert int(model.bn.num_batches_tracked[...]) == 3


def _counts_each_run(call):
    counter = es.to_refs(es.nn.Counter())
    outer = jax.jit(lambda: call(counter))
    assert [int(outer()) for _ in range(3)] == [1, 2, 3]
    loop_counter = es.to_refs(es.nn.Counter())
    total = jax.lax.fori_loop(0, 3, lambda i, t: t + call(loop_counter), jnp.int32(0))
    assert int(total) == 1 + 2 + 3 and int(loop_counter.value[...]) == 3


def test_one_ref_passed_as_two_arguments_is_named():
    metric = es.to_refs(es.metrics.Mean())
    both = es.make_apply(lambda m, a, b, x: (a.update(x), b.update(x)))
    with pytest.raises(
        es.StateError, match=r"passed at two places: `args\[0\]\.total` and `args\[1\]"
    ):
        both(eqx.nn.Identity(), metric, metric, jnp.ones(3))
