"""`Accuracy`: the (weighted) fraction of correct predictions, top-k from logits."""

from __future__ import annotations

from collections.abc import Hashable

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Integer, Real, Shaped

from .._buffer import MetricState
from ._base import FloatScalar, Metric, _cell, _safe_div, _weights
from ._labels import _split_inputs


class Accuracy(Metric):
    """The fraction of correct predictions, like `sklearn.metrics.accuracy_score`
    (and `top_k_accuracy_score` for `top_k > 1`).

    Statistics: the (weighted) number of `correct` predictions and the `total`
    weight. A prediction is correct (top-k) when fewer than `k` classes score strictly
    higher than the true class; with ties this counts in the model's favour (sklearn
    breaks ties by class order; the two agree whenever scores are distinct).

    **Arguments:**

    - `top_k`: count a prediction as correct when the true class is among the `k`
        highest-scoring classes (needs logits/scores, not predicted labels).
    - `axis_name`: reduce each update over this named axis (see
        [`eqx_state.metrics.Metric`][]).
    - `dtype`: the dtype of the statistics (default float32).

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

    correct: MetricState
    total: MetricState
    top_k: int = eqx.field(static=True)

    _kinds = {"correct": "sum", "total": "sum"}

    def __init__(
        self, *, top_k: int = 1, axis_name: Hashable | None = None, dtype=jnp.float32
    ):
        if top_k < 1:
            raise ValueError(f"Accuracy: top_k must be >= 1, got {top_k}.")
        self.correct = _cell("sum", (), dtype)
        self.total = _cell("sum", (), dtype)
        self.top_k = top_k
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
            `[*batch, num_classes]`, or predicted labels of shape `[*batch]`.
        - `labels`: the true class indices, shape `[*batch]`.
        - `sample_weight`: a weight per example (scalar, `[*batch]` or a prefix).
        - `mask`: which examples count; masked-out (padding) examples contribute
            nothing. (Unmasked examples whose label is not a class index, e.g. a
            padding label of -1, count as wrong: mask them.)
        """
        logits, preds, labels = _split_inputs("Accuracy", logits_or_preds, labels, None)
        if logits is not None:
            num_classes = logits.shape[-1]
            valid = (labels >= 0) & (labels < num_classes)
            safe = jnp.where(valid, labels, 0)
            true_score = jnp.take_along_axis(logits, safe[..., None], axis=-1)
            higher = jnp.sum((logits > true_score).astype(jnp.int32), axis=-1)
            hit = valid & (higher < self.top_k)
        else:
            assert preds is not None
            if self.top_k != 1:
                raise ValueError(
                    f"Accuracy(top_k={self.top_k}) needs logits or scores with a "
                    "trailing class axis to rank the classes; it got predicted "
                    "labels. Pass the logits, or use `Accuracy()` (top_k=1)."
                )
            hit = preds == labels
        dtype = self.total.dtype
        w = _weights(labels, mask, sample_weight, dtype)
        correct = jnp.sum(jnp.where(hit, w, jnp.zeros_like(w)))
        self._accumulate((correct, jnp.sum(w)))

    def _result(self, states: tuple[Array, ...]) -> FloatScalar:
        correct, total = states
        return jnp.where(total != 0, _safe_div(correct, total), jnp.nan)

    def compute(self) -> FloatScalar:
        """The accuracy in [0, 1]; NaN if no (unmasked) example was added."""
        return self._result(self._read())
