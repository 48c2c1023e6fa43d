"""Two rules against scikit-learn and numpy, in both storage modes.

* The dtype of a metric's statistics: a floating dtype everywhere; a signed integer
  dtype only where whole numbers are counted or summed (Sum, Accuracy, the
  confusion-matrix metrics, Histogram) or kept (Min, Max, LastValue), and then an
  input the statistics would truncate (a weight of 0.5, a value of 2.5) raises at
  `update` instead of being truncated; a mean is never integer.
* The macro average of Precision / Recall / F1 is over the classes seen in the
  labels or predictions (scikit-learn's `labels=None`), whatever the examples'
  sample weights, 0 included: a weight of 0 is not a mask, `mask=` and padding
  labels are. The "seen" statistic merges (two halves = one pass) and resets."""

import equinox as eqx
import jax.numpy as jnp
import numpy as np
import pytest
import sklearn.metrics as skm
from _metric_run import run

import eqx_state as es
from eqx_state import metrics as esm


# The same arithmetic in both modes: each case runs in one of them by default and in
# the other with the slow cases (tests/conftest.py, `_split_cases`); ref
# mode's writes under every transformation: tests/core/test_transform_matrix.py.
MODES = ["value", "ref"]


def close(a, b, rtol=1e-5, atol=1e-6):
    np.testing.assert_allclose(
        np.asarray(a, np.float64), np.asarray(b, np.float64), rtol=rtol, atol=atol
    )


# ---------------------------------------------------------------------- dtypes

FLOAT_ONLY = [esm.Mean, esm.MeanStd]
COUNTS = [
    esm.Sum,
    esm.Accuracy,
    lambda **kw: esm.ConfusionMatrix(3, **kw),
    lambda **kw: esm.Precision(3, average="macro", **kw),
    lambda **kw: esm.Recall(3, average="macro", **kw),
    lambda **kw: esm.F1(3, average="macro", **kw),
    lambda **kw: esm.Histogram(3, range=(0.0, 1.0), **kw),
]
VALUES = [esm.Min, esm.Max, esm.LastValue]


@pytest.mark.parametrize("factory", FLOAT_ONLY)
def test_a_mean_refuses_an_integer_dtype(factory):
    # the red-team case: Mean(dtype=int32) of [1.5, 2.5, 0.4] computed 1
    for dtype in (jnp.int32, jnp.uint8, jnp.bool_, jnp.complex64):
        with pytest.raises(ValueError, match="dtype must be a floating dtype"):
            factory(dtype=dtype)
    factory(dtype=jnp.float32)


@pytest.mark.parametrize("factory", COUNTS)
def test_counts_take_floating_or_signed_integer_dtypes(factory):
    for dtype in (jnp.uint8, jnp.uint32, jnp.bool_, jnp.complex64):
        with pytest.raises(ValueError, match="or, to count whole numbers exactly"):
            factory(dtype=dtype)
    for dtype in (jnp.float32, jnp.int32):
        factory(dtype=dtype)


@pytest.mark.parametrize("factory", FLOAT_ONLY + COUNTS)
def test_accumulated_statistics_refuse_a_narrow_float(factory):
    """In bfloat16 a count stops at 256 (float16: 2048) without a word: 300
    single-example updates of `Accuracy(dtype=bfloat16)` read 256 examples. The
    inputs may be narrow; float32 statistics count them as NumPy does."""
    for dtype, stop in ((jnp.bfloat16, 256), (jnp.float16, 2048)):
        with pytest.raises(ValueError, match=rf"32 bits or more.*past {stop}"):
            factory(dtype=dtype)


def test_narrow_inputs_are_counted_exactly_by_float32_statistics():
    n = 300  # bfloat16 statistics would read 256
    values = jnp.asarray(np.arange(n) % 3 / 2.0, jnp.bfloat16)  # 0, .5, 1 exact
    _, metric = es.make_apply(lambda m, v: m.update(v)).scan(esm.Mean(), values)
    assert float(metric.weight[...]) == n
    np.testing.assert_allclose(metric.compute(), np.mean(np.float64(values)))


