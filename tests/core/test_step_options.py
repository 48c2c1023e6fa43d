"""`make_step`'s options for the training-loop habits PyTorch users bring (issue
14): freezing (`trainable=`), the loss (`return_loss=`), the step count
(`es.step_count`), a ragged last batch, and errors that name the cell."""

import inspect
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import eqx_state as es


MODES = ["value", "ref"]


class Net(eqx.Module):
    body: eqx.nn.Linear
    bn: es.nn.BatchNorm
    head: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.body = eqx.nn.Linear(3, 6, key=k1)
        self.bn = es.nn.BatchNorm(6)
        self.head = eqx.nn.Linear(6, 2, key=k2)

    def __call__(self, x):
        return jax.vmap(self.head)(jax.nn.relu(self.bn(jax.vmap(self.body)(x))))


def loss_fn(model, x, y):
    return jnp.mean((model(x) - y) ** 2)


def data(n=5, batch=8):
    kx, ky = jax.random.split(jax.random.key(3))
    return jax.random.normal(kx, (n, batch, 3)), jax.random.normal(ky, (n, batch, 2))


def head_only(model):
    spec = jax.tree.map(lambda _: False, model)
    return eqx.tree_at(
        lambda m: m.head, spec, replace_fn=lambda h: jax.tree.map(lambda _: True, h)
    )


