"""`Mean` (optionally weighted) and `Sum`."""

from __future__ import annotations

from collections.abc import Hashable

import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Real, Shaped

from .._buffer import MetricState
from ._base import FloatScalar, Metric, RealScalar, _cell, _safe_div, _weights


class Mean(Metric):
    """The (weighted) mean of every value it is given: `sum(w * x) / sum(w)`.

    Statistics: the weighted `total` and the total `weight`, both
    [`eqx_state.MetricState`][] cells. A typical use is the mean loss over the steps
    of an epoch (`update(loss)` with a scalar loss) or the mean per-example loss over
    an evaluation set (`update(losses, mask=mask)` with padded batches).

    **Arguments:**

    - `axis_name`: reduce each update over this named axis (see
        [`eqx_state.metrics.Metric`][]).
    - `dtype`: the dtype of the statistics (default float32: counts are exact up to
        2**24 examples; pass `jnp.float64` with x64 enabled for more).

    **Example:**

    ```python
    import jax.numpy as jnp
    import eqx_state as es

    mean = es.to_refs(es.metrics.Mean())
    mean.update(jnp.array([1.0, 2.0, 3.0]))
    mean.update(jnp.array([10.0, 99.0]), mask=jnp.array([True, False]))
    assert float(mean.compute()) == 4.0
    ```
    """

    total: MetricState
    weight: MetricState

    _kinds = {"total": "sum", "weight": "sum"}

    def __init__(self, *, axis_name: Hashable | None = None, dtype=jnp.float32):
        self.total = _cell("sum", (), dtype)
        self.weight = _cell("sum", (), dtype)
        self.axis_name = axis_name

    def update(
        self,
        values: Real[ArrayLike, "..."],
        *,
        sample_weight: Real[ArrayLike, "..."] | None = None,
        mask: Shaped[ArrayLike, "..."] | None = None,
    ) -> None:
        """Add `values` (any shape; every element counts) to the mean.

        **Arguments:**

        - `values`: the values, e.g. a scalar loss or per-example losses.
        - `sample_weight`: a weight per value; a scalar, an array of the values'
            shape, or of a prefix of it (broadcast over the trailing axes).
        - `mask`: which values count (shape as for `sample_weight`); masked-out
            values contribute nothing, even if they are NaN.
        """
        values = jnp.asarray(values).astype(self.total.dtype)
        w = _weights(values, mask, sample_weight, self.total.dtype)
        total = jnp.sum(jnp.where(w != 0, values * w, jnp.zeros_like(values)))
        self._accumulate((total, jnp.sum(w)))

    def _result(self, states: tuple[Array, ...]) -> FloatScalar:
        total, weight = states
        return jnp.where(weight != 0, _safe_div(total, weight), jnp.nan)

    def compute(self) -> FloatScalar:
        """The weighted mean; NaN if nothing (or only zero weight) was added, like
        `numpy.mean` of an empty array."""
        return self._result(self._read())


class Sum(Metric):
    """The (weighted) sum of every value it is given: `sum(w * x)`.

    **Arguments:**

    - `axis_name`: reduce each update over this named axis (see
        [`eqx_state.metrics.Metric`][]).
    - `dtype`: the dtype of the sum (default float32).

    **Example:**

    ```python
    import jax.numpy as jnp
    import eqx_state as es

    total = es.to_refs(es.metrics.Sum())
    total.update(jnp.array([1.0, 2.0]))
    total.update(3.0)
    assert float(total.compute()) == 6.0
    ```
    """

    total: MetricState

    _kinds = {"total": "sum"}

    def __init__(self, *, axis_name: Hashable | None = None, dtype=jnp.float32):
        self.total = _cell("sum", (), dtype)
        self.axis_name = axis_name

    def update(
        self,
        values: Real[ArrayLike, "..."],
        *,
        sample_weight: Real[ArrayLike, "..."] | None = None,
        mask: Shaped[ArrayLike, "..."] | None = None,
    ) -> None:
        """Add the (weighted) sum of `values` (any shape).

        **Arguments:**

        - `values`: the values.
        - `sample_weight`: a weight per value (scalar, the values' shape or a prefix
            of it).
        - `mask`: which values count; masked-out values contribute nothing.
        """
        values = jnp.asarray(values).astype(self.total.dtype)
        w = _weights(values, mask, sample_weight, self.total.dtype)
        self._accumulate(
            (jnp.sum(jnp.where(w != 0, values * w, jnp.zeros_like(values))),)
        )

    def _result(self, states: tuple[Array, ...]) -> Array:
        return states[0]

    def compute(self) -> RealScalar:
        """The sum; 0 if nothing was added."""
        return self._result(self._read())
