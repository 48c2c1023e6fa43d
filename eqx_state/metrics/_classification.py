"""Metrics built on a confusion matrix: `ConfusionMatrix`, `Precision`, `Recall`,
`F1`."""

from __future__ import annotations

import math
from collections.abc import Hashable
from typing import ClassVar

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Integer, Real, Shaped

from .._buffer import MetricState
from .._errors import StateValueError, check_bool
from ._base import (
    ConfusionArray,
    Metric,
    Scores,
    _check_dtype,
    _check_inputs,
    _check_int,
    _div,
    _fit,
    _replicated,
    _truthy,
    _weights,
    statistic,
)
from ._labels import (
    _as_labels,
    _check_ignore_index,
    _check_threshold,
    _ignored,
    _predictions,
    _split_inputs,
    _threshold,
    as_label_array,
    check_top_k,
    refuse_complex_scores,
)


_AVERAGES = ("binary", "micro", "macro", "weighted", None)


def _check_zero_division(metric: str, zero_division: int | float | str) -> float | str:
    """0.0, 1.0 or the string "nan" (a static field must compare equal to itself)."""
    if isinstance(zero_division, str) and zero_division == "nan":
        return "nan"
    if isinstance(zero_division, (int, float)):
        if math.isnan(zero_division):
            return "nan"
        if zero_division in (0, 1):
            return float(zero_division)
    raise StateValueError(
        f"{metric}: zero_division must be 0, 1 or nan (as in scikit-learn), got "
        f"{zero_division!r}."
    )


