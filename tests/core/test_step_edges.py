"""Edges of a training step found by outside testing (issue 24: items 1, 5, 6, 11,
12, 18), each against an independent reference: a full-batch step by hand, optax's
own loop, JAX's own error."""

from __future__ import annotations

import re
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import eqx_state as es


def _weighted_loss(model, x, y, class_weights):
    logits = jax.vmap(model)(x)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, y)
    return jnp.mean(ce * class_weights[y])


def test_microbatches_refuse_an_argument_that_is_not_a_batch():
    """Item 1: class weights [4] beside a batch [8] are not split; the error names
    them (they would have been halved, the gather clamping silently)."""
    model = eqx.nn.Linear(3, 4, key=jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (8, 3))
    y = jnp.arange(8) % 4
    w = jnp.array([1.0, 2.0, 3.0, 4.0])
    step = es.make_step(_weighted_loss, optax.sgd(0.1), microbatches=2)
    with pytest.raises(es.StepError, match=r"`args\[2\]` \(4,\).*closure"):
        step(model, step.init(model), x, y, w)
    # the documented fix, a closure, equals a full-batch step by hand
    import functools

    loss = functools.partial(_weighted_loss, class_weights=w)
    step = es.make_step(
        loss, optax.sgd(0.1), microbatches=2, return_loss=True, donate=False
    )
    new, _, value = step(model, step.init(model), x, y)
    grads = jax.grad(_weighted_loss)(model, x, y, w)
    want = jax.tree.map(lambda p, g: p - 0.1 * g, model, grads)
    assert float(value) == pytest.approx(float(_weighted_loss(model, x, y, w)), 1e-6)
    np.testing.assert_allclose(new.weight, want.weight, rtol=1e-5, atol=1e-7)


def _mse(model, x, y):
    return jnp.mean((jax.vmap(model)(x)[:, 0] - y) ** 2)


def _beside_optaxs_loop(opt, ref_opt, calls):
    """`calls` steps of `make_step(_mse, opt)` beside optax's documented loop by
    hand with `ref_opt` (the loss passed as `value=`): losses and parameters
    equal at every call; returns both optimizer states."""
    model = eqx.nn.Linear(2, 1, key=jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (16, 2))
    y = jnp.sin(x[:, 0])
    step = es.make_step(_mse, opt, return_loss=True, donate=False)
    state = step.init(model)
    params, ref_state = model, ref_opt.init(eqx.filter(model, eqx.is_inexact_array))
    for _ in range(calls):
        model, state, loss = step(model, state, x, y)
        ref_loss, grads = jax.value_and_grad(_mse)(params, x, y)
        updates, ref_state = ref_opt.update(grads, ref_state, params, value=ref_loss)
        params = optax.apply_updates(params, updates)
        np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    np.testing.assert_allclose(model.weight, params.weight, rtol=1e-5)
    return state, ref_state


def test_reduce_on_plateau_gets_the_loss_like_optaxs_own_loop():
    """Item 12: an optimizer that needs the loss (`value=`) trains as in optax's
    documented loop."""
    opt = optax.chain(
        # a step too large for the problem: the loss stops improving, and the
        # plateau rule halves the updates
        optax.sgd(1.5),
        optax.contrib.reduce_on_plateau(patience=1, factor=0.5),
    )
    state, ref_state = _beside_optaxs_loop(opt, opt, 8)
    assert float(state[1].scale) == float(ref_state[1].scale) < 1.0  # it reduced


@pytest.mark.parametrize("plain", [False, True], ids=["MultiSteps", "its_plain_form"])
def test_multi_steps_forwards_the_loss_like_optaxs_own_loop(plain):
    """`optax.MultiSteps` forwards `value=` to the optimizer it wraps (its `update`
    takes extra arguments, though it is no `GradientTransformationExtraArgs`):
    a plateau rule inside it gets the loss, as in optax's loop by hand."""
    inner = optax.chain(
        optax.sgd(1.5), optax.contrib.reduce_on_plateau(patience=1, factor=0.5)
    )
    multi = optax.MultiSteps(inner, every_k_schedule=2)
    opt = multi.gradient_transformation() if plain else multi
    state, ref_state = _beside_optaxs_loop(opt, multi, 12)
    scale = ref_state.inner_opt_state[1].scale
    assert float(state.inner_opt_state[1].scale) == float(scale) < 1.0
    assert int(es.step_count(state)) == int(ref_state.gradient_step) == 6


