"""`Min` and `Max`: the smallest / largest value seen."""

from __future__ import annotations

from collections.abc import Hashable
from typing import ClassVar

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import ArrayLike, Real, Shaped

from .._buffer import MetricState
from ._base import (
    Metric,
    RealScalar,
    _check_dtype,
    _check_inputs,
    _check_nan_strategy,
    _default_init,
    _kept,
    _nan_policy,
    _weights,
    statistic,
)


class _Extremum(Metric):
    value: MetricState
    count: MetricState
    nan_strategy: str = eqx.field(static=True)

    _reduction: ClassVar[str] = "min"
    _wide_cells = ("count",)

    def __init__(
        self,
        *,
        nan_strategy: str = "propagate",
        axis_name: Hashable | None = None,
        dtype=jnp.float32,
    ):
        dtype = _check_dtype(type(self).__name__, dtype, "values")
        self.value = statistic(self._reduction, dtype=dtype)
        self.count = statistic("sum", dtype=jnp.float32)
        self.nan_strategy = _check_nan_strategy(type(self).__name__, nan_strategy)
        self.axis_name = axis_name

    def update(
        self,
        values: Real[ArrayLike, "..."],
        *,
        mask: Shaped[ArrayLike, "..."] | None = None,
    ) -> None:
        """Add `values` (any shape; every element counts).

        **Arguments:**

        - `values`: the values.
        - `mask`: which values count (a scalar, the values' shape or a prefix of
            it); masked-out values are ignored, even if they are NaN.
        """
        dtype = self.value.dtype
        _check_inputs(type(self).__name__, dtype, values=values)
        values = jnp.asarray(values).astype(dtype)
        w = _weights(values, mask, None, jnp.float32)
        values, w, keep = _nan_policy(
            type(self).__name__, self.nan_strategy, values, w, _kept(values, mask)
        )
        neutral = _default_init(self._reduction, dtype)
        values = jnp.where(keep, values, jnp.full_like(values, neutral))
        reduce = jnp.min if self._reduction == "min" else jnp.max
        # the identity as an array of the dtype: a Python int past int32 (uint32's
        # largest) overflows as JAX's weakly typed argument
        extreme = reduce(values, initial=jnp.asarray(neutral, dtype))
        self.accumulate(value=extreme, count=jnp.sum(w))

    def compute(self) -> RealScalar:
        """The extreme value; with no data, the identity of the reduction: +inf for
        `Min`, -inf for `Max` (an integer `dtype`'s largest / smallest value), as
        torchmetrics. `count` says how many values were seen."""
        return self.value[...]


class Min(_Extremum):
    """The smallest value seen (NaN values propagate, as in `numpy.min`, unless
    `nan_strategy` says otherwise).

    Statistics: the running minimum `value` (starting at +inf) and the `count` of
    values seen (float32: exact up to 2**24, never wraps). Merges and cross-device
    reductions take the minimum.

    **Arguments:**

    - `nan_strategy`: `"propagate"` (default), `"ignore"` or `"error"` (see
        [`eqx_state.metrics.Mean`][]).
    - `axis_name`: reduce each update over this named axis (see
        [`eqx_state.metrics.Metric`][]).
    - `dtype`: the dtype of the minimum (default float32); an integer dtype takes
        integer values it holds only: a float, or an integer of a
        dtype it does not hold (uint32 into int32), raises a `TypeError` at
        `update` rather than being truncated or wrapped.

    **Example:**

    ```python
    import jax.numpy as jnp
    import eqx_state as es

    low = es.to_refs(es.metrics.Min())
    low.update(jnp.array([3.0, -1.0, 2.0]))
    assert float(low.compute()) == -1.0
    ```
    """

    _reduction = "min"


class Max(_Extremum):
    """The largest value seen (NaN values propagate, as in `numpy.max`, unless
    `nan_strategy` says otherwise).

    Statistics: the running maximum `value` (starting at -inf) and the `count` of
    values seen (float32: exact up to 2**24, never wraps). Merges and cross-device
    reductions take the maximum.

    **Arguments:**

    - `nan_strategy`: `"propagate"` (default), `"ignore"` or `"error"` (see
        [`eqx_state.metrics.Mean`][]).
    - `axis_name`: reduce each update over this named axis (see
        [`eqx_state.metrics.Metric`][]).
    - `dtype`: the dtype of the maximum (default float32); an integer dtype takes
        integer values it holds only: a float, or an integer of a
        dtype it does not hold (uint32 into int32), raises a `TypeError` at
        `update` rather than being truncated or wrapped.

    **Example:**

    ```python
    import jax.numpy as jnp
    import eqx_state as es

    high = es.to_refs(es.metrics.Max())
    high.update(jnp.array([3.0, -1.0, 2.0]))
    assert float(high.compute()) == 3.0
    ```
    """

    _reduction = "max"