class _ConfusionMetric(Metric):
    """Shared by every metric whose sufficient statistic is a confusion matrix:
    `[C, C]` (multi-class; rows: true class, columns: predicted class) or `[L, 2, 2]`
    (multi-label: per label `[[tn, fp], [fn, tp]]`, as
    `sklearn.metrics.multilabel_confusion_matrix`)."""

    _wide_cells = ("matrix",)

    matrix: MetricState
    num_classes: int = eqx.field(static=True)
    top_k: int = eqx.field(static=True)
    threshold: float | None = eqx.field(static=True)
    multilabel: bool = eqx.field(static=True)
    ignore_index: int | None = eqx.field(static=True)

    # torchmetrics' BinaryConfusionMatrix drops the ignored examples before it
    # decides whether binary scores are logits; its stat-score metrics (precision,
    # recall, F1, accuracy) and every multi-label metric decide over all of them
    _logits_rule_sees_ignored: ClassVar[bool] = True

    def _init_matrix(
        self,
        num_classes: int,
        *,
        top_k: int,
        threshold: float | None,
        multilabel: bool,
        ignore_index: int | None,
        axis_name: Hashable | None,
        dtype,
    ) -> None:
        name = type(self).__name__
        num_classes = _check_int(name, "num_classes", num_classes, 1)
        top_k = _check_int(name, "top_k", top_k, 1)
        if num_classes < (1 if multilabel else 2):
            raise StateValueError(
                f"{name}: num_classes must be >= 2 (>= 1 labels for multilabel=True), "
                f"got {num_classes}."
            )
        if top_k < 1 or (top_k > 1 and multilabel):
            raise StateValueError(
                f"{name}: top_k must be >= 1, and 1 for multi-label input; got "
                f"top_k={top_k}, multilabel={multilabel}."
            )
        if not multilabel:
            check_top_k(name, top_k, num_classes)
        self.num_classes = num_classes
        self.top_k = top_k
        self.threshold = _check_threshold(name, threshold)
        self.multilabel = check_bool(type(self).__name__, "multilabel", multilabel)
        self.ignore_index = _check_ignore_index(name, ignore_index)
        dtype = _check_dtype(name, dtype, "counts")
        shape = (num_classes, 2, 2) if multilabel else (num_classes, num_classes)
        self.matrix = statistic("sum", shape=shape, dtype=dtype)
        self.axis_name = axis_name

    def update(
        self,
        logits_or_preds: Real[ArrayLike, "..."],
        labels: Integer[ArrayLike, "..."],
        *,
        sample_weight: Real[ArrayLike, "..."] | None = None,
        mask: Shaped[ArrayLike, "..."] | None = None,
    ) -> None:
        """Add a batch of predictions to the confusion matrix.

        **Arguments:**

        - `logits_or_preds`: multi-class: logits (or any scores) of shape
            `[*batch, num_classes]` (ranked as in [`eqx_state.metrics.Accuracy`][]:
            the prediction is the argmax, or the true class when it is in the
            `top_k`), predicted labels of shape `[*batch]`, or, with `threshold`
            (binary), probabilities (or logits) of the positive class of shape
            `[*batch]`. Multi-label: predictions of shape `[*batch, num_labels]`,
            0/1 or, with `threshold`, probabilities (or logits). As torchmetrics:
            when any (unmasked) value of an update is outside [0, 1] (or NaN), all
            its values are logits and go through a sigmoid before `> threshold`.
        - `labels`: the true class indices, shape `[*batch]`; multi-label: 0/1 of
            shape `[*batch, num_labels]`.
        - `sample_weight`: a weight per example (scalar, `[*batch]` or a prefix;
            multi-label, also one per entry, `[*batch, num_classes]`).
        - `mask`: which examples (multi-label: or entries) count; masked-out
            (padding) examples contribute
            nothing. Labels (and predicted labels) outside `[0, num_classes)` — or,
            multi-label, other than 0 and 1 — e.g. a padding label of -1, are
            dropped too, as are labels equal to `ignore_index`. (A sample weight
            of 0 is not a mask: the example adds nothing to the counts, but its
            classes count as seen; see `"macro"`.)
        """
        _check_inputs(
            type(self).__name__, self.matrix.dtype, sample_weight=sample_weight
        )
        if self.multilabel:
            self._update_multilabel(logits_or_preds, labels, sample_weight, mask)
            return
        name = type(self).__name__
        c = self.num_classes
        if self.threshold is not None and c != 2:
            raise StateValueError(
                f"{name}(num_classes={c}, threshold=...): a threshold on "
                "probabilities makes a binary prediction; build the metric with "
                "num_classes=2, or multilabel=True for one probability per label."
            )
        y = as_label_array(labels, f"{name}.update: `labels`")
        counted = None if mask is None else _fit("mask", _truthy(mask), y.shape)
        ignored = _ignored(labels, self.ignore_index)
        if ignored is not None and not self._logits_rule_sees_ignored:
            counted = ~ignored if counted is None else counted & ~ignored
        logits, preds, labels = _split_inputs(
            name, logits_or_preds, y, c, self.threshold, counted, self.axis_name
        )
        if logits is not None:
            preds, _ = _predictions(name, logits, labels, self.top_k)
        elif self.top_k != 1:
            raise StateValueError(
                f"{name}(top_k={self.top_k}) needs logits or scores with a trailing "
                "class axis to rank the classes; it got predictions of the labels' "
                "shape. Pass the logits, or use top_k=1."
            )
        assert preds is not None
        w = _weights(labels, mask, sample_weight, self.matrix.dtype)
        # an example counts when it is not masked out and both its label and its
        # prediction are class indices; its weight (0 included) is what it adds
        valid = (labels >= 0) & (labels < c) & (preds >= 0) & (preds < c)
        if ignored is not None:
            valid = valid & ~ignored
        if mask is not None:
            valid = valid & _fit("mask", _truthy(mask), labels.shape)
        zero = jnp.zeros_like(w)
        # out-of-range flat index: dropped by the scatter
        flat = jnp.where(valid, labels * c + preds, c * c).reshape(-1)
        counts = jnp.zeros((c * c,), self.matrix.dtype)
        counts = counts.at[flat].add(
            jnp.where(valid, w, zero).reshape(-1), mode="drop", **_replicated(flat)
        )
        # the classes seen, whatever their weight (sklearn's labels=None: the
        # union of the labels and the predictions)
        seen = jnp.zeros((c,), jnp.int32)
        for index in (labels, preds):
            index = jnp.where(valid, index, c).reshape(-1)
            ones = jnp.ones(index.shape, jnp.int32)
            seen = seen.at[index].add(ones, mode="drop", **_replicated(index))
        self._accumulate(counts.reshape(c, c), seen > 0)

    def _update_multilabel(self, x, labels, sample_weight, mask) -> None:
        name = type(self).__name__
        x = as_label_array(x, f"{name}.update: `logits_or_preds`")
        y = as_label_array(labels, f"{name}.update: `labels`")
        refuse_complex_scores(name, x)
        y = _as_labels(f"{name}.update: `labels`", y)
        if x.shape != y.shape or x.ndim < 1 or x.shape[-1] != self.num_classes:
            raise StateValueError(
                f"{name}(num_classes={self.num_classes}, multilabel=True) got "
                f"predictions of shape {x.shape} and labels of shape {y.shape}: both "
                f"must have the shape [*batch, {self.num_classes}] (one 0/1 entry, "
                "or probability, per label)."
            )
        counted = None if mask is None else _fit("mask", _truthy(mask), y.shape)
        if jnp.issubdtype(x.dtype, jnp.inexact):
            preds = _threshold(
                name, x, self.threshold, y.shape, counted, self.axis_name
            )
        else:
            preds = _as_labels(f"{name}.update: predictions", x)
        dtype = self.matrix.dtype
        # a weight (or mask) per example ([*batch], a prefix) or per entry
        w = jnp.broadcast_to(_weights(y, mask, sample_weight, dtype), y.shape)
        ok = ((y == 0) | (y == 1)) & ((preds == 0) | (preds == 1))
        ignored = _ignored(labels, self.ignore_index)
        if ignored is not None:  # per entry, as torchmetrics' multi-label metrics
            ok = ok & ~ignored
        w = jnp.where(ok, w, jnp.zeros_like(w))  # [*batch, L]
        t = jnp.stack([y == 0, y == 1], -1).astype(dtype)  # [*batch, L, 2]
        p = jnp.stack([preds == 0, preds == 1], -1).astype(dtype)
        batch_axes = "".join(chr(ord("a") + i) for i in range(y.ndim - 1))
        spec = f"{batch_axes}l,{batch_axes}lt,{batch_axes}lp->ltp"
        # every label is scored (sklearn's macro average over all the columns):
        # `seen` is not used, but it says which labels had a counted entry
        counted = ok if counted is None else ok & counted
        seen = jnp.any(counted.reshape(-1, self.num_classes), axis=0)
        self._accumulate(jnp.einsum(spec, w, t, p), seen)

    def _accumulate(self, matrix: Array, seen: Array) -> None:
        """Merge a batch's confusion matrix (and, for the averaged metrics, the
        classes it has seen) into the statistics."""
        del seen
        self.accumulate(matrix=matrix)

    def _counts(self) -> tuple[Array, Array, Array]:
        """Per class (label): true positives, false positives, false negatives."""
        m = self.matrix[...]
        if self.multilabel:
            return m[:, 1, 1], m[:, 0, 1], m[:, 1, 0]
        tp = jnp.diagonal(m)
        return tp, jnp.sum(m, axis=0) - tp, jnp.sum(m, axis=1) - tp