@pytest.mark.parametrize("mode", MODES)
def test_frozen_parameters_get_no_update_even_from_weight_decay(mode):
    """AdamW with weight decay and momentum: the frozen body is bit-for-bit
    unchanged; the head trains exactly as a hand-written loop that differentiates
    and updates the head only (BatchNorm statistics threaded by hand)."""
    xs, ys = data()
    opt = optax.adamw(1e-2, weight_decay=0.5)
    model = Net(jax.random.key(0))
    body_w = np.asarray(model.body.weight)
    step = es.make_step(loss_fn, opt, trainable=head_only(model))
    m = es.to_refs(model) if mode == "ref" else model
    opt_state = step.init(m)
    assert jax.tree.leaves(opt_state[0].mu)[0].shape == model.head.weight.shape
    assert len(jax.tree.leaves(opt_state[0].mu)) == 2  # the head's weight and bias
    for i in range(len(xs)):
        m, opt_state = step(m, opt_state, xs[i], ys[i])
    np.testing.assert_array_equal(m.body.weight, body_w)
    assert step.trace_count == 1

    # reference: plain JAX, the head as the only differentiated argument
    ref = Net(jax.random.key(0))
    head = ref.head
    ref_state = opt.init(head)
    mean, var = jnp.zeros(6), jnp.ones(6)

    @jax.jit
    def ref_step(head, ref_state, mean, var, x, y):
        def loss(head):
            z = jax.vmap(ref.body)(x)
            mu, v = jnp.mean(z, 0), jnp.var(z, 0)
            h = jax.nn.relu((z - mu) / jnp.sqrt(v + 1e-5) * ref.bn.weight + ref.bn.bias)
            return jnp.mean((jax.vmap(head)(h) - y) ** 2), (mu, jnp.var(z, 0, ddof=1))

        (_, (mu, uv)), g = jax.value_and_grad(loss, has_aux=True)(head)
        u, ref_state = opt.update(g, ref_state, head)
        return (
            eqx.apply_updates(head, u),
            ref_state,
            0.9 * mean + 0.1 * mu,
            0.9 * var + 0.1 * uv,
        )

    for i in range(len(xs)):
        head, ref_state, mean, var = ref_step(head, ref_state, mean, var, xs[i], ys[i])
    np.testing.assert_allclose(m.head.weight, head.weight, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(m.bn.running_mean[...], mean, rtol=1e-5, atol=1e-6)


def test_trainable_as_a_predicate_and_with_optax_wrappers():
    xs, ys = data()
    model = Net(jax.random.key(0))
    body_w = np.asarray(model.body.weight)

    opt = optax.MultiSteps(optax.inject_hyperparams(optax.adam)(learning_rate=1e-2), 2)
    # a predicate: train the 2-D weights except the body's (chosen by shape here)
    step = es.make_step(
        loss_fn, opt, trainable=lambda x: eqx.is_array(x) and x.shape != (6, 3)
    )
    opt_state = step.init(model)
    for i in range(4):
        model, opt_state = step(model, opt_state, xs[i], ys[i])
    np.testing.assert_array_equal(model.body.weight, body_w)
    assert int(es.step_count(opt_state)) == 2  # MultiSteps: 4 calls, 2 updates
    assert step.trace_count == 1


@pytest.mark.parametrize(
    "predicate",
    [
        lambda p: p > 0,
        lambda p: p.sum() > 0,
        lambda p: float(p.sum()) > 0,
        lambda p: np.asarray(p).sum() > 0,
    ],
    ids=["elementwise", "a reduction", "a Python float of it", "a NumPy copy"],
)
def test_a_predicate_of_the_values_is_refused_naming_the_rule(predicate):
    """A predicate that computes with a parameter's values selects differently at
    `init` (concrete) and in the step (traced): JAX's bare "truth value is
    ambiguous" or `TracerBoolConversionError` became an error naming the rule."""
    model = Net(jax.random.key(0))
    step = es.make_step(loss_fn, optax.sgd(0.1), trainable=predicate)
    with pytest.raises(TypeError, match=r"shape or dtype.*not on its values") as info:
        opt_state = step.init(model)
        xs, ys = data()
        step(model, opt_state, xs[0], ys[0])
    assert isinstance(info.value, es.EqxStateError)


def test_a_predicate_of_shapes_returning_numpy_bools_is_accepted():
    model = Net(jax.random.key(0))
    step = es.make_step(
        loss_fn, optax.adam(0.1), trainable=lambda p: np.asarray(p.ndim > 1)
    )
    mu = step.init(model)[0].mu  # Adam's moments: the matrices only
    assert {x.ndim for x in jax.tree.leaves(mu)} == {2}
    assert len(jax.tree.leaves(mu)) == len(
        [x for x in jax.tree.leaves(es.params(model)) if x.ndim > 1]
    )


def test_return_loss_is_the_loss_before_the_update():
    xs, ys = data()
    model = Net(jax.random.key(0))
    step = es.make_step(
        lambda m, x, y: (loss_fn(m, x, y), {"n": x.shape[0]}),
        optax.sgd(0.1),
        has_aux=True,
        return_loss=True,
    )
    # the loss of the model before the update (a training-mode call writes state:
    # evaluated on an identical model through es.apply)
    ref, _ = es.apply(loss_fn, Net(jax.random.key(0)), xs[0], ys[0])
    model, opt_state, loss, aux = step(model, step.init(model), xs[0], ys[0])
    np.testing.assert_allclose(loss, ref, rtol=1e-6)
    assert aux == {"n": 8}


@pytest.mark.parametrize(
    "make_opt, calls, want",
    [
        (lambda: optax.adam(1e-3), 3, 3),
        (lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3)), 3, 3),
        (lambda: optax.inject_hyperparams(optax.adam)(learning_rate=1e-3), 3, 3),
        (lambda: optax.MultiSteps(optax.adam(1e-3), 3), 6, 2),
        # counts that are not step counters are left out (adam's is read)
        (
            lambda: optax.chain(
                optax.adam(1e-3), optax.contrib.reduce_on_plateau(patience=1)
            ),
            3,
            3,
        ),
        (lambda: optax.chain(optax.apply_every(2), optax.adam(1e-3)), 3, 3),
    ],
    ids=[
        "adam",
        "chain",
        "inject_hyperparams",
        "MultiSteps",
        "reduce_on_plateau",
        "apply_every",
    ],
)
@pytest.mark.split
def test_step_count_reads_optax_counters(make_opt, calls, want):
    xs, ys = data(n=calls)
    model = Net(jax.random.key(0))
    step = es.make_step(loss_fn, make_opt())
    opt_state = step.init(model)
    for i in range(calls):
        model, opt_state = step(model, opt_state, xs[i], ys[i])
    assert int(es.step_count(opt_state)) == want


def test_step_count_without_a_counter_says_so():
    opt_state = optax.sgd(0.1).init({"w": jnp.ones(2)})
    with pytest.raises(ValueError, match="keeps no step counter"):
        es.step_count(opt_state)
    # reduce_on_plateau's `count` (losses towards its average, 0 again after each)
    # is no step counter: after 3 steps it is 0, and nothing else counts
    opt = optax.chain(optax.sgd(0.1), optax.contrib.reduce_on_plateau())
    params = {"w": jnp.ones(2)}
    opt_state = opt.init(params)
    for _ in range(3):
        _, opt_state = opt.update(params, opt_state, params, value=jnp.asarray(1.0))
    assert int(opt_state[1].count) == 0
    with pytest.raises(ValueError, match="keeps no step counter"):
        es.step_count(opt_state)


