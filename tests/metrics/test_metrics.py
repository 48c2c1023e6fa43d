"""Metrics against scikit-learn and numpy, in both storage modes; masks and weights;
empty inputs; merge/reduce (vmap in-process, shard_map on 4 CPU devices in a
subprocess); metrics inside `make_step`; reset; the `Metrics` collection; the
docstring examples and the training example."""

import json
import os
import re
import subprocess
import sys
import textwrap

import equinox as eqx
import jax
import jax.numpy as jnp
import jaxtyping
import numpy as np
import optax
import pytest
import sklearn.metrics as skm

import eqx_state as es
from eqx_state import metrics as esm


MODES = ["value", "ref"]
C = 6  # classes in the classification tests


def _update(metric, args, kwargs):
    """`metric.update(*args, **kwargs)`; for a `Metrics` collection, the same
    arguments go to every member."""
    members = (
        list(metric.metrics.values()) if isinstance(metric, esm.Metrics) else [metric]
    )
    for m in members:
        m.update(*args, **kwargs)


@eqx.filter_jit
def _update_value_mode(metric, args, kwargs):
    return es.apply(_update, metric, args, kwargs)[1]


def run(metric, mode, batches):
    """Update `metric` with each `(args, kwargs)` batch: in value mode through a jitted
    `es.apply`, in ref mode eagerly in place."""
    if mode == "ref":
        metric = es.to_refs(metric)
        for args, kwargs in batches:
            _update(metric, args, kwargs)
        return metric
    for args, kwargs in batches:
        metric = _update_value_mode(metric, args, kwargs)
    return metric


N = 48  # examples in each comparison; always the same batches, so that jitted
# (value mode) and eager (ref mode) updates compile for a few shapes only. Arbitrary
# splits and merge groupings are covered by tests/test_metrics_properties.py.
PARTS = [slice(0, 20), slice(20, 20), slice(20, N)]  # one batch is empty


def batches_of(args, **kwargs):
    """Cut every array in `args` / `kwargs` into the `PARTS` batches."""
    return [
        (
            tuple(jnp.asarray(a[s]) for a in args),
            {k: jnp.asarray(v[s]) for k, v in kwargs.items()},
        )
        for s in PARTS
    ]


def close(a, b, rtol=1e-5, atol=1e-6):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=atol)


# --------------------------------------------------------------- numeric metrics


@pytest.mark.parametrize("mode", MODES)
def test_mean_and_sum_match_numpy(mode):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(N, 3)).astype(np.float32)
    w = rng.uniform(0.1, 2.0, size=N).astype(np.float32)
    mask = rng.random(N) < 0.7
    x[~mask] = np.nan  # padding: must contribute nothing
    kept, wk = x[mask], np.repeat(w[mask][:, None], 3, axis=1)

    plain = run(
        esm.Metrics(mean=esm.Mean(), sum=esm.Sum()), mode, batches_of((x,), mask=mask)
    )
    # per-row weights, broadcast over the 3 values of each row
    weighted = esm.Metrics(mean=esm.Mean(), sum=esm.Sum())
    weighted = run(weighted, mode, batches_of((x,), mask=mask, sample_weight=w))
    out, out_w = plain.compute(), weighted.compute()
    close(out["mean"], kept.mean())
    close(out["sum"], kept.sum(), rtol=1e-5)
    close(out_w["mean"], np.average(kept, weights=wk))
    close(out_w["sum"], (kept * wk).sum(), rtol=1e-5)


@pytest.mark.parametrize("mode", MODES)
def test_mean_std_matches_numpy(mode):
    rng = np.random.default_rng(1)
    x = (rng.normal(size=N) * 3 + 100).astype(np.float32)  # offset: tests stability
    freq = rng.integers(0, 4, size=N)  # integer frequency weights, some 0
    mask = rng.random(N) < 0.8
    ms = esm.Metrics(pop=esm.MeanStd(), sample=esm.MeanStd(ddof=1))
    masked = run(ms, mode, batches_of((x,), mask=mask)).compute()
    weighted = run(ms, mode, batches_of((x,), sample_weight=freq)).compute()
    rep = np.repeat(x, freq)
    for out, data in [(masked, x[mask]), (weighted, rep)]:
        for name, ddof in [("pop", 0), ("sample", 1)]:
            mean, std = out[name]
            close(mean, data.mean(), rtol=1e-6)
            close(std, data.std(ddof=ddof), rtol=1e-4)


@pytest.mark.parametrize("mode", MODES)
def test_min_max_last_value_match_numpy(mode):
    rng = np.random.default_rng(2)
    x = rng.normal(size=(N, 2)).astype(np.float32)
    mask = rng.random(N) < 0.6
    mask[-1] = False  # the last row is padding: LastValue must skip it
    ms = esm.Metrics(min=esm.Min(), max=esm.Max(), last=esm.LastValue(shape=(2,)))
    out = run(ms, mode, batches_of((x,), mask=mask)).compute()
    close(out["min"], x[mask].min(), rtol=0)
    close(out["max"], x[mask].max(), rtol=0)
    close(out["last"], x[mask][-1], rtol=0)
    # one scalar at a time, a masked-out one last
    scalars = [((jnp.float32(v),), {}) for v in x[:5, 0]]
    scalars.append(((jnp.float32(7.0),), {"mask": jnp.asarray(False)}))
    close(run(esm.LastValue(), mode, scalars).compute(), x[4, 0], rtol=0)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "dtype", [jnp.float32, jnp.bfloat16, jnp.float16, jnp.float4_e2m1fn]
)
def test_last_value_keeps_a_signed_zero(mode, dtype):
    # the last value of a batch as NumPy indexes it, bit for bit: -0.0 stays -0.0
    # and +0.0 stays +0.0 (a masked sum with +0.0 elsewhere gave +0.0 for -0.0)
    batch = np.array([[3.0, -0.0, 0.0], [1.0, -0.0, -0.0], [5.0, 7.0, 0.0]])
    for rows, mask in ((batch[:2], None), (batch, np.array([1, 1, 0], bool))):
        x = jnp.asarray(rows, dtype)
        kwargs = {} if mask is None else {"mask": jnp.asarray(mask)}
        got = np.asarray(
            run(esm.LastValue((3,), dtype=dtype), mode, [((x,), kwargs)]).compute()
        )
        want = np.asarray(x)[1]
        assert got.tobytes() == want.tobytes(), (got, want)
    # and over a named axis, where the members' values are gathered (`_gather`):
    # the last member's -0.0 on every member

    def member(v):
        m = es.to_refs(esm.LastValue((), axis_name="i", dtype=dtype))
        m.update(v)
        return m.compute()

    vals = jnp.asarray([1.0, -0.0], dtype)
    out = np.asarray(jax.vmap(member, axis_name="i")(vals))
    want = np.asarray(vals[1:]).repeat(2)
    assert out.tobytes() == want.tobytes(), (out, want)


