"""Recorders (`es.nn.Record`, `es.nn.Capture`, `es.recorded`): recorded statistics
equal float64 NumPy over the activations of a plain forward pass that returns them;
captures equal the intermediate of an uncaptured forward; both modes, make_step,
apply, es.vmap, scan over layers; reset, merge, inference mode, bad input."""

import inspect

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import eqx_state as es


BUILTINS = (
    "mean",
    "std",
    "rms",
    "min",
    "max",
    "max_abs",
    "zero_fraction",
    "nonfinite_fraction",
    "dead_fraction",
)
BINS, RANGE = 8, (-0.5, 1.5)


def _np_stats(chunks):
    """Float64 NumPy reference of every built-in statistic (and the histogram) over
    the recorded calls `chunks` (one `[batch, features]` array per call)."""
    chunks = [np.asarray(c, np.float64) for c in chunks]
    flat = np.concatenate([c.ravel() for c in chunks])
    return {
        "mean": flat.mean(),
        "std": flat.std(),
        "rms": np.sqrt(np.mean(flat**2)),
        "min": flat.min(),
        "max": flat.max(),
        "max_abs": np.abs(flat).max(),
        "zero_fraction": np.mean(flat == 0),
        "nonfinite_fraction": np.mean(~np.isfinite(flat)),
        # per call: the fraction of units <= 0 on every example; averaged over calls
        "dead_fraction": np.mean([np.mean(np.all(c <= 0, axis=0)) for c in chunks]),
        "hist": np.histogram(flat, bins=BINS, range=RANGE)[0],
    }


def _check(recorded, prefix, chunks, rtol=1e-5):
    want = _np_stats(chunks)
    for name, value in want.items():
        got = np.asarray(recorded[f"{prefix}.{name}"], np.float64)
        np.testing.assert_allclose(got, value, rtol=rtol, atol=1e-6, err_msg=name)


def _record():
    return es.nn.Record(*BUILTINS, hist=es.metrics.Histogram(BINS, range=RANGE))


class MLP(eqx.Module):
    layers: list
    recs: list
    cap: es.nn.Capture

    def __init__(self, sizes, batch, key):
        keys = jax.random.split(key, len(sizes) - 1)
        self.layers = [
            eqx.nn.Linear(a, b, key=k) for a, b, k in zip(sizes[:-1], sizes[1:], keys)
        ]
        self.recs = [_record() for _ in sizes[1:-1]]
        self.cap = es.nn.Capture((batch, sizes[1]))

    def forward(self, x):
        """The plain forward pass: the output and every hidden activation."""
        acts = []
        for lin in self.layers[:-1]:
            x = jax.nn.relu(jax.vmap(lin)(x))
            acts.append(x)
        return jax.vmap(self.layers[-1])(x), acts

    def __call__(self, x):
        for i, (lin, rec) in enumerate(zip(self.layers[:-1], self.recs)):
            x = rec(jax.nn.relu(jax.vmap(lin)(x)))
            if i == 0:
                x = self.cap(x)
        return jax.vmap(self.layers[-1])(x)


def _loss(model, x, y):
    return jnp.mean((model(x)[:, 0] - y) ** 2)


def _data(steps=3, batch=16, features=5, seed=1):
    kx, ky = jax.random.split(jax.random.key(seed))
    xs = jax.random.normal(kx, (steps, batch, features))
    ys = jax.random.normal(ky, (steps, batch))
    return xs, ys


@pytest.mark.parametrize("ref_mode", [False, True], ids=["value", "ref"])
def test_make_step_statistics_equal_numpy_over_the_activations(ref_mode):
    xs, ys = _data()
    model = MLP((5, 12, 12, 1), batch=16, key=jax.random.key(0))
    # a bias pushing some units below zero everywhere, so dead units exist
    model = eqx.tree_at(
        lambda m: m.layers[1].bias, model, model.layers[1].bias.at[:4].set(-50.0)
    )
    if ref_mode:
        model = es.to_refs(model)
    step = es.make_step(_loss, optax.sgd(0.05))
    opt_state = step.init(model)
    seen = [[], []]
    forward = eqx.filter_jit(lambda m, x: m.forward(x))
    for x, y in zip(xs, ys):
        _, acts = forward(es.freeze(model), x)  # the activations this step sees
        for s, a in zip(seen, acts):
            s.append(a)
        model, opt_state = step(model, opt_state, x, y)
    rec = es.recorded(model)
    assert sorted(rec) == sorted(
        [f"recs.{i}.{n}" for i in (0, 1) for n in (*BUILTINS, "hist")] + ["cap"]
    )
    for i in (0, 1):
        _check(rec, f"recs.{i}", seen[i])
    assert float(rec["recs.1.dead_fraction"]) >= 4 / 12  # the units pushed down
    # the capture holds the last step's first activation, exactly
    np.testing.assert_array_equal(rec["cap"], seen[0][-1])
    assert int(model.cap.count[...]) == 3
    assert step.trace_count == 1