class ConfusionMatrix(_ConfusionMetric):
    """The confusion matrix: entry `[i, j]` is the (weighted) number of examples of
    true class `i` predicted as class `j`, as in `sklearn.metrics.confusion_matrix`
    with `labels=range(num_classes)`. With `multilabel=True`, one 2x2 matrix per
    label, `[[tn, fp], [fn, tp]]`, as `sklearn.metrics.multilabel_confusion_matrix`.

    **Arguments:**

    - `num_classes`: the number of classes (of labels, with `multilabel=True`).
    - `normalize`: `None` (counts), `"true"` (each row sums to 1), `"pred"` (each
        column sums to 1) or `"all"` (the matrix sums to 1); empty rows/columns give
        0, as in sklearn.
    - `threshold`: binary problems given as probabilities of the positive class
        (needs `num_classes=2`), or multi-label probabilities: predict 1 where the
        probability is `> threshold` (in the probabilities' dtype, the threshold
        rounded to it, as torchmetrics). Logits work too: when any value of an
        update is outside [0, 1] (or NaN), the update's values go through a
        sigmoid first (torchmetrics' rule; for binary input, torchmetrics'
        `BinaryConfusionMatrix` decides over the examples it does not ignore).
    - `multilabel`: inputs are 0/1 indicators (or probabilities) of shape
        `[*batch, num_classes]`.
    - `ignore_index`: a label value (e.g. -1, 255, or a class index such as 0)
        whose examples (multi-label: entries) are left out of the matrix, as
        torchmetrics' `ignore_index`.
    - `axis_name`: reduce each update over this named axis (see
        [`eqx_state.metrics.Metric`][]).
    - `dtype`: the dtype of the counts (default float32: exact up to 2**24), or a
        signed integer dtype (e.g. `jnp.int32`) to count exactly; then
        `sample_weight` must be integers (a float weight raises a `TypeError` at
        `update` rather than being truncated).

    **Example:**

    ```python
    import jax.numpy as jnp
    import eqx_state as es

    cm = es.to_refs(es.metrics.ConfusionMatrix(3))
    cm.update(jnp.array([0, 2, 2, 1]), jnp.array([0, 1, 2, 1]))
    assert cm.compute().tolist() == [[1, 0, 0], [0, 1, 1], [0, 0, 1]]
    ```
    """

    normalize: str | None = eqx.field(static=True)

    _logits_rule_sees_ignored: ClassVar[bool] = False

    def __init__(
        self,
        num_classes: int,
        *,
        normalize: str | None = None,
        threshold: float | None = None,
        multilabel: bool = False,
        ignore_index: int | None = None,
        axis_name: Hashable | None = None,
        dtype=jnp.float32,
    ):
        if normalize not in (None, "true", "pred", "all"):
            raise StateValueError(
                "ConfusionMatrix: normalize must be None, 'true', 'pred' or 'all', "
                f"got {normalize!r}."
            )
        self._init_matrix(
            num_classes,
            top_k=1,
            threshold=threshold,
            multilabel=multilabel,
            ignore_index=ignore_index,
            axis_name=axis_name,
            dtype=dtype,
        )
        self.normalize = normalize

    def compute(self) -> ConfusionArray:
        """The `[num_classes, num_classes]` matrix (rows: true class, columns:
        predicted class), or `[num_labels, 2, 2]` with `multilabel=True`; zeros with
        no data."""
        matrix = self.matrix[...]
        if self.normalize == "true":
            return _div(matrix, jnp.sum(matrix, axis=-1, keepdims=True))
        if self.normalize == "pred":
            return _div(matrix, jnp.sum(matrix, axis=-2, keepdims=True))
        if self.normalize == "all":
            return _div(matrix, jnp.sum(matrix, axis=(-2, -1), keepdims=True))
        return matrix