# ---------------------------------------------------------- classification metrics


def class_data(rng, n=N):
    """Labels in {0, 1, 2, 4}, predictions (argmax of logits) in {0, 1, 2, 3}: class 3
    is predicted but never true, class 4 true but never predicted, class 5 absent."""
    labels = rng.choice([0, 1, 2, 4], size=n)
    logits = rng.normal(size=(n, C)).astype(np.float32)
    logits[:, 4:] -= 10.0  # never the argmax
    logits[rng.random(n) < 0.5, 3] -= 10.0
    # make about half the predictions right
    right = rng.random(n) < 0.5
    logits[right & (labels < 4), labels[right & (labels < 4)]] += 10.0
    w = rng.uniform(0.5, 2.0, size=n).astype(np.float32)
    return logits, labels, w


@pytest.mark.parametrize("mode", MODES)
def test_accuracy_matches_sklearn(mode):
    rng = np.random.default_rng(3)
    logits, labels, w = class_data(rng)
    mask = rng.random(N) < 0.8
    accs = esm.Metrics({f"top{k}": esm.Accuracy(top_k=k) for k in (1, 2, 3)})
    masked = run(accs, mode, batches_of((logits, labels), mask=mask)).compute()
    weighted = run(accs, mode, batches_of((logits, labels), sample_weight=w)).compute()
    for k in (1, 2, 3):
        want = skm.top_k_accuracy_score(
            labels[mask], logits[mask], k=k, labels=range(C)
        )
        close(masked[f"top{k}"], want)
        want = skm.top_k_accuracy_score(
            labels, logits, k=k, labels=range(C), sample_weight=w
        )
        close(weighted[f"top{k}"], want)
    close(masked["top1"], skm.accuracy_score(labels[mask], logits[mask].argmax(-1)))
    # from predicted labels
    preds = logits.argmax(-1)
    got = run(
        esm.Accuracy(), mode, batches_of((preds, labels), sample_weight=w)
    ).compute()
    close(got, skm.accuracy_score(labels, preds, sample_weight=w))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("average", ["micro", "macro", "weighted", None])
@pytest.mark.split(every=4)
def test_precision_recall_f1_match_sklearn(mode, average):
    rng = np.random.default_rng(7)
    logits, labels, w = class_data(rng)
    preds = logits.argmax(-1)
    assert 3 in preds and 3 not in labels and 4 in labels and 4 not in preds
    prf = esm.Metrics(
        p=esm.Precision(C, average=average),
        r=esm.Recall(C, average=average),
        f=esm.F1(C, average=average),
    )
    # average=None: sklearn's per-class scores over all classes
    sk_labels = range(C) if average is None else None
    for x, sw in [(logits, None), (preds, w)]:  # from logits / from predicted labels
        kw = {} if sw is None else {"sample_weight": sw}
        out = run(prf, mode, batches_of((x, labels), **kw)).compute()
        p, r, f, _ = skm.precision_recall_fscore_support(
            labels,
            preds,
            average=average,
            labels=sk_labels,
            sample_weight=sw,
            zero_division=0,
        )
        close(out["p"], p)
        close(out["r"], r)
        close(out["f"], f)


@pytest.mark.parametrize("mode", MODES)
def test_binary_precision_recall_f1_match_sklearn(mode):
    rng = np.random.default_rng(11)
    labels = rng.integers(0, 2, size=N)
    scores = rng.normal(size=(N, 2)).astype(np.float32)
    mask = rng.random(N) < 0.8
    preds = scores.argmax(-1)
    for pos_label in (0, 1):
        prf = esm.Metrics(
            p=esm.Precision(pos_label=pos_label),
            r=esm.Recall(pos_label=pos_label),
            f=esm.F1(pos_label=pos_label),
        )
        out = run(prf, mode, batches_of((scores, labels), mask=mask)).compute()
        p, r, f, _ = skm.precision_recall_fscore_support(
            labels[mask],
            preds[mask],
            average="binary",
            pos_label=pos_label,
            zero_division=0,
        )
        close(out["p"], p)
        close(out["r"], r)
        close(out["f"], f)


@pytest.mark.parametrize("mode", MODES)
def test_confusion_matrix_matches_sklearn(mode):
    rng = np.random.default_rng(13)
    logits, labels, w = class_data(rng)
    preds = logits.argmax(-1)
    norms = [None, "true", "pred", "all"]
    cms = esm.Metrics({str(n): esm.ConfusionMatrix(C, normalize=n) for n in norms})
    out = run(cms, mode, batches_of((logits, labels), sample_weight=w)).compute()
    for n in norms:
        want = skm.confusion_matrix(
            labels, preds, labels=range(C), sample_weight=w, normalize=n
        )
        close(out[str(n)], want, rtol=1e-5)


def test_out_of_range_labels_are_dropped():
    """A padding label of -1 (or >= num_classes) adds nothing to the confusion matrix;
    accuracy from logits counts it as wrong (mask it to exclude it)."""
    cm = es.to_refs(esm.ConfusionMatrix(3))
    cm.update(jnp.array([0, 1, 2, 1]), jnp.array([0, -1, 2, 3]))
    np.testing.assert_array_equal(
        cm.compute(), skm.confusion_matrix([0, 2], [0, 2], labels=range(3))
    )
    acc = es.to_refs(esm.Accuracy())
    acc.update(jnp.eye(3)[jnp.array([0, 1, 2])], jnp.array([0, -1, 2]))
    close(acc.compute(), 2 / 3)


