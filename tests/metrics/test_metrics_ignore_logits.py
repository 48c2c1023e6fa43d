"""The classification metrics against torchmetrics on two of its input rules:
`ignore_index` (ignored targets change no statistic) and binary / multi-label
scores outside [0, 1] (logits: torchmetrics applies a sigmoid to the whole update
before `> threshold`). Binary, multi-class and multi-label inputs, both storage
modes (value mode runs under `jit`), and a merge of two halves."""

import equinox as eqx
import jax.numpy as jnp
import numpy as np
import pytest
from _metric_run import run
from _torchmetrics import classification as tc, torch

import eqx_state as es
from eqx_state import metrics as esm


# The same arithmetic in both modes: each case runs in one of them by default and in
# the other with the slow cases (tests/conftest.py, `_split_cases`); ref
# mode's writes under every transformation: tests/core/test_transform_matrix.py.
MODES = ["value", "ref"]


@eqx.filter_jit
def _update_all(metrics, p, y, mask):
    def update(ms, p, y, mask):
        for m in ms:
            m.update(p, y, mask=mask)

    return es.apply(update, metrics, p, y, mask)[1]


def update_all(metrics, mode, p, y, mask=None):
    """One update of every metric: jitted `es.apply` (value mode), or eagerly in
    ref mode."""
    p, y = jnp.asarray(p), jnp.asarray(y)
    mask = None if mask is None else jnp.asarray(mask)
    if mode == "ref":
        metrics = es.to_refs(metrics)
        for m in metrics:
            m.update(p, y, mask=mask)
        return metrics
    return _update_all(metrics, p, y, mask)


def binary_pairs(**kw):
    """Each binary metric beside its torchmetrics counterpart, built with `kw`."""
    metrics = [
        esm.Accuracy(**kw),
        esm.Precision(**kw),
        esm.Recall(**kw),
        esm.F1(**kw),
        esm.ConfusionMatrix(2, **kw),
    ]
    refs = [
        tc.BinaryAccuracy(**kw),
        tc.BinaryPrecision(**kw),
        tc.BinaryRecall(**kw),
        tc.BinaryF1Score(**kw),
        tc.BinaryConfusionMatrix(**kw),
    ]
    return metrics, refs


def check(metrics, refs, mode, p, y):
    """One pass over `(p, y)`, and the merge of two halves (two updates), equal
    the torchmetrics metrics `refs` (given the same data in one, then two calls)."""
    whole = update_all(metrics, mode, p, y)
    n = len(y) // 2
    first = update_all(metrics, mode, p[:n], y[:n])
    second = update_all(metrics, mode, p[n:], y[n:])
    merged = [a.merge(b) for a, b in zip(first, second)]
    tp, ty = torch.tensor(p), torch.tensor(y)
    for m, w, g, ref in zip(metrics, whole, merged, refs):
        name = f"{type(m).__name__} vs {type(ref).__name__}"
        want = ref(tp, ty).numpy()
        np.testing.assert_allclose(w.compute(), want, rtol=1e-5, err_msg=name)
        ref.reset()
        ref.update(tp[:n], ty[:n])
        ref.update(tp[n:], ty[n:])
        want2 = ref.compute().numpy()
        np.testing.assert_allclose(g.compute(), want2, rtol=1e-5, err_msg=name)
    return whole