def test_a_python_float_that_keeps_changing_warns_naming_the_leaf():
    """Item 6: each new float compiles again; the warning names the leaf and the
    fix (an array)."""
    opt = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
    model = eqx.nn.Linear(2, 1, key=jax.random.key(0))
    x, y = jnp.ones((4, 2)), jnp.zeros(4)
    step = es.make_step(_mse, opt, donate=False)
    state = step.init(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for lr in (0.1, 0.2, 0.3, 0.4):
            state.hyperparams["learning_rate"] = lr
            model, state = step(model, state, x, y)
            # the third Python value (the second change) is the one that warns
            warned = [w for w in caught if w.category is es.RecompileWarning]
            assert len(warned) == (lr >= 0.3), (lr, warned)
    messages = [str(w.message) for w in caught if w.category is es.RecompileWarning]
    assert len(messages) == 1, messages
    assert "opt_state.hyperparams['learning_rate']" in messages[0]
    assert "jnp.asarray" in messages[0]
    assert step.trace_count == 4
    # a keyword argument is named as passed
    step = es.make_step(lambda m, x, y, scale: scale * _mse(m, x, y), opt, donate=False)
    with pytest.warns(es.RecompileWarning, match=r"`kwargs\['scale'\]`"):
        for scale in (1.0, 2.0, 3.0, 4.0):
            step(model, state, x, y, scale=scale)
    # with an array: no new compilation, no warning
    step = es.make_step(_mse, opt, donate=False)
    state = step.init(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for lr in (0.1, 0.2, 0.3, 0.4):
            state.hyperparams["learning_rate"] = jnp.asarray(lr)
            model, state = step(model, state, x, y)
    assert step.trace_count == 1


class _Scaled(eqx.Module):
    lin: eqx.nn.Linear
    scale: list

    def __call__(self, x):
        s = self.scale[0]
        return self.lin(x) * (s[...] if isinstance(s, es.Buffer) else s)


def test_a_changing_number_in_the_model_gets_advice_that_keeps_it_untrained():
    """A Python number of the model that keeps changing warns with the fix for a
    model: a state cell (a bare array there is a parameter, which the optimizer
    trains: the advice to make it an array did that). Followed, the value changes
    without a new compilation, each step uses it, and it stays as set. Reference:
    `jax.grad` of the same loss by hand."""
    lin = eqx.nn.Linear(2, 1, key=jax.random.key(0))
    x, y = jnp.ones((4, 2)), jnp.zeros(4)
    step = es.make_step(_mse, optax.sgd(0.1), donate=False)
    model = _Scaled(lin, [1.0])
    state = step.init(model)
    with pytest.warns(es.RecompileWarning) as caught:
        for scale in (1.0, 2.0, 3.0):
            model.scale[0] = scale
            model, state = step(model, state, x, y)
    message = str(caught[0].message)
    assert "`model.scale[0]`" in message and "es.Buffer(" in message
    assert "hyperparams" not in message  # the optimizer state's fix is not this
    model = _Scaled(lin, [es.Buffer(jnp.asarray(1.0, jnp.float32))])
    step = es.make_step(_mse, optax.sgd(0.1), donate=False)
    state = step.init(model)
    ref = lin
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for scale in (2.0, 3.0, 4.0):
            model = eqx.tree_at(
                lambda m: m.scale[0], model, es.Buffer(jnp.asarray(scale, jnp.float32))
            )
            model, state = step(model, state, x, y)
            grads = jax.grad(lambda m, s=scale: _mse(lambda v: m(v) * s, x, y))(ref)
            ref = jax.tree.map(lambda p, g: p - 0.1 * g, ref, grads)
            assert float(model.scale[0][...]) == scale  # set, not trained
    assert step.trace_count == 1
    np.testing.assert_allclose(model.lin.weight, ref.weight, rtol=1e-6)


def test_a_scan_warns_of_a_new_batch_shape_but_not_of_a_new_length():
    """`step.scan` and `make_apply(...).scan` warn, as a step does, when the batch
    inside each step changes shape (a ragged last batch); a new number of steps
    K compiles again by design and does not warn."""
    model = eqx.nn.Linear(2, 1, key=jax.random.key(0))
    step = es.make_step(_mse, optax.sgd(0.1), donate=False)
    state = step.init(model)
    apply_fn = es.make_apply(lambda m, x: jax.vmap(m)(x))
    for scan in (
        lambda xs: step.scan(model, state, xs, xs[..., 0]),
        lambda xs: apply_fn.scan(model, xs),
    ):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            scan(jnp.ones((3, 8, 2)))
            scan(jnp.ones((5, 8, 2)))  # a new K
        with pytest.warns(
            es.RecompileWarning, match=r"\(\(8, 2\), 'float32'\) -> \(\(5, 2\)"
        ):
            scan(jnp.ones((5, 5, 2)))  # a short batch in each step


def test_an_unhashable_static_leaf_is_named_by_its_path():
    """The error names each unhashable leaf as every message names leaves:
    `args[i]`, `kwargs[...]`, `model....`."""
    step = es.make_step(
        lambda m, x, tags=None, opts=None: _mse(m, x, x[:, 0]), optax.sgd(0.1)
    )
    model = eqx.nn.Linear(2, 1, key=jax.random.key(0))
    state = step.init(model)
    x = jnp.ones((4, 2))
    for call, name in (
        (lambda: step(model, state, x, {1}), "`args[1]` (set)"),
        (lambda: step(model, state, x, opts={1}), "`kwargs['opts']` (set)"),
        (lambda: step(_Scaled(model, [{1}]), state, x), "`model.scale[0]` (set)"),
    ):
        with pytest.raises(es.StepError, match=re.escape(name)):
            call()


class _StaticTable(eqx.Module):
    linear: eqx.nn.Linear
    table: object = eqx.field(static=True)

    def __call__(self, x):
        return self.linear(x)


@pytest.mark.parametrize("runner", ["step", "scan", "own", "apply"])
def test_a_static_field_holding_an_array_is_named_by_its_path(runner):
    """A NumPy array in a static field (Equinox warns when one is set): a call on a
    rebuilt model compared it with an earlier structure with `==` (a call's or one
    of JAX's caches) and gave JAX's bare "metadata fields" ValueError, or not,
    depending on what ran before. Every runner now refuses it at its first call,
    naming the field (one check, in the shared signature lookup)."""
    import warnings as w

    def make():
        with w.catch_warnings():
            w.simplefilter("ignore")  # Equinox's own warning about such a field
            return _StaticTable(
                eqx.nn.Linear(2, 1, key=jax.random.key(0)), np.arange(3.0)
            )

    def loss(m, x):
        return jnp.mean(jax.vmap(m)(x) ** 2)

    step = es.make_step(loss, optax.sgd(0.1), donate=False)
    apply = es.make_apply(lambda m, x: jax.vmap(m)(x), donate=False)
    x = jnp.ones((4, 2))
    calls = {
        "step": lambda m: step(m, step.init(m), x),
        "scan": lambda m: step.scan(m, step.init(m), x[None]),
        "own": lambda m: step.own(m, step.init(m))(x),
        "apply": lambda m: apply(m, x),
    }
    for _ in range(2):  # refused at once, not at a later call or in JAX's caches
        with pytest.raises(es.StepError, match=r"`model\.table` \(ndarray\)") as info:
            calls[runner](make())
        assert "eqx.field(static=True)" in str(info.value)
    linear = eqx.nn.Linear(2, 1, key=jax.random.key(0))
    # an array inside a container, or of size 1: `==` of a container skips an
    # item that is the same object, and a 0-d array broadcasts against a list
    for table in (
        (np.arange(3.0),),
        {"a": np.arange(3.0)},
        [np.float32(1.0), np.ones(())],
    ):
        with w.catch_warnings():
            w.simplefilter("ignore")  # Equinox's warning about a JAX array there
            model = _StaticTable(linear, table)
        with pytest.raises(es.StepError, match=r"`model\.table`"):
            calls[runner](model)
    calls[runner](_StaticTable(linear, (0.0, 1.0, 2.0)))  # a tuple runs
    calls[runner](_StaticTable(linear, [0.0, 1.0]))  # a list too (JAX compares it)
    calls[runner](_StaticTable(linear, [0.0, 1.0]))


def test_a_runtime_error_of_the_first_step_is_reported_as_itself():
    """Item 11: a callback that raises inside the first step of a fresh model is
    the error reported (not "consumed by an earlier call"), with a note that the
    donated inputs are gone."""

    def fail(_):
        raise RuntimeError("the data loader's callback failed")

    def loss(model, x, y):
        jax.debug.callback(fail, x)
        return _mse(model, x, y)

    model = eqx.nn.Linear(2, 1, key=jax.random.key(0))
    step = es.make_step(loss, optax.sgd(0.1))
    with pytest.raises(Exception) as info:  # noqa: B017 -- whatever JAX raises
        out = step(model, step.init(model), jnp.ones((4, 2)), jnp.zeros(4))
        jax.block_until_ready(out)
    assert not isinstance(info.value, es.StaleModelError)
    assert "the data loader's callback failed" in str(info.value)
    # and a model consumed before a call is still named as such
    model = eqx.nn.Linear(2, 1, key=jax.random.key(0))
    state = step.init(model)
    step2 = es.make_step(_mse, optax.sgd(0.1))
    step2(model, state, jnp.ones((4, 2)), jnp.zeros(4))
    with pytest.raises(es.StaleModelError, match="donate=False"):
        step2(model, state, jnp.ones((4, 2)), jnp.zeros(4))


_USER_SCRIPT = """
import jax, jax.numpy as jnp, optax, equinox as eqx, eqx_state as es
m = eqx.nn.Linear(2, 1, key=jax.random.key(0))
step = es.make_step(lambda m, x, scale: scale * jnp.mean(jax.vmap(m)(x) ** 2),
                    optax.sgd(0.1), donate=False)
o = step.init(m)
for s in (1.0, 2.0, 3.0, 4.0):
    m, o = step(m, o, jnp.ones((2, 2)), scale=s)  # line 8
m, o = step(m, o, jnp.ones((3, 2)), scale=1.0)  # line 9: a new shape, traced
"""


def test_the_recompile_warning_points_at_the_users_call(tmp_path):
    """Run as a user runs it (no type-checking import hook, which adds frames):
    each warning (a changing Python number, a new shape) names the line of the
    user's step call."""
    import subprocess
    import sys

    script = tmp_path / "user.py"
    script.write_text(_USER_SCRIPT)
    out = subprocess.run(
        [sys.executable, "-W", "always", str(script)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"{script}:8: RecompileWarning" in out.stderr, out.stderr[-2000:]
    # the shape warning is given while JAX traces the call: JAX's frames skipped too
    assert f"{script}:9: RecompileWarning" in out.stderr, out.stderr[-2000:]


def test_an_assigned_hyperparameter_array_is_donated_as_documented():
    """Item 18 (documented convention): an array put into the optimizer state is
    part of it and donated by the next step; a copy kept by the user stays valid,
    and the value read back from the returned state is the one assigned."""
    opt = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)
    model = eqx.nn.Linear(2, 1, key=jax.random.key(0))
    step = es.make_step(_mse, opt)
    state = step.init(model)
    lr = jnp.asarray(0.05)
    state.hyperparams["learning_rate"] = jnp.copy(lr)
    model, state = step(model, state, jnp.ones((4, 2)), jnp.zeros(4))
    assert float(lr) == pytest.approx(0.05)
    assert float(state.hyperparams["learning_rate"]) == pytest.approx(0.05)


def test_an_optimizer_that_needs_more_than_the_loss_names_the_fix():
    """`optax.lbfgs()`'s zoom line search needs `grad=` and `value_fn=`, which a
    step does not pass: a `StepError` naming `linesearch=None` (it was optax's
    bare "missing 2 required keyword-only arguments"), before anything ran. With
    `linesearch=None` the step equals optax's own loop."""
    import optax

    def loss(m, x):
        return jnp.sum((m["w"] * x - 1.0) ** 2)

    x = jnp.arange(1.0, 4.0)
    model = {"w": jnp.ones(3)}
    step = es.make_step(loss, optax.lbfgs())
    with pytest.raises(es.StepError, match=r"linesearch=None.*value_and_grad_from"):
        step(model, step.init(model), x)
    assert model["w"].tolist() == [1.0, 1.0, 1.0]  # not consumed: nothing ran

    opt = optax.lbfgs(linesearch=None)
    p, s = {"w": jnp.ones(3)}, opt.init({"w": jnp.ones(3)})
    for _ in range(3):
        g = jax.grad(loss)(p, x)
        u, s = opt.update(g, s, p)
        p = optax.apply_updates(p, u)
    step = es.make_step(loss, opt)
    got = {"w": jnp.ones(3)}
    got_s = step.init(got)
    for _ in range(3):
        got, got_s = step(got, got_s, x)
    np.testing.assert_allclose(got["w"], p["w"], rtol=1e-6)


class _TwoOfEach(eqx.Module):
    norms: list
    metrics: dict

    def __init__(self):
        self.norms = [es.nn.RunningNorm(3), es.nn.RunningNorm(4)]
        self.metrics = {
            "train": es.metrics.F1(3, average="macro"),
            "val": es.metrics.F1(3, average="macro"),
        }


class _WritesAnInt(es.metrics.Metric):
    total: es.MetricState = es.metrics.statistic("sum", shape=(), dtype=jnp.float32)

    def update(self, x):
        self.total[...] = jnp.int32(1)  # a dtype the cell refuses

    def compute(self):
        return self.total[...]


@pytest.mark.parametrize("runner", ["step", "scan", "apply", "make_apply"])
@pytest.mark.parametrize("mode", ["value", "ref"])
def test_an_error_inside_a_layer_names_which_layer_by_its_path(runner, mode):
    """Of two layers (or metrics) of one kind, the message says which one got the
    wrong input, on every runner: one rule where the runners name cells
    (`named_cells`), from the failing method's layer, instead of each layer's
    messages (only BatchNorm's named it, as `at ...`)."""
    model = _TwoOfEach()
    model = es.to_refs(model) if mode == "ref" else model
    x3, y = jnp.ones((4, 3)), jnp.zeros(4, jnp.int32)
    cases = {
        r"In `model\.norms\[1\]` \(RunningNorm\): RunningNorm\(shape=\(4,\)\) got": (
            lambda m, x: m.norms[1](x)
        ),
        r"In `model\.metrics\['val'\]` \(F1\): F1\(num_classes=3\) got logits": (
            lambda m, x: m.metrics["val"].update(jnp.ones((4, 2)), y)
        ),
    }
    for match, body in cases.items():

        def loss(m, x, body=body):
            body(m, x)
            return jnp.sum(x**2)

        step = es.make_step(loss, optax.sgd(0.1))
        call = {
            "step": lambda s=step: s(model, s.init(model), x3),
            "scan": lambda s=step: s.scan(model, s.init(model), x3[None]),
            "apply": lambda: es.apply(loss, model, x3),
            "make_apply": lambda: es.make_apply(loss)(model, x3),
        }[runner]
        with pytest.raises(es.EqxStateError, match=match) as info:
            call()
        assert str(info.value).count("In `") == 1  # named once, not per frame

    # an error that names its cell already is left as it is
    metric = _WritesAnInt()
    metric = es.to_refs(metric) if mode == "ref" else metric
    with pytest.raises(es.EqxStateError) as info:
        es.apply(lambda m, x: m["m"].update(x), {"m": metric}, x3)
    assert "cell at `model['m'].total`" in str(info.value)
    assert not str(info.value).startswith("In `")