# ------------------------------------------------------------------ empty inputs


FRESH = [
    (esm.Mean, 0.0),
    (esm.Sum, 0.0),
    (esm.Min, np.inf),
    (esm.Max, -np.inf),
    (esm.LastValue, 0.0),
    (esm.Accuracy, 0.0),
    (lambda: esm.Precision(), 0.0),
    (lambda: esm.Recall(4, average="macro"), 0.0),
    (lambda: esm.F1(4, average="micro"), 0.0),
    (lambda: esm.F1(4, average="weighted"), 0.0),
    (lambda: esm.Precision(4, average="macro", zero_division=1), 1.0),
]


@pytest.mark.parametrize("factory,want", FRESH)
def test_empty_metrics_give_a_number_not_nan(factory, want):
    # no NaN as a "no data" marker: constructing and computing an empty metric works
    # under jax.debug_nans (which raises on any NaN produced)
    with jax.debug_nans(True):
        fresh = factory().compute()
        # an update whose every entry is masked out changes nothing
        m = es.to_refs(factory())
        if isinstance(m, (esm.Accuracy, esm.Precision, esm.Recall, esm.F1)):
            m.update(
                jnp.array([1, 0]), jnp.array([1, 1]), mask=jnp.array([False, False])
            )
        else:
            m.update(jnp.array([3.0, 4.0]), mask=jnp.array([0, 0]))
        for got in (fresh, m.compute()):
            assert float(got) == want


def test_empty_mean_std_and_confusion_matrix():
    with jax.debug_nans(True):
        mean, std = esm.MeanStd().compute()
        assert float(mean) == 0.0 and float(std) == 0.0
        one = es.to_refs(esm.MeanStd(ddof=1))
        one.update(jnp.array([5.0]))
        mean, std = one.compute()
        # numpy: std(ddof=1) of one value is NaN (with a warning); here 0, count 1
        assert float(mean) == 5.0 and float(std) == 0.0
        assert float(one.count[...]) == 1.0
        np.testing.assert_array_equal(
            esm.ConfusionMatrix(3).compute(), np.zeros((3, 3))
        )
        np.testing.assert_array_equal(
            esm.ConfusionMatrix(3, normalize="true").compute(), np.zeros((3, 3))
        )


def test_no_positive_predictions_matches_sklearn_zero_division():
    labels, preds = np.array([1, 1, 0, 0]), np.array([0, 0, 0, 0])
    for cls, fn in [
        (esm.Precision, skm.precision_score),
        (esm.Recall, skm.recall_score),
        (esm.F1, skm.f1_score),
    ]:
        m = es.to_refs(cls())
        m.update(jnp.asarray(preds), jnp.asarray(labels))
        want = fn(labels, preds, zero_division=0)
        assert float(m.compute()) == want


# ------------------------------------------------------------ errors and modes


def test_value_mode_update_outside_apply_names_the_fixes():
    with pytest.raises(es.StateWriteError, match="es.apply|eqx_state.apply"):
        esm.Mean().update(jnp.ones(3))


def test_bad_inputs_raise_clear_errors():
    acc = es.to_refs(esm.Accuracy(top_k=2))
    with pytest.raises(ValueError, match="needs logits"):
        acc.update(jnp.array([0, 1]), jnp.array([0, 1]))
    with pytest.raises(TypeError, match="floating-point predictions"):
        es.to_refs(esm.Accuracy()).update(jnp.array([0.2, 0.9]), jnp.array([0, 1]))
    # float labels: the jaxtyping annotation rejects them under the test suite's
    # runtime type checking; without it, the metric's own check does
    with pytest.raises(TypeError, match="integer class labels|Integer"):
        es.to_refs(esm.Accuracy()).update(jnp.zeros((2, 3)), jnp.array([0.0, 1.0]))
    from eqx_state.metrics._labels import _split_inputs

    with pytest.raises(TypeError, match="integer class labels"):
        _split_inputs("Accuracy", jnp.zeros((2, 3)), jnp.array([0.0, 1.0]), None)
    with pytest.raises(ValueError, match="num_classes=5"):
        es.to_refs(esm.F1(3, average="macro")).update(
            jnp.zeros((2, 5)), jnp.array([0, 1])
        )
    with pytest.raises(ValueError, match="average='macro'"):
        esm.Precision(5)
    with pytest.raises(ValueError, match="does not fit values of shape"):
        es.to_refs(esm.Mean()).update(jnp.ones((4, 2)), mask=jnp.ones(3, bool))
    with pytest.raises(ValueError, match="LastValue"):
        es.to_refs(esm.LastValue(shape=(3,))).update(jnp.ones((2, 4)))


def test_merge_checks_kind_and_configuration():
    with pytest.raises(TypeError, match="same kind of metric"):
        esm.Mean().merge(esm.Sum())
    with pytest.raises(ValueError, match="configured differently"):
        esm.ConfusionMatrix(3).merge(esm.ConfusionMatrix(4))
    with pytest.raises(ValueError, match="configured differently"):
        esm.Accuracy(top_k=1).merge(esm.Accuracy(top_k=2))