@pytest.mark.parametrize("ref_mode", [False, True], ids=["value", "ref"])
def test_apply_and_capture_equal_the_uncaptured_forward(ref_mode):
    xs, _ = _data(steps=2)
    model = MLP((5, 12, 12, 1), batch=16, key=jax.random.key(3))
    if ref_mode:
        model = es.to_refs(model)
    call = es.make_apply(lambda m, x: m(x))
    outs, seen = [], []
    for x in xs:
        want_out, acts = eqx.filter_jit(lambda m, x: m.forward(x))(es.freeze(model), x)
        out, model = call(model, x)
        # recording does not change what the model computes
        np.testing.assert_array_equal(out, want_out)
        outs.append(acts)
        seen.append(acts[0])
    np.testing.assert_array_equal(model.cap.last, seen[-1])
    _check(es.recorded(model), "recs.0", [a[0] for a in outs])
    _check(es.recorded(model), "recs.1", [a[1] for a in outs])


def test_eager_ref_mode_records_in_place():
    rec = es.to_refs(_record())
    x1 = jnp.array([[0.0, -1.0, 2.0], [0.5, -3.0, 0.0]])
    x2 = jnp.array([[4.0, -2.0, 0.25]])
    assert rec(x1) is x1  # returns its input
    rec(x2)
    got = es.recorded(rec)
    for name, want in _np_stats([x1, x2]).items():
        np.testing.assert_allclose(got[name], want, rtol=1e-6, err_msg=name)


def test_python_numbers_are_recorded_and_lists_refused():
    """A Python number (a loss, a scalar) is a value, recorded as `jnp.asarray`
    reads it and returned as given; a list is refused as the layers refuse one."""
    rec = es.to_refs(es.nn.Record("mean", "max"))
    assert rec(1.5) == 1.5 and rec(-0.5) == -0.5 and rec(4) == 4
    got = es.recorded(rec)
    np.testing.assert_allclose(got["mean"], np.mean([1.5, -0.5, 4.0]), rtol=1e-7)
    np.testing.assert_allclose(got["max"], 4.0)
    cap = es.to_refs(es.nn.Capture(()))
    assert cap(2.5) == 2.5
    np.testing.assert_array_equal(cap.value[...], np.float32(2.5))
    for layer in (rec, cap):
        with pytest.raises(TypeError, match="expects a JAX or NumPy array"):
            layer([1.0, 2.0])


def test_streaming_statistics_over_many_calls_and_large_offsets():
    # Chan et al.'s merge: std of values with a large common offset stays accurate
    key = jax.random.key(0)
    chunks = [1e3 + jax.random.normal(k, (64, 8)) for k in jax.random.split(key, 5)]
    rec = es.to_refs(es.nn.Record("mean", "std"))
    for c in chunks:
        rec(c)
    want = np.concatenate([np.asarray(c, np.float64).ravel() for c in chunks])
    got = es.recorded(rec)
    np.testing.assert_allclose(got["mean"], want.mean(), rtol=1e-6)
    np.testing.assert_allclose(got["std"], want.std(), rtol=1e-3)


def test_mask_leaves_padding_out_even_nan():
    x = jnp.array([[1.0, -2.0], [3.0, 0.5], [jnp.nan, 99.0]])
    mask = jnp.array([True, True, False])
    rec = es.to_refs(_record())
    rec(x, mask=mask)
    got = es.recorded(rec)
    for name, want in _np_stats([x[:2]]).items():
        np.testing.assert_allclose(got[name], want, rtol=1e-6, err_msg=name)


def test_nan_and_inf_show_up():
    x = jnp.array([[1.0, jnp.nan], [jnp.inf, -2.0]])
    rec = es.to_refs(es.nn.Record("max_abs", "std", "nonfinite_fraction"))
    rec(x)
    got = es.recorded(rec)
    assert np.isnan(got["max_abs"]) and np.isnan(got["std"])
    assert float(got["nonfinite_fraction"]) == 0.5


def _np_nan_stats(chunks):
    """Float64 NumPy with NaN propagating (the reference for `zero_fraction` and
    `dead_fraction` on NaN activations): a NaN value is NaN in the per-value
    indicator, a unit with a NaN is NaN in the per-unit one."""
    chunks = [np.asarray(c, np.float64) for c in chunks]
    flat = np.concatenate([c.ravel() for c in chunks])
    zero = np.where(np.isnan(flat), np.nan, flat == 0)
    dead = [
        np.mean(np.where(np.isnan(c).any(0), np.nan, np.all(c <= 0, axis=0)))
        for c in chunks
    ]
    return {"zero_fraction": np.mean(zero), "dead_fraction": np.mean(dead),
            "mean": flat.mean(), "nonfinite_fraction": np.mean(~np.isfinite(flat))}  # fmt: skip