# ---------------------------------------------------------------- ignore_index


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("ignore", [-1, 0])
@pytest.mark.split(every=4)
def test_ignore_index_binary(mode, ignore):
    rng = np.random.default_rng(10)
    p = rng.random(24).astype(np.float32)
    y = rng.integers(0, 2, 24)
    if ignore == -1:
        y[[1, 4, 9, 17, 20]] = -1
    kw = dict(threshold=0.5, ignore_index=ignore)
    metrics, refs = binary_pairs(**kw)
    whole = check(metrics, refs, mode, p, y)
    # the ignored examples change nothing: the same metrics on the kept ones alone
    keep = y != ignore
    kept = update_all(metrics, mode, p[keep], y[keep])
    for a, b in zip(whole, kept):
        np.testing.assert_array_equal(a.compute(), b.compute())


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("ignore", [-1, 0, 255])
@pytest.mark.split(every=4)
def test_ignore_index_multiclass(mode, ignore):
    rng = np.random.default_rng(11)
    c = 4
    logits = rng.normal(size=(30, c)).astype(np.float32)
    y = rng.integers(0, c, 30)
    if ignore != 0:
        y[[0, 3, 8, 15, 16, 29]] = ignore
    kw = dict(ignore_index=ignore)
    metrics = [
        esm.Accuracy(**kw),
        esm.Accuracy(top_k=2, **kw),
        esm.Precision(c, average="macro", **kw),
        esm.Recall(c, average="weighted", **kw),
        esm.F1(c, average=None, **kw),
        esm.ConfusionMatrix(c, **kw),
    ]
    refs = [
        tc.MulticlassAccuracy(c, average="micro", **kw),
        tc.MulticlassAccuracy(c, top_k=2, average="micro", **kw),
        tc.MulticlassPrecision(c, average="macro", **kw),
        tc.MulticlassRecall(c, average="weighted", **kw),
        tc.MulticlassF1Score(c, average="none", **kw),
        tc.MulticlassConfusionMatrix(c, **kw),
    ]
    check(metrics, refs, mode, logits, y)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("ignore", [-1, 0])
@pytest.mark.split(every=4)
def test_ignore_index_multilabel(mode, ignore):
    rng = np.random.default_rng(12)
    n, labels = 20, 3
    p = rng.random((n, labels)).astype(np.float32)
    y = rng.integers(0, 2, (n, labels))
    if ignore == -1:
        y[rng.random((n, labels)) < 0.25] = -1  # ignored entries, per label
    kw = dict(threshold=0.5, ignore_index=ignore)
    ml = dict(multilabel=True, **kw)
    metrics = [
        esm.Accuracy(**kw),
        esm.Precision(labels, average="macro", **ml),
        esm.Recall(labels, average="micro", **ml),
        esm.F1(labels, average=None, **ml),
        esm.ConfusionMatrix(labels, **ml),
    ]
    refs = [
        tc.MultilabelAccuracy(labels, average="micro", **kw),
        tc.MultilabelPrecision(labels, average="macro", **kw),
        tc.MultilabelRecall(labels, average="micro", **kw),
        tc.MultilabelF1Score(labels, average="none", **kw),
        tc.MultilabelConfusionMatrix(labels, **kw),
    ]
    check(metrics, refs, mode, p, y)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("how", ["mask", "sample_weight"])
def test_multilabel_entries_left_out_per_entry_equal_torchmetrics_ignoring_them(
    mode, how
):
    """A per-entry mask (or 0/1 weight) of shape [batch, num_labels]: the confusion
    metrics refused it, saying the values had shape [batch] (they built the
    weights from the first label's column), where Accuracy takes it. Reference:
    torchmetrics with those entries' labels set to its `ignore_index`."""
    rng = np.random.default_rng(3)
    n, labels = 16, 3
    p = rng.random((n, labels)).astype(np.float32)
    y = rng.integers(0, 2, (n, labels))
    keep = rng.random((n, labels)) < 0.7
    given = keep if how == "mask" else keep.astype(np.float32)
    ml = dict(threshold=0.5, multilabel=True)
    metrics = [
        esm.Precision(labels, average="macro", **ml),
        esm.Recall(labels, average="micro", **ml),
        esm.F1(labels, average=None, **ml),
        esm.ConfusionMatrix(labels, **ml),
    ]
    refs = [
        tc.MultilabelPrecision(labels, average="macro", threshold=0.5, ignore_index=-1),
        tc.MultilabelRecall(labels, average="micro", threshold=0.5, ignore_index=-1),
        tc.MultilabelF1Score(labels, average="none", threshold=0.5, ignore_index=-1),
        tc.MultilabelConfusionMatrix(labels, threshold=0.5, ignore_index=-1),
    ]
    y_ignored = torch.tensor(np.where(keep, y, -1))
    for m, ref in zip(metrics, refs):
        got = run(m, mode, p, y, **{how: given})
        want = ref(torch.tensor(p), y_ignored).numpy()
        np.testing.assert_allclose(
            got.compute(), want, rtol=1e-5, err_msg=type(m).__name__
        )