@pytest.mark.parametrize(
    "a,b,differs",
    [
        (esm.Accuracy(), esm.Accuracy(top_k=2), "`top_k` is 1 here and 2 in the other"),
        (
            esm.Histogram(3, (0, 1)),
            esm.Histogram(3, (0, 10)),
            "`range` is (0.0, 1.0) here and (0.0, 10.0) in the other",
        ),
        (
            esm.Precision(3, average="macro"),
            esm.Precision(3, average="micro"),
            "`average` is 'macro' here and 'micro' in the other",
        ),
        (esm.MeanStd(ddof=0), esm.MeanStd(ddof=1), "`ddof` is 0 here and 1 in the"),
        (esm.ConfusionMatrix(3), esm.ConfusionMatrix(4), "`num_classes` is 3 here"),
        (esm.LastValue(()), esm.LastValue((3,)), "`shape` is () here and (3,) in"),
        (esm.Mean(axis_name="i"), esm.Mean(), "`axis_name` is 'i' here and None"),
        (
            esm.Max(),
            esm.Max(dtype=jnp.bfloat16),
            "the statistic 'value' has shape () and dtype float32 (merge 'max') "
            "here, and shape () and dtype bfloat16",
        ),
    ],
    ids=lambda x: type(x).__name__ if isinstance(x, esm.Metric) else "",
)
def test_merge_of_differently_configured_metrics_says_what_differs(a, b, differs):
    """The message used to print the statistics' shapes and `axis_name` only, so
    two metrics differing in `top_k`, a histogram's range, `average` or `ddof`
    were described by two identical strings."""
    with pytest.raises(ValueError, match="configured differently") as info:
        a.merge(b)
    assert differs in str(info.value), str(info.value)
    assert isinstance(info.value, es.EqxStateError)


@pytest.mark.parametrize("mode", MODES)
def test_complex_values_are_refused_and_the_fix_matches_numpy(mode, monkeypatch):
    """Complex values into real statistics were refused with the integer advice
    ("2.5 would become 2 ... build the metric with a floating dtype", which it
    already had); the message says the imaginary parts would be dropped, and the
    fix it names (a metric each for the real and imaginary parts) gives NumPy's
    complex mean. (The suite's jaxtyping hook, which refuses complex values by
    the annotation, is off: users see the library's own error.)"""
    monkeypatch.setattr(jaxtyping.config, "jaxtyping_disable", True)
    z = np.array([1 + 5j, 3 - 1j, -2 + 0.5j])
    for metric in (esm.Mean(), esm.Sum(), esm.MeanStd(), esm.Max(), esm.LastValue()):
        with pytest.raises(TypeError, match=r"1\+2j would become 1") as info:
            run(metric, mode, [((jnp.asarray(z, jnp.complex64),), {})])
        assert "`values.real` and `values.imag`" in str(
            info.value
        ) or "`value.real` and `value.imag`" in str(info.value)
        assert "floating dtype" not in str(info.value)
    re_ = run(esm.Mean(), mode, [((jnp.asarray(z.real, jnp.float32),), {})])
    im = run(esm.Mean(), mode, [((jnp.asarray(z.imag, jnp.float32),), {})])
    close(re_.compute() + 1j * im.compute(), np.mean(z))


@pytest.mark.parametrize(
    "build,error,match",
    [
        (lambda: esm.LastValue((-1,)), ValueError, r"shape \(-1,\) must be >= 0"),
        (lambda: esm.LastValue(3), TypeError, r"tuple of ints .* got 3\. E\.g\."),
        (lambda: esm.LastValue((2.5,)), TypeError, "must be an int, got 2.5"),
        (lambda: esm.Accuracy(top_k=1.5), TypeError, "top_k must be an int"),
        (lambda: esm.Accuracy(top_k=0), ValueError, "top_k must be >= 1, got 0"),
        (lambda: esm.ConfusionMatrix(2.5), TypeError, "num_classes must be an int"),
        (lambda: esm.F1(3.0, average="macro"), TypeError, "num_classes must be an"),
        (lambda: esm.MeanStd(ddof=0.5), TypeError, "ddof must be an int, got 0.5"),
        (lambda: esm.MeanStd(ddof=-1), ValueError, "ddof must be >= 0, got -1"),
    ],
)
def test_constructor_sizes_are_checked(build, error, match, monkeypatch):
    """`LastValue((-1,))` used to raise JAX's broadcast_in_dim error, and a float
    size JAX's "Shapes must be 1D sequences ..." (or nothing: `top_k=1.5`). (The
    suite's jaxtyping hook is off here: users see the library's own error.)"""
    monkeypatch.setattr(jaxtyping.config, "jaxtyping_disable", True)
    with pytest.raises(error, match=match) as info:
        build()
    assert isinstance(info.value, es.EqxStateError)


@pytest.mark.parametrize("mode", MODES)
def test_merge_is_pure_and_returns_value_mode(mode):
    a = run(esm.Mean(), mode, [((jnp.array([1.0, 2.0]),), {})])
    b = run(esm.Mean(), mode, [((jnp.array([9.0]),), {})])
    merged = a.merge(b)
    assert not any(isinstance(x, jax.Ref) for x in jax.tree.leaves(merged))
    close(merged.compute(), 4.0)
    close(a.compute(), 1.5)  # inputs unchanged
    close(b.compute(), 9.0)


def test_metrics_update_under_inference_mode():
    """Metrics have no `inference` flag: they are meant for evaluation loops."""

    class Model(eqx.Module):
        bn: es.nn.BatchNorm
        acc: esm.Accuracy

        def __call__(self, x, y):
            out = self.bn(x)
            self.acc.update(out, y)
            return out

    model = eqx.nn.inference_mode(Model(es.nn.BatchNorm(3), esm.Accuracy()))
    x = jnp.array([[3.0, 0.0, 0.0], [0.0, 2.0, 0.0]])
    _, model = es.apply(lambda m: m(x, jnp.array([0, 0])), model)
    close(model.acc.compute(), 0.5)
    np.testing.assert_array_equal(model.bn.running_mean[...], np.zeros(3))


# ------------------------------------------------------------------------- reset