class _AveragedMetric(_ConfusionMetric):
    seen: MetricState
    average: str | None = eqx.field(static=True)
    pos_label: int = eqx.field(static=True)
    zero_division: float | str = eqx.field(static=True)

    _what: ClassVar[str] = ""

    def __init__(
        self,
        num_classes: int = 2,
        *,
        average: str | None = "binary",
        pos_label: int = 1,
        top_k: int = 1,
        threshold: float | None = None,
        multilabel: bool = False,
        zero_division: int | float | str = 0.0,
        ignore_index: int | None = None,
        axis_name: Hashable | None = None,
        dtype=jnp.float32,
    ):
        name = type(self).__name__
        if average not in _AVERAGES:
            raise StateValueError(
                f"{name}: average must be one of {_AVERAGES}, got {average!r}."
            )
        num_classes = _check_int(name, "num_classes", num_classes, 1)
        if average == "binary" and (num_classes != 2 or multilabel):
            raise StateValueError(
                f"{name}(num_classes={num_classes}, average='binary'): the binary "
                "average scores one positive class of a two-class problem. For "
                "more classes, or multi-label input, pass average='macro', "
                "'micro', 'weighted' or None (per class)."
            )
        pos_label = _check_int(name, "pos_label", pos_label, 0)
        if not 0 <= pos_label < max(num_classes, 2):
            raise StateValueError(
                f"{name}: pos_label must be a class index in [0, {num_classes}), "
                f"got {pos_label}."
            )
        self._init_matrix(
            num_classes,
            top_k=top_k,
            threshold=threshold,
            multilabel=multilabel,
            ignore_index=ignore_index,
            axis_name=axis_name,
            dtype=dtype,
        )
        # which classes occurred in the labels or predictions of an example given
        # to `update` (masked-out ones and padding labels aside), whatever its weight
        self.seen = statistic("max", shape=(num_classes,), dtype=jnp.bool_)
        self.average = average
        self.pos_label = pos_label
        self.zero_division = _check_zero_division(name, zero_division)

    def _accumulate(self, matrix: Array, seen: Array) -> None:
        self.accumulate(matrix=matrix, seen=seen)

    def _score(self, tp: Array, fp: Array, fn: Array, zd: float) -> Array:
        raise NotImplementedError

    def compute(self) -> Scores:
        """The score: a scalar, or one per class with `average=None`. Undefined
        ratios are `zero_division`."""
        zd = math.nan if self.zero_division == "nan" else float(self.zero_division)
        tp, fp, fn = self._counts()
        if self.average == "micro":
            return self._score(jnp.sum(tp), jnp.sum(fp), jnp.sum(fn), zd)
        per_class = self._score(tp, fp, fn, zd)
        if self.average is None:
            return per_class
        if self.average == "binary":
            return per_class[self.pos_label]
        if self.multilabel:
            present = jnp.ones(per_class.shape, bool)
        else:  # sklearn's labels=None: the classes seen in the labels or predictions
            present = self.seen[...]
        counted = present & ~jnp.isnan(per_class)  # NaN: zero_division=nan
        zero = jnp.zeros_like(per_class)
        scores = jnp.where(counted, per_class, zero)
        n = jnp.sum(counted.astype(per_class.dtype))
        mean = _div(jnp.sum(scores), n, zd)
        if self.average == "macro":
            return mean
        support = jnp.where(counted, (tp + fn).astype(zero.dtype), zero)
        total = jnp.sum(support)
        # weights all zero: sklearn falls back to the unweighted mean
        return jnp.where(total != 0, _div(jnp.sum(scores * support), total, zd), mean)