@pytest.mark.parametrize("factory", VALUES)
def test_kept_values_take_floating_or_integer_dtypes(factory):
    for dtype in (jnp.bool_, jnp.complex64):
        with pytest.raises(ValueError, match="floating or integer dtype"):
            factory(dtype=dtype)
    for dtype in (jnp.float32, jnp.int32, jnp.uint32, jnp.uint8, jnp.int16):
        factory(dtype=dtype)


@pytest.mark.parametrize("factory", COUNTS)
def test_integer_counts_narrower_than_32_bits_are_refused(factory):
    """An int8 count wraps without a word (`ConfusionMatrix(2, dtype=int8)` read
    -86 for scikit-learn's 170, and `Recall(average="micro")` 1.536 for 0.85), and
    JAX sums int8 and int16 in 32 bits, so every update of such a metric failed.
    Refused when the metric is built; the inputs may be narrow. (A kept value,
    `Min`, `Max`, `LastValue`, cannot overflow: narrow integers are fine there.)"""
    for dtype in (jnp.int8, jnp.int16, jnp.uint8, jnp.uint16):
        with pytest.raises(ValueError, match="Keep integer statistics in jnp.int32"):
            factory(dtype=dtype)


@pytest.mark.parametrize("mode", MODES)
def test_integer_counts_refuse_fractional_weights_at_update(mode):
    # the red-team case: Accuracy(dtype=int32) with weights [0.5, 0.5, 2] gave 0.0
    p, y, w = np.array([1, 0, 1]), np.array([1, 0, 0]), np.array([0.5, 0.5, 2.0])
    for name, metric, args in [
        ("Accuracy", esm.Accuracy(dtype=jnp.int32), (p, y)),
        ("ConfusionMatrix", esm.ConfusionMatrix(2, dtype=jnp.int32), (p, y)),
        ("F1", esm.F1(dtype=jnp.int32), (p, y)),
        (
            "Recall",
            esm.Recall(2, average="macro", multilabel=True, dtype=jnp.int32),
            (p[:, None],) * 2,
        ),
        ("Sum", esm.Sum(dtype=jnp.int32), (y,)),
    ]:
        with pytest.raises(TypeError, match=rf"{name}\(dtype=int32\).*sample_weight"):
            run(metric, mode, *args, sample_weight=w)
    # a Python float weight too (weakly typed), as a state write would refuse it
    acc = es.to_refs(esm.Accuracy(dtype=jnp.int32))
    with pytest.raises(TypeError, match="a weight of 0.5 would count as 0"):
        acc.update(jnp.asarray(p), jnp.asarray(y), sample_weight=1.0)


@pytest.mark.parametrize("mode", MODES)
def test_integer_sums_and_extremes_refuse_fractional_values_at_update(mode):
    # the red-team case: Sum(dtype=int32) of [1.5, 2.5, 0.4] gave 3
    x = np.array([1.5, 2.5, 0.4], np.float32)
    for metric in [
        esm.Sum(dtype=jnp.int32),
        esm.Min(dtype=jnp.int32),
        esm.Max(dtype=jnp.int32),
        esm.LastValue(dtype=jnp.int32),
    ]:
        name = type(metric).__name__
        with pytest.raises(TypeError, match=rf"{name}\(dtype=int\d+\).*2.5 would"):
            run(metric, mode, x)