@pytest.mark.parametrize("ref_mode", [False, True], ids=["value", "ref"])
def test_zero_and_dead_fraction_propagate_nan(ref_mode):
    x1 = np.array([[0.0, -1.0, 2.0], [0.0, -3.0, 0.0]], np.float32)
    x2 = np.array([[-1.0, np.nan, 0.0], [-2.0, -1.0, 0.0]], np.float32)
    stats = ("zero_fraction", "dead_fraction", "mean", "nonfinite_fraction")

    def record(rec, chunks, mask=None):
        if ref_mode:
            rec = es.to_refs(rec)
            for c in chunks:
                rec(jnp.asarray(c), mask=mask)
            return rec

        def calls(rec):
            for c in chunks:
                rec(jnp.asarray(c), mask=mask)

        return es.apply(calls, rec)[1]

    rec = record(es.nn.Record(*stats), [x1])
    want = _np_nan_stats([x1])
    assert want["dead_fraction"] == 2 / 3 and want["zero_fraction"] == 0.5
    for name in stats:  # no NaN yet: numbers
        np.testing.assert_allclose(es.recorded(rec)[name], want[name], err_msg=name)
    rec = record(es.nn.Record(*stats), [x1, x2])
    want = _np_nan_stats([x1, x2])
    got = es.recorded(rec)
    for name in stats:
        np.testing.assert_allclose(got[name], want[name], err_msg=name)
    assert np.isnan(got["zero_fraction"]) and np.isnan(got["dead_fraction"])
    assert float(got["nonfinite_fraction"]) == pytest.approx(1 / 12)
    # masked out, the NaN row counts for nothing (the reference: the kept rows)
    mask = jnp.array([False, True])
    rec = record(es.nn.Record(*stats), [x2], mask=mask)
    got, want = es.recorded(rec), _np_nan_stats([x2[1:]])
    for name in stats:
        np.testing.assert_allclose(got[name], want[name], err_msg=name)
    assert not np.isnan(want["dead_fraction"])


def test_narrow_dtypes_are_recorded_in_float32():
    x = jax.random.normal(jax.random.key(0), (32, 16)).astype(jnp.bfloat16) * 300
    rec = es.to_refs(es.nn.Record("mean", "std", "rms", "max_abs"))
    rec(x)
    got = es.recorded(rec)
    assert all(v.dtype == jnp.float32 for v in got.values())
    want = _np_stats([np.asarray(x.astype(jnp.float32))])
    for name in ("mean", "std", "rms", "max_abs"):
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, err_msg=name)


def test_dead_fraction_of_a_feature_map_per_channel():
    # [N, C, H, W]: a channel is dead when it is <= 0 at every example and position
    x = np.random.default_rng(0).normal(size=(4, 6, 3, 3)).astype(np.float32)
    x[:, [1, 4]] = -np.abs(x[:, [1, 4]])
    x[2, 1, 0, 0] = 0.0
    rec = es.to_refs(es.nn.Record("dead_fraction", batch_axis=(0, 2, 3)))
    rec(jnp.asarray(x))
    want = np.mean(np.all(x <= 0, axis=(0, 2, 3)))
    assert float(es.recorded(rec)["dead_fraction"]) == pytest.approx(want)
    assert want == 2 / 6


def test_histogram_matches_numpy_with_weights_and_edges():
    values = np.array([-1.0, 0.0, 0.25, 0.5, 0.999, 1.0, 1.0, 2.0, np.nan], np.float32)
    weights = np.arange(1, 10).astype(np.float32)
    hist = es.to_refs(es.metrics.Histogram(4, range=(0.0, 1.0)))
    hist.update(jnp.asarray(values), sample_weight=jnp.asarray(weights))
    keep = ~np.isnan(values)
    want, edges = np.histogram(
        values[keep], bins=4, range=(0.0, 1.0), weights=weights[keep]
    )
    np.testing.assert_array_equal(hist.compute(), want)
    np.testing.assert_allclose(hist.edges, edges)
    assert float(hist.below[...]) == 1.0 and float(hist.above[...]) == 8.0


def test_histogram_bad_arguments():
    with pytest.raises(ValueError, match=r"Histogram: bins must be >= 1, got 0\."):
        es.metrics.Histogram(0, range=(0.0, 1.0))
    with pytest.raises(ValueError, match="finite with low < high"):
        es.metrics.Histogram(3, range=(1.0, 1.0))


def test_histogram_bins_of_a_wrong_type_is_a_type_error_as_in_numpy():
    # the class unwrapped: the test run's beartype hook would refuse 2.5 first
    init = inspect.unwrap(es.metrics.Histogram.__init__)
    for bins, numpy_error in ((2.5, TypeError), (True, None), ("4", None)):
        if numpy_error is not None:
            with pytest.raises(numpy_error):
                np.histogram([0.5], bins=bins, range=(0.0, 1.0))
        with pytest.raises(TypeError, match=r"Histogram: bins must be an int, got"):
            init(object.__new__(es.metrics.Histogram), bins, range=(0.0, 1.0))
    # NumPy integers are whole numbers: taken as they are, as by `np.histogram`
    hist = es.metrics.Histogram(np.int64(4), range=(0.0, 1.0))
    assert hist.bins == 4 and type(hist.bins) is int


# ---------------------------------------------------------------- per example


@pytest.mark.slow
def test_es_vmap_per_example_equals_the_whole_batch():
    x = jax.random.normal(jax.random.key(0), (8, 5)) - 0.3
    whole = es.to_refs(_record())
    whole(jax.nn.relu(x))

    per = es.nn.Record(
        *BUILTINS,
        hist=es.metrics.Histogram(BINS, range=RANGE, axis_name="b"),
        axis_name="b",
    )

    def f(rec, x):
        per_example = es.vmap(
            lambda r, xi: r(jax.nn.relu(xi)), in_axes=(None, 0), axis_name="b"
        )
        return per_example(rec, x)

    _, per = es.apply(f, per, x)
    got, want = es.recorded(per), es.recorded(whole)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, err_msg=name)