class Precision(_AveragedMetric):
    """Precision, `tp / (tp + fp)`: of the examples predicted as a class, the
    fraction that belong to it.

    The statistics are the confusion matrix `matrix` (one 2x2 matrix per label for
    multi-label input) and `seen`, which classes have occurred (for the macro
    average); `compute()` derives the score from them, so merging and
    cross-device reduction are exact. Averages, as in sklearn's
    `precision_recall_fscore_support`:

    - `"binary"` (default; needs `num_classes=2`): the score of class `pos_label`;
    - `"micro"`: from the total true positives, false positives and false
        negatives (for single-label data all three scores equal the accuracy);
    - `"macro"`: the unweighted mean of the per-class scores — over the classes
        that occur in the labels or the predictions (sklearn's default
        `labels=None`; torchmetrics likewise for `top_k=1`, while for `top_k > 1`
        it averages over the classes that occur in the labels only), or over every label for
        multi-label input. A class occurs when it is the label or the prediction of
        an example given to `update`, whatever that example's sample weight (0
        included, as sklearn); examples left out by `mask=`, and padding labels,
        do not count;
    - `"weighted"`: the per-class scores weighted by support (true count);
    - `None`: one score per class, shape `[num_classes]`.

    Undefined ratios (a class never predicted, no positive labels, no data) are
    `zero_division` (0, 1 or NaN, as sklearn's `zero_division`); with NaN, macro and
    weighted averages skip the undefined classes, as sklearn does.

    **Arguments:**

    - `num_classes`: the number of classes (default 2), or of labels with
        `multilabel=True`.
    - `average`: one of the above.
    - `pos_label`: the positive class for `average="binary"`.
    - `top_k`: from logits, a prediction is the true class when that is among the
        `top_k` highest-ranked classes, else the top class (torchmetrics' rule; the
        ranking of [`eqx_state.metrics.Accuracy`][]).
    - `threshold`: binary problems given as probabilities of the positive class,
        or multi-label probabilities: predict 1 where the probability is
        `> threshold` (as torchmetrics: in the probabilities' dtype, the threshold
        rounded to it). Logits work too: when any value of an
        update is outside [0, 1] (or NaN), the update's values go through a
        sigmoid first (torchmetrics' rule).
    - `multilabel`: inputs are 0/1 indicators (or probabilities) of shape
        `[*batch, num_classes]`, each label its own binary problem.
    - `zero_division`: the value of an undefined ratio: 0 (default), 1 or NaN.
    - `ignore_index`: a label value (e.g. -1, 255, or a class index such as 0)
        whose examples (multi-label: entries) change no statistic, as
        torchmetrics' `ignore_index`: they are neither counted nor make a class
        occur.
    - `axis_name`: reduce each update over this named axis (see
        [`eqx_state.metrics.Metric`][]).
    - `dtype`: the dtype of the confusion matrix (default float32: exact up to
        2**24 examples), or a signed integer dtype (e.g. `jnp.int32`) to count
        exactly; then `sample_weight` must be integers (a float weight raises a
        `TypeError` at `update` rather than being truncated).

    **Example:**

    ```python
    import jax.numpy as jnp
    import eqx_state as es

    precision = es.to_refs(es.metrics.Precision())  # binary, positive class 1
    precision.update(jnp.array([1, 1, 0, 1]), jnp.array([1, 0, 0, 1]))
    assert abs(float(precision.compute()) - 2 / 3) < 1e-6
    ```
    """

    def _score(self, tp: Array, fp: Array, fn: Array, zd: float) -> Array:
        return _div(tp, tp + fp, zd)


