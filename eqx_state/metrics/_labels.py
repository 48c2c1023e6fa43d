"""Classification inputs and the one ranking rule every classification metric uses.

Inputs: logits (or any scores) with a trailing class axis, predicted labels of the
labels' shape, or — with a `threshold` — probabilities (or logits) of the labels'
shape: as torchmetrics, when any value of an update is outside [0, 1] the update's
values are logits and go through a sigmoid before `> threshold`.

The ranking rule (`Accuracy(top_k)`, `ConfusionMatrix`, `Precision` / `Recall` /
`F1`, including their `top_k`): classes are ordered by score, a NaN score above
every number, and equal scores by class index, lower first — the order in which
`numpy.argmax` / `torch.argmax` pick the top class. The true class is in the top
`k` when fewer than `k` classes come before it. An example's prediction is its true
class when that is in the top `k`, else its top class (torchmetrics' rule for
`top_k`); for `k = 1` it is the argmax.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike

from .._buffer import host_value
from .._errors import (
    StateInputError,
    StateTypeError,
    StateValueError,
    check_real,
    is_whole,
)


def _as_labels(what: str, x: Array) -> Array:
    if not (jnp.issubdtype(x.dtype, jnp.integer) or x.dtype == jnp.bool_):
        raise StateTypeError(
            f"{what}: expected integer class labels, got dtype {x.dtype}. Labels are "
            "class indices (0 / 1 for binary and multi-label problems)."
        )
    if x.dtype != jnp.bool_ and jnp.iinfo(x.dtype).max > _INT32.max:
        # int64 (x64 on), uint32, uint64: a label past int32's range is out of any
        # class range, and stays so (clamped to int32's bounds) instead of wrapping
        # into a class (`2**32 + 1` was class 1)
        if jnp.iinfo(x.dtype).min < 0:
            x = jnp.clip(x, _INT32.min, _INT32.max)
        else:
            x = jnp.minimum(x, jnp.asarray(_INT32.max, x.dtype))
    return x.astype(jnp.int32)


_INT32 = np.iinfo(np.int32)


def as_label_array(x: Any, what: str) -> Array:
    """`jnp.asarray(x)` for labels, predicted labels and scores (`what` names the
    input in errors): a NumPy integer array wider than int32 is first clamped to
    int32's bounds in NumPy (with x64 off, `jnp.asarray` would wrap `2**32 + 1`
    into class 1), as `_as_labels` clamps a JAX one; other inputs go through the
    one conversion of user values (`host_value`: None, a string or a masked array
    is refused by name)."""
    if isinstance(x, np.ndarray | np.generic) and np.issubdtype(x.dtype, np.integer):
        info = np.iinfo(x.dtype)  # pyright: ignore[reportCallIssue, reportArgumentType]
        if info.max > _INT32.max:
            low = max(int(info.min), int(_INT32.min))
            x = np.clip(x, low, int(_INT32.max)).astype(np.int32)
    # a float64 score beyond float32 (a logit masked with `finfo.min`) becomes
    # -inf, which ranks as it did: taken
    return host_value(
        x,
        what,
        "Give an array of labels or scores.",
        StateTypeError,
        StateInputError,
        inf_ok=True,
    )


def refuse_complex_scores(metric: str, x: Array) -> None:
    """A classification metric's scores are real: complex ones raised JAX's "gt does
    not accept dtype complex64", or (thresholded) lost their imaginary parts. The
    layers' refusal (`nn._complex`), imported here to keep `metrics` importable
    before `nn`."""
    from ..nn._complex import refuse_complex

    refuse_complex(
        f"{metric}.update",
        x.dtype,
        "logits, probabilities and predicted labels are real (complex scores have "
        "no order)",
        "Pass the real scores your model means, e.g. `jnp.abs(z)` or `jnp.real(z)`.",
    )


def _check_threshold(metric: str, threshold: float | None) -> float | None:
    if threshold is None:
        return None
    threshold = check_real(metric, "threshold", threshold)
    if not 0.0 <= threshold <= 1.0:
        raise StateValueError(
            f"{metric}: threshold must be a probability in [0, 1], got {threshold}. "
            "Logits are fine as inputs (when any value of a batch is outside [0, 1], "
            "the batch is passed through a sigmoid first, as torchmetrics does); the "
            "threshold applies to the probabilities."
        )
    return threshold


def _check_ignore_index(metric: str, ignore_index: int | None) -> int | None:
    if ignore_index is None:
        return None
    if not is_whole(ignore_index):
        raise StateTypeError(
            f"{metric}: ignore_index must be None or an int (a label value whose "
            f"examples are left out, e.g. -1 or 255), got {ignore_index!r}."
        )
    return int(ignore_index)


def _ignored(labels: Any, ignore_index: int | None) -> Array | None:
    """Where the labels *as given* are `ignore_index` (None without one): a NumPy
    array is compared on the host, exactly, before any conversion (`jnp.asarray`
    with x64 off wraps int64, `as_label_array` clamps it)."""
    if ignore_index is None:
        return None
    if isinstance(labels, np.ndarray | np.generic):
        return jnp.asarray(np.asarray(labels) == ignore_index)
    labels = jnp.asarray(labels)
    if labels.dtype == jnp.bool_:  # compared as the numbers 0 and 1
        labels = labels.astype(jnp.int32)
    if jnp.issubdtype(labels.dtype, jnp.integer):
        info = jnp.iinfo(labels.dtype)
        if not info.min <= ignore_index <= info.max:  # no label of this dtype is it
            return jnp.zeros(labels.shape, jnp.bool_)
    return labels == jnp.asarray(ignore_index, labels.dtype)


def _as_probabilities(x: Array, counted: Array | None, axis_name: Any) -> Array:
    """torchmetrics' rule for binary and multi-label scores: when any (counted)
    value of the update is outside [0, 1] (NaN included), the values are logits and
    all of them go through a sigmoid; otherwise they are probabilities, kept as they
    are. Decided per update, without a Python branch on values (jit-safe); with an
    `axis_name`, over the whole (global) batch of the update."""
    outside = ~((x >= 0) & (x <= 1))  # NaN >= 0 is False: outside
    if counted is not None:
        outside = outside & counted
    logits = jnp.any(outside)
    if axis_name is not None:
        try:
            logits = jax.lax.pmax(logits.astype(jnp.int32), axis_name) > 0
        except NameError:  # unbound axis: `accumulate` names the fix
            pass
    return jnp.where(logits, jax.nn.sigmoid(x), x)


def _threshold(
    metric: str,
    x: Array,
    threshold: float | None,
    shape: tuple,
    counted: Array | None = None,
    axis_name: Any = None,
) -> Array:
    if threshold is None:
        raise StateTypeError(
            f"{metric}.update got floating-point predictions of the labels' shape "
            f"{shape}. For probabilities (or logits) of the positive class, build "
            f"the metric with a threshold, e.g. `{metric}(..., threshold=0.5)` (an "
            "example is predicted positive when its probability is > threshold); "
            "otherwise pass logits/scores with a trailing class axis (shape "
            f"{shape + ('num_classes',)}) or predicted integer labels "
            "(`jnp.argmax(logits, -1)`)."
        )
    dtype = x.dtype
    if jnp.dtype(dtype).itemsize < 4:  # the sigmoid of logits in float32
        x = x.astype(jnp.float32)
    p = _as_probabilities(x, counted, axis_name).astype(dtype)
    # compared in the predictions' dtype, the threshold rounded to it, for every
    # dtype alike: torchmetrics' `preds > threshold` on a tensor, and NumPy's
    # (bfloat16 0.30078125 is not > 0.3, which rounds to it; float32 0.3 is not
    # either). NaN > t is False: predicted 0.
    return (p > np.asarray(threshold, dtype)).astype(jnp.int32)


def _split_inputs(
    metric: str,
    logits_or_preds: ArrayLike,
    labels: ArrayLike,
    num_classes: int | None,
    threshold: float | None = None,
    counted: Array | None = None,
    axis_name: Any = None,
) -> tuple[Array | None, Array | None, Array]:
    """Return `(logits, preds, labels)`: exactly one of `logits` / `preds` is set.

    `logits_or_preds` holds logits (or any scores) when it has one more axis than
    `labels` (the trailing class axis); predicted labels when it has the labels'
    shape and an integer dtype; probabilities of the positive class, thresholded,
    when it has the labels' shape, a floating dtype, and `threshold` is set (logits
    of the positive class too: see `_as_probabilities`, which decides over the
    entries where `counted` is true, all by default)."""
    x = as_label_array(logits_or_preds, f"{metric}.update: `logits_or_preds`")
    refuse_complex_scores(metric, x)
    where = f"{metric}.update: `labels`"
    y = _as_labels(where, as_label_array(labels, where))
    if x.ndim == y.ndim + 1 and x.shape[:-1] == y.shape:
        if x.shape[-1] == 1:
            # one class: every prediction would be class 0 (a model's [B, 1]
            # output of binary probabilities scored silently as 0.5 accuracy)
            fix = (
                "For a binary model's output of shape [*batch, 1] (a probability "
                "or logit of the positive class), drop the axis, `x[..., 0]`, and "
                "build the metric with `threshold=0.5`; for two classes pass logits "
                "of shape [*batch, 2]."
                if jnp.issubdtype(x.dtype, jnp.inexact)
                else "Predicted labels have the labels' shape: drop the axis, "
                "`x[..., 0]` (e.g. `jnp.argmax(logits, -1)` without `keepdims`)."
            )
            raise StateValueError(
                f"{metric}.update got scores with a class axis of size 1 (shape "
                f"{x.shape}) for labels of shape {y.shape}: with one class every "
                f"prediction is class 0. {fix}"
            )
        if num_classes is not None and x.shape[-1] != num_classes:
            raise StateValueError(
                f"{metric}(num_classes={num_classes}) got logits with "
                f"{x.shape[-1]} classes (shape {x.shape}). Build the metric with "
                f"`num_classes={x.shape[-1]}`."
            )
        return x, None, y
    if x.shape == y.shape:
        if jnp.issubdtype(x.dtype, jnp.inexact):
            preds = _threshold(metric, x, threshold, y.shape, counted, axis_name)
            return None, preds, y
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


def check_top_k(name: str, top_k: int, num_classes: int | None) -> None:
    """`top_k` ranks among `num_classes` classes: more than there are would count
    every prediction correct (torchmetrics refuses it)."""
    if num_classes is not None and top_k > num_classes:
        raise StateValueError(
            f"{name}(top_k={top_k}) ranks among {num_classes} classes: every "
            f"prediction would count as correct. Use top_k <= {num_classes} (the "
            "size of the scores' class axis)."
        )


def _predictions(
    name: str, logits: Array, labels: Array, top_k: int
) -> tuple[Array, Array]:
    """`(preds, in_top_k)` of logits by the ranking rule; `labels` must be class
    indices where they are to be used (others give `in_top_k` False)."""
    num_classes = logits.shape[-1]
    check_top_k(name, top_k, num_classes)
    valid = _valid_labels(labels, num_classes)
    safe = jnp.where(valid, labels, jnp.zeros_like(labels))
    hit = valid & (_rank_of_label(logits, safe) < top_k)
    top1 = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # NaN first, ties: lowest
    return jnp.where(hit, labels, top1), hit