def test_capture_with_axis_name_gathers_the_examples():
    x = jax.random.normal(jax.random.key(0), (4, 3))
    cap = es.nn.Capture((4, 3), axis_name="b")
    _, cap = es.apply(
        lambda c, x: es.vmap(lambda c, xi: c(xi * 2), in_axes=(None, 0), axis_name="b")(
            c, x
        ),
        cap,
        x,
    )
    np.testing.assert_array_equal(cap.last, x * 2)


# ------------------------------------------------------------ scan over layers


class Block(eqx.Module):
    linear: eqx.nn.Linear
    act: es.nn.Record

    def __init__(self, key):
        self.linear = eqx.nn.Linear(6, 6, key=key)
        self.act = es.nn.Record("mean", "std", "dead_fraction")

    def __call__(self, x):
        return self.act(jax.nn.relu(jax.vmap(self.linear)(x)))


class Stacked(eqx.Module):
    blocks: Block
    head: eqx.nn.Linear

    def __call__(self, x):
        dynamic, static = eqx.partition(self.blocks, es.is_array_or_ref)

        def body(x, arrays):
            return eqx.combine(arrays, static)(x), x

        x, inputs = jax.lax.scan(body, x, dynamic)
        return jax.vmap(self.head)(x), inputs


class Listed(eqx.Module):
    blocks: list
    head: eqx.nn.Linear

    def __call__(self, x):
        for b in self.blocks:
            x = b(x)
        return jax.vmap(self.head)(x)


@pytest.mark.parametrize("ref_mode", [False, True], ids=["value", "ref"])
def test_scan_over_layers_records_each_layer(ref_mode):
    keys = jax.random.split(jax.random.key(0), 3)
    head = eqx.nn.Linear(6, 1, key=jax.random.key(2))
    stacked = Stacked(eqx.filter_vmap(Block)(keys), head)
    listed = Listed([Block(k) for k in keys], head)
    x = jax.random.normal(jax.random.key(1), (10, 6))
    if ref_mode:
        stacked, listed = es.to_refs(stacked), es.to_refs(listed)
    (_, inputs), stacked = es.apply(lambda m, x: m(x), stacked, x)
    _, listed = es.apply(lambda m, x: m(x), listed, x)
    got, other = es.recorded(stacked), es.recorded(listed)
    # the same names as a Python list of the same blocks, and the same values
    assert list(got) == list(other)
    assert list(got)[:3] == ["blocks.0.act.mean", "blocks.0.act.std",
                             "blocks.0.act.dead_fraction"]  # fmt: skip
    for k in got:
        np.testing.assert_allclose(got[k], other[k], rtol=1e-5, err_msg=k)
    # against numpy: layer i's activation is relu(linear_i(input_i))
    for i, key in enumerate(keys):
        lin = Block(key).linear
        act = np.asarray(jax.nn.relu(jax.vmap(lin)(inputs[i])), np.float64)
        np.testing.assert_allclose(got[f"blocks.{i}.act.mean"], act.mean(), rtol=1e-5)
        np.testing.assert_allclose(got[f"blocks.{i}.act.std"], act.std(), rtol=1e-5)
        np.testing.assert_allclose(
            got[f"blocks.{i}.act.dead_fraction"], np.mean(np.all(act <= 0, 0))
        )


def test_an_ensemble_reports_one_entry_per_member():
    recs = eqx.filter_vmap(lambda _: es.nn.Record("max"))(jnp.arange(2))
    xs = jnp.array([[1.0, 5.0], [-3.0, 2.0]])

    def call(recs, xs):
        dynamic, static = eqx.partition(recs, es.is_array_or_ref)
        return jax.vmap(lambda d, x: eqx.combine(d, static)(x))(dynamic, xs)

    _, recs = es.apply(call, recs, xs)
    # a recorder held by no module is the stack: its index follows its own path
    assert {k: float(v) for k, v in es.recorded({"members": recs}).items()} == {
        "members.0.max": 5.0,
        "members.1.max": 2.0,
    }
    assert {k: float(v) for k, v in es.recorded(recs).items()} == {
        "0.max": 5.0,
        "1.max": 2.0,
    }


class Narrow(eqx.Module):
    """A width-2 block: a linear layer whose output is recorded."""

    linear: eqx.nn.Linear
    rec: es.nn.Record

    def __init__(self, key):
        self.linear = eqx.nn.Linear(2, 2, key=key)
        self.rec = es.nn.Record("mean")

    def __call__(self, x, *, key=None):
        return self.rec(jax.vmap(self.linear)(x))


def _scan(stack, x):
    dynamic, static = eqx.partition(stack, es.is_array_or_ref)
    return jax.lax.scan(lambda x, a: (eqx.combine(a, static)(x), None), x, dynamic)[0]


def _hand_means(weights, biases, x):
    """The hand-written forward pass through width-2 linear layers, float64: the
    mean of every layer's output."""
    x, means = np.asarray(x, np.float64), []
    for w, b in zip(weights, biases):
        x = x @ np.asarray(w, np.float64).T + np.asarray(b, np.float64)
        means.append(x.mean())
    return means


class WithHead(eqx.Module):
    blocks: Narrow
    head: eqx.nn.Linear  # as wide as the stack is deep: every array leads with 2

    def __call__(self, x):
        return jax.vmap(self.head)(_scan(self.blocks, x))