@pytest.mark.parametrize("mode", MODES)
def test_reset_zeroes_metrics_and_leaves_other_state(mode):
    class Model(eqx.Module):
        bn: es.nn.BatchNorm
        steps: es.nn.Counter
        metrics: esm.Metrics

        def __call__(self, x):
            self.steps.increment()
            y = self.bn(x)
            self.metrics.update(mean=y, low=y, last=y[0, 0], ms=x)
            return y

    model = Model(
        es.nn.BatchNorm(2),
        es.nn.Counter(),
        esm.Metrics(
            mean=esm.Mean(), low=esm.Min(), last=esm.LastValue(), ms=esm.MeanStd()
        ),
    )
    x = jnp.array([[1.0, 2.0], [3.0, 5.0]])
    # a fresh collection: 0 for the mean, +inf for the minimum, 0 for the rest
    fresh = [0.0, np.inf, 0.0, 0.0, 0.0]
    if mode == "ref":
        model = es.to_refs(model)
        model(x)
        same = es.reset(model)
        assert same is model  # ref mode: written in place, the same model returned
        out = model.metrics.compute()
        for got, want in zip(jax.tree.leaves(out), jax.tree.leaves(fresh)):
            np.testing.assert_array_equal(got, want)
    else:
        _, model = es.apply(lambda m: m(x), model)
        before = model.metrics.compute()
        new = es.reset(model)
        out = new.metrics.compute()
        for got, want in zip(jax.tree.leaves(out), jax.tree.leaves(fresh)):
            np.testing.assert_array_equal(got, want)
        close(model.metrics.compute()["mean"], before["mean"])  # old model unchanged
        model = new
    assert int(model.steps.value) == 1
    close(model.bn.running_mean[...], 0.1 * np.array([2.0, 3.5]))
    # the reset metrics count from scratch (Min restarted at +inf, not 0)
    if mode == "ref":
        model(x + 10)
    else:
        _, model = es.apply(lambda m: m(x + 10), model)
    close(model.metrics["low"].compute(), -1.0, rtol=1e-5)  # normalised y
    close(model.metrics["ms"].compute()[0], 12.75)
    assert int(model.steps.value) == 2


def test_reset_inside_apply_writes_in_place():
    m = esm.Sum()
    _, m = es.apply(lambda m: m.update(jnp.ones(3)), m)

    def fn(m):
        es.reset(m)
        m.update(jnp.ones(2))

    _, m = es.apply(fn, m)
    close(m.compute(), 2.0)


def test_reset_resets_every_position_on_its_own():
    class Two(eqx.Module):
        a: esm.Sum
        b: esm.Sum

    shared = esm.Sum()
    _, shared = es.apply(lambda m: m.update(2.0), shared)
    model = es.reset(Two(shared, shared))  # one array reachable from two places
    assert float(model.a.compute()) == 0.0 and float(model.b.compute()) == 0.0
    # two fresh arrays: each position is its own value
    assert model.a.total.value is not model.b.total.value
    assert float(shared.compute()) == 2.0  # value mode: the input is unchanged


def test_reset_inside_make_step_loss():
    """A loss that resets its metric every step records only that step."""

    class Model(eqx.Module):
        w: jax.Array
        seen: esm.Sum

    def loss_fn(model, x):
        es.reset(model)
        model.seen.update(x)
        return jnp.sum(model.w * x)

    model = Model(jnp.ones(3), esm.Sum())
    step = es.make_step(loss_fn, optax.sgd(0.1))
    opt_state = step.init(model)
    for i in range(3):
        model, opt_state = step(model, opt_state, jnp.full(3, float(i)))
        assert float(model.seen.compute()) == 3.0 * i
    assert step.trace_count == 1


def test_eval_loop_under_scan_matches_sklearn():
    """The whole evaluation loop compiled as one `lax.scan` with the metrics in the
    carry (value mode), on padded batches."""
    rng = np.random.default_rng(19)
    logits, labels, _ = class_data(rng, n=N)
    mask = rng.random(N) < 0.8
    losses = rng.uniform(size=N).astype(np.float32)
    shape = lambda a: jnp.asarray(a).reshape(6, 8, *a.shape[1:])  # noqa: E731

    @eqx.filter_jit
    def evaluate(metrics, logits, labels, losses, mask):
        def body(metrics, batch):
            lg, y, loss, m = batch
            _, metrics = es.apply(
                lambda ms: ms.update(acc=(lg, y), f1=(lg, y), loss=loss, mask=m),
                metrics,
            )
            return metrics, None

        return jax.lax.scan(body, metrics, (logits, labels, losses, mask))[0]

    metrics = esm.Metrics(
        acc=esm.Accuracy(), f1=esm.F1(C, average="macro"), loss=esm.Mean()
    )
    out = evaluate(
        metrics, shape(logits), shape(labels), shape(losses), shape(mask)
    ).compute()
    preds = logits.argmax(-1)
    close(out["acc"], skm.accuracy_score(labels[mask], preds[mask]))
    close(
        out["f1"],
        skm.f1_score(labels[mask], preds[mask], average="macro", zero_division=0),
    )
    close(out["loss"], losses[mask].mean())


# ------------------------------------------------------------------ collection


@pytest.mark.parametrize("mode", MODES)
def test_metrics_collection_matches_individual_metrics(mode):
    rng = np.random.default_rng(17)
    logits, labels, _ = class_data(rng, n=20)
    losses = rng.uniform(size=20).astype(np.float32)
    mask = rng.random(20) < 0.7

    def make():
        return esm.Metrics(
            {
                "loss": esm.Mean(),
                "acc": esm.Accuracy(),
                "top-2": esm.Accuracy(top_k=2),
                "f1": esm.F1(C, average="macro"),
                "last": esm.LastValue(),
            }
        )

    def values(s):
        lg, y = jnp.asarray(logits[s]), jnp.asarray(labels[s])
        return {
            "loss": jnp.asarray(losses[s]),
            "acc": (lg, y),
            "top-2": (lg, y),
            "f1": {"logits_or_preds": lg, "labels": y},
            "last": jnp.asarray(losses[s]),
        }

    metrics = make() if mode == "value" else es.to_refs(make())
    update = eqx.filter_jit(
        lambda m, v, mask: es.apply(lambda m: m.update(v, mask=mask), m)[1]
    )
    for s in (slice(0, 8), slice(8, 20)):  # one call per batch updates them all
        if mode == "value":
            metrics = update(metrics, values(s), jnp.asarray(mask[s]))
        else:
            metrics.update(values(s), mask=jnp.asarray(mask[s]))
    out = metrics.compute()
    assert set(out) == {"loss", "acc", "top-2", "f1", "last"}
    close(out["loss"], losses[mask].mean())
    close(out["acc"], skm.accuracy_score(labels[mask], logits[mask].argmax(-1)))
    close(
        out["top-2"],
        skm.top_k_accuracy_score(labels[mask], logits[mask], k=2, labels=range(C)),
    )
    want_f1 = skm.f1_score(
        labels[mask], logits[mask].argmax(-1), average="macro", zero_division=0
    )
    close(out["f1"], want_f1)
    close(out["last"], losses[mask][-1], rtol=0)


