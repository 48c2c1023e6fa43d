"""Metrics built on a confusion matrix: `ConfusionMatrix`, `Precision`, `Recall`,
`F1`."""

from __future__ import annotations

from collections.abc import Hashable
from typing import ClassVar

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Integer, Real, Shaped

from .._buffer import MetricState
from ._base import (
    ConfusionArray,
    Metric,
    Scores,
    _cell,
    _replicated,
    _safe_div,
    _weights,
)
from ._labels import _split_inputs


_AVERAGES = ("binary", "micro", "macro", "weighted", None)


class _ConfusionMetric(Metric):
    """Shared by every metric whose sufficient statistic is the confusion matrix."""

    matrix: MetricState
    num_classes: int = eqx.field(static=True)

    _kinds = {"matrix": "sum"}

    def _init_matrix(self, num_classes: int, axis_name: Hashable | None, dtype) -> None:
        if num_classes < 2:
            raise ValueError(
                f"{type(self).__name__}: num_classes must be >= 2, got {num_classes}."
            )
        self.num_classes = num_classes
        self.matrix = _cell("sum", (num_classes, num_classes), dtype)
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

        - `logits_or_preds`: logits (or any scores) of shape
            `[*batch, num_classes]`, whose argmax is the prediction, or predicted
            labels of shape `[*batch]`.
        - `labels`: the true class indices, shape `[*batch]`.
        - `sample_weight`: a weight per example (scalar, `[*batch]` or a prefix).
        - `mask`: which examples count; masked-out (padding) examples contribute
            nothing. Examples whose label or prediction is outside
            `[0, num_classes)` (e.g. a padding label of -1) are dropped too.
        """
        name = type(self).__name__
        logits, preds, labels = _split_inputs(
            name, logits_or_preds, labels, self.num_classes
        )
        if logits is not None:
            preds = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        assert preds is not None
        c = self.num_classes
        w = _weights(labels, mask, sample_weight, self.matrix.dtype)
        valid = (labels >= 0) & (labels < c) & (preds >= 0) & (preds < c) & (w != 0)
        # out-of-range flat index: dropped by the scatter
        flat = jnp.where(valid, labels * c + preds, c * c).reshape(-1)
        counts = jnp.zeros((c * c,), self.matrix.dtype)
        counts = counts.at[flat].add(w.reshape(-1), mode="drop", **_replicated(flat))
        self._accumulate((counts.reshape(c, c),))

    def _counts(self, matrix: Array) -> tuple[Array, Array, Array]:
        """Per class: true positives, predicted count (tp + fp), support (tp + fn)."""
        return jnp.diagonal(matrix), jnp.sum(matrix, axis=0), jnp.sum(matrix, axis=1)


class ConfusionMatrix(_ConfusionMetric):
    """The confusion matrix: entry `[i, j]` is the (weighted) number of examples of
    true class `i` predicted as class `j`, as in `sklearn.metrics.confusion_matrix`
    with `labels=range(num_classes)`.

    **Arguments:**

    - `num_classes`: the number of classes.
    - `normalize`: `None` (counts), `"true"` (each row sums to 1), `"pred"` (each
        column sums to 1) or `"all"` (the matrix sums to 1); empty rows/columns give
        0, as in sklearn.
    - `axis_name`: reduce each update over this named axis (see
        [`eqx_state.metrics.Metric`][]).
    - `dtype`: the dtype of the counts (default float32: exact up to 2**24).

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

    def __init__(
        self,
        num_classes: int,
        *,
        normalize: str | None = None,
        axis_name: Hashable | None = None,
        dtype=jnp.float32,
    ):
        if normalize not in (None, "true", "pred", "all"):
            raise ValueError(
                "ConfusionMatrix: normalize must be None, 'true', 'pred' or 'all', "
                f"got {normalize!r}."
            )
        self._init_matrix(num_classes, axis_name, dtype)
        self.normalize = normalize

    def _result(self, states: tuple[Array, ...]) -> Array:
        (matrix,) = states
        if self.normalize == "true":
            return _safe_div(matrix, jnp.sum(matrix, axis=1, keepdims=True))
        if self.normalize == "pred":
            return _safe_div(matrix, jnp.sum(matrix, axis=0, keepdims=True))
        if self.normalize == "all":
            return _safe_div(matrix, jnp.sum(matrix))
        return matrix

    def compute(self) -> ConfusionArray:
        """The `[num_classes, num_classes]` matrix (rows: true class, columns:
        predicted class); zeros with no data."""
        return self._result(self._read())