def test_ignore_index_must_be_an_int():
    # (a float is refused by the signature's type check in the tests)
    for cls in (esm.Accuracy, esm.F1, esm.ConfusionMatrix):
        kw = {} if cls is esm.Accuracy else {"num_classes": 2}
        with pytest.raises(TypeError, match="ignore_index must be None or an int"):
            cls(ignore_index=True, **kw)


# ---------------------------------------------------------------------- logits


@pytest.mark.parametrize("mode", MODES)
def test_binary_logits_are_passed_through_a_sigmoid(mode):
    rng = np.random.default_rng(13)
    logits = (2 * rng.normal(size=24)).astype(np.float32)
    y = rng.integers(0, 2, 24)
    # the second half is probabilities: each update decides for itself, as
    # torchmetrics decides per call (the merged halves equal its two calls)
    logits[12:] = rng.random(12).astype(np.float32)
    kw = dict(threshold=0.5)
    metrics, refs = binary_pairs(**kw)
    whole = check(metrics, refs, mode, logits, y)
    # by hand: the whole batch (it has values outside [0, 1]) through a sigmoid
    hard = (1 / (1 + np.exp(-logits.astype(np.float64))) > 0.5).astype(int)
    assert float(whole[0].compute()) == pytest.approx(np.mean(hard == y))
    assert not np.array_equal(hard, logits > 0.5)  # the rule matters here


@pytest.mark.parametrize("mode", MODES)
def test_multilabel_logits_are_passed_through_a_sigmoid(mode):
    rng = np.random.default_rng(14)
    n, labels = 20, 3
    logits = rng.normal(size=(n, labels)).astype(np.float32)
    logits[:10] = rng.random((10, labels)).astype(np.float32)  # probabilities
    y = rng.integers(0, 2, (n, labels))
    kw = dict(threshold=0.5)
    ml = dict(multilabel=True, **kw)
    metrics = [
        esm.Accuracy(**kw),
        esm.Precision(labels, average="micro", **ml),
        esm.Recall(labels, average="macro", **ml),
        esm.F1(labels, average="weighted", **ml),
        esm.ConfusionMatrix(labels, **ml),
    ]
    refs = [
        tc.MultilabelAccuracy(labels, average="micro", **kw),
        tc.MultilabelPrecision(labels, average="micro", **kw),
        tc.MultilabelRecall(labels, average="macro", **kw),
        tc.MultilabelF1Score(labels, average="weighted", **kw),
        tc.MultilabelConfusionMatrix(labels, **kw),
    ]
    check(metrics, refs, mode, logits, y)


@pytest.mark.parametrize("mode", MODES)
def test_logits_rule_with_masked_and_ignored_entries(mode):
    """Masked-out entries are not given to the metric: they do not decide. Ignored
    ones are given: they decide, except for torchmetrics' BinaryConfusionMatrix,
    which drops them first."""
    p = np.array([0.2, 0.7, 0.4, 0.9, 0.6, 0.1], np.float32)
    y = np.array([0, 1, 1, 1, 0, 0])
    p_out = p.copy()
    p_out[5] = 3.0  # a logit on an entry that is masked out / ignored
    mask = np.array([True] * 5 + [False])
    metrics = [esm.Precision(threshold=0.5), esm.ConfusionMatrix(2, threshold=0.5)]
    got = update_all(metrics, mode, p_out, y, mask)
    tp, ty = torch.tensor(p[:5]), torch.tensor(y[:5])
    want = tc.BinaryPrecision(threshold=0.5)(tp, ty).item()  # probabilities
    np.testing.assert_allclose(got[0].compute(), want, rtol=1e-6)
    np.testing.assert_array_equal(
        got[1].compute(), tc.BinaryConfusionMatrix(threshold=0.5)(tp, ty).numpy()
    )
    y_ign = y.copy()
    y_ign[5] = -1
    metrics = [
        esm.Precision(threshold=0.5, ignore_index=-1),
        esm.ConfusionMatrix(2, threshold=0.5, ignore_index=-1),
    ]
    got = update_all(metrics, mode, p_out, y_ign)
    tp, ty = torch.tensor(p_out), torch.tensor(y_ign)
    prec = tc.BinaryPrecision(threshold=0.5, ignore_index=-1)(tp, ty).item()
    cm = tc.BinaryConfusionMatrix(threshold=0.5, ignore_index=-1)(tp, ty).numpy()
    np.testing.assert_allclose(got[0].compute(), prec, rtol=1e-6)
    np.testing.assert_array_equal(got[1].compute(), cm)
    # the two rules differ on this batch: sigmoid(0.4) > 0.5, 0.4 is not
    assert prec != want