def test_metrics_collection_partial_nested_and_errors():
    ms = es.to_refs(
        esm.Metrics(train=esm.Metrics(loss=esm.Mean()), count=esm.Sum(), low=esm.Min())
    )
    ms.update(train={"loss": jnp.array([1.0, 3.0])}, count=jnp.array([1.0, 1.0]))
    ms.update(count=1.0)  # only `count`; the others are untouched
    out = ms.compute()
    assert float(out["train"]["loss"]) == 2.0 and float(out["count"]) == 3.0
    assert float(out["low"]) == np.inf and float(ms["low"].count[...]) == 0
    with pytest.raises(ValueError, match="not in this collection"):
        ms.update(loss=1.0)
    with pytest.raises(ValueError, match="cannot name a metric"):
        esm.Metrics(mask=esm.Mean())
    with pytest.raises(TypeError, match="not a metric"):
        esm.Metrics(loss=3.0)
    merged = ms.merge(ms)
    assert float(merged.compute()["count"]) == 6.0
    with pytest.raises(ValueError, match="different metrics"):
        ms.merge(esm.Metrics(count=esm.Sum()))


# -------------------------------------------------------------- cross-device


def reduction_cases(rng):
    """(name, factory, update args per shard [4, ...], one-pass reference)."""
    n = 4 * 6
    x = rng.normal(size=n).astype(np.float32)
    mask = rng.random(n) < 0.75
    mask[-6:] = False  # the last shard is all padding: LastValue must look earlier
    logits, labels, w = class_data(rng, n=n)
    preds = logits.argmax(-1)
    xm = x[mask]
    sh = lambda a: jnp.asarray(a).reshape(4, 6, *a.shape[1:])  # noqa: E731
    vals = ((sh(x),), {"mask": sh(mask)})
    cls_args = ((sh(logits), sh(labels)), {"sample_weight": sh(w)})
    f1 = skm.f1_score(labels, preds, average="macro", sample_weight=w, zero_division=0)
    return [
        ("Mean", esm.Mean, vals, xm.mean()),
        ("Sum", esm.Sum, vals, xm.sum()),
        (
            "MeanStd",
            lambda **k: esm.MeanStd(ddof=1, **k),
            vals,
            (xm.mean(), xm.std(ddof=1)),
        ),
        ("Min", esm.Min, vals, xm.min()),
        ("Max", esm.Max, vals, xm.max()),
        ("LastValue", esm.LastValue, vals, xm[-1]),
        (
            "Accuracy",
            lambda **k: esm.Accuracy(top_k=2, **k),
            cls_args,
            skm.top_k_accuracy_score(
                labels, logits, k=2, labels=range(C), sample_weight=w
            ),
        ),
        ("F1", lambda **k: esm.F1(C, average="macro", **k), cls_args, f1),
        (
            "ConfusionMatrix",
            lambda **k: esm.ConfusionMatrix(C, **k),
            cls_args,
            skm.confusion_matrix(labels, preds, labels=range(C), sample_weight=w),
        ),
    ]


CASES = reduction_cases(np.random.default_rng(23))


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
@pytest.mark.split
def test_reduce_under_vmap_equals_one_pass(case):
    _, factory, (args, kwargs), want = case

    def reduce_path(metric, args, kwargs):  # each shard updates its own, then reduce
        _, metric = es.apply(lambda m: m.update(*args, **kwargs), metric)
        return metric.reduce("shards").compute()

    def axis_name_path(metric, args, kwargs):  # every update reduced over the axis
        _, metric = es.apply(lambda m: m.update(*args, **kwargs), metric)
        return metric.compute()

    for fn, metric in [
        (reduce_path, factory()),
        (axis_name_path, factory(axis_name="shards")),
    ]:
        out = eqx.filter_jit(jax.vmap(fn, in_axes=(None, 0, 0), axis_name="shards"))(
            metric, args, kwargs
        )
        for got, ref in zip(jax.tree.leaves(out), jax.tree.leaves(want)):
            for member in np.asarray(got):  # identical on every shard
                close(member, ref, rtol=1e-4)


