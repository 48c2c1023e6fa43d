"""`Accuracy`: the (weighted) fraction of correct predictions, top-k from logits."""

from __future__ import annotations

from collections.abc import Hashable

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import ArrayLike, Integer, Real, Shaped

from .._buffer import MetricState
from .._errors import StateValueError
from ._base import (
    FloatScalar,
    Metric,
    _check_dtype,
    _check_inputs,
    _check_int,
    _div,
    _fit,
    _truthy,
    _weights,
    statistic,
)
from ._labels import (
    _check_ignore_index,
    _check_threshold,
    _ignored,
    _predictions,
    _split_inputs,
    _valid_labels,
    as_label_array,
    check_top_k,
)


class Accuracy(Metric):
    """The fraction of correct predictions, like `sklearn.metrics.accuracy_score`
    (and `top_k_accuracy_score` for `top_k > 1`).

    Statistics: the (weighted) number of `correct` predictions and the `total`
    weight.

    Ranking (from logits): classes are ordered by score, a NaN score above every
    number, equal scores by class index (lower first) — the order of
    `numpy.argmax` / `torch.argmax`, so `Accuracy()` equals `accuracy_score(labels,
    logits.argmax(-1))` even with ties or NaN (all-NaN logits predict class 0: a
    diverged model does not score 1.0). The same rule decides
    [`eqx_state.metrics.ConfusionMatrix`][], `Precision`, `Recall` and `F1`, so
    `Accuracy(top_k=k)` equals `Recall(top_k=k, average="micro")` whenever every
    label is a class index (or the others are masked out, or `ignore_index`ed:
    unmasked, `Accuracy` counts them wrong and the confusion-matrix metrics drop
    them, as below). With
    ties, sklearn's `top_k_accuracy_score` ranks the higher class index first, so
    the two can differ for `top_k > 1`; they agree whenever scores are distinct.

    A label that is not a class index (e.g. a padding label of -1, or one
    `>= num_classes`) counts as wrong; leave such examples out with `mask=` or
    `ignore_index=`.

    **Arguments:**

    - `top_k`: count a prediction as correct when the true class is among the `k`
        highest-ranked classes (needs logits/scores, not predicted labels).
    - `threshold`: for binary (or multi-label) problems given as probabilities of
        the positive class, of the labels' shape: predict 1 where the probability
        is `> threshold` (torchmetrics' rule: in the probabilities' dtype, the
        threshold rounded to it; NaN predicts 0). Logits work too, as
        in torchmetrics: when any (unmasked) value of an update is outside [0, 1]
        (or NaN), all the update's values go through a sigmoid first. On multi-label input
        `[*batch, num_labels]` this is the fraction of correct label entries
        (torchmetrics' `MultilabelAccuracy(average="micro")`, sklearn's
        `1 - hamming_loss`).
    - `num_classes`: if given, predicted labels and labels `>= num_classes` are not
        class indices (logits always give the number of classes).
    - `ignore_index`: a label value (e.g. -1, 255, or a class index such as 0)
        whose examples (multi-label: entries) are left out: they change no
        statistic, as torchmetrics' `ignore_index`.
    - `axis_name`: reduce each update over this named axis (see
        [`eqx_state.metrics.Metric`][]).
    - `dtype`: the dtype of the statistics (default float32: exact up to 2**24
        examples), or a signed integer dtype (e.g. `jnp.int32`) to count examples
        exactly; then `sample_weight` must be integers (a float weight raises a
        `TypeError` at `update` rather than being truncated).

    **Example:**

    ```python
    import jax.numpy as jnp
    import eqx_state as es

    acc = es.to_refs(es.metrics.Accuracy())
    logits = jnp.array([[2.0, 1.0, 0.0], [0.0, 1.0, 2.0], [1.0, 3.0, 0.0]])
    acc.update(logits, jnp.array([0, 1, 1]))          # from logits: 2 of 3
    acc.update(jnp.array([2, 0]), jnp.array([2, 1]))  # from labels: 1 of 2
    assert abs(float(acc.compute()) - 0.6) < 1e-6
    ```
    """

    _wide_cells = ("correct", "total")

    correct: MetricState
    total: MetricState
    top_k: int = eqx.field(static=True)
    threshold: float | None = eqx.field(static=True)
    num_classes: int | None = eqx.field(static=True)
    ignore_index: int | None = eqx.field(static=True)

    def __init__(
        self,
        *,
        top_k: int = 1,
        threshold: float | None = None,
        num_classes: int | None = None,
        ignore_index: int | None = None,
        axis_name: Hashable | None = None,
        dtype=jnp.float32,
    ):
        top_k = _check_int("Accuracy", "top_k", top_k, 1)
        dtype = _check_dtype("Accuracy", dtype, "counts")
        self.correct = statistic("sum", dtype=dtype)
        self.total = statistic("sum", dtype=dtype)
        self.top_k = top_k
        self.threshold = _check_threshold("Accuracy", threshold)
        self.num_classes = (
            None
            if num_classes is None
            else _check_int("Accuracy", "num_classes", num_classes, 1)
        )
        check_top_k("Accuracy", top_k, self.num_classes)
        self.ignore_index = _check_ignore_index("Accuracy", ignore_index)
        self.axis_name = axis_name

    def update(
        self,
        logits_or_preds: Real[ArrayLike, "..."],
        labels: Integer[ArrayLike, "..."],
        *,
        sample_weight: Real[ArrayLike, "..."] | None = None,
        mask: Shaped[ArrayLike, "..."] | None = None,
    ) -> None:
        """Add a batch of predictions.

        **Arguments:**

        - `logits_or_preds`: logits (or probabilities, any scores) of shape
            `[*batch, num_classes]`; predicted labels of shape `[*batch]`; or, with
            `threshold`, probabilities of the labels' shape.
        - `labels`: the true class indices, shape `[*batch]`.
        - `sample_weight`: a weight per example (scalar, `[*batch]` or a prefix).
        - `mask`: which examples count; masked-out (padding) examples contribute
            nothing. (Unmasked examples whose label is not a class index, e.g. a
            padding label of -1, count as wrong: mask them, or build the metric
            with `ignore_index=-1`.)
        """
        _check_inputs("Accuracy", self.total.dtype, sample_weight=sample_weight)
        given, y = labels, as_label_array(labels, "Accuracy.update: `labels`")
        counted = None if mask is None else _fit("mask", _truthy(mask), y.shape)
        logits, preds, labels = _split_inputs(
            "Accuracy",
            logits_or_preds,
            y,
            self.num_classes,
            self.threshold,
            counted,
            self.axis_name,
        )
        if logits is not None:
            _, hit = _predictions("Accuracy", logits, labels, self.top_k)
        else:
            assert preds is not None
            if self.top_k != 1:
                raise StateValueError(
                    f"Accuracy(top_k={self.top_k}) needs logits or scores with a "
                    "trailing class axis to rank the classes; it got predictions of "
                    "the labels' shape. Pass the logits, or use `Accuracy()` "
                    "(top_k=1)."
                )
            num_classes = 2 if self.threshold is not None else self.num_classes
            hit = _valid_labels(labels, num_classes) & (preds == labels)
        w = _weights(labels, mask, sample_weight, self.total.dtype)
        ignored = _ignored(given, self.ignore_index)
        if ignored is not None:
            w = jnp.where(ignored, jnp.zeros_like(w), w)
        correct = jnp.sum(jnp.where(hit, w, jnp.zeros_like(w)))
        self.accumulate(correct=correct, total=jnp.sum(w))

    def compute(self) -> FloatScalar:
        """The accuracy, `correct / total` (with negative sample weights too, as
        sklearn); 0 if no (unmasked) example was added."""
        return _div(self.correct[...], self.total[...])