class Recall(_AveragedMetric):
    """Recall, `tp / (tp + fn)`: of the examples of a class, the fraction
    predicted as it.

    The statistics are the confusion matrix `matrix` (one 2x2 matrix per label for
    multi-label input) and `seen`, which classes have occurred (for the macro
    average); `compute()` derives the score from them, so merging and
    cross-device reduction are exact. Averages, as in sklearn's
    `precision_recall_fscore_support`:

    - `"binary"` (default; needs `num_classes=2`): the score of class `pos_label`;
    - `"micro"`: from the total true positives, false positives and false
        negatives (for single-label data all three scores equal the accuracy);
    - `"macro"`: the unweighted mean of the per-class scores — over the classes
        that occur in the labels or the predictions (sklearn's default
        `labels=None`; torchmetrics likewise for `top_k=1`, while for `top_k > 1`
        it averages over the classes that occur in the labels only), or over every label for
        multi-label input. A class occurs when it is the label or the prediction of
        an example given to `update`, whatever that example's sample weight (0
        included, as sklearn); examples left out by `mask=`, and padding labels,
        do not count;
    - `"weighted"`: the per-class scores weighted by support (true count);
    - `None`: one score per class, shape `[num_classes]`.

    Undefined ratios (a class never predicted, no positive labels, no data) are
    `zero_division` (0, 1 or NaN, as sklearn's `zero_division`); with NaN, macro and
    weighted averages skip the undefined classes, as sklearn does.

    **Arguments:**

    - `num_classes`: the number of classes (default 2), or of labels with
        `multilabel=True`.
    - `average`: one of the above.
    - `pos_label`: the positive class for `average="binary"`.
    - `top_k`: from logits, a prediction is the true class when that is among the
        `top_k` highest-ranked classes, else the top class (torchmetrics' rule; the
        ranking of [`eqx_state.metrics.Accuracy`][]).
    - `threshold`: binary problems given as probabilities of the positive class,
        or multi-label probabilities: predict 1 where the probability is
        `> threshold` (as torchmetrics: in the probabilities' dtype, the threshold
        rounded to it). Logits work too: when any value of an
        update is outside [0, 1] (or NaN), the update's values go through a
        sigmoid first (torchmetrics' rule).
    - `multilabel`: inputs are 0/1 indicators (or probabilities) of shape
        `[*batch, num_classes]`, each label its own binary problem.
    - `zero_division`: the value of an undefined ratio: 0 (default), 1 or NaN.
    - `ignore_index`: a label value (e.g. -1, 255, or a class index such as 0)
        whose examples (multi-label: entries) change no statistic, as
        torchmetrics' `ignore_index`: they are neither counted nor make a class
        occur.
    - `axis_name`: reduce each update over this named axis (see
        [`eqx_state.metrics.Metric`][]).
    - `dtype`: the dtype of the confusion matrix (default float32: exact up to
        2**24 examples), or a signed integer dtype (e.g. `jnp.int32`) to count
        exactly; then `sample_weight` must be integers (a float weight raises a
        `TypeError` at `update` rather than being truncated).

    **Example:**

    ```python
    import jax.numpy as jnp
    import eqx_state as es

    recall = es.to_refs(es.metrics.Recall(3, average="macro"))
    recall.update(jnp.array([0, 1, 1, 2]), jnp.array([0, 1, 2, 2]))
    assert abs(float(recall.compute()) - (1 + 1 + 0.5) / 3) < 1e-6
    ```
    """

    def _score(self, tp: Array, fp: Array, fn: Array, zd: float) -> Array:
        return _div(tp, tp + fn, zd)