@pytest.mark.parametrize("mode", MODES)
def test_inputs_the_statistics_cannot_hold_are_refused_not_wrapped(mode):
    """A cast into the statistics' dtype wrapped or rounded inputs of the same kind:
    `Max(dtype=int32)` of uint32 [3e9, 7] read 7 (NumPy: 3e9), `Min(dtype=uint32)`
    of [-1, 3] read 3, `Max(dtype=bfloat16)` of float32 1.001 read 1.0. Refused at
    `update`, as a state write refuses a narrowing cast; inputs the statistics hold
    (narrower integers, Python numbers) give NumPy's numbers."""
    big = np.array([3_000_000_000, 7], np.uint32)
    for metric, x in [
        (esm.Max(dtype=jnp.int32), big),
        (esm.Min(dtype=jnp.int32), big),
        (esm.Sum(dtype=jnp.int32), big),
        (esm.LastValue(dtype=jnp.int32), big[0]),
        (esm.Min(dtype=jnp.uint32), np.array([-1, 3], np.int32)),
        (esm.Max(dtype=jnp.bfloat16), np.array([1.001], np.float32)),
    ]:
        name = type(metric).__name__
        with pytest.raises(TypeError, match=rf"{name}\(dtype=\w+\).*do not hold"):
            run(metric, mode, x)
    small = np.array([-100, 27, 5], np.int8)
    assert int(run(esm.Max(dtype=jnp.int32), mode, small).compute()) == small.max()
    assert int(run(esm.Min(dtype=jnp.int32), mode, small).compute()) == small.min()
    assert int(run(esm.Sum(dtype=jnp.int32), mode, small).compute()) == small.sum()
    assert float(run(esm.Max(), mode, big).compute()) == np.float32(big.max())
    got = run(esm.Max(dtype=jnp.bfloat16), mode, jnp.asarray([1.001], jnp.bfloat16))
    assert float(got.compute()) == float(jnp.bfloat16(1.001))
    # a Python int is cast, so it must fit: -1 into uint32 read 4294967295 (x64)
    # or raised JAX's bare OverflowError
    low = esm.Min(dtype=jnp.uint32)
    with pytest.raises(TypeError, match=r"Min\(dtype=uint32\).*-1.*do not hold"):
        if mode == "ref":
            es.to_refs(low).update(-1)
        else:
            es.apply(lambda m: m.update(-1), low)
    assert int(run(esm.Min(dtype=jnp.uint32), mode, 5).compute()) == 5


@pytest.mark.parametrize("mode", MODES)
def test_kept_values_of_narrow_and_unsigned_integer_dtypes_equal_numpy(mode):
    """`LastValue(dtype=int8)` raised at every update (JAX summed its pick in
    int32) and `Min(dtype=uint32)` overflowed its identity 2**32 - 1 as a weakly
    typed argument; both equal NumPy now, as `Max(dtype=uint8)` did."""
    for dtype in (np.int8, np.uint8, np.int16, np.uint32):
        info = np.iinfo(dtype)
        x = np.array([info.max, info.min, 7], dtype)
        assert int(run(esm.Max(dtype=dtype), mode, x).compute()) == x.max()
        assert int(run(esm.Min(dtype=dtype), mode, x).compute()) == x.min()
        got = run(esm.LastValue(dtype=dtype), mode, x).compute()
        assert int(got) == x[-1]


@pytest.mark.parametrize("mode", MODES)
def test_an_ignore_index_outside_the_labels_dtype_ignores_nothing(mode):
    """uint8 labels with `ignore_index=-1` (or int8 with 255) raised NumPy's bare
    OverflowError in the confusion-matrix metrics: no label of that dtype is the
    index, so nothing is ignored, as scikit-learn counts the same labels (and as
    Accuracy already did)."""
    rng = np.random.default_rng(4)
    y = rng.integers(0, 3, 50).astype(np.uint8)
    p = np.where(rng.random(50) < 0.6, y, rng.integers(0, 3, 50)).astype(np.int32)
    for ignore in (-1, 300):
        cm = run(esm.ConfusionMatrix(3, ignore_index=ignore), mode, p, y)
        np.testing.assert_array_equal(cm.compute(), skm.confusion_matrix(y, p))
        r = run(esm.Recall(3, average="macro", ignore_index=ignore), mode, p, y)
        close(r.compute(), skm.recall_score(y, p, average="macro"))
    y8 = y.astype(np.int8)
    f1 = run(esm.F1(3, average="micro", ignore_index=255), mode, p, y8)
    close(f1.compute(), skm.f1_score(y8, p, average="micro"))