class _AveragedMetric(_ConfusionMetric):
    average: str | None = eqx.field(static=True)
    pos_label: int = eqx.field(static=True)

    _what: ClassVar[str] = ""

    def __init__(
        self,
        num_classes: int = 2,
        *,
        average: str | None = "binary",
        pos_label: int = 1,
        axis_name: Hashable | None = None,
        dtype=jnp.float32,
    ):
        name = type(self).__name__
        if average not in _AVERAGES:
            raise ValueError(
                f"{name}: average must be one of {_AVERAGES}, got {average!r}."
            )
        if average == "binary" and num_classes != 2:
            raise ValueError(
                f"{name}(num_classes={num_classes}, average='binary'): the binary "
                "average scores one positive class of a two-class problem. For "
                "more classes pass average='macro', 'micro', 'weighted' or None "
                "(per class)."
            )
        if not 0 <= pos_label < num_classes:
            raise ValueError(
                f"{name}: pos_label must be a class index in [0, {num_classes}), "
                f"got {pos_label}."
            )
        self._init_matrix(num_classes, axis_name, dtype)
        self.average = average
        self.pos_label = pos_label

    def _score(self, tp: Array, predicted: Array, support: Array) -> Array:
        raise NotImplementedError

    def _result(self, states: tuple[Array, ...]) -> Array:
        (matrix,) = states
        tp, predicted, support = self._counts(matrix)
        if self.average == "micro":
            return self._score(jnp.sum(tp), jnp.sum(predicted), jnp.sum(support))
        per_class = self._score(tp, predicted, support)
        if self.average is None:
            return per_class
        if self.average == "binary":
            return per_class[self.pos_label]
        if self.average == "weighted":
            return _safe_div(jnp.sum(per_class * support), jnp.sum(support))
        # macro: the mean over the classes that occur in the labels or predictions,
        # as sklearn does with its default `labels=None`
        present = (support > 0) | (predicted > 0)
        n_present = jnp.sum(present.astype(per_class.dtype))
        return _safe_div(
            jnp.sum(jnp.where(present, per_class, 0 * per_class)), n_present
        )

    def compute(self) -> Scores:
        """The score: a scalar, or one per class with `average=None`. Undefined
        ratios (no positive predictions, no positive labels, no data) are 0, as
        sklearn's `zero_division=0`."""
        return self._result(self._read())


class Precision(_AveragedMetric):
    """Precision, `tp / (tp + fp)`: of the examples predicted as a class, the
    fraction that belong to it.

    The statistic is the confusion matrix; `compute()` derives the score from it, so
    merging and cross-device reduction are exact. Averages, as in sklearn's
    `precision_recall_fscore_support`:

    - `"binary"` (default; needs `num_classes=2`): the score of class `pos_label`;
    - `"micro"`: from the total true positives, false positives and false
        negatives (for single-label data all three scores equal the accuracy);
    - `"macro"`: the unweighted mean of the per-class scores over the classes that
        occur in the labels or the predictions (sklearn's default `labels=None`);
    - `"weighted"`: the per-class scores weighted by support (true count);
    - `None`: one score per class, shape `[num_classes]`.

    Division by zero gives 0 (sklearn's `zero_division=0`): e.g. a class that is
    never predicted has precision 0; a fresh metric computes 0.

    **Arguments:**

    - `num_classes`: the number of classes (default 2).
    - `average`: one of the above.
    - `pos_label`: the positive class for `average="binary"`.
    - `axis_name`: reduce each update over this named axis (see
        [`eqx_state.metrics.Metric`][]).
    - `dtype`: the dtype of the confusion matrix (default float32).

    **Example:**

    ```python
    import jax.numpy as jnp
    import eqx_state as es

    precision = es.to_refs(es.metrics.Precision())  # binary, positive class 1
    precision.update(jnp.array([1, 1, 0, 1]), jnp.array([1, 0, 0, 1]))
    assert abs(float(precision.compute()) - 2 / 3) < 1e-6
    ```
    """

    def _score(self, tp: Array, predicted: Array, support: Array) -> Array:
        return _safe_div(tp, predicted)


