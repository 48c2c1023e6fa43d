"""`Step.scan` and `Apply.scan` (issue 16): K steps in one compiled call equal K
calls of the step — parameters, optimizer state and every kind of state cell — in
both modes, with microbatches, a frozen subset, and under `eqx.filter_vmap`."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import eqx_state as es


MODES = ["value", "ref"]
K = 6


class Net(eqx.Module):
    """Every kind of state a step writes: BatchNorm statistics, a counter, an RNG
    stream (Dropout), metrics and an EMA of the parameters."""

    lin1: eqx.nn.Linear
    bn: es.nn.BatchNorm
    drop: es.nn.Dropout
    lin2: eqx.nn.Linear
    steps: es.nn.Counter
    metrics: es.metrics.Metrics
    ema: es.nn.EMA

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        # no bias before BatchNorm: its gradient is zero up to round-off, which Adam
        # would amplify into noise that differs between vmapped and plain programs
        self.lin1 = eqx.nn.Linear(4, 8, use_bias=False, key=k1)
        self.bn = es.nn.BatchNorm(8)
        self.drop = es.nn.Dropout(0.2, key=7)
        self.lin2 = eqx.nn.Linear(8, 3, key=k2)
        self.steps = es.nn.Counter()
        self.metrics = es.metrics.Metrics(
            loss=es.metrics.Mean(), acc=es.metrics.Accuracy()
        )
        self.ema = es.nn.EMA((self.lin1, self.lin2), decay=0.9)

    def __call__(self, x):
        h = jax.nn.relu(self.bn(jax.vmap(self.lin1)(x)))
        return jax.vmap(self.lin2)(self.drop(h))


def loss_fn(model, x, y):
    logits = model(x)
    loss = jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, y))
    model.steps.increment()
    model.metrics["loss"].update(loss)
    model.metrics["acc"].update(logits, y)
    model.ema.update((model.lin1, model.lin2))
    return loss


def data(k=K, batch=16, seed=0):
    kx, ky = jax.random.split(jax.random.key(seed))
    return jax.random.normal(kx, (k, batch, 4)), jax.random.randint(
        ky, (k, batch), 0, 3
    )


def leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(es.freeze(tree))]


def assert_trees_close(a, b, rtol=1e-5, atol=1e-6):
    la, lb = leaves(a), leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        if np.issubdtype(x.dtype, np.inexact):
            np.testing.assert_allclose(x, y, rtol=rtol, atol=atol)
        else:
            np.testing.assert_array_equal(x, y)


def fresh(mode):
    model = Net(jax.random.key(0))
    return es.to_refs(model) if mode == "ref" else model


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "options",
    [
        {},
        {"microbatches": 2},
        {"trainable": lambda x: eqx.is_array(x) and x.ndim == 2},
        {"scan_unroll": 4},  # K = 6: an unrolled body and a remainder
        {"scan_unroll": True},
    ],
    ids=["plain", "microbatches", "frozen", "unroll4", "unrolled"],
)
def test_scan_equals_k_steps(mode, options):
    xs, ys = data()
    opt = optax.adamw(1e-2, weight_decay=0.1)
    step = es.make_step(loss_fn, opt, return_loss=True, **options)
    model, opt_state = fresh(mode), None
    opt_state = step.init(model)
    losses = []
    for i in range(K):
        model, opt_state, loss = step(model, opt_state, xs[i], ys[i])
        losses.append(float(loss))

    scan_step = es.make_step(loss_fn, opt, return_loss=True, **options)
    m2 = fresh(mode)
    s2 = scan_step.init(m2)
    m2, s2, scan_losses = scan_step.scan(m2, s2, xs, ys)
    np.testing.assert_allclose(scan_losses, losses, rtol=1e-5)
    assert_trees_close((m2, s2), (model, opt_state))
    assert int(m2.steps.value) == K * options.get("microbatches", 1)
    assert scan_step.trace_count == 1


def test_scan_compiles_once_per_k_and_donates():
    xs, ys = data(k=12)
    step = es.make_step(loss_fn, optax.sgd(0.1))
    model = fresh("value")
    opt_state = step.init(model)
    for _ in range(2):
        old = model
        model, opt_state = step.scan(model, opt_state, xs[:4], ys[:4])
    assert step.trace_count == 1
    with pytest.raises(es.StaleModelError):
        step.scan(old, opt_state, xs[:4], ys[:4])
    model, opt_state = step.scan(model, opt_state, xs, ys)  # K = 12
    assert step.trace_count == 2
    assert int(model.steps.value) == 4 + 4 + 12


def test_scan_under_filter_vmap_trains_an_ensemble():
    xs, ys = data()
    step = es.make_step(loss_fn, optax.adam(1e-2))
    keys = jax.random.split(jax.random.key(0), 3)
    models = eqx.filter_vmap(Net)(keys)
    states = eqx.filter_vmap(step.init)(models)
    in_axes = (eqx.if_array(0), eqx.if_array(0), None, None)
    models, states = eqx.filter_vmap(step.scan, in_axes=in_axes)(models, states, xs, ys)
    # member 1 alone, K single steps
    solo = Net(keys[1])
    solo_state = step.init(solo)
    for i in range(K):
        solo, solo_state = step(solo, solo_state, xs[i], ys[i])
    member = jax.tree.map(lambda x: x[1] if eqx.is_array(x) else x, models)
    assert_trees_close(member, solo)


def test_scan_needs_stacked_array_arguments():
    xs, ys = data()
    step = es.make_step(loss_fn, optax.sgd(0.1))
    model = fresh("value")
    with pytest.raises(es.StepError, match="leading axis"):
        step.scan(model, step.init(model), xs, ys[:3])


@pytest.mark.parametrize("mode", MODES)
def test_apply_scan_updates_metrics_per_batch(mode):
    """An evaluation loop in one compiled call; reference: numpy over all batches."""
    xs = jax.random.normal(jax.random.key(2), (5, 7, 3))
    ys = jax.random.randint(jax.random.key(3), (5, 7), 0, 3)
    metrics = es.metrics.Metrics(acc=es.metrics.Accuracy(), mean=es.metrics.Mean())
    metrics = es.to_refs(metrics) if mode == "ref" else metrics

    def evaluate(m, x, y):
        m["acc"].update(x, y)
        m["mean"].update(x)
        return jnp.max(x)

    run = es.make_apply(evaluate)
    maxima, metrics = run.scan(metrics, xs, ys)
    np.testing.assert_allclose(maxima, np.asarray(xs).max(axis=(1, 2)))
    out = metrics.compute()
    want_acc = np.mean(np.asarray(xs).argmax(-1) == np.asarray(ys))
    np.testing.assert_allclose(out["acc"], want_acc, rtol=1e-6)
    np.testing.assert_allclose(
        out["mean"], np.asarray(xs, np.float64).mean(), rtol=1e-5
    )
    assert run.trace_count == 1


def test_scan_carries_state_in_place():
    """The stacked batch is the only memory a scan adds: the compiled program's
    temporaries do not grow with K (no per-step copy of the model or the optimizer
    state)."""
    step = es.make_step(loss_fn, optax.adam(1e-2))
    model = fresh("value")
    opt_state = step.init(model)
    temps = []
    for k in (4, 32):
        xs, ys = data(k=k)
        mem = step._scan.lower((model, opt_state), (xs, ys), {}).compile()
        temps.append(mem.memory_analysis().temp_size_in_bytes)
    assert temps[1] <= temps[0] * 1.1 + 4096, temps


@pytest.mark.parametrize("weak", ["parameter", "learning_rate"])
def test_scan_of_a_carry_whose_weak_type_changes_equals_k_steps(weak):
    """adam returns a weakly typed parameter (`jnp.asarray(1.3)`) strongly typed, and
    `inject_hyperparams` a weakly typed learning rate (`jnp.asarray(0.1)`, what
    users write) strongly typed: K separate steps compute the later steps with the
    strong type (checked against an `eqx.filter_jit` loop). A scan's carry keeps one
    type, so `scan` runs the first step on its own and scans the others: the same
    K steps, bit for bit, and nothing is refused (K = 1 and K = 3)."""

    class Scale(eqx.Module):
        a: jax.Array

        def __call__(self, x):
            return self.a * x

    def loss(m, x):
        return jnp.mean((m(x).astype(jnp.float32) - 1.0) ** 2)

    xs = jnp.stack([(jnp.arange(1, 9.0) / 7).astype(jnp.bfloat16)] * 3)
    opt = optax.inject_hyperparams(optax.adam)(learning_rate=0.1)

    def fresh():
        if weak == "parameter":
            model = Scale(jnp.asarray(1.3))
            return model, opt.init(model)
        model = Scale(jnp.asarray(1.3, jnp.float32))
        state = opt.init(model)
        state.hyperparams["learning_rate"] = jnp.asarray(0.05)
        return model, state

    model, state = fresh()
    changing = model.a if weak == "parameter" else state.hyperparams["learning_rate"]
    assert changing.weak_type

    @eqx.filter_jit
    def ref_step(m, s, x):
        value, g = eqx.filter_value_and_grad(loss)(m, x)
        u, s = opt.update(g, s, m)
        return eqx.apply_updates(m, u), s, value

    for k in (1, 3):
        ref, ref_s = fresh()
        ref_losses = []
        for x in xs[:k]:
            ref, ref_s, value = ref_step(ref, ref_s, x)
            ref_losses.append(value)
        step = es.make_step(loss, opt, return_loss=True)
        got, got_s, losses = step.scan(*fresh(), xs[:k])
        np.testing.assert_array_equal(np.asarray(got.a), np.asarray(ref.a))
        np.testing.assert_array_equal(np.asarray(losses), np.stack(ref_losses))
        assert not got.a.weak_type and not got_s.hyperparams["learning_rate"].weak_type


@pytest.mark.parametrize("mode", MODES)
def test_a_weak_learning_rate_set_before_every_scan_is_traced_once(mode):
    """A weakly typed learning rate (`jnp.asarray(lr)`) set before every
    `step.scan`: the scan's trace refuses that carry type (the first call runs on
    its own, `NeedsFirstCall`), and the refusal was not kept, so every call traced
    the scan again (about 60x a call, and no warning). It is kept for those input
    types: the loss is traced a fixed number of times over 6 calls, not once
    more per call. Reference: an `eqx.filter_jit` loop of optax's own update with
    the same learning rates, bit for bit, and K `step` calls."""
    traces = []

    def loss(m, x):
        traces.append(None)
        return jnp.mean((m(x) - 1.0) ** 2)

    opt = optax.inject_hyperparams(optax.adam)(learning_rate=1e-2)

    def fresh():
        model = eqx.nn.Sequential(
            [
                es.nn.Batched(eqx.nn.Linear(4, 8, key=jax.random.key(0))),
                es.nn.BatchNorm(8),
                es.nn.Batched(eqx.nn.Linear(8, 1, key=jax.random.key(1))),
            ]
        )
        return es.to_refs(model) if mode == "ref" else model

    @eqx.filter_jit
    def ref_step(m, s, x):  # optax's own update; the statistics through es.apply
        state, p = eqx.partition(m, es.is_state, is_leaf=es.is_state)

        def f(p):
            return es.apply(loss, eqx.combine(p, state, is_leaf=es.is_state), x)

        (_, new), g = eqx.filter_value_and_grad(f, has_aux=True)(p)
        u, s = opt.update(g, s, p)
        new_state = eqx.filter(new, es.is_state, is_leaf=es.is_state)
        return eqx.combine(eqx.apply_updates(p, u), new_state, is_leaf=es.is_state), s

    xs = jax.random.normal(jax.random.key(2), (6, 3, 16, 4))
    step = es.make_step(loss, opt)
    model = fresh()
    state = step.init(model)
    stepped = fresh()
    stepped_s = step.init(stepped)
    counts = []
    for j, batch in enumerate(xs):
        lr = jnp.asarray(1e-2 / (j + 1))
        assert lr.weak_type
        state.hyperparams["learning_rate"] = lr
        model, state = step.scan(model, state, batch)
        counts.append(len(traces))
        for x in batch:  # the same K calls of the step
            stepped_s.hyperparams["learning_rate"] = lr
            stepped, stepped_s = step(stepped, stepped_s, x)
    assert counts[-1] == counts[1], counts  # no trace after the second call
    for a, b in zip(jax.tree.leaves(model), jax.tree.leaves(stepped), strict=True):
        a, b = (x[...] if isinstance(x, jax.Ref) else x for x in (a, b))
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # against optax's own update in a hand-written loop (value mode)
    ref = fresh()
    ref = es.freeze(ref) if mode == "ref" else ref
    ref_s = opt.init(es.params(ref))
    for j, batch in enumerate(xs):
        for x in batch:
            ref_s.hyperparams["learning_rate"] = jnp.asarray(1e-2 / (j + 1))
            ref, ref_s = ref_step(ref, ref_s, x)
    got = es.freeze(model) if mode == "ref" else model
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)


def test_a_scan_whose_carry_changes_dtype_every_step_equals_k_steps():
    """A carry with a weakly typed leaf and a leaf whose dtype flips every step
    (one scan cannot carry it): K step calls take it (each call compiles for the
    types it is given), so `step.scan` makes the same K calls: the first on its
    own, and, as the types keep changing, the others one by one. (It raised "changed
    the dtype" before, as did an optimizer whose bfloat16 moment a float32
    hyperparameter promotes after the first step.) Reference: K calls of `step` on
    an identical ref-mode model, and what the optimizer's own rule gives."""
    base = optax.sgd(0.1)

    def init(p):
        return (jnp.asarray(1.0), jnp.zeros((), jnp.float32), base.init(p))

    def update(g, s, p=None):
        u, b = base.update(g, s[2], p)
        flipped = jnp.float16 if s[1].dtype == jnp.float32 else jnp.float32
        return u, (s[0] + jnp.ones((), jnp.float32), s[1].astype(flipped), b)

    def fresh():
        return es.to_refs(
            eqx.nn.Sequential(
                [
                    es.nn.Batched(eqx.nn.Linear(2, 3, key=jax.random.key(0))),
                    es.nn.BatchNorm(3),
                ]
            )
        )

    step = es.make_step(
        lambda m, x: jnp.mean(m(x) ** 2), optax.GradientTransformation(init, update)
    )
    xs = jax.random.normal(jax.random.key(1), (3, 8, 2))
    model = fresh()
    model, opt_state = step.scan(model, step.init(model), xs)
    ref = fresh()
    ref_state = step.init(ref)
    for x in xs:
        ref, ref_state = step(ref, ref_state, x)
    assert float(opt_state[0]) == 4.0 and opt_state[1].dtype == jnp.float16
    assert int(model[1].num_batches_tracked[...]) == 3
    for a, b in zip(jax.tree.leaves(model), jax.tree.leaves(ref), strict=True):
        a, b = (x[...] if isinstance(x, jax.Ref) else x for x in (a, b))
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_bfloat16_moment_promoted_by_a_hyperparameter_scans_like_a_hand_loop():
    """`optax.inject_hyperparams(optax.adam)` keeps its hyperparameters in float32,
    so the first update turns Adam's moment of a bfloat16 weight into float32. K
    step calls take that; `step.scan` refused it ("changed the dtype"). It now
    equals a hand-written `jax.jit` optax loop bit for bit."""

    class M(eqx.Module):
        a: jax.Array
        w: jax.Array

    def loss(m, x):
        return jnp.mean((m.a * x @ m.w - 1.0) ** 2)

    def fresh():
        return M(jnp.asarray(1.5), jnp.linspace(0.1, 0.5, 4, dtype=jnp.bfloat16))

    xs = jax.random.normal(jax.random.key(0), (5, 3, 4))
    opt = optax.inject_hyperparams(optax.adam)(learning_rate=0.05)

    @jax.jit
    def hand(p, s, x):
        value, g = jax.value_and_grad(loss)(p, x)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s, value

    p, s = fresh(), opt.init(fresh())
    losses = []
    for x in xs:
        p, s, value = hand(p, s, x)
        losses.append(value)
    assert s.inner_state[0].mu.w.dtype == jnp.float32  # promoted
    step = es.make_step(loss, opt, return_loss=True)
    model = fresh()
    model, opt_state, got = step.scan(model, step.init(model), xs)
    np.testing.assert_array_equal(np.asarray(got), np.stack(losses))
    assert model.w.dtype == jnp.bfloat16
    np.testing.assert_array_equal(
        np.asarray(model.w, np.float32), np.asarray(p.w, np.float32)
    )
    np.testing.assert_array_equal(np.asarray(model.a), np.asarray(p.a))