@pytest.mark.parametrize("mode", MODES)
def test_accuracy_ignores_an_unsigned_padding_label_past_int32(mode):
    """A uint32 padding label 0xFFFFFFFF with `ignore_index=2**32 - 1`: Accuracy
    compared it after casting the labels to int32 (-1), so the padding counted as
    wrong (0.4 where sklearn on the kept examples gives 2/3); the confusion-matrix
    metrics compared the labels as given. Reference: sklearn on the kept ones."""
    pad = 2**32 - 1
    y = np.array([0, 1, 2, pad, pad], np.uint32)
    p = np.array([0, 1, 1, 0, 2], np.int32)
    keep = y != pad
    want = skm.accuracy_score(y[keep], p[keep])
    acc = run(esm.Accuracy(ignore_index=pad), mode, p, y)
    close(acc.compute(), want)
    rec = run(esm.Recall(3, average="micro", ignore_index=pad), mode, p, y)
    close(rec.compute(), want)
    labels = np.array([[1, 0, pad], [0, pad, 1]], np.uint32)
    probs = np.array([[0.9, 0.2, 0.7], [0.6, 0.1, 0.8]], np.float32)
    multi = run(esm.Accuracy(threshold=0.5, ignore_index=pad), mode, probs, labels)
    kept = labels != pad
    close(multi.compute(), np.mean((probs > 0.5)[kept] == (labels[kept] == 1)))


@pytest.mark.parametrize("mode", MODES)
def test_a_threshold_compares_in_the_probabilities_dtype_as_torchmetrics(mode):
    """`p > threshold` with the threshold rounded to the probabilities' dtype, for
    every dtype alike: bfloat16 and float16 probabilities were compared in
    float32 against the exact threshold (bfloat16 0.30078125 > 0.3), float32 ones
    against the rounded threshold, so that one probability value was predicted
    differently in bfloat16 and in float32. Reference: torchmetrics on tensors of
    the same dtype, values at, just above and just below the threshold."""
    from _torchmetrics import classification as tc, torch

    t = 0.3
    y = np.array([1, 1, 1, 0, 1, 0])
    for dtype, tdtype in (
        (jnp.bfloat16, torch.bfloat16),
        (jnp.float16, torch.float16),
        (jnp.float32, torch.float32),
    ):
        at = jnp.asarray(t, dtype)
        up = jnp.nextafter(at, jnp.asarray(1, dtype))
        down = jnp.nextafter(at, jnp.asarray(0, dtype))
        probs = jnp.stack([at, up, down, up, at, jnp.asarray(0.9, dtype)])
        tp = torch.tensor(np.asarray(probs, np.float32)).to(tdtype)
        for cls, tcls in (
            (esm.Recall, tc.BinaryRecall),
            (esm.Accuracy, tc.BinaryAccuracy),
        ):
            got = run(cls(threshold=t), mode, probs, y).compute()
            want = tcls(threshold=t)(tp, torch.tensor(y)).item()
            assert float(got) == pytest.approx(want), (cls, jnp.dtype(dtype).name)


@pytest.mark.parametrize("mode", MODES)
def test_integer_dtypes_count_whole_numbers_exactly(mode):
    rng = np.random.default_rng(0)
    y = rng.integers(0, 3, 40)
    p = np.where(rng.random(40) < 0.6, y, rng.integers(0, 3, 40))
    w = rng.integers(0, 4, 40).astype(np.int32)
    kw = {"sample_weight": w}
    acc = run(esm.Accuracy(dtype=jnp.int32), mode, p, y, **kw)
    assert acc.correct[...].dtype == jnp.int32
    close(acc.compute(), skm.accuracy_score(y, p, sample_weight=w))
    cm = run(esm.ConfusionMatrix(3, dtype=jnp.int32), mode, p, y, **kw)
    np.testing.assert_array_equal(
        cm.compute(), skm.confusion_matrix(y, p, labels=[0, 1, 2], sample_weight=w)
    )
    for cls, fn in [
        (esm.Precision, skm.precision_score),
        (esm.Recall, skm.recall_score),
        (esm.F1, skm.f1_score),
    ]:
        for average in ("macro", "weighted", "micro", None):
            got = run(cls(3, average=average, dtype=jnp.int32), mode, p, y, **kw)
            want = fn(y, p, average=average, sample_weight=w, zero_division=0)
            close(got.compute(), want)
    # past float32's 2**24, integers still count one by one
    big = np.array([2**24, 1, 1], np.int32)
    total = run(esm.Sum(dtype=jnp.int32), mode, big)
    assert int(total.compute()) == 2**24 + 2
    assert float(run(esm.Sum(), mode, big).compute()) != 2**24 + 2  # float32 rounds
    x = rng.integers(-50, 50, 12).astype(np.int32)
    assert int(run(esm.Min(dtype=jnp.int32), mode, x).compute()) == x.min()
    assert int(run(esm.Max(dtype=jnp.int32), mode, x).compute()) == x.max()
    assert int(run(esm.LastValue(dtype=jnp.int32), mode, x).compute()) == x[-1]