@pytest.mark.parametrize("x64", [False, True])
def test_labels_past_int32_are_out_of_range_not_wrapped(x64):
    """A label or prediction past int32's range (NumPy int64 / uint64 with x64 off,
    JAX int64 with it on) is out of range, as any label outside
    `[0, num_classes)`: dropped by the confusion matrix, never the label of a
    class. Before, the cast to int32 wrapped `2**32 + 1` into class 1 (sklearn,
    given the same labels, leaves it out of the listed classes)."""
    import jax
    from sklearn.metrics import confusion_matrix, recall_score

    big = 2**32 + 1
    with jax.enable_x64(x64):
        y = np.array([1, 1, 0, 1], np.int64)
        p = np.array([big, 1, 0, 2**32], np.int64)
        cm = es.to_refs(esm.ConfusionMatrix(2))
        cm.update(p if not x64 else jnp.asarray(p), y)
        want = confusion_matrix(y, p, labels=[0, 1])
        np.testing.assert_array_equal(np.asarray(cm.compute()), want)
        rec = es.to_refs(esm.Recall(3, average=None))
        rec.update(np.array([2**32, 1], np.uint64), np.array([0, 1], np.uint64))
        np.testing.assert_array_equal(
            np.asarray(rec.compute()),
            recall_score(
                [0, 1], [2**32, 1], labels=[0, 1, 2], average=None, zero_division=0
            ),
        )
        # the ignored label is the given one, not a wrapped or clamped one
        acc = es.to_refs(esm.Accuracy(ignore_index=1))
        acc.update(np.array([1, 0]), np.array([big, 0], np.int64))
        assert float(acc.compute()) == 0.5
        acc = es.to_refs(esm.Accuracy(ignore_index=2**31 - 1))
        acc.update(np.array([1, 0]), np.array([2**40, 0], np.int64))
        assert float(acc.compute()) == 0.5
        acc = es.to_refs(esm.Accuracy(ignore_index=2**40))
        acc.update(np.array([1, 0]), np.array([2**40, 0], np.int64))
        assert float(acc.compute()) == 1.0  # left out, as torchmetrics leaves it


def test_scores_with_one_class_are_refused_with_the_fix():
    """`[B, 1]` probabilities with `[B]` labels read as logits of one class made
    every prediction class 0 (accuracy 0.5 here, 1.0 squeezed; torchmetrics'
    binary_accuracy refuses the shapes); Precision's message advised
    `num_classes=1`, which Precision refuses."""
    p = jnp.asarray([[0.9], [0.8], [0.1], [0.2]])
    y = jnp.asarray([1, 1, 0, 0])
    for metric in (
        esm.Accuracy(threshold=0.5),
        esm.Accuracy(),
        esm.Precision(2, threshold=0.5),
        esm.ConfusionMatrix(2, threshold=0.5),
    ):
        m = es.to_refs(metric)
        with pytest.raises(ValueError, match=r"class axis of size 1.*x\[\.\.\., 0\]"):
            m.update(p, y)
    m = es.to_refs(esm.Accuracy(threshold=0.5))
    m.update(p[..., 0], y)  # the fix the message names
    assert float(m.compute()) == 1.0