@pytest.mark.parametrize("ref_mode", [False, True], ids=["value", "ref"])
def test_stacked_recorders_are_named_from_the_structure(ref_mode):
    """Names come from where the recorder sits, not from array shapes: a list of
    two stacks of two width-2 blocks (every array leads with 2), and one stack
    beside a head whose width equals the depth."""
    keys = jax.random.split(jax.random.key(0), 4)
    stacks = [eqx.filter_vmap(Narrow)(keys[:2]), eqx.filter_vmap(Narrow)(keys[2:])]
    x = jax.random.normal(jax.random.key(1), (3, 2))
    layers = [Narrow(k).linear for k in keys]  # the same layers, unstacked
    want = _hand_means([lin.weight for lin in layers], [lin.bias for lin in layers], x)
    if ref_mode:
        stacks = es.to_refs(stacks)

    def run(stacks, x):
        for stack in stacks:
            x = _scan(stack, x)
        return x

    _, stacks = es.apply(run, stacks, x)
    got = es.recorded(stacks)
    assert list(got) == ["0.0.rec.mean", "0.1.rec.mean", "1.0.rec.mean", "1.1.rec.mean"]
    for i, name in enumerate(got):  # stack i // 2, layer i % 2
        np.testing.assert_allclose(got[name], want[i], rtol=1e-5, err_msg=name)
    assert abs(want[1] - want[2]) > 1e-3  # swapped names would fail

    model = WithHead(
        eqx.filter_vmap(Narrow)(keys[:2]), eqx.nn.Linear(2, 2, key=keys[3])
    )
    if ref_mode:
        model = es.to_refs(model)
    _, model = es.apply(lambda m, x: m(x), model, x)
    got = es.recorded(model)
    assert list(got) == ["blocks.0.rec.mean", "blocks.1.rec.mean"]
    np.testing.assert_allclose([got["blocks.0.rec.mean"], got["blocks.1.rec.mean"]],
                               want[:2], rtol=1e-5)  # fmt: skip


class Features(eqx.Module):
    features: eqx.nn.Sequential

    def __call__(self, x):
        return self.features(x)


@pytest.mark.parametrize("ref_mode", [False, True], ids=["value", "ref"])
def test_recorded_names_are_the_state_dict_names(ref_mode):
    """One naming rule: `eqx.nn.Sequential` is named as `torch.nn.Sequential`
    (`features.2`, not `features.layers.2`) by both `es.state_dict` and
    `es.recorded`, and a stack of Sequentials as a list of them."""
    lin = eqx.nn.Linear(3, 4, key=jax.random.key(0))
    model = Features(
        eqx.nn.Sequential([
            es.nn.Batched(lin),
            es.nn.BatchNorm(4),
            es.nn.Record("mean"),
            eqx.nn.Lambda(jax.nn.relu),
            es.nn.Record("max"),
        ])
    )  # fmt: skip
    x = jax.random.normal(jax.random.key(1), (8, 3))
    if ref_mode:
        model = es.to_refs(model)
    _, model = es.apply(lambda m, x: m(x), model, x)
    got = es.recorded(model)
    assert list(got) == ["features.2.mean", "features.4.max"]
    names = list(es.state_dict(model))
    assert "features.0.weight" in names and "features.1.running_mean" in names
    # hand forward pass (float64): linear, batch norm in training mode
    h = np.asarray(x, np.float64) @ np.asarray(lin.weight, np.float64).T
    h = h + np.asarray(lin.bias, np.float64)
    h = (h - h.mean(0)) / np.sqrt(h.var(0) + 1e-5)
    np.testing.assert_allclose(got["features.2.mean"], h.mean(), atol=1e-5)
    np.testing.assert_allclose(got["features.4.max"], np.maximum(h, 0).max(), rtol=1e-5)

    # a stack of Sequentials, one recorder a field of a block inside: one stack,
    # named as a Python list of the Sequentials
    def layer(k):
        return eqx.nn.Sequential([Narrow(k), es.nn.Record("mean")])

    keys = jax.random.split(jax.random.key(2), 2)
    seq = {"blocks": eqx.filter_vmap(layer)(keys)}
    if ref_mode:
        seq = es.to_refs(seq)
    _, seq = es.apply(lambda s, x: _scan(s["blocks"], x), seq, x[:, :2])
    got = es.recorded(seq)
    assert list(got) == [
        "blocks.0.0.rec.mean", "blocks.1.0.rec.mean",
        "blocks.0.1.mean", "blocks.1.1.mean",
    ]  # fmt: skip
    lins = [Narrow(k).linear for k in keys]
    want = _hand_means([m.weight for m in lins], [m.bias for m in lins], x[:, :2])
    for i in (0, 1):  # both recorders of layer i see its output
        np.testing.assert_allclose(got[f"blocks.{i}.0.rec.mean"], want[i], rtol=1e-5)
        np.testing.assert_allclose(got[f"blocks.{i}.1.mean"], want[i], rtol=1e-5)


# --------------------------------------------------------- reading, resetting


def test_recorded_is_a_read_that_works_under_jit_and_in_the_loss():
    model = MLP((5, 8, 8, 1), batch=16, key=jax.random.key(0))
    xs, ys = _data(steps=2)

    def loss(m, x, y):
        m = es.reset(m, es.RecordState)  # per-step recordings
        return _loss(m, x, y), es.recorded(m)

    step = es.make_step(loss, optax.sgd(0.0), has_aux=True)
    opt_state = step.init(model)
    for x, y in zip(xs, ys):
        acts = model.forward(x)[1]
        model, opt_state, aux = step(model, opt_state, x, y)
        _check(aux, "recs.0", [acts[0]])  # only this step's activations
    eager = es.recorded(model)
    jitted = eqx.filter_jit(es.recorded)(model)
    assert sorted(eager) == sorted(jitted)
    for k in eager:
        np.testing.assert_array_equal(eager[k], jitted[k])


