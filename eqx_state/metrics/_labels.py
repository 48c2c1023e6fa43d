"""Classification inputs: logits (or scores) with a trailing class axis, or predicted
labels of the labels' shape."""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, ArrayLike


def _as_labels(what: str, x: Array) -> Array:
    if not (jnp.issubdtype(x.dtype, jnp.integer) or x.dtype == jnp.bool_):
        raise TypeError(
            f"{what}: expected integer class labels, got dtype {x.dtype}. Labels are "
            "class indices; for a binary classifier with one score per example, "
            "threshold it first, e.g. `(probs > 0.5).astype(jnp.int32)`."
        )
    return x.astype(jnp.int32)


def _split_inputs(
    metric: str, logits_or_preds: ArrayLike, labels: ArrayLike, num_classes: int | None
) -> tuple[Array | None, Array | None, Array]:
    """Return `(logits, preds, labels)`: exactly one of `logits` / `preds` is set.

    `logits_or_preds` holds logits (or any scores) when it has one more axis than
    `labels` (the trailing class axis), predicted labels when it has the labels'
    shape."""
    x = jnp.asarray(logits_or_preds)
    y = _as_labels(f"{metric}.update: `labels`", jnp.asarray(labels))
    if x.ndim == y.ndim + 1 and x.shape[:-1] == y.shape:
        if num_classes is not None and x.shape[-1] != num_classes:
            raise ValueError(
                f"{metric}(num_classes={num_classes}) got logits with "
                f"{x.shape[-1]} classes (shape {x.shape}). Build the metric with "
                f"`num_classes={x.shape[-1]}`."
            )
        return x, None, y
    if x.shape == y.shape:
        if jnp.issubdtype(x.dtype, jnp.inexact):
            raise TypeError(
                f"{metric}.update got floating-point predictions of the labels' shape "
                f"{y.shape}. Pass logits/scores with a trailing class axis (shape "
                f"{y.shape + ('num_classes',)}), or predicted integer labels, e.g. "
                "`jnp.argmax(logits, -1)` or `(probs > 0.5).astype(jnp.int32)`."
            )
        return None, _as_labels(f"{metric}.update: predictions", x), y
    raise ValueError(
        f"{metric}.update got predictions of shape {x.shape} and labels of shape "
        f"{y.shape}. Pass either logits of shape [*batch, num_classes] with labels "
        "[*batch], or predicted labels of the labels' shape."
    )
