from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Num

from .._buffer import BatchStat, _LayerBase, check_cell_dtype
from .._errors import (
    StateTypeError,
    StateValueError,
    check_axis_name,
    check_bool,
    check_dtype,
    check_real,
    is_whole,
)
from ._axis import axis_size
from ._complex import refuse_complex, refuse_non_array
from ._counter import saturating_add
from ._flag import inference_flag


def _check_shape(shape: Any) -> tuple[int, ...]:
    """The shape of one input, from an int or a sequence of ints, each positive."""
    dims: Any = (shape,) if is_whole(shape) else shape
    if not isinstance(dims, Sequence) or not all(is_whole(d) for d in dims):
        raise StateTypeError(
            "RunningNorm: shape must be an int (a vector of that size) or a tuple "
            f"of ints (`()` for scalars), got {shape!r}."
        )
    dims = tuple(int(d) for d in dims)
    if any(d <= 0 for d in dims):
        raise StateValueError(
            f"RunningNorm: every size in shape must be positive, got {dims} (an "
            "input with an empty axis has nothing to normalise). Give the shape of "
            "one input, e.g. `RunningNorm(obs_dim)`, or `RunningNorm(())` for "
            "scalar inputs."
        )
    return dims


class RunningNorm(_LayerBase):
    r"""Normalisation by the running mean and variance of everything seen so far:
    the observation normaliser of reinforcement learning.

    Each call treats the leading axes of `x` as a batch of inputs of shape
    `shape`. In training (the default) it first folds the batch into the running
    moments with Chan et al.'s parallel update,

    $$\delta = \bar x_B - \mu,\quad n' = n + n_B,\quad
    \mu' = \mu + \delta \tfrac{n_B}{n'},\quad
    \sigma'^2 = \sigma^2 \tfrac{n}{n'} + \sigma_B^2 \tfrac{n_B}{n'}
      + \delta^2 \tfrac{n\, n_B}{n'^2},$$

    so that `mean` and `var` are the mean and (population) variance of all inputs
    seen, however they were split into batches (up to float rounding); then it
    returns
    `clip((x - mean) / sqrt(var + eps), -clip, clip)`. In evaluation
    ([`eqx.nn.inference_mode`](https://docs.kidger.site/equinox/api/nn/inference/)) it only normalises.
    Before any update the statistics are mean 0, variance 1. For per-example
    code, build it with `axis_name=` and map with [`eqx_state.vmap`][].

    The moments (float32 by default) and the count (int32) are
    [`eqx_state.BatchStat`][] cells with reset fills mean 0, variance 1, count 0, so
    `es.reset(model, es.BatchStat)` starts the normaliser over.

    **Long runs.** The count saturates at $2^{31} - 1$ instead of wrapping (an
    int32 that wrapped would turn the weights negative: variance $-1$, NaN
    outputs). From there every batch is folded in with weight
    $n_B / (2^{31} - 1 + n_B)$: a moving average over the last ~$2^{31}$ inputs.
    (In float32 the moments stop moving long before: a batch of 64 after $2^{30}$
    inputs has weight $6 \cdot 10^{-8}$, below float32's resolution; use
    `dtype=jnp.float64`, with `jax_enable_x64`, for such runs.)

    **Merging.** [`merge`][eqx_state.nn.RunningNorm.merge] combines two normalisers'
    statistics with the same parallel formula, exactly as if one had seen all the
    inputs of both (e.g. normalisers updated by separate actors or devices).

    **Arguments:**

    - `shape`: the shape of one input (an int for a vector of that size; `()` for
        scalars). Every size is positive.
    - `eps`: added to the variance before the square root.
    - `clip`: the bound of the normalised output, or `None` for no clipping.
    - `axis_name`: a named axis (of [`eqx_state.vmap`][]) whose inputs form one
        batch: the batch moments are reduced over it, so a
        per-environment call `es.vmap(policy, axis_name="env")(obs)` updates the
        moments once with every environment's observation.
    - `inference`: start in evaluation mode.
    - `dtype`: the floating dtype of the moments, 32 bits or more (default
        float32).

    **Example:**

    ```python
    import jax.numpy as jnp
    import eqx_state as es

    norm = es.to_refs(es.nn.RunningNorm(2))
    norm(jnp.array([[0.0, 10.0], [2.0, 30.0]]))
    norm(jnp.array([[4.0, 20.0]]))
    print(norm.mean[...], norm.var[...])  # [ 2. 20.] [ 2.666667 66.66667 ]
    ```
    """

    mean: BatchStat
    var: BatchStat
    count: BatchStat
    shape: tuple[int, ...] = eqx.field(static=True)
    eps: float = eqx.field(static=True)
    clip: float | None = eqx.field(static=True)
    axis_name: Hashable | None = eqx.field(static=True)
    inference: bool

    def __init__(
        self,
        shape: int | Sequence[int] = (),
        *,
        eps: float = 1e-8,
        clip: float | None = 5.0,
        axis_name: Hashable | None = None,
        inference: bool = False,
        dtype=None,
    ):
        shape = _check_shape(shape)
        eps = check_real("RunningNorm", "eps", eps)
        if clip is not None:
            clip = check_real("RunningNorm", "clip", clip)
        inference = check_bool("RunningNorm", "inference", inference)
        if not 0 <= eps < math.inf:
            raise StateValueError(
                f"RunningNorm: eps must be non-negative and finite, got {eps!r}: it is added to "
                "the variance before the square root."
            )
        if clip is not None and not clip > 0:
            raise StateValueError(
                f"RunningNorm: clip must be positive or None, got {clip}."
            )
        dtype = (
            jnp.float32 if dtype is None else check_dtype("RunningNorm", "dtype", dtype)
        )
        if not jnp.issubdtype(dtype, jnp.floating):
            raise StateValueError(f"RunningNorm: dtype must be floating, got {dtype}.")
        if jnp.finfo(dtype).bits < 32:
            raise StateValueError(
                f"RunningNorm: dtype must be a floating dtype of 32 bits or more "
                f"(float32, float64 with x64), got {jnp.dtype(dtype).name}: the "
                "moments accumulate the whole run, and in a narrower float the "
                "count's weights overflow (float16: NaN after 65,504 inputs). Train "
                "in float32 and cast the model for inference if you need to."
            )
        self.shape = shape
        self.eps = float(eps)
        self.clip = clip
        self.axis_name = check_axis_name("RunningNorm", axis_name)
        self.inference = inference
        self.mean = BatchStat(jnp.zeros(shape, dtype), init=0)
        self.var = BatchStat(jnp.ones(shape, dtype), init=1)
        self.count = BatchStat(jnp.zeros((), jnp.int32), init=0)

    @property
    def std(self) -> Float[Array, "..."]:
        """`sqrt(var + eps)`, the scale the inputs are divided by."""
        return jnp.sqrt(self.var[...] + jnp.asarray(self.eps, self.var.dtype))

    def _batch_ndim(self, x: Array) -> int:
        k = len(self.shape)
        if x.ndim < k or tuple(x.shape[x.ndim - k :]) != self.shape:
            raise StateValueError(
                f"RunningNorm(shape={self.shape}) got an input of shape {x.shape}: "
                f"expected [..., {', '.join(map(str, self.shape))}] (one input of "
                "shape `shape`, or a batch of them along leading axes)."
            )
        return x.ndim - k

    def __call__(self, x: Num[Array, "..."], *, key=None) -> Float[Array, "..."]:
        """Update the moments with the batch `x` (training mode only) and return it
        normalised and clipped.

        **Arguments:**

        - `x`: inputs of shape `[*batch, *shape]` (any number of batch axes,
            none for a single input), real (integer or floating); complex input
            is refused with a `TypeError`.
        - `key`: ignored; accepted for compatibility with `eqx.nn.Sequential`.

        **Returns:**

        An array of the shape of `x`: its dtype if floating (and at least as wide
        as the moments), else the moments' dtype.
        """
        del key
        refuse_non_array("RunningNorm", x)
        refuse_complex(
            "RunningNorm",
            x.dtype,
            "the variance of complex data has more than one definition",
            "Normalise the real and imaginary parts as features of their own, e.g. "
            f"`RunningNorm({(*self.shape, 2)})` on `jnp.stack([x.real, x.imag], "
            "axis=-1)`.",
        )
        for cell in (self.mean, self.var):  # moments of any floating dtype
            check_cell_dtype("RunningNorm", self, cell, jnp.floating)
        nb = self._batch_ndim(x)
        sdtype = self.mean.dtype
        if jnp.issubdtype(x.dtype, jnp.floating) and (
            jnp.finfo(x.dtype).bits >= jnp.finfo(sdtype).bits
        ):
            cdtype = x.dtype
        else:
            cdtype = sdtype
        xc = x.astype(cdtype)
        n = math.prod(x.shape[:nb])
        if not inference_flag(self) and n > 0:
            self._update(xc, nb, n)
        expand = (1,) * nb + self.shape
        mean = self.mean[...].astype(cdtype).reshape(expand)
        var = self.var[...].astype(cdtype).reshape(expand)
        y = (xc - mean) / jnp.sqrt(var + jnp.asarray(self.eps, cdtype))
        if self.clip is not None:
            c = jnp.asarray(self.clip, cdtype)
            y = jnp.clip(y, -c, c)
        out_dtype = x.dtype if jnp.issubdtype(x.dtype, jnp.floating) else cdtype
        return y.astype(out_dtype)

    def _update(self, xc: Array, nb: int, n: int) -> None:
        check_cell_dtype("RunningNorm", self, self.count, jnp.integer, 32)
        for cell in (self.mean, self.var):  # accumulated: 32 bits at least
            check_cell_dtype("RunningNorm", self, cell, jnp.floating, 32)
        axes = tuple(range(nb))
        expand = (1,) * nb + self.shape
        if self.axis_name is None:
            batch_n: Array | int = n
            batch_mean = jnp.mean(xc, axis=axes)
            centred = jnp.square(xc - batch_mean.reshape(expand))
            batch_var = jnp.mean(centred, axis=axes)
        else:
            # The batch is spread over the named axis: sum, then centre on the
            # global mean (two passes, as numerically sound as the local case).
            batch_n = n * axis_size(self.axis_name, "RunningNorm")
            total = jax.lax.psum(jnp.sum(xc, axis=axes), self.axis_name)
            batch_mean = total / jnp.asarray(batch_n, xc.dtype)
            centred = jnp.square(xc - batch_mean.reshape(expand))
            batch_var = jax.lax.psum(
                jnp.sum(centred, axis=axes), self.axis_name
            ) / jnp.asarray(batch_n, xc.dtype)
        count, mean, var = _combine(
            (self.count[...], self.mean[...].astype(xc.dtype), self.var[...]),
            (jnp.asarray(batch_n, jnp.int32), batch_mean, batch_var),
        )
        self.count[...] = count
        self.mean[...] = mean.astype(self.mean.dtype)
        self.var[...] = var.astype(self.var.dtype)

    def merge(self, other: RunningNorm) -> RunningNorm:
        """Combine the statistics of two normalisers (Chan et al.'s parallel
        formula): the result's `mean`, `var` and `count` are those of all the inputs
        either has seen, as if one normaliser had seen them all (up to float
        rounding). The count saturates as in training.

        Pure: neither normaliser changes; the result is a new value-mode
        `RunningNorm` with `self`'s configuration (even if the inputs are in ref
        mode).

        **Arguments:**

        - `other`: a `RunningNorm` of the same `shape` and moment dtype.

        **Returns:**

        A new `RunningNorm` holding the combined statistics.

        **Example:**

        ```python
        import jax.numpy as jnp
        import eqx_state as es

        a, b = es.to_refs(es.nn.RunningNorm()), es.to_refs(es.nn.RunningNorm())
        a(jnp.array([1.0, 2.0]))
        b(jnp.array([6.0]))
        both = a.merge(b)
        print(int(both.count[...]), float(both.mean[...]))  # 3 3.0
        ```
        """
        if not isinstance(other, RunningNorm):
            raise StateTypeError(
                f"RunningNorm.merge needs another RunningNorm, got {type(other).__name__}."
            )
        if other.shape != self.shape or other.mean.dtype != self.mean.dtype:
            raise StateValueError(
                "RunningNorm.merge: the normalisers must have the same shape and "
                f"dtype, got shape {self.shape} ({self.mean.dtype}) and {other.shape} "
                f"({other.mean.dtype})."
            )
        count, mean, var = _combine(
            (self.count[...], self.mean[...], self.var[...]),
            (other.count[...], other.mean[...], other.var[...]),
        )
        return eqx.tree_at(
            lambda m: (m.mean, m.var, m.count),
            self,
            (
                BatchStat(mean.astype(self.mean.dtype), init=0),
                BatchStat(var.astype(self.var.dtype), init=1),
                BatchStat(count, init=0),
            ),
        )