def test_reset_by_kind():
    class WithMetric(eqx.Module):
        rec: es.nn.Record
        cap: es.nn.Capture
        loss: es.metrics.Mean

    m = es.to_refs(
        WithMetric(es.nn.Record("mean", "max"), es.nn.Capture((2,)), es.metrics.Mean())
    )
    m.rec(jnp.array([1.0, 3.0]))
    m.cap(jnp.array([1.0, 3.0]))
    m.loss.update(jnp.array(7.0))
    m = es.reset(m)  # metrics only: recordings stay
    assert float(m.rec.read()["mean"]) == 2.0 and float(m.loss.weight[...]) == 0
    m = es.reset(m, es.RecordState)
    assert float(m.rec.read()["mean"]) == 0.0
    assert float(m.rec.read()["max"]) == -np.inf
    assert m.cap.last.tolist() == [0.0, 0.0] and int(m.cap.count[...]) == 0
    m.loss.update(jnp.array(7.0))
    m = es.reset(m, es.RecordState)  # recordings only: the metric stays
    assert float(m.loss.compute()) == 7.0
    # value mode: a new model with fresh cells
    v = es.freeze(m)
    v2 = es.reset(v, es.RecordState)
    assert v2 is not v and float(v2.rec.read()["mean"]) == 0.0


def test_merge_equals_one_recorder_over_all_the_data():
    a_x = jnp.array([[1.0, -2.0, 0.0]])
    b_x = jnp.array([[5.0, 0.5, -1.0], [2.0, 0.0, 0.0]])
    a, b, both = (es.to_refs(_record()) for _ in range(3))
    a(a_x)
    b(b_x)
    both(a_x)
    both(b_x)
    merged = a.merge(b)
    assert not isinstance(merged.metrics["mean"].total.value, jax.Ref)  # value mode
    got, want = es.recorded(merged), es.recorded(both)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-6, err_msg=k)
    for name, value in _np_stats([a_x, b_x]).items():
        np.testing.assert_allclose(got[name], value, rtol=1e-6, err_msg=name)
    with pytest.raises(ValueError, match="same statistics"):
        a.merge(es.nn.Record("mean"))


def test_merge_of_recorders_built_differently_says_what_differs():
    """Recorders differing in `dtype` or `batch_axis` used to be described by two
    identical strings (names and `axis_name` only)."""
    cases = [
        (
            es.nn.Record("max"),  # (a bfloat16 mean is refused: it accumulates)
            es.nn.Record("max", dtype=jnp.bfloat16),
            "`dtype` is dtype('float32') here and dtype(bfloat16) in the other",
        ),
        (
            es.nn.Record("dead_fraction", batch_axis=0),
            es.nn.Record("dead_fraction", batch_axis=1),
            "`batch_axis` is (0,) here and (1,) in the other",
        ),
        (
            es.nn.Record("mean"),
            es.nn.Record("mean", axis_name="i"),
            "`axis_name` is None here and 'i' in the other",
        ),
    ]
    with pytest.raises(ValueError, match="32 bits or more.*past 256"):
        es.nn.Record("mean", dtype=jnp.bfloat16)  # as the metrics refuse it
    for a, b, part in cases:
        with pytest.raises(ValueError, match="same statistics and options") as info:
            a.merge(b)
        assert part in str(info.value), str(info.value)
        assert isinstance(info.value, es.EqxStateError)
    with pytest.raises(TypeError, match="another Record, got a Mean"):
        es.nn.Record("mean").merge(es.metrics.Mean())  # type: ignore[arg-type]


# ----------------------------------------------------------- inference mode


def test_inference_mode_switches_recording_off_and_on():
    model = MLP((5, 8, 8, 1), batch=16, key=jax.random.key(0))
    xs, ys = _data(steps=2)
    step = es.make_step(_loss, optax.sgd(0.1))
    opt_state = step.init(model)
    model, opt_state = step(model, opt_state, xs[0], ys[0])
    before = es.recorded(model)
    off = es.inference_mode(model, only=es.nn.Recorder)
    assert all(r.inference for r in off.recs) and off.cap.inference
    off, opt_state = step(off, opt_state, xs[1], ys[1])
    after = es.recorded(off)
    for k in before:
        np.testing.assert_array_equal(after[k], before[k])
    # evaluation: an eager value-mode call records nothing and needs no apply
    ev = eqx.nn.inference_mode(off)
    np.testing.assert_array_equal(ev(xs[1]), ev.forward(xs[1])[0])
    # on again: records
    on = es.inference_mode(off, False, only=es.nn.Recorder)
    on, opt_state = step(on, opt_state, xs[1], ys[1])
    assert int(on.cap.count[...]) == 2
    # part of a model
    part = es.inference_mode(on, where=lambda m: m.recs[1])
    assert [r.inference for r in part.recs] == [False, True]