# ------------------------------------------------- macro average: seen classes


PRF = [
    (esm.Precision, skm.precision_score),
    (esm.Recall, skm.recall_score),
    (esm.F1, skm.f1_score),
]


@pytest.mark.parametrize("mode", MODES)
def test_a_class_seen_only_with_weight_zero_counts_in_the_macro_average(mode):
    # the red-team case: class 3 occurs only in an example of weight 0
    y, p, w = np.array([0, 3, 3]), np.array([0, 0, 2]), np.array([0.5, 0.5, 0.0])
    for cls, fn in PRF:
        for average in ("macro", "weighted", "micro", None):
            got = run(cls(4, average=average), mode, p, y, sample_weight=w)
            want = fn(y, p, average=average, sample_weight=w, zero_division=0)
            if average is None:  # sklearn scores the classes seen: 0, 2, 3
                got = np.asarray(got.compute())[[0, 2, 3]]
            else:
                got = got.compute()
            close(got, want)
    assert float(
        run(esm.Recall(4, average="macro"), mode, p, y, sample_weight=w).compute()
    ) == pytest.approx(1 / 3)


N = 30
C = 5


def _draw(seed):
    rng = np.random.default_rng(seed)
    y = rng.integers(0, C, N)
    p = np.where(rng.random(N) < 0.5, y, rng.integers(0, C, N))
    w = rng.uniform(0.1, 2.0, N).astype(np.float32)
    w[rng.random(N) < 0.4] = 0.0  # many zero weights
    if seed % 3 == 0:
        w[y == 4] = 0.0  # a class seen only with weight 0 (as label)
    if seed % 3 == 1:
        w[(y == 4) | (p == 4)] = 0.0  # ... as label and prediction
    mask = rng.random(N) < 0.8
    return y, p, w, mask


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("zero_division", [0, 1, np.nan])
def test_random_zero_weights_mask_and_padding_match_sklearn(mode, zero_division):
    for seed in range(6):
        y, p, w, mask = _draw(seed)
        # a padding label (-1) is dropped like a masked-out example
        y_pad = np.where(np.arange(N) % 7 == 3, -1, y)
        keep = mask & (y_pad >= 0)
        for cls, fn in PRF:
            for average in ("macro", "weighted"):
                metric = cls(C, average=average, zero_division=zero_division)
                got = run(metric, mode, p, y_pad, sample_weight=w, mask=mask)
                want = fn(
                    y_pad[keep],
                    p[keep],
                    average=average,
                    sample_weight=w[keep],
                    zero_division=zero_division,
                )
                np.testing.assert_allclose(
                    np.asarray(got.compute(), np.float64),
                    want,
                    rtol=1e-5,
                    equal_nan=True,
                    err_msg=f"{cls.__name__} {average} seed {seed}",
                )


def test_a_masked_out_class_is_not_seen():
    # mask= is a mask: class 2, only in a masked-out example, is not averaged over
    y, p = np.array([0, 1, 2]), np.array([0, 0, 2])
    metric = run(esm.Recall(3, average="macro"), "ref", p, y, mask=np.array([1, 1, 0]))
    close(metric.compute(), skm.recall_score(y[:2], p[:2], average="macro"))
    assert np.asarray(metric.seen[...]).tolist() == [True, True, False]


@pytest.mark.parametrize("cls,fn", PRF)
def test_seen_merges_as_one_pass_and_resets(cls, fn):
    y, p, w, mask = _draw(0)
    h = N // 2
    a = run(cls(C, average="macro"), "value", p[:h], y[:h], sample_weight=w[:h])
    b = run(cls(C, average="macro"), "ref", p[h:], y[h:], sample_weight=w[h:])
    whole = run(cls(C, average="macro"), "ref", p, y, sample_weight=w)
    merged = a.merge(b)
    np.testing.assert_array_equal(merged.seen[...], whole.seen[...])
    want = fn(y, p, average="macro", sample_weight=w, zero_division=0)
    close(merged.compute(), want)
    close(whole.compute(), want)
    fresh = es.reset(merged)
    assert not np.asarray(fresh.seen[...]).any()
    assert float(fresh.compute()) == 0.0