def test_a_ragged_last_batch_warns_once():
    xs, ys = data(n=3, batch=8)
    model = Net(jax.random.key(0))
    step = es.make_step(loss_fn, optax.sgd(0.1))
    opt_state = step.init(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for i in range(2):
            model, opt_state = step(model, opt_state, xs[i], ys[i])
    with pytest.warns(es.RecompileWarning, match="drop_last"):
        model, opt_state = step(model, opt_state, xs[2, :5], ys[2, :5])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per step
        model, opt_state = step(model, opt_state, xs[2, :3], ys[2, :3])
    assert step.trace_count == 3


def test_a_new_argument_dtype_warns_with_dtype_advice_not_batch_advice():
    """A scalar argument passed as float32, then as int32 (a step count, a
    temperature): the warning names the dtype change and how to keep one dtype;
    the short-batch advice (`drop_last`) is only for a change of lengths."""
    step = es.make_step(
        lambda m, x, t: jnp.mean(m(x) ** 2) * t, optax.sgd(0.1), donate=False
    )
    model = eqx.nn.Linear(2, 1, key=jax.random.key(0))
    state = step.init(model)
    x = jnp.ones(2)
    step(model, state, x, jnp.asarray(1.0, jnp.float32))
    with pytest.warns(es.RecompileWarning) as caught:
        step(model, state, x, jnp.asarray(2, jnp.int32))
    (message,) = [str(w.message) for w in caught]
    assert "((), 'float32') -> ((), 'int32')" in message
    assert "jnp.asarray(x, jnp.float32)" in message
    assert "drop_last" not in message
    # a change of rank is not a short batch either
    step2 = es.make_step(
        lambda m, x: jnp.mean(m(jnp.ravel(x)[:2]) ** 2), optax.sgd(0.1), donate=False
    )
    step2(model, step2.init(model), jnp.ones(2))
    with pytest.warns(es.RecompileWarning, match="number of axes") as caught:
        step2(model, step2.init(model), jnp.ones((3, 2)))
    assert "drop_last" not in str(caught[0].message)


def test_a_weak_type_change_warns_with_its_own_advice():
    """`jnp.asarray(0.5)` (weakly typed, as a Python number) then
    `jnp.float32(0.5)`: JAX compiles again (it keys programs on weak typing, which
    `jax.jit`'s own cache shows), so the warning says so instead of being silent."""
    step = es.make_step(
        lambda m, x, t: jnp.mean(m(x) ** 2) * t, optax.sgd(0.1), donate=False
    )
    model = eqx.nn.Linear(2, 1, key=jax.random.key(0))
    state = step.init(model)
    x = jnp.ones(2)
    step(model, state, x, jnp.asarray(0.5))
    with pytest.warns(es.RecompileWarning) as caught:
        step(model, state, x, jnp.float32(0.5))
    (message,) = [str(w.message) for w in caught]
    assert "((), 'float32 (weak)') -> ((), 'float32')" in message
    assert "weakly typed" in message and "jnp.asarray(x, jnp.float32)" in message
    assert "new dtype" not in message and "drop_last" not in message
    assert step.trace_count == 2
    # the reference: jax.jit itself compiles twice for the two kinds
    traces = []
    f = jax.jit(lambda t: traces.append(t) or t)
    f(jnp.asarray(0.5)), f(jnp.float32(0.5))
    assert len(traces) == 2


@pytest.mark.parametrize("mode", MODES)
def test_state_errors_name_the_cell_path_and_mode(mode):
    class Outer(eqx.Module):
        net: Net

    def bad_loss(model, x, y):
        model.net.bn.running_mean[...] = jnp.zeros(6, jnp.int32)  # a wrong dtype
        return loss_fn(model.net, x, y)

    xs, ys = data(n=1)
    model = Outer(Net(jax.random.key(0)))
    if mode == "ref":
        model = es.to_refs(model)
    step = es.make_step(bad_loss, optax.sgd(0.1))
    with pytest.raises(
        es.StateWriteError, match=rf"`model\.net\.bn\.running_mean` \({mode} mode\)"
    ):
        step(model, step.init(model), xs[0], ys[0])


@pytest.mark.parametrize("mode", MODES)
def test_owned_loop_equals_step_calls(mode):
    """`step.own` keeps the model as flat arrays between steps: the same results as
    calling the step, the handed-over model is consumed, and a change made after
    `release()` takes effect when the loop owns the model again."""
    xs, ys = data(n=6)
    opt = optax.inject_hyperparams(optax.adam)(learning_rate=1e-2)

    def fresh():
        m = Net(jax.random.key(0))
        return es.to_refs(m) if mode == "ref" else m

    step = es.make_step(loss_fn, opt, return_loss=True)
    model = fresh()
    opt_state = step.init(model)
    losses = []
    for i in range(6):
        if i == 3:
            opt_state.hyperparams["learning_rate"] = jnp.asarray(0.0, jnp.float32)
        model, opt_state, loss = step(model, opt_state, xs[i], ys[i])
        losses.append(float(loss))

    owned_step = es.make_step(loss_fn, opt, return_loss=True)
    m = fresh()
    s = owned_step.init(m)
    loop = owned_step.own(m, s)
    got = [float(loop(xs[i], ys[i])) for i in range(3)]
    if mode == "value":
        with pytest.raises(es.StaleModelError):
            owned_step(m, s, xs[0], ys[0])  # handed over, and consumed
    m, s = loop.release()
    with pytest.raises(es.StepError, match="released"):
        loop(xs[0], ys[0])
    s.hyperparams["learning_rate"] = jnp.asarray(0.0, jnp.float32)
    loop = owned_step.own(m, s)
    got += [float(loop(xs[i], ys[i])) for i in range(3, 6)]
    m, s = loop.release()
    np.testing.assert_allclose(got, losses, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(es.freeze(m)), jax.tree.leaves(es.freeze(model))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
    assert owned_step.trace_count == 1


def test_owned_loop_refuses_a_ref_set_into_a_hyperparameter():
    """A number slot of the owned carry set between calls is read into the loop's
    leaves; a ref put there (one of the model's cells') would sit at two carry
    positions, each writing it, one write lost. The loop checks its leaves again
    after such a change, as a call of the step does."""
    opt = optax.inject_hyperparams(optax.sgd)(learning_rate=0.0)
    step = es.make_step(loss_fn, opt)
    model = es.to_refs(Net(jax.random.key(0)))
    opt_state = step.init(model)
    loop = step.own(model, opt_state)
    xs, ys = data(n=2)
    loop(xs[0], ys[0])
    loop(xs[1], ys[1])  # the leaves the last call returned: not checked again
    opt_state.hyperparams["learning_rate"] = model.bn.num_batches_tracked.value
    with pytest.raises(es.StateError, match=r"same ref is .*num_batches_tracked"):
        loop(xs[0], ys[0])


def _mse_loss(model, x):
    return jnp.mean(jax.vmap(model)(x) ** 2)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"microbatches": 0}, es.EqxStateError, r"microbatches must be >= 1"),
        ({"bogus": 1}, TypeError, r"unexpected keyword argument `bogus`.*jax.jit"),
        (
            {"donate_argnums": (0,)},
            ValueError,
            r"set by the runner itself; use `donate=`",
        ),
        ({"static_argnums": (1,)}, ValueError, r"static already"),
        ({"scan_unroll": 0}, ValueError, r"scan_unroll"),
        ({"optimizer": None}, TypeError, r"optax optimizer"),
    ],
)
def test_a_wrong_option_is_refused_when_the_step_is_built(kwargs, error, match):
    """Each option is checked by `make_step` itself (one check, shared with
    `make_apply`), as an `EqxStateError` of the built-in type it stands for; they
    surfaced at the first call as bare `TypeError`s of Python or `jax.jit`, or as
    'a multiple of 1.5'. (Unwrapped: the test run's type-checking hook would refuse
    some of them first; those it refuses in every wrapper are run below as a user
    runs them.)"""
    make_step = inspect.unwrap(es.make_step)
    args = {"loss_fn": _mse_loss, "optimizer": optax.sgd(0.1)}
    args.update(kwargs)
    with pytest.raises(error, match=match) as info:
        make_step(args.pop("loss_fn"), args.pop("optimizer"), **args)
    assert isinstance(info.value, es.EqxStateError)
    if set(kwargs) & {"bogus", "donate_argnums", "scan_unroll"}:
        fn = lambda m, x: m(x)  # noqa: E731
        with pytest.raises(error, match=match):
            inspect.unwrap(es.make_apply)(fn, **kwargs)