def test_eager_value_mode_write_says_what_to_do():
    rec = es.nn.Record("mean")
    with pytest.raises(es.StateWriteError, match="inference_mode"):
        rec(jnp.ones(3))
    with pytest.raises(es.StateWriteError, match="to_refs"):
        es.nn.Capture((3,))(jnp.ones(3))


# --------------------------------------------------------------- bad input


def test_constructor_errors():
    with pytest.raises(ValueError, match="at least one statistic"):
        es.nn.Record()
    with pytest.raises(ValueError, match="unknown statistic 'median'.*metric by name"):
        es.nn.Record("median")
    with pytest.raises(ValueError, match="given twice"):
        es.nn.Record("std", std=es.metrics.Mean())
    with pytest.raises(TypeError, match="must be a metric"):
        es.nn.Record(hist=np.histogram)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="dtype must be floating"):
        es.nn.Record("mean", dtype=jnp.int32)
    with pytest.raises(ValueError, match="non-negative"):
        es.nn.Capture((-1,))


def test_capture_shape_and_dtype_errors():
    cap = es.to_refs(es.nn.Capture((4, 3)))
    with pytest.raises(ValueError, match=r"shape=\(4, 3\).*shape \(2, 3\)"):
        cap(jnp.ones((2, 3)))
    with pytest.raises(ValueError, match="cannot hold exactly.*dtype=jnp.float32"):
        es.to_refs(es.nn.Capture((3,), jnp.bfloat16))(jnp.ones(3, jnp.float32))
    # a narrower float widens exactly
    cap(jnp.full((4, 3), 0.1, jnp.bfloat16))
    np.testing.assert_array_equal(cap.last, np.full((4, 3), 0.1, jnp.bfloat16))


def test_complex_values_are_refused_before_anything_is_written():
    """`Record("rms")` used to cast complex values to float32 (the RMS of the real
    parts) and `dead_fraction` compared them with 0; the statistics of real values
    refuse complex input, before any statistic of the call is written. The
    statistics of |x| and of flags take it, and equal NumPy's."""
    z = np.array([[1 + 5j, 0j, 2 - 3j], [3 + 1j, np.inf + 0j, -4 + 2j]])
    for real_only in ("mean", "std", "rms", "min", "max", "dead_fraction"):
        rec = es.to_refs(es.nn.Record("zero_fraction", real_only))
        with pytest.raises(TypeError, match="does not support complex") as info:
            rec(jnp.asarray(z, jnp.complex64))
        assert isinstance(info.value, es.EqxStateError)
        assert f"Record('{real_only}')" in str(info.value)
        # `zero_fraction` (first) was not written either: the check comes first
        assert float(rec.read()["zero_fraction"]) == 0.0
        assert float(rec.metrics["zero_fraction"].weight[...]) == 0.0
    rec = es.to_refs(es.nn.Record("max_abs", "zero_fraction", "nonfinite_fraction"))
    rec(jnp.asarray(z, jnp.complex64))
    got = rec.read()
    np.testing.assert_allclose(got["max_abs"], np.max(np.abs(z)))  # inf
    np.testing.assert_allclose(got["zero_fraction"], np.mean(z == 0))
    np.testing.assert_allclose(got["nonfinite_fraction"], np.mean(~np.isfinite(z)))


def test_dead_fraction_needs_a_batch_axis():
    rec = es.to_refs(es.nn.Record("dead_fraction"))
    with pytest.raises(ValueError, match="batch axes must be distinct axes"):
        rec(jnp.float32(1.0))


def test_custom_metric_and_tuple_results():
    rec = es.to_refs(es.nn.Record(moments=es.metrics.MeanStd(ddof=1)))
    rec(jnp.array([1.0, 2.0, 4.0]))
    got = es.recorded(rec)
    assert list(got) == ["moments.0", "moments.1"]
    np.testing.assert_allclose(got["moments.1"], np.std([1, 2, 4], ddof=1), rtol=1e-6)
    # the metric given is copied: the recorder does not consume it
    m = es.metrics.Mean()
    r = es.nn.Record(m=m)
    assert r.metrics["m"].total.value is not m.total.value
    assert isinstance(r.metrics["m"].total, es.RecordState)
    assert not isinstance(r.metrics["m"].total, es.MetricState)


@pytest.mark.slow
def test_checkpoint_round_trip(tmp_path):
    model = es.to_refs(MLP((5, 8, 8, 1), batch=4, key=jax.random.key(0)))
    x = jax.random.normal(jax.random.key(1), (4, 5))
    model(x)
    es.save(tmp_path / "m.eqxs", model)
    like = MLP((5, 8, 8, 1), batch=4, key=jax.random.key(0))
    loaded = es.load(tmp_path / "m.eqxs", like)
    want, got = es.recorded(model), es.recorded(loaded)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k])


@pytest.mark.slow
def test_dead_fraction_ignores_empty_and_masked_out_batches():
    rec = es.to_refs(es.nn.Record("dead_fraction", "mean"))
    x = jnp.array([[1.0, -1.0, 0.0, 2.0]])
    rec(x)  # units 1 and 2 dead: 0.5
    rec(jnp.zeros((0, 4)))  # no example: counts for nothing (not "all dead")
    rec(-jnp.ones((2, 4)), mask=jnp.array([False, False]))  # all masked out
    got = es.recorded(rec)
    assert float(got["dead_fraction"]) == 0.5
    assert float(got["mean"]) == 0.5
    # a partly masked batch: only the unmasked examples decide
    rec2 = es.to_refs(es.nn.Record("dead_fraction"))
    rec2(jnp.array([[-1.0, 3.0], [5.0, -2.0]]), mask=jnp.array([True, False]))
    assert float(es.recorded(rec2)["dead_fraction"]) == 0.5