def test_an_ignore_index_on_bool_labels_compares_the_numbers_0_and_1():
    """Bool labels (taken without the type hook's `Integer` check, as users call
    it) are the numbers 0 and 1: `ignore_index=-1` ignores none of them (it was
    cast to `True`, which dropped every positive example), 1 the positives.
    Reference: NumPy's comparison of the numbers."""
    from eqx_state.metrics._labels import _ignored

    labels = np.array([True, False, True, False])
    for index in (-1, 0, 1, 2, 255):
        got = _ignored(jnp.asarray(labels), index)
        np.testing.assert_array_equal(got, labels.astype(np.int64) == index)


def test_a_weakly_typed_integer_constant_updates_integer_statistics_under_jit():
    """A concrete weakly typed constant (`jnp.asarray(3)` made outside) closed over
    by a jitted function or a scan body: the range check reads it on the host
    (`int(jnp.min(c))` inside the trace raised a ConcretizationTypeError).
    Reference: NumPy's sums and maxima of the same numbers."""
    c, w = jnp.asarray(3), jnp.full((3,), 2)
    assert c.weak_type and w.weak_type
    v = jnp.array([1, 2, 3], jnp.int32)

    @eqx.filter_jit
    def update(metric):
        return es.apply(lambda m: m.update(c), metric)[1]

    assert int(update(esm.Sum(dtype=jnp.int32)).compute()) == 3
    assert int(update(esm.Max(dtype=jnp.uint8)).compute()) == 3
    weighted = eqx.filter_jit(
        lambda m: es.apply(lambda m: m.update(v, sample_weight=w), m)[1]
    )(esm.Sum(dtype=jnp.int32))
    assert int(weighted.compute()) == int(np.sum(np.array([1, 2, 3]) * 2))
    _, total = es.make_apply(lambda m, x: m.update(c)).scan(
        esm.Sum(dtype=jnp.int32), jnp.zeros((2, 1))
    )
    assert int(total.compute()) == 6


@pytest.mark.parametrize("mode", MODES)
def test_mean_std_of_float32_values_far_from_zero_equals_float64(mode):
    """1e7 + N(0, 1) in float32: the batch mean rounds by about one unit of float32
    at that size, and the sum of squared deviations around it read a std of 1.44
    (+44 %); the corrected two-pass sum removes that error. Across batches the
    float32 state's mean itself has that resolution (as the docstring says): a
    few percent, where the uncorrected sum was off by 40 %. Reference: float64
    NumPy on the same float32 values, one batch and 20."""
    rng = np.random.default_rng(0)
    x = (1e7 + rng.normal(size=(20, 1000))).astype(np.float32)
    exact = np.asarray(x, np.float64)
    one = run(esm.MeanStd(), mode, x[0])
    close(one.compute()[1], exact[0].std(), rtol=1e-3)
    metric = esm.MeanStd()
    for batch in x:
        metric = run(metric, mode, batch)
    mean, std = metric.compute()
    close(std, exact.std(), rtol=0.03)
    close(mean, exact.mean(), rtol=3e-7)  # one float32 unit at 1e7


@pytest.mark.parametrize("metric", ["Sum", "Min", "Max"])
def test_a_numpy_int64_past_the_statistics_is_refused_not_wrapped(metric):
    """With x64 off `jnp.asarray` wraps a NumPy int64 into int32 (2**40 read 0):
    the docs promise a TypeError for an integer the statistics do not hold. A
    NumPy int64 array whose values fit (NumPy's default integer) is accepted, as
    Python's sum of it says."""
    m = es.to_refs(getattr(es.metrics, metric)(dtype=jnp.int32))
    with pytest.raises(TypeError, match="do not hold"):
        m.update(np.array([2**40, 1]))
    values = np.array([3, -4, 5])  # int64
    m.update(values)
    want = {"Sum": sum, "Min": min, "Max": max}[metric](values.tolist())
    assert int(m.compute()) == want
