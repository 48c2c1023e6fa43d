"""Classification inputs and the one ranking rule every classification metric uses.

Inputs: logits (or any scores) with a trailing class axis, predicted labels of the
labels' shape, or — with a `threshold` — probabilities of the labels' shape.

The ranking rule (`Accuracy(top_k)`, `ConfusionMatrix`, `Precision` / `Recall` /
`F1`, including their `top_k`): classes are ordered by score, a NaN score above
every number, and equal scores by class index, lower first — the order in which
`numpy.argmax` / `torch.argmax` pick the top class. The true class is in the top
`k` when fewer than `k` classes come before it. An example's prediction is its true
class when that is in the top `k`, else its top class (torchmetrics' rule for
`top_k`); for `k = 1` it is the argmax.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike

from .._errors import StateTypeError, StateValueError


def _as_labels(what: str, x: Array) -> Array:
    if not (jnp.issubdtype(x.dtype, jnp.integer) or x.dtype == jnp.bool_):
        raise StateTypeError(
            f"{what}: expected integer class labels, got dtype {x.dtype}. Labels are "
            "class indices (0 / 1 for binary and multi-label problems)."
        )
    return x.astype(jnp.int32)


def _check_threshold(metric: str, threshold: float | None) -> float | None:
    if threshold is None:
        return None
    threshold = float(threshold)
    if not 0.0 <= threshold <= 1.0:
        raise StateValueError(
            f"{metric}: threshold must be a probability in [0, 1], got {threshold}. "
            "For logits, threshold the probabilities (`jax.nn.sigmoid(logits)`), or "
            "pass predicted labels `(logits > 0).astype(jnp.int32)`."
        )
    return threshold


def _threshold(metric: str, x: Array, threshold: float | None, shape: tuple) -> Array:
    if threshold is None:
        raise StateTypeError(
            f"{metric}.update got floating-point predictions of the labels' shape "
            f"{shape}. For probabilities of the positive class, build the metric "
            f"with a threshold, e.g. `{metric}(..., threshold=0.5)` (an example is "
            "predicted positive when its probability is > threshold); otherwise "
            "pass logits/scores with a trailing class axis (shape "
            f"{shape + ('num_classes',)}) or predicted integer labels "
            "(`jnp.argmax(logits, -1)`)."
        )
    return (x > threshold).astype(jnp.int32)  # NaN > t is False: predicted 0


def _split_inputs(
    metric: str,
    logits_or_preds: ArrayLike,
    labels: ArrayLike,
    num_classes: int | None,
    threshold: float | None = None,
) -> tuple[Array | None, Array | None, Array]:
    """Return `(logits, preds, labels)`: exactly one of `logits` / `preds` is set.

    `logits_or_preds` holds logits (or any scores) when it has one more axis than
    `labels` (the trailing class axis); predicted labels when it has the labels'
    shape and an integer dtype; probabilities of the positive class, thresholded,
    when it has the labels' shape, a floating dtype, and `threshold` is set."""
    x = jnp.asarray(logits_or_preds)
    y = _as_labels(f"{metric}.update: `labels`", jnp.asarray(labels))
    if x.ndim == y.ndim + 1 and x.shape[:-1] == y.shape:
        if num_classes is not None and x.shape[-1] != num_classes:
            raise StateValueError(
                f"{metric}(num_classes={num_classes}) got logits with "
                f"{x.shape[-1]} classes (shape {x.shape}). Build the metric with "
                f"`num_classes={x.shape[-1]}`."
            )
        return x, None, y
    if x.shape == y.shape:
        if jnp.issubdtype(x.dtype, jnp.inexact):
            return None, _threshold(metric, x, threshold, y.shape), y
        return None, _as_labels(f"{metric}.update: predictions", x), y
    raise StateValueError(
        f"{metric}.update got predictions of shape {x.shape} and labels of shape "
        f"{y.shape}. Pass either logits of shape [*batch, num_classes] with labels "
        "[*batch], or predictions (labels, or probabilities with `threshold=`) of "
        "the labels' shape."
    )


def _valid_labels(labels: Array, num_classes: int | None) -> Array:
    """Labels that are class indices (a padding label of -1 is not)."""
    valid = labels >= 0
    if num_classes is not None:
        valid = valid & (labels < num_classes)
    return valid


def _rank_of_label(logits: Array, labels: Array) -> Array:
    """How many classes come before the (valid) true class in the ranking order."""
    num_classes = logits.shape[-1]
    true = jnp.take_along_axis(logits, labels[..., None], axis=-1)  # [*batch, 1]
    s_nan, t_nan = jnp.isnan(logits), jnp.isnan(true)
    above = (logits > true) | (s_nan & ~t_nan)
    tied = (logits == true) | (s_nan & t_nan)
    del num_classes
    index = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    before = above | (tied & (index < labels[..., None]))
    return jnp.sum(before.astype(jnp.int32), axis=-1)


def _predictions(logits: Array, labels: Array, top_k: int) -> tuple[Array, Array]:
    """`(preds, in_top_k)` of logits by the ranking rule; `labels` must be class
    indices where they are to be used (others give `in_top_k` False)."""
    num_classes = logits.shape[-1]
    valid = _valid_labels(labels, num_classes)
    safe = jnp.where(valid, labels, jnp.zeros_like(labels))
    hit = valid & (_rank_of_label(logits, safe) < top_k)
    top1 = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # NaN first, ties: lowest
    return jnp.where(hit, labels, top1), hit