def test_a_loss_that_is_not_floating_point_is_named():
    model = eqx.nn.Linear(2, 1, key=jax.random.key(0))
    step = es.make_step(lambda m, x: jnp.sum(x > 0), optax.sgd(0.1))
    with pytest.raises(es.StepError, match=r"floating-point loss, got dtype int32"):
        step(model, step.init(model), jnp.ones((4, 2)))


def test_a_malformed_trainable_filter_is_named():
    model = eqx.nn.Linear(2, 1, key=jax.random.key(0))
    step = es.make_step(_mse_loss, optax.sgd(0.1), trainable=3)
    with pytest.raises(
        es.EqxStateError, match=r"`trainable` must be None, a predicate"
    ):
        step(model, step.init(model), jnp.ones((4, 2)))


_WRONG_TYPES = """
import optax, eqx_state as es
for kwargs in ({"microbatches": 1.5}, {"has_aux": "yes"}, {"loss_fn": 3}):
    args = {"loss_fn": len, "optimizer": optax.sgd(0.1), **kwargs}
    try:
        es.make_step(args.pop("loss_fn"), args.pop("optimizer"), **args)
    except es.EqxStateError as e:
        print(type(e).__name__, isinstance(e, TypeError), e)
import numpy as np, jax.numpy as jnp, equinox as eqx, jax
model = eqx.nn.Linear(2, 1, key=jax.random.key(0))
step = es.make_step(lambda m, x: jnp.mean(jax.vmap(m)(x) ** 2), optax.sgd(0.1),
                    microbatches=np.int64(2), scan_unroll=np.int64(2), donate=np.False_)
step.scan(model, step.init(model), jnp.ones((2, 4, 2)))
print("NumPy integers and bools accepted")
"""