SHARD_MAP_SCRIPT = textwrap.dedent(
    """
    import os, json, sys
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    import jax, jax.numpy as jnp, numpy as np
    jax.config.update("jax_numpy_dtype_promotion", "strict")
    jax.config.update("jax_numpy_rank_promotion", "raise")
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
    import eqx_state as es
    from eqx_state import metrics as esm

    assert len(jax.devices()) == 4
    mesh = jax.make_mesh((4,), ("data",), axis_types=(AxisType.Explicit,))
    rng = np.random.default_rng(0)
    n = 32
    x = rng.normal(size=n).astype(np.float32)
    mask = rng.random(n) < 0.75
    mask[-8:] = False
    labels = rng.integers(0, 5, size=n)
    logits = rng.normal(size=(n, 5)).astype(np.float32)
    put = lambda a: jax.device_put(jnp.asarray(a), NamedSharding(mesh, P("data")))
    xs, ms, ls, ys = put(x), put(mask), put(logits), put(labels)

    def factories(axis_name):
        return esm.Metrics(
            mean=esm.Mean(axis_name=axis_name),
            sum=esm.Sum(axis_name=axis_name),
            ms=esm.MeanStd(axis_name=axis_name),
            min=esm.Min(axis_name=axis_name),
            max=esm.Max(axis_name=axis_name),
            last=esm.LastValue(axis_name=axis_name),
            acc=esm.Accuracy(top_k=2, axis_name=axis_name),
            f1=esm.F1(5, average="macro", axis_name=axis_name),
            cm=esm.ConfusionMatrix(5, axis_name=axis_name),
        )

    def update(m, x, mask, logits, labels):
        m.update(
            mean=x, sum=x, ms=x, min=x, max=x, last=x,
            acc=(logits, labels), f1=(logits, labels), cm=(logits, labels),
            mask=mask,
        )

    def body_axis_name(m, x, mask, logits, labels):
        _, m = es.apply(update, m, x, mask, logits, labels)
        return m  # every device holds the global statistics: replicated

    def body_reduce(m, x, mask, logits, labels):
        # each device: a fresh state of its own for this batch, reduced over the
        # devices, then merged into the running (replicated) metric
        local = jax.tree.map(lambda v: jax.lax.pcast(v, "data", to="varying"), es.reset(m))
        _, local = es.apply(update, local, x, mask, logits, labels)
        return m.merge(local.reduce("data"))

    specs = (P(), P("data"), P("data"), P("data"), P("data"))
    results = {}
    for name, body, metric in [
        ("axis_name", body_axis_name, factories("data")),
        ("reduce", body_reduce, factories(None)),
    ]:
        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P()))
        out = f(metric, xs, ms, ls, ys)  # two batches: the same data twice
        out = f(out, xs, ms, ls, ys)
        results[name] = jax.tree.map(lambda a: np.asarray(a).tolist(), out.compute())

    # plain jit over the sharded batch (no shard_map): XLA's SPMD partitioner makes
    # the reductions global by itself
    g = jax.jit(lambda m, *a: es.apply(update, m, *a)[1])
    out = g(g(factories(None), xs, ms, ls, ys), xs, ms, ls, ys)
    results["jit"] = jax.tree.map(lambda a: np.asarray(a).tolist(), out.compute())

    # data-parallel make_step: batch sharded, model replicated; the train metrics
    # equal those of the same steps on one device
    import equinox as eqx, optax

    class Net(eqx.Module):
        lin: eqx.nn.Linear
        metrics: esm.Metrics

    def loss_fn(model, x, y):
        logits = jax.vmap(model.lin)(x)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
        model.metrics.update(loss=loss, acc=(logits, y), f1=(logits, y))
        return loss

    def train(x, y, model):
        step = es.make_step(loss_fn, optax.sgd(0.1), donate=False)
        opt_state = step.init(model)
        for _ in range(3):
            model, opt_state = step(model, opt_state, x, y)
        return model.metrics.compute(), step.trace_count

    xf = rng.normal(size=(n, 3)).astype(np.float32)
    net = Net(
        eqx.nn.Linear(3, 5, key=jax.random.key(0)),
        esm.Metrics(loss=esm.Mean(), acc=esm.Accuracy(), f1=esm.F1(5, average="macro")),
    )
    single, _ = train(jnp.asarray(xf), jnp.asarray(labels), net)
    replicated = jax.device_put(net, NamedSharding(mesh, P()))
    sharded, traces = train(put(xf), ys, replicated)
    results["make_step"] = {
        "single": jax.tree.map(lambda a: np.asarray(a).tolist(), single),
        "sharded": jax.tree.map(lambda a: np.asarray(a).tolist(), sharded),
        "traces": traces,
    }

    # a replicated metric without axis_name, updated with per-device data
    try:
        f = jax.jit(jax.shard_map(body_axis_name, mesh=mesh, in_specs=specs, out_specs=P()))
        f(factories(None), xs, ms, ls, ys)
        results["error"] = None
    except ValueError as e:
        results["error"] = str(e)
    print("RESULT" + json.dumps(results))
    """
)


@pytest.mark.slow  # a 4-device subprocess; tests/multidevice covers metrics sharded
def test_shard_map_on_four_devices_equals_one_pass(tmp_path):
    script = tmp_path / "shard_map_metrics.py"
    script.write_text(SHARD_MAP_SCRIPT)
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(s for s in proc.stdout.splitlines() if s.startswith("RESULT"))
    results = json.loads(line[len("RESULT") :])

    rng = np.random.default_rng(0)  # the same data as the script
    n = 32
    x = rng.normal(size=n).astype(np.float32)
    mask = rng.random(n) < 0.75
    mask[-8:] = False
    labels = rng.integers(0, 5, size=n)
    logits = rng.normal(size=(n, 5)).astype(np.float32)
    xm = np.concatenate([x[mask], x[mask]])  # the data was seen twice
    lm, ym = np.concatenate([logits[mask]] * 2), np.concatenate([labels[mask]] * 2)
    pm = lm.argmax(-1)
    want = {
        "mean": xm.mean(),
        "sum": xm.sum(),
        "ms": [xm.mean(), xm.std()],
        "min": xm.min(),
        "max": xm.max(),
        "last": xm[-1],
        "acc": skm.top_k_accuracy_score(ym, lm, k=2, labels=range(5)),
        "f1": skm.f1_score(ym, pm, average="macro", zero_division=0),
        "cm": skm.confusion_matrix(ym, pm, labels=range(5)),
    }
    for path in ("axis_name", "reduce", "jit"):
        got = results[path]
        for key, ref in want.items():
            close(got[key], ref, rtol=1e-4)
    dp = results["make_step"]
    assert dp["traces"] == 1
    for key in ("loss", "acc", "f1"):
        close(dp["sharded"][key], dp["single"][key], rtol=1e-5)
    assert results["error"] is not None
    assert "axis_name='data'" in results["error"] and "reduce" in results["error"]


# ------------------------------------------------------------ inside make_step

IN, BATCH, STEPS = 5, 16, 4


class Classifier(eqx.Module):
    lin: eqx.nn.Linear
    metrics: esm.Metrics

    def __init__(self, key):
        self.lin = eqx.nn.Linear(IN, C, key=key)
        self.metrics = esm.Metrics(
            loss=esm.Mean(), last_loss=esm.LastValue(), acc=esm.Accuracy()
        )

    def __call__(self, x):
        return jax.vmap(self.lin)(x)


