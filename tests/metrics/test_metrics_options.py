"""The metrics' options and edge cases against independent references: torchmetrics,
scikit-learn and float64 numpy. Ranking ties and NaN (one rule for every
classification metric), padding labels, negative sample weights, `threshold`,
multi-label input, `top_k` for Precision/Recall/F1, `zero_division`, `nan_strategy`,
no NaN as a "no data" marker (`jax.debug_nans`), the `Metrics` collection's
`update_all` and key order."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import sklearn.metrics as skm
from _metric_run import apply_update, run
from _torchmetrics import aggregation as ta, classification as tc, torch

import eqx_state as es
from eqx_state import metrics as esm


MODES = ["value", "ref"]


def value(metric, mode, *args, **kwargs):
    return np.asarray(run(metric, mode, *args, **kwargs).compute())


def close(a, b, rtol=1e-5, atol=1e-6):
    np.testing.assert_allclose(
        np.asarray(a, np.float64), np.asarray(b, np.float64), rtol=rtol, atol=atol
    )


def ranked(logits):
    """The documented ranking order in float64 numpy: by score, NaN above every
    number, equal scores by class index (lower first). Returns class indices, best
    first, per row."""
    key = np.where(np.isnan(logits), np.inf, logits.astype(np.float64))
    nan_first = np.isnan(logits)
    # lexsort: last key is primary. Primary: NaN first; then score descending;
    # then class index ascending (a stable sort keeps it).
    return np.stack([np.lexsort((-key[i], ~nan_first[i])) for i in range(len(logits))])


def ref_predictions(logits, labels, k):
    """torchmetrics' top-k rule on the documented ranking: the true class if it is
    in the top k, else the top class."""
    order = ranked(logits)
    in_top = (order[:, :k] == labels[:, None]).any(-1)
    return np.where(in_top, labels, order[:, 0]), in_top


# ---------------------------------------------------------- ranking: ties, NaN

TIES = np.array(
    [
        [1.0, 1.0, 0.0, 0.0],  # tie for first between 0 and 1
        [1.0, 1.0, 0.0, 0.0],
        [0.0, 2.0, 2.0, 2.0],  # three-way tie
        [0.0, 2.0, 2.0, 2.0],
        [np.nan, 0.0, 1.0, 1.0],  # NaN ranks above every number
        [0.0, np.nan, 1.0, np.nan],  # two NaN: the lower index first
        [np.nan] * 4,  # a diverged model
        [np.nan] * 4,
        [3.0, -1.0, 2.0, 2.0],
    ],
    np.float32,
)
TIE_LABELS = np.array([0, 1, 3, 2, 2, 3, 0, 2, 3])


@pytest.mark.parametrize("mode,k", [("ref", 1), ("value", 2), ("ref", 3)])
def test_one_ranking_rule_for_every_classification_metric(mode, k):
    preds, hit = ref_predictions(TIES, TIE_LABELS, k)
    want_acc = hit.mean()
    acc = value(esm.Accuracy(top_k=k), mode, TIES, TIE_LABELS)
    close(acc, want_acc)
    if k == 1:
        # numpy's argmax is the same rule: Accuracy() equals sklearn on argmax
        close(acc, skm.accuracy_score(TIE_LABELS, np.argmax(TIES, -1)))
    # Accuracy(top_k) == Recall(top_k, micro) == Precision(top_k, micro), always
    for cls in (esm.Recall, esm.Precision, esm.F1):
        close(value(cls(4, average="micro", top_k=k), mode, TIES, TIE_LABELS), acc)
    # per-class scores and the confusion matrix follow the same predictions
    for cls, fn in [
        (esm.Precision, skm.precision_score),
        (esm.Recall, skm.recall_score),
        (esm.F1, skm.f1_score),
    ]:
        for average in ("macro", "weighted", None):
            got = value(cls(4, average=average, top_k=k), mode, TIES, TIE_LABELS)
            want = fn(TIE_LABELS, preds, average=average, zero_division=0)
            close(got, want)
    if k == 1:
        cm = value(esm.ConfusionMatrix(4), mode, TIES, TIE_LABELS)
        np.testing.assert_array_equal(
            cm, skm.confusion_matrix(TIE_LABELS, preds, labels=range(4))
        )
        assert np.trace(cm) / cm.sum() == pytest.approx(float(acc))


def test_all_nan_logits_do_not_score_one():
    logits = np.full((6, 3), np.nan, np.float32)
    labels = np.array([0, 1, 2, 1, 2, 1])
    for k, want in [(1, 1 / 6), (2, 4 / 6)]:  # NaN ties: classes 0, then 1
        acc = value(esm.Accuracy(top_k=k), "ref", logits, labels)
        close(acc, want)
        close(acc, ref_predictions(logits, labels, k)[1].mean())
    # torch agrees for top-1 (argmax of NaN rows is the first NaN)
    close(
        tc.MulticlassAccuracy(3, average="micro")(
            torch.tensor(logits), torch.tensor(labels)
        ).item(),
        1 / 6,
    )


def test_bf16_logits_rank_like_float64():
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(64, 7)).astype(np.float32)
    labels = rng.integers(0, 7, 64)
    lb = jnp.asarray(logits, jnp.bfloat16)
    as_f64 = np.asarray(lb.astype(jnp.float32), np.float64)  # the same (tied) values
    for k in (1, 3):
        got = value(esm.Accuracy(top_k=k), "ref", lb, labels)
        close(got, ref_predictions(as_f64, labels, k)[1].mean())


@pytest.mark.parametrize("k", [1, 3])
def test_top_k_precision_recall_f1_match_torchmetrics(k):
    rng = np.random.default_rng(5)
    logits = rng.normal(size=(60, 5)).astype(np.float32)  # no ties
    labels = rng.integers(0, 5, 60)
    t_logits, t_labels = torch.tensor(logits), torch.tensor(labels)
    for cls, tcls in [
        (esm.Precision, tc.MulticlassPrecision),
        (esm.Recall, tc.MulticlassRecall),
        (esm.F1, tc.MulticlassF1Score),
    ]:
        averages = ("micro", "macro", "weighted", None) if k > 1 else ("macro",)
        for average in averages:
            got = value(cls(5, average=average, top_k=k), "ref", logits, labels)
            want = tcls(5, top_k=k, average=average or "none")(t_logits, t_labels)
            close(got, want.numpy())
    acc = tc.MulticlassAccuracy(5, top_k=k, average="micro")(t_logits, t_labels)
    close(value(esm.Accuracy(top_k=k), "value", logits, labels), acc.item())
    close(
        value(esm.Accuracy(top_k=k), "value", logits, labels),
        skm.top_k_accuracy_score(labels, logits, k=k, labels=range(5)),
    )


def test_top_k_past_the_classes_is_refused_as_torchmetrics_does():
    # top_k > num_classes would count every prediction correct (Accuracy returned
    # 1.0): torchmetrics refuses it; top_k == num_classes is allowed by both
    rng = np.random.default_rng(6)
    logits = rng.normal(size=(20, 3)).astype(np.float32)
    labels = rng.integers(0, 3, 20)
    with pytest.raises(ValueError):
        tc.MulticlassAccuracy(3, top_k=4)
    for make in (
        lambda: esm.Accuracy(top_k=4, num_classes=3),
        lambda: esm.Precision(3, average="macro", top_k=4),
        lambda: esm.Recall(3, average="micro", top_k=4),
    ):
        with pytest.raises(ValueError, match=r"top_k=4\) ranks among 3 classes") as e:
            make()
        assert isinstance(e.value, es.EqxStateError)
    # without num_classes, Accuracy finds it from the scores' class axis
    with pytest.raises(ValueError, match=r"Use top_k <= 3"):
        value(esm.Accuracy(top_k=4), "value", logits, labels)
    t_logits, t_labels = torch.tensor(logits), torch.tensor(labels)
    acc = tc.MulticlassAccuracy(3, top_k=3, average="micro")(t_logits, t_labels)
    close(value(esm.Accuracy(top_k=3), "value", logits, labels), acc.item())
    got = value(esm.Recall(3, average="macro", top_k=3), "ref", logits, labels)
    want = tc.MulticlassRecall(3, top_k=3, average="macro")(t_logits, t_labels)
    close(got, want.numpy())


# ------------------------------------------------------------- padding labels


@pytest.mark.parametrize("mode", MODES)
def test_padding_labels_count_as_wrong_in_accuracy(mode):
    # 18.3: a label that is not a class index is never a correct prediction
    close(value(esm.Accuracy(), mode, np.array([0, -1]), np.array([0, -1])), 0.5)
    close(
        value(esm.Accuracy(num_classes=3), mode, np.array([0, 5, 1]), [0, 5, 2]), 1 / 3
    )
    eye = np.eye(3, dtype=np.float32)
    close(value(esm.Accuracy(), mode, eye[[0, 1]], np.array([0, -1])), 0.5)
    # masked out, they count for nothing (sklearn on the real examples)
    got = value(esm.Accuracy(), mode, [0, -1, 2], [0, -1, 1], mask=[1, 0, 1])
    close(got, skm.accuracy_score([0, 1], [0, 2]))


# ----------------------------------------------------- negative sample weights


@pytest.mark.parametrize("mode", MODES)
def test_negative_total_weight_computes_the_weighted_value(mode):
    # 18.4: numpy.average / sklearn compute it; a silent 0 would be wrong
    x, w = np.array([1.0, 2.0], np.float32), np.array([-1.0, -1.0], np.float32)
    close(value(esm.Mean(), mode, x, sample_weight=w), np.average(x, weights=w))
    w2 = np.array([-1.0, 3.0], np.float32)
    close(value(esm.Mean(), mode, x, sample_weight=w2), np.average(x, weights=w2))
    preds, labels = np.array([1, 0]), np.array([1, 1])
    close(
        value(esm.Accuracy(), mode, preds, labels, sample_weight=w),
        skm.accuracy_score(labels, preds, sample_weight=w),
    )
    rng = np.random.default_rng(0)
    p, y = rng.integers(0, 3, 20), rng.integers(0, 3, 20)
    sw = rng.uniform(-2.0, -0.5, 20).astype(np.float32)
    for cls, fn in [(esm.Precision, skm.precision_score), (esm.F1, skm.f1_score)]:
        for average in ("micro", "macro", None):
            got = value(cls(3, average=average), mode, p, y, sample_weight=sw)
            close(got, fn(y, p, average=average, sample_weight=sw, zero_division=0))


def test_mean_std_refuses_negative_frequency_weights():
    m = es.to_refs(esm.MeanStd())
    with pytest.raises(Exception, match="negative sample weight"):
        m.update(jnp.array([1.0, 2.0]), sample_weight=jnp.array([1.0, -1.0]))
    with pytest.raises(ValueError, match="negative"):  # numpy.cov refuses them too
        np.cov([1.0, 2.0], fweights=[1, -1])


# ------------------------------------------------------------------- threshold


@pytest.mark.parametrize("mode", MODES)
def test_binary_threshold_matches_torchmetrics(mode):
    rng = np.random.default_rng(1)
    p = rng.random(50).astype(np.float32)
    p[:2] = 0.3  # exactly at the threshold: negative (`>`, as torchmetrics)
    y = rng.integers(0, 2, 50)
    tp, ty = torch.tensor(p), torch.tensor(y)
    pairs = [
        (esm.Accuracy, tc.BinaryAccuracy, skm.accuracy_score),
        (esm.Precision, tc.BinaryPrecision, skm.precision_score),
        (esm.Recall, tc.BinaryRecall, skm.recall_score),
        (esm.F1, tc.BinaryF1Score, skm.f1_score),
    ]
    for cls, tcls, fn in pairs:
        got = value(cls(threshold=0.3), mode, p, y)
        close(got, tcls(threshold=0.3)(tp, ty).item())
        close(got, fn(y, (p > 0.3).astype(int)))
        # a NaN is outside [0, 1]: as torchmetrics (on CPU), the whole batch goes
        # through a sigmoid (every other value then predicts 1), and NaN predicts 0
        pn = p.copy()
        pn[5] = np.nan
        got = value(cls(threshold=0.3), mode, pn, y)
        close(got, tcls(threshold=0.3)(torch.tensor(pn), ty).item())
        hard = np.where(np.isnan(pn), 0, 1)  # sigmoid(p) > 0.5 > 0.3 for p >= 0
        close(got, fn(y, hard))
    cm = value(esm.ConfusionMatrix(2, threshold=0.3), mode, p, y)
    np.testing.assert_array_equal(cm, tc.BinaryConfusionMatrix(threshold=0.3)(tp, ty))
    np.testing.assert_array_equal(cm, skm.confusion_matrix(y, (p > 0.3).astype(int)))


def test_threshold_errors():
    with pytest.raises(TypeError, match="threshold=0.5"):
        es.to_refs(esm.Precision()).update(jnp.array([0.2, 0.9]), jnp.array([0, 1]))
    with pytest.raises(ValueError, match=r"in \[0, 1\]"):
        esm.Accuracy(threshold=2.0)
    with pytest.raises(ValueError, match="num_classes=2"):
        es.to_refs(esm.ConfusionMatrix(3, threshold=0.5)).update(
            jnp.array([0.2, 0.9]), jnp.array([0, 1])
        )


# ------------------------------------------------------------------ multi-label


@pytest.mark.parametrize("mode", MODES)
def test_multilabel_matches_sklearn_and_torchmetrics(mode):
    rng = np.random.default_rng(2)
    n, num_labels = 40, 4
    p = rng.random((n, num_labels)).astype(np.float32)
    y = rng.integers(0, 2, (n, num_labels))
    y[:, 3] = 0  # a label with no positives: sklearn/torchmetrics average it too
    hard = (p > 0.5).astype(int)
    tp, ty = torch.tensor(p), torch.tensor(y)
    for cls, tcls, fn in [
        (esm.Precision, tc.MultilabelPrecision, skm.precision_score),
        (esm.Recall, tc.MultilabelRecall, skm.recall_score),
        (esm.F1, tc.MultilabelF1Score, skm.f1_score),
    ]:
        for average in ("micro", "macro", "weighted", None):
            m = cls(num_labels, average=average, multilabel=True, threshold=0.5)
            got = value(m, mode, p, y)
            close(got, fn(y, hard, average=average, zero_division=0))
            want = tcls(num_labels, threshold=0.5, average=average or "none")(tp, ty)
            close(got, want.numpy())
        # 0/1 predictions need no threshold
        got = value(cls(num_labels, average="macro", multilabel=True), mode, hard, y)
        close(got, fn(y, hard, average="macro", zero_division=0))
    cm = value(esm.ConfusionMatrix(num_labels, multilabel=True), mode, hard, y)
    np.testing.assert_array_equal(cm, skm.multilabel_confusion_matrix(y, hard))
    # Accuracy with a threshold on multi-label input: the fraction of correct entries
    got = value(esm.Accuracy(threshold=0.5), mode, p, y)
    close(got, 1 - skm.hamming_loss(y, hard))
    acc = tc.MultilabelAccuracy(num_labels, threshold=0.5, average="micro")(tp, ty)
    close(got, acc.item())


def test_multilabel_weights_mask_and_padding():
    rng = np.random.default_rng(4)
    hard, y = rng.integers(0, 2, (12, 3)), rng.integers(0, 2, (12, 3))
    w = rng.uniform(0.5, 2.0, 12).astype(np.float32)
    mask = rng.random(12) < 0.7
    y_pad = y.copy()
    y_pad[0, 1] = -1  # a padding entry: dropped
    keep = np.ones_like(y, bool)
    keep[0, 1] = False
    m = es.to_refs(esm.ConfusionMatrix(3, multilabel=True))
    m.update(jnp.asarray(hard), jnp.asarray(y_pad), sample_weight=w, mask=mask)
    want = np.zeros((3, 2, 2))
    for i in range(12):
        for j in range(3):
            if mask[i] and keep[i, j]:
                want[j, y[i, j], hard[i, j]] += w[i]
    close(m.compute(), want)
    # without the padding entry: sklearn on the unmasked rows
    m = es.to_refs(esm.ConfusionMatrix(3, multilabel=True))
    m.update(jnp.asarray(hard), jnp.asarray(y), sample_weight=w, mask=mask)
    close(
        m.compute(),
        skm.multilabel_confusion_matrix(y[mask], hard[mask], sample_weight=w[mask]),
    )


# --------------------------------------------------------------- zero_division


@pytest.mark.parametrize("zero_division", [0, 1, np.nan])
def test_zero_division_matches_sklearn(zero_division):
    y = np.array([0, 0, 1, 1, 2])
    p = np.array([0, 0, 0, 0, 0])  # classes 1 and 2 never predicted
    for cls, fn in [
        (esm.Precision, skm.precision_score),
        (esm.Recall, skm.recall_score),
        (esm.F1, skm.f1_score),
    ]:
        for average in ("micro", "macro", "weighted", None):
            m = cls(3, average=average, zero_division=zero_division)
            got = value(m, "ref", p, y)
            want = fn(y, p, average=average, zero_division=zero_division)
            np.testing.assert_allclose(got, want, rtol=1e-6, equal_nan=True)
        # binary: no positive predictions / no positive labels
        for pb, yb in [([0, 0, 0], [1, 0, 1]), ([1, 1, 0], [0, 0, 0])]:
            got = value(cls(zero_division=zero_division), "ref", pb, yb)
            want = fn(yb, pb, zero_division=zero_division)
            np.testing.assert_allclose(got, want, rtol=1e-6, equal_nan=True)


def test_zero_division_is_validated_and_compiles_once():
    with pytest.raises(ValueError, match="zero_division"):
        esm.F1(zero_division=0.5)
    # NaN is stored so that two metrics compare equal (no retrace per instance)
    a, b = esm.F1(zero_division=np.nan), esm.F1(zero_division=float("nan"))
    assert jax.tree.structure(a) == jax.tree.structure(b)


# ---------------------------------------------------------------- nan_strategy

X_NAN = np.array([1.0, np.nan, 3.0, 4.0], np.float32)
W_NAN = np.array([1.0, 2.0, np.nan, 0.5], np.float32)


@pytest.mark.parametrize("mode", MODES)
def test_nan_strategy_ignore_matches_torchmetrics(mode):
    tx, tw = torch.tensor(X_NAN), torch.tensor(W_NAN)
    pairs = [
        (esm.Mean, ta.MeanMetric, True),
        (esm.Sum, ta.SumMetric, False),
        (esm.Min, ta.MinMetric, False),
        (esm.Max, ta.MaxMetric, False),
    ]
    for cls, tcls, weighted in pairs:
        got = value(cls(nan_strategy="ignore"), mode, X_NAN)
        close(got, tcls(nan_strategy="ignore")(tx).item())
        close(
            got,
            {"Mean": np.nanmean, "Sum": np.nansum, "Min": np.nanmin}.get(
                cls.__name__, np.nanmax
            )(X_NAN),
        )
        if weighted:  # a NaN weight skips its value too
            got = value(cls(nan_strategy="ignore"), mode, X_NAN, sample_weight=W_NAN)
            close(got, tcls(nan_strategy="ignore")(tx, tw).item())
    ok = ~np.isnan(X_NAN)
    mean, std = run(esm.MeanStd(ddof=1, nan_strategy="ignore"), mode, X_NAN).compute()
    close(mean, X_NAN[ok].mean())
    close(std, X_NAN[ok].std(ddof=1))


def test_nan_strategy_propagate_is_numpy():
    assert np.isnan(value(esm.Mean(), "ref", X_NAN)) and np.isnan(np.mean(X_NAN))
    assert np.isnan(value(esm.Max(), "ref", X_NAN)) and np.isnan(np.max(X_NAN))
    assert np.isnan(value(esm.Mean(), "ref", [1.0, 2.0], sample_weight=[1.0, np.nan]))


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_a_weight_of_0_is_not_a_mask_for_nan_and_inf(bad):
    """A NaN (or inf) value with sample weight 0 makes the weighted mean and sum
    NaN (`0 * nan`, `0 * inf`), as `numpy.average` (and, for NaN, torchmetrics,
    whose `"disable"` is our `"propagate"`): only `mask=` leaves a value out. It
    was dropped, as if masked."""
    x = np.array([bad, 1.0, 2.0], np.float32)
    w = np.array([0.0, 1.0, 1.0], np.float32)
    with np.errstate(invalid="ignore"):
        want = {esm.Mean: np.average(x, weights=w), esm.Sum: np.sum(x * w)}
    assert np.isnan(want[esm.Mean]) and np.isnan(want[esm.Sum])
    unmasked = {esm.Mean: 1.5, esm.Sum: 3.0, esm.MeanStd: 1.5}  # the mean for MeanStd
    for cls, kept in unmasked.items():
        got = run(cls(), "value", x, sample_weight=w).compute()
        assert np.all(np.isnan(got)), cls.__name__
        masked = run(cls(), "value", x, mask=w != 0).compute()
        close(masked[0] if cls is esm.MeanStd else masked, kept)
    if np.isnan(bad):
        tx, tw = torch.tensor(x), torch.tensor(w)
        assert np.isnan(ta.MeanMetric(nan_strategy="disable")(tx, tw).item())
        # "ignore" skips a NaN whatever its weight (as torchmetrics removes it);
        # "error" refuses it whatever its weight, since it counts
        close(value(esm.Mean(nan_strategy="ignore"), "value", x, sample_weight=w), 1.5)
        close(ta.MeanMetric(nan_strategy="ignore")(tx, tw).item(), 1.5)
        with pytest.raises(Exception, match="nan_strategy='error'"):
            m = apply_update(esm.Mean(nan_strategy="error"), (x,), {"sample_weight": w})
            jax.block_until_ready(m.compute())


def test_nan_strategy_error_raises_in_every_way_of_running():
    bad, good = jnp.asarray(X_NAN), jnp.array([1.0, 2.0, 3.0, 4.0])
    # eagerly (ref mode): at the call
    m = es.to_refs(esm.Mean(nan_strategy="error"))
    with pytest.raises(Exception, match="nan_strategy='error'"):
        m.update(bad)
    # a masked NaN is no error, and the metric is usable
    m.update(bad, mask=~jnp.isnan(bad))
    close(m.compute(), np.nanmean(X_NAN))
    # under eqx.filter_jit(es.apply) (value mode): when the compiled call runs
    with pytest.raises(Exception, match="nan_strategy='error'"):
        apply_update(esm.Sum(nan_strategy="error"), (bad,), {})
    close(apply_update(esm.Sum(nan_strategy="error"), (good,), {}).compute(), 10.0)

    # inside make_step (the loss updates the metric)
    class Model(eqx.Module):
        w: jax.Array
        loss: esm.Mean

    def loss_fn(model, x):
        per_example = model.w * x
        model.loss.update(per_example)
        return jnp.mean(per_example)

    step = es.make_step(loss_fn, optax.sgd(0.1), donate=False)
    model = Model(jnp.ones(()), esm.Mean(nan_strategy="error"))
    opt_state = step.init(model)
    model, opt_state = step(model, opt_state, good)
    with pytest.raises(Exception, match="nan_strategy='error'"):
        step(model, opt_state, bad)
    close(model.loss.compute(), 2.5)  # the model returned before the error is intact


def test_nan_strategy_is_validated():
    with pytest.raises(ValueError, match="nan_strategy"):
        esm.Mean(nan_strategy="warn")


# ------------------------------------------------------- no NaN for "no data"


def test_last_value_and_empty_metrics_under_debug_nans():
    with jax.debug_nans(True):
        last = es.to_refs(esm.LastValue(shape=(2,)))
        assert np.asarray(last.compute()).tolist() == [0.0, 0.0]
        assert float(last.count[...]) == 0
        last.update(jnp.array([1.0, 2.0]))
        assert np.asarray(last.compute()).tolist() == [1.0, 2.0]
        # merging with an empty metric keeps the value (the count decides)
        merged = last.merge(esm.LastValue(shape=(2,)))
        assert np.asarray(merged.compute()).tolist() == [1.0, 2.0]
        merged = esm.LastValue(shape=(2,)).merge(last)
        assert np.asarray(merged.compute()).tolist() == [1.0, 2.0]
        for m in (
            esm.Mean(),
            esm.MeanStd(ddof=1),
            esm.Accuracy(),
            esm.F1(3, average="macro"),
        ):
            jax.tree.map(np.asarray, m.compute())
            jax.jit(lambda m: m.compute())(m)


# ---------------------------------------------------------- Metrics collection


@pytest.mark.parametrize("mode", MODES)
def test_update_all_gives_every_member_the_same_inputs(mode):
    rng = np.random.default_rng(6)
    logits = rng.normal(size=(30, 4)).astype(np.float32)
    labels = rng.integers(0, 4, 30)
    mask = rng.random(30) < 0.8
    collection = esm.Metrics(
        acc=esm.Accuracy(),
        top2=esm.Accuracy(top_k=2),
        nested=esm.Metrics(f1=esm.F1(4, average="macro"), cm=esm.ConfusionMatrix(4)),
    )
    args = (jnp.asarray(logits), jnp.asarray(labels))
    if mode == "ref":
        collection = es.to_refs(collection)
        collection.update_all(*args, mask=jnp.asarray(mask))
    else:
        fn = lambda m, a, k: m.update_all(*a, **k)  # noqa: E731
        _, collection = eqx.filter_jit(es.apply)(
            fn, collection, args, {"mask": jnp.asarray(mask)}
        )
    out = collection.compute()
    preds = logits.argmax(-1)
    close(out["acc"], skm.accuracy_score(labels[mask], preds[mask]))
    close(
        out["top2"],
        skm.top_k_accuracy_score(labels[mask], logits[mask], k=2, labels=range(4)),
    )
    close(out["nested"]["f1"], skm.f1_score(labels[mask], preds[mask], average="macro"))
    np.testing.assert_array_equal(
        out["nested"]["cm"],
        skm.confusion_matrix(labels[mask], preds[mask], labels=range(4)),
    )


def test_compute_keeps_the_users_key_order():
    def make():
        return esm.Metrics(
            {"zeta": esm.Mean(), "loss": esm.Sum(), "accuracy": esm.Accuracy()},
            beta=esm.Metrics(z=esm.Mean(), a=esm.Mean()),
        )

    want = ["zeta", "loss", "accuracy", "beta"]
    m = make()
    assert list(m.compute()) == want and list(m) == want
    params, static = eqx.partition(m, eqx.is_array)
    assert list(eqx.combine(params, static).compute()) == want
    assert list(jax.tree.map(lambda x: x, m).compute()) == want
    _, applied = es.apply(lambda m: m.update(zeta=1.0), m)
    assert list(applied.compute()) == want
    assert list(applied.compute()["beta"]) == ["z", "a"]
    jitted = eqx.filter_jit(lambda m: m)(m)
    assert list(jitted.compute()) == want
    assert list(es.freeze(es.to_refs(m)).compute()) == want
    assert list(m.merge(make()).compute()) == want
    assert list(es.reset(applied).compute()) == want