def _combine(
    a: tuple[Array, Array, Array], b: tuple[Array, Array, Array]
) -> tuple[Array, Array, Array]:
    """Chan et al.'s parallel combination of (count, mean, population variance),
    with a saturating int32 count. The weights are computed in floating point from
    the counts, so nothing overflows."""
    (na, ma, va), (nb, mb, vb) = a, b
    dtype = jnp.result_type(ma, mb)
    fa, fb = na.astype(dtype), nb.astype(dtype)
    total = fa + fb
    safe = jnp.where(total > 0, total, jnp.ones((), dtype))
    wa = jnp.where(total > 0, fa / safe, jnp.ones((), dtype))  # n_a / n
    wb = jnp.where(total > 0, fb / safe, jnp.zeros((), dtype))  # n_b / n
    delta = mb.astype(dtype) - ma.astype(dtype)
    mean = ma.astype(dtype) + delta * wb
    var = va.astype(dtype) * wa + vb.astype(dtype) * wb + jnp.square(delta) * (wa * wb)
    count = saturating_add(_as_int32_count(na), _as_int32_count(nb))
    return count, mean, var


def _as_int32_count(n: Array) -> Array:
    """A count (of any integer dtype, e.g. a uint32 cell) as int32, at most int32's
    largest value: cut in its own dtype first, so that nothing wraps."""
    top = np.iinfo(np.int32).max
    n = jnp.asarray(n)
    if jnp.iinfo(n.dtype).max > top:
        n = jnp.minimum(n, jnp.asarray(top, n.dtype))
    return n.astype(jnp.int32)