def test_remat_records_once_per_call():
    # jax.checkpoint under grad re-runs the forward; the recording lands once
    class Remat(eqx.Module):
        lin: eqx.nn.Linear
        rec: es.nn.Record

        def __call__(self, x):
            arrays, static = eqx.partition(self, es.is_array_or_ref)

            def f(arrays, x):
                m = eqx.combine(arrays, static)
                return m.rec(jax.nn.relu(jax.vmap(m.lin)(x)))

            return jax.checkpoint(f)(arrays, x)

    model = Remat(eqx.nn.Linear(3, 4, key=jax.random.key(0)), es.nn.Record("mean"))
    x = jax.random.normal(jax.random.key(1), (5, 3))
    want = np.asarray(jax.nn.relu(jax.vmap(model.lin)(x)), np.float64).mean()
    step = es.make_step(lambda m, x: jnp.sum(m(x)), optax.sgd(0.0))
    model, _ = step(model, step.init(model), x)
    assert float(model.rec.metrics["mean"].weight[...]) == 5 * 4  # one call
    np.testing.assert_allclose(es.recorded(model)["rec.mean"], want, rtol=1e-6)


def test_identically_built_models_share_one_compilation():
    step = es.make_step(_loss, optax.sgd(0.1))
    xs, ys = _data(steps=1)
    for seed in range(2):
        model = MLP((5, 8, 8, 1), batch=16, key=jax.random.key(seed))
        step(model, step.init(model), xs[0], ys[0])
    assert step.trace_count == 1


def test_deepcopy_is_independent():
    import copy

    rec = es.to_refs(es.nn.Record("max"))
    rec(jnp.array([1.0]))
    other = copy.deepcopy(rec)
    other(jnp.array([5.0]))
    assert float(rec.read()["max"]) == 1.0 and float(other.read()["max"]) == 5.0


def test_filter_jit_apply_equals_make_apply():
    xs, _ = _data(steps=1)
    model = MLP((5, 8, 8, 1), batch=16, key=jax.random.key(0))
    _, a = eqx.filter_jit(lambda m, x: es.apply(lambda m, x: m(x), m, x))(model, xs[0])
    _, b = es.make_apply(lambda m, x: m(x), donate=False)(model, xs[0])
    ra, rb = es.recorded(a), es.recorded(b)
    for k in ra:
        np.testing.assert_array_equal(ra[k], rb[k])


# ------------------------------------------------------------ many steps a call


@pytest.mark.parametrize("ref_mode", [False, True], ids=["value", "ref"])
def test_step_scan_records_every_step(ref_mode):
    """`Step.scan`: K steps in one call record what K calls of the step record;
    with the per-step pattern (reset + `es.recorded` as aux) each step's entry is
    that step's statistics."""
    xs, ys = _data(steps=4)

    def fresh():  # ref-mode models are written in place: one per run
        model = MLP((5, 8, 8, 1), batch=16, key=jax.random.key(0))
        return es.to_refs(model) if ref_mode else model

    step = es.make_step(_loss, optax.sgd(0.05), donate=False)
    looped = fresh()
    opt_state = step.init(looped)
    seen = []
    for x, y in zip(xs, ys):
        seen.append(es.freeze(looped).forward(x)[1][0])
        looped, opt_state = step(looped, opt_state, x, y)
    want = es.recorded(looped)
    base = fresh()
    scanned, _ = step.scan(base, step.init(base), xs, ys)
    got = es.recorded(scanned)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6, err_msg=k)
    _check(got, "recs.0", seen)
    # `seen` is an eager forward: XLA's compiled step may contract a multiply-add
    # into one rounding (CPU-dependent), so the capture equals it to the last ulp
    np.testing.assert_allclose(got["cap"], seen[-1], rtol=1e-5, atol=1e-6)

    def per_step(m, x, y):
        m = es.reset(m, es.RecordState)
        return _loss(m, x, y), es.recorded(m)

    aux_step = es.make_step(per_step, optax.sgd(0.05), has_aux=True, donate=False)
    base = fresh()
    _, _, recorded = aux_step.scan(base, step.init(base), xs, ys)
    assert recorded["recs.0.std"].shape == (4,)
    for i, acts in enumerate(seen):
        row = {k: v[i] for k, v in recorded.items()}
        _check(row, "recs.0", [acts])


def test_owned_loop_records_like_the_step():
    xs, ys = _data(steps=3)

    def per_step(m, x, y):
        m = es.reset(m, es.RecordState)
        return _loss(m, x, y), es.recorded(m)

    model = MLP((5, 8, 8, 1), batch=16, key=jax.random.key(0))
    step = es.make_step(per_step, optax.sgd(0.05), has_aux=True)
    seen = []
    loop = step.own(model, step.init(model))
    for x, y in zip(xs, ys):
        recorded = loop(x, y)
        seen.append(recorded)
    model, _ = loop.release()
    final = es.recorded(model)
    for k in final:  # the model holds the last step's recordings
        np.testing.assert_array_equal(final[k], seen[-1][k])