class F1(_AveragedMetric):
    """The F1 score, `2 tp / (2 tp + fp + fn)`: the harmonic mean of precision and
    recall. The macro average is the mean of per-class F1 scores, as in sklearn
    (not the F1 of the macro precision and recall).

    The statistics are the confusion matrix `matrix` (one 2x2 matrix per label for
    multi-label input) and `seen`, which classes have occurred (for the macro
    average); `compute()` derives the score from them, so merging and
    cross-device reduction are exact. Averages, as in sklearn's
    `precision_recall_fscore_support`:

    - `"binary"` (default; needs `num_classes=2`): the score of class `pos_label`;
    - `"micro"`: from the total true positives, false positives and false
        negatives (for single-label data all three scores equal the accuracy);
    - `"macro"`: the unweighted mean of the per-class scores — over the classes
        that occur in the labels or the predictions (sklearn's default
        `labels=None`; torchmetrics likewise for `top_k=1`, while for `top_k > 1`
        it averages over the classes that occur in the labels only), or over every label for
        multi-label input. A class occurs when it is the label or the prediction of
        an example given to `update`, whatever that example's sample weight (0
        included, as sklearn); examples left out by `mask=`, and padding labels,
        do not count;
    - `"weighted"`: the per-class scores weighted by support (true count);
    - `None`: one score per class, shape `[num_classes]`.

    Undefined ratios (a class never predicted, no positive labels, no data) are
    `zero_division` (0, 1 or NaN, as sklearn's `zero_division`); with NaN, macro and
    weighted averages skip the undefined classes, as sklearn does.

    **Arguments:**

    - `num_classes`: the number of classes (default 2), or of labels with
        `multilabel=True`.
    - `average`: one of the above.
    - `pos_label`: the positive class for `average="binary"`.
    - `top_k`: from logits, a prediction is the true class when that is among the
        `top_k` highest-ranked classes, else the top class (torchmetrics' rule; the
        ranking of [`eqx_state.metrics.Accuracy`][]).
    - `threshold`: binary problems given as probabilities of the positive class,
        or multi-label probabilities: predict 1 where the probability is
        `> threshold` (as torchmetrics: in the probabilities' dtype, the threshold
        rounded to it). Logits work too: when any value of an
        update is outside [0, 1] (or NaN), the update's values go through a
        sigmoid first (torchmetrics' rule).
    - `multilabel`: inputs are 0/1 indicators (or probabilities) of shape
        `[*batch, num_classes]`, each label its own binary problem.
    - `zero_division`: the value of an undefined ratio: 0 (default), 1 or NaN.
    - `ignore_index`: a label value (e.g. -1, 255, or a class index such as 0)
        whose examples (multi-label: entries) change no statistic, as
        torchmetrics' `ignore_index`: they are neither counted nor make a class
        occur.
    - `axis_name`: reduce each update over this named axis (see
        [`eqx_state.metrics.Metric`][]).
    - `dtype`: the dtype of the confusion matrix (default float32: exact up to
        2**24 examples), or a signed integer dtype (e.g. `jnp.int32`) to count
        exactly; then `sample_weight` must be integers (a float weight raises a
        `TypeError` at `update` rather than being truncated).

    **Example:**

    ```python
    import jax.numpy as jnp
    import eqx_state as es

    f1 = es.to_refs(es.metrics.F1())
    f1.update(jnp.array([1, 1, 0, 1]), jnp.array([1, 0, 0, 1]))
    assert abs(float(f1.compute()) - 0.8) < 1e-6
    ```
    """

    def _score(self, tp: Array, fp: Array, fn: Array, zd: float) -> Array:
        return _div(2 * tp, 2 * tp + fp + fn, zd)