def test_a_wrong_option_type_is_refused_as_a_user_runs_it():
    """Without the test run's type-checking hook (which refuses these first); NumPy
    integers and bools, which worked before the options were checked, still do."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", _WRONG_TYPES],
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = out.stdout.splitlines()
    assert lines[3:] == ["NumPy integers and bools accepted"], out.stderr[-2000:]
    lines = lines[:3]
    assert all(line.startswith("StateTypeError True ") for line in lines), lines
    assert "microbatches must be an int" in lines[0]
    assert "`has_aux` must be True or False" in lines[1]
    assert "must be callable" in lines[2]


@pytest.mark.parametrize(
    "make_opt",
    [
        lambda: optax.adam(1e-3),
        lambda: optax.chain(optax.adam(1e-3), optax.scale_by_schedule(lambda n: 1.0)),
        lambda: optax.MultiSteps(optax.adam(1e-3), 2),
    ],
    ids=["adam", "chain", "MultiSteps"],
)
@pytest.mark.split
def test_step_count_of_a_consumed_state_raises_stale(make_opt):
    """`es.step_count(old_opt_state)` after a donating step used to return a
    deleted array (adam: `int(...)` then raised JAX's "Array has been deleted") or
    raise that bare RuntimeError (a chain comparing its counters); it raises
    `StaleModelError`, naming the leaf, and the returned state still counts."""
    xs, ys = data(n=2)
    model = Net(jax.random.key(0))
    step = es.make_step(loss_fn, make_opt())
    opt_state = step.init(model)
    model, new_state = step(model, opt_state, xs[0], ys[0])
    with pytest.raises(es.StaleModelError, match="donate=False") as info:
        es.step_count(opt_state)
    assert "The optimizer state holds an array" in str(info.value)
    assert "Consumed: `opt_state" in str(info.value)
    _, newer = step(model, new_state, xs[1], ys[1])
    want = 1 if isinstance(newer, optax.MultiStepsState) else 2
    assert int(es.step_count(newer)) == want
    # with donate=False the old state stays readable
    keep = es.make_step(loss_fn, make_opt(), donate=False)
    fresh = Net(jax.random.key(0))
    s0 = keep.init(fresh)
    keep(fresh, s0, xs[0], ys[0])
    assert int(es.step_count(s0)) == 0