class Recall(_AveragedMetric):
    """Recall, `tp / (tp + fn)`: of the examples of a class, the fraction
    predicted as it.

    The statistic is the confusion matrix; `compute()` derives the score from it, so
    merging and cross-device reduction are exact. Averages, as in sklearn's
    `precision_recall_fscore_support`:

    - `"binary"` (default; needs `num_classes=2`): the score of class `pos_label`;
    - `"micro"`: from the total true positives, false positives and false
        negatives (for single-label data all three scores equal the accuracy);
    - `"macro"`: the unweighted mean of the per-class scores over the classes that
        occur in the labels or the predictions (sklearn's default `labels=None`);
    - `"weighted"`: the per-class scores weighted by support (true count);
    - `None`: one score per class, shape `[num_classes]`.

    Division by zero gives 0 (sklearn's `zero_division=0`): e.g. a class that is
    never predicted has precision 0; a fresh metric computes 0.

    **Arguments:**

    - `num_classes`: the number of classes (default 2).
    - `average`: one of the above.
    - `pos_label`: the positive class for `average="binary"`.
    - `axis_name`: reduce each update over this named axis (see
        [`eqx_state.metrics.Metric`][]).
    - `dtype`: the dtype of the confusion matrix (default float32).

    **Example:**

    ```python
    import jax.numpy as jnp
    import eqx_state as es

    recall = es.to_refs(es.metrics.Recall(3, average="macro"))
    recall.update(jnp.array([0, 1, 1, 2]), jnp.array([0, 1, 2, 2]))
    assert abs(float(recall.compute()) - (1 + 1 + 0.5) / 3) < 1e-6
    ```
    """

    def _score(self, tp: Array, predicted: Array, support: Array) -> Array:
        return _safe_div(tp, support)


class F1(_AveragedMetric):
    """The F1 score, `2 tp / (2 tp + fp + fn)`: the harmonic mean of precision and
    recall (0 when both are 0). The macro average is the mean of per-class F1
    scores, as in sklearn (not the F1 of the macro precision and recall).

    The statistic is the confusion matrix; `compute()` derives the score from it, so
    merging and cross-device reduction are exact. Averages, as in sklearn's
    `precision_recall_fscore_support`:

    - `"binary"` (default; needs `num_classes=2`): the score of class `pos_label`;
    - `"micro"`: from the total true positives, false positives and false
        negatives (for single-label data all three scores equal the accuracy);
    - `"macro"`: the unweighted mean of the per-class scores over the classes that
        occur in the labels or the predictions (sklearn's default `labels=None`);
    - `"weighted"`: the per-class scores weighted by support (true count);
    - `None`: one score per class, shape `[num_classes]`.

    Division by zero gives 0 (sklearn's `zero_division=0`): e.g. a class that is
    never predicted has precision 0; a fresh metric computes 0.

    **Arguments:**

    - `num_classes`: the number of classes (default 2).
    - `average`: one of the above.
    - `pos_label`: the positive class for `average="binary"`.
    - `axis_name`: reduce each update over this named axis (see
        [`eqx_state.metrics.Metric`][]).
    - `dtype`: the dtype of the confusion matrix (default float32).

    **Example:**

    ```python
    import jax.numpy as jnp
    import eqx_state as es

    f1 = es.to_refs(es.metrics.F1())
    f1.update(jnp.array([1, 1, 0, 1]), jnp.array([1, 0, 0, 1]))
    assert abs(float(f1.compute()) - 0.8) < 1e-6
    ```
    """

    def _score(self, tp: Array, predicted: Array, support: Array) -> Array:
        return _safe_div(2 * tp, predicted + support)
