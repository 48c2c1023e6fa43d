"""Property tests: for every metric, splitting the data into any batches (empty ones
included) and merging the per-batch metrics in any grouping gives the same result as
one pass, which matches numpy / scikit-learn; updating one metric batch by batch (ref
mode, in place) gives it too.

Shapes are fixed (N examples, padded): a batch is the whole array with a mask that
selects its examples, so each metric compiles once for the whole file."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import sklearn.metrics as skm
from hypothesis import HealthCheck, given, settings, strategies as st

import eqx_state as es
from eqx_state import metrics as esm


N = 10  # examples per draw
C = 4  # classes
SETTINGS = settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    derandomize=True,
)


def values_data(rng, weights):
    x = rng.normal(size=N).astype(np.float32)
    kwargs = {}
    if weights == "float":
        kwargs["sample_weight"] = rng.uniform(0.0, 2.0, size=N).astype(np.float32)
    elif weights == "freq":
        kwargs["sample_weight"] = rng.integers(0, 3, size=N).astype(np.float32)
    return (x,), kwargs


def class_data(rng, num_classes=C, weighted=True):
    logits = rng.normal(size=(N, num_classes)).astype(np.float32)
    labels = rng.integers(0, num_classes, size=N).astype(np.int32)
    kwargs = {}
    if weighted:
        kwargs["sample_weight"] = rng.uniform(0.5, 2.0, size=N).astype(np.float32)
    return (logits, labels), kwargs


def _w(kwargs, keep):
    w = kwargs.get("sample_weight")
    return None if w is None else w[keep]


def ref_mean(args, kwargs, keep):
    x, w = args[0][keep], _w(kwargs, keep)
    if w is None:
        return x.mean() if len(x) else 0.0  # no data: 0 (never NaN)
    return np.average(x, weights=w) if w.sum() > 0 else 0.0


def ref_sum(args, kwargs, keep):
    x, w = args[0][keep], _w(kwargs, keep)
    return x.sum() if w is None else (x * w).sum()


def ref_mean_std(args, kwargs, keep):
    x = np.repeat(args[0][keep], _w(kwargs, keep).astype(int))
    mean = x.mean() if len(x) else 0.0  # no data: 0 (never NaN)
    std = x.std(ddof=1) if len(x) > 1 else 0.0
    return mean, std


def ref_extreme(fn, empty):
    return lambda args, kwargs, keep: fn(args[0][keep]) if keep.any() else empty


def ref_last(args, kwargs, keep):
    return args[0][keep][-1] if keep.any() else 0.0


def ref_accuracy(args, kwargs, keep):
    logits, labels = args[0][keep], args[1][keep]
    if not keep.any():
        return 0.0
    w = _w(kwargs, keep)
    return skm.top_k_accuracy_score(
        labels, logits, k=2, labels=range(C), sample_weight=w
    )


def ref_prf(index, average, num_classes=C):
    def ref(args, kwargs, keep):
        if not keep.any():
            return 0.0
        preds, labels = args[0][keep].argmax(-1), args[1][keep]
        out = skm.precision_recall_fscore_support(
            labels,
            preds,
            average=average,
            sample_weight=_w(kwargs, keep),
            zero_division=0,
        )
        return out[index]

    return ref


def ref_confusion(args, kwargs, keep):
    preds, labels = args[0][keep].argmax(-1), args[1][keep]
    if not keep.any():
        return np.zeros((C, C))
    return skm.confusion_matrix(
        labels, preds, labels=range(C), sample_weight=_w(kwargs, keep)
    )


# name: (factory, data(rng), reference(args, kwargs, keep))
CASES = {
    "Mean": (esm.Mean, lambda r: values_data(r, "float"), ref_mean),
    "Sum": (esm.Sum, lambda r: values_data(r, "float"), ref_sum),
    "MeanStd": (
        lambda: esm.MeanStd(ddof=1),
        lambda r: values_data(r, "freq"),
        ref_mean_std,
    ),
    "Min": (esm.Min, lambda r: values_data(r, None), ref_extreme(np.min, np.inf)),
    "Max": (esm.Max, lambda r: values_data(r, None), ref_extreme(np.max, -np.inf)),
    "LastValue": (esm.LastValue, lambda r: values_data(r, None), ref_last),
    "Accuracy": (lambda: esm.Accuracy(top_k=2), class_data, ref_accuracy),
    "Precision": (
        lambda: esm.Precision(C, average="macro"),
        class_data,
        ref_prf(0, "macro"),
    ),
    "Recall": (lambda: esm.Recall(C, average="micro"), class_data, ref_prf(1, "micro")),
    "F1": (lambda: esm.F1(C, average="weighted"), class_data, ref_prf(2, "weighted")),
    "F1-binary": (
        esm.F1,
        lambda r: class_data(r, num_classes=2, weighted=False),
        ref_prf(2, "binary", num_classes=2),
    ),
    "ConfusionMatrix": (lambda: esm.ConfusionMatrix(C), class_data, ref_confusion),
}


@eqx.filter_jit
def update_value_mode(metric, args, kwargs, mask):
    return es.apply(lambda m: m.update(*args, **kwargs, mask=mask), metric)[1]


def draw_problem(data, case):
    """Random data, padding mask, and a split of range(N) into contiguous batches."""
    factory, make, reference = CASES[case]
    seed = data.draw(st.integers(0, 2**31 - 1), label="seed")
    rng = np.random.default_rng(seed)
    args, kwargs = make(rng)
    keep = rng.random(N) < data.draw(
        st.sampled_from([0.0, 0.5, 0.9, 1.0]), label="density"
    )
    cuts = sorted(data.draw(st.lists(st.integers(0, N), max_size=4), label="cuts"))
    bounds = [0, *cuts, N]
    index = np.arange(N)
    masks = [keep & (index >= a) & (index < b) for a, b in zip(bounds[:-1], bounds[1:])]
    return factory, args, kwargs, keep, masks, reference


def merge_in_grouping(data, metrics):
    """Merge `metrics` in order, grouped as a random binary tree."""
    if len(metrics) == 1:
        return metrics[0]
    k = data.draw(st.integers(1, len(metrics) - 1), label="grouping")
    return merge_in_grouping(data, metrics[:k]).merge(
        merge_in_grouping(data, metrics[k:])
    )


def check(got, want):
    got_leaves = got if isinstance(got, tuple) else (got,)
    want_leaves = want if isinstance(want, tuple) else (want,)
    for g, w in zip(got_leaves, want_leaves, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-5)


def jnp_args(args, kwargs):
    return tuple(jnp.asarray(a) for a in args), {
        k: jnp.asarray(v) for k, v in kwargs.items()
    }


@pytest.mark.parametrize("case", list(CASES))
@SETTINGS
@given(data=st.data())
@pytest.mark.split
def test_batches_merged_in_any_grouping_equal_one_pass(case, data):
    factory, args, kwargs, keep, masks, reference = draw_problem(data, case)
    jargs, jkwargs = jnp_args(args, kwargs)
    one_pass = update_value_mode(factory(), jargs, jkwargs, jnp.asarray(keep))
    per_batch = [
        update_value_mode(factory(), jargs, jkwargs, jnp.asarray(m)) for m in masks
    ]
    merged = merge_in_grouping(data, per_batch)
    want = reference(args, kwargs, keep)
    check(one_pass.compute(), want)
    check(merged.compute(), want)


@pytest.mark.parametrize("case", list(CASES))
@SETTINGS
@given(data=st.data())
@pytest.mark.split(every=4)
def test_batch_by_batch_in_place_equals_one_pass(case, data):
    factory, args, kwargs, keep, masks, reference = draw_problem(data, case)
    jargs, jkwargs = jnp_args(args, kwargs)
    metric = es.to_refs(factory())
    for m in masks:  # eager, in place
        metric.update(*jargs, **jkwargs, mask=jnp.asarray(m))
    check(metric.compute(), reference(args, kwargs, keep))


@SETTINGS
@given(data=st.data())
def test_merge_is_associative_for_collections(data):
    factory = lambda: esm.Metrics(  # noqa: E731
        ms=esm.MeanStd(), last=esm.LastValue(), cm=esm.ConfusionMatrix(C)
    )
    seed = data.draw(st.integers(0, 2**31 - 1), label="seed")
    rng = np.random.default_rng(seed)
    (logits, labels), _ = class_data(rng, weighted=False)
    x = rng.normal(size=N).astype(np.float32)
    parts = []
    for _ in range(3):
        m = es.to_refs(factory())
        mask = jnp.asarray(rng.random(N) < 0.6)
        xs, cm_args = jnp.asarray(x), (jnp.asarray(logits), jnp.asarray(labels))
        m.update(ms=xs, last=xs, cm=cm_args, mask=mask)
        parts.append(m)
    a, b, c = parts
    left = jax.tree.leaves(a.merge(b).merge(c).compute())
    right = jax.tree.leaves(a.merge(b.merge(c)).compute())
    assert len(left) == len(right) == 4  # mean, std, last, confusion matrix
    for g, w in zip(left, right):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6, equal_nan=True)