def ce(logits, y):
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def metric_loss(model, x, y):
    logits = model(x)
    loss = ce(logits, y)
    model.metrics.update(loss=loss, last_loss=loss, acc=(logits, y))
    return loss


@pytest.mark.parametrize("mode", MODES)
def test_metrics_inside_make_step(mode, getkey):
    model = Classifier(getkey())
    xs = jax.random.normal(getkey(), (STEPS, BATCH, IN))
    ys = jax.random.randint(getkey(), (STEPS, BATCH), 0, C)
    opt = optax.adam(0.1)

    # reference: the same training written by hand, no metrics
    @jax.jit
    def ref_step(lin, opt_state, x, y):
        def loss(lin):
            logits = jax.vmap(lin)(x)
            return ce(logits, y), logits

        (value, logits), g = jax.value_and_grad(loss, has_aux=True)(lin)
        updates, opt_state = opt.update(g, opt_state, lin)
        return optax.apply_updates(lin, updates), opt_state, value, logits

    lin = model.lin
    ref_opt_state = opt.init(lin)
    ref_losses, ref_correct = [], []

    step = es.make_step(metric_loss, opt)
    if mode == "ref":
        model = es.to_refs(model)
    opt_state = step.init(model)
    # metric cells are state, not parameters: the optimizer never sees them
    assert jax.tree.leaves(es.params(model.metrics)) == []
    for i in range(STEPS):
        lin, ref_opt_state, value, logits = ref_step(lin, ref_opt_state, xs[i], ys[i])
        ref_losses.append(float(value))
        ref_correct.extend(np.asarray(logits.argmax(-1) == ys[i]).tolist())
        model, opt_state = step(model, opt_state, xs[i], ys[i])
        out = model.metrics.compute()
        close(out["last_loss"], ref_losses[-1])  # the loss of this step
        close(out["loss"], np.mean(ref_losses))
        close(out["acc"], np.mean(ref_correct))
    assert step.trace_count == 1
    # the metrics did not change training: parameters equal the metric-free run
    close(model.lin.weight, lin.weight, rtol=1e-5)
    close(model.lin.bias, lin.bias, rtol=1e-5)


def test_no_gradient_flows_through_metric_state():
    def f(x):
        _, m = es.apply(lambda m: m.update(x * x), esm.Mean())
        return m.compute() + jnp.sum(x)

    np.testing.assert_array_equal(jax.grad(f)(jnp.array([1.0, 2.0])), np.ones(2))


# ------------------------------------------------------ docstrings and example


PUBLIC = [getattr(esm, name) for name in esm.__dict__ if not name.startswith("_")]
PUBLIC = [obj for obj in PUBLIC if callable(obj)] + [
    esm.Metric.merge,
    esm.Metric.reduce,
]


@pytest.mark.parametrize("obj", PUBLIC, ids=lambda o: o.__qualname__)
def test_docstring_examples_run(obj):
    doc = obj.__doc__ or ""
    blocks = re.findall(r"```python\n(.*?)```", doc, flags=re.S)
    assert blocks, f"{obj.__qualname__} has no example"
    for block in blocks:
        exec(textwrap.dedent(block), {})


def test_train_eval_metrics_example(capsys):
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
    try:
        import train_eval_metrics
    finally:
        sys.path.pop(0)
    history = train_eval_metrics.main(
        [
            "--epochs",
            "2",
            "--batch-size",
            "32",
            "--hidden",
            "16",
            "--train-size",
            "96",
            "--eval-size",
            "50",
            "--no-progress",
        ]
    )
    printed = capsys.readouterr().out
    # train: the per-step running mean of the loss restarts every epoch (reset)
    for epoch in history["train"]:
        losses = [s["loss"] for s in epoch]
        close(
            [s["mean_loss"] for s in epoch],
            np.cumsum(losses) / np.arange(1, len(losses) + 1),
        )
    # eval: equals numpy/sklearn on the final model's predictions over the eval set
    final = history["eval"][-1]
    preds, labels = history["eval_preds"], history["eval_labels"]
    assert len(labels) == 50  # the padded last batch was masked
    close(final["accuracy"], np.mean(preds == labels))
    close(
        final["f1_macro"], skm.f1_score(labels, preds, average="macro", zero_division=0)
    )
    assert f"eval_accuracy={final['accuracy']:.4f}" in printed
    assert history["compiles"] == 1  # the train step compiled once across epochs
    np.testing.assert_array_equal(
        history["confusion"], skm.confusion_matrix(labels, preds, labels=range(10))
    )


def test_mean_std_with_an_infinite_value_equals_numpy_in_every_grouping():
    """One update, several updates, an empty or fully masked update after it and a
    merge all give NumPy's mean of inf (several updates gave NaN: `inf * 0` and
    `inf - inf` in the parallel formula); opposite infinities give NaN as NumPy."""
    want = np.mean(np.array([1.0, np.inf, 2.0]))
    groupings = (
        [[1.0, np.inf, 2.0]],
        [[1.0, np.inf], [2.0]],
        [[1.0], [np.inf, 2.0]],
        [[1.0, np.inf, 2.0], []],
    )
    for batches in groupings:
        metric = es.to_refs(esm.MeanStd())
        for b in batches:
            metric.update(jnp.asarray(b, jnp.float32))
        assert float(metric.compute()[0]) == want, batches
    masked = es.to_refs(esm.MeanStd())
    masked.update(jnp.asarray([1.0, np.inf, 2.0]))
    masked.update(jnp.asarray([5.0]), sample_weight=jnp.zeros(1))
    assert float(masked.compute()[0]) == want
    a, b = es.to_refs(esm.MeanStd()), es.to_refs(esm.MeanStd())
    a.update(jnp.asarray([1.0, np.inf]))
    b.update(jnp.asarray([2.0]))
    assert float(a.merge(b).compute()[0]) == want
    c, d = es.to_refs(esm.MeanStd()), es.to_refs(esm.MeanStd())
    c.update(jnp.asarray([np.inf]))
    d.update(jnp.asarray([-np.inf]))
    assert np.isnan(float(c.merge(d).compute()[0]))
