"""`Min` and `Max`: the smallest / largest value seen."""

from __future__ import annotations

from collections.abc import Hashable
from typing import ClassVar

import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Real, Shaped

from .._buffer import MetricState
from ._base import Metric, RealScalar, _cell, _fill, _weights


class _Extremum(Metric):
    value: MetricState
    count: MetricState

    _reduction: ClassVar[str] = "min"

    def __init__(self, *, axis_name: Hashable | None = None, dtype=jnp.float32):
        self.value = _cell(self._reduction, (), dtype)
        self.count = _cell("sum", (), jnp.int32)
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
        values = jnp.asarray(values).astype(dtype)
        keep = _weights(values, mask, None, jnp.int32) != 0
        neutral = jnp.full_like(values, _fill(self._reduction, (), dtype))
        values = jnp.where(keep, values, neutral)
        reduce = jnp.min if self._reduction == "min" else jnp.max
        extreme = reduce(values, initial=_fill(self._reduction, (), dtype))
        self._accumulate((extreme, jnp.sum(keep.astype(jnp.int32))))

    def _result(self, states: tuple[Array, ...]) -> Array:
        value, count = states
        if jnp.issubdtype(value.dtype, jnp.inexact):
            return jnp.where(count > 0, value, jnp.nan)
        return value

    def compute(self) -> RealScalar:
        """The extreme value; NaN if nothing was added (for an integer `dtype`, the
        dtype's largest / smallest value)."""
        return self._result(self._read())


class Min(_Extremum):
    """The smallest value seen (NaN values propagate, as in `numpy.min`).

    Statistics: the running minimum `value` (starting at +inf) and the `count` of
    values seen. Merges and cross-device reductions take the minimum.

    **Arguments:**

    - `axis_name`: reduce each update over this named axis (see
        [`eqx_state.metrics.Metric`][]).
    - `dtype`: the dtype of the minimum (default float32).

    **Example:**

    ```python
    import jax.numpy as jnp
    import eqx_state as es

    low = es.to_refs(es.metrics.Min())
    low.update(jnp.array([3.0, -1.0, 2.0]))
    assert float(low.compute()) == -1.0
    ```
    """

    _kinds = {"value": "min", "count": "sum"}
    _reduction = "min"


class Max(_Extremum):
    """The largest value seen (NaN values propagate, as in `numpy.max`).

    Statistics: the running maximum `value` (starting at -inf) and the `count` of
    values seen. Merges and cross-device reductions take the maximum.

    **Arguments:**

    - `axis_name`: reduce each update over this named axis (see
        [`eqx_state.metrics.Metric`][]).
    - `dtype`: the dtype of the maximum (default float32).

    **Example:**

    ```python
    import jax.numpy as jnp
    import eqx_state as es

    high = es.to_refs(es.metrics.Max())
    high.update(jnp.array([3.0, -1.0, 2.0]))
    assert float(high.compute()) == 3.0
    ```
    """

    _kinds = {"value": "max", "count": "sum"}
    _reduction = "max"
