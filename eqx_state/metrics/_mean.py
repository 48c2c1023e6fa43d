"""`Mean` (optionally weighted) and `Sum`."""

from __future__ import annotations

from collections.abc import Hashable

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import ArrayLike, Real, Shaped

from .._buffer import MetricState
from ._base import (
    FloatScalar,
    Metric,
    RealScalar,
    _check_dtype,
    _check_inputs,
    _check_nan_strategy,
    _div,
    _kept,
    _nan_policy,
    _weights,
    statistic,
)


class Mean(Metric):
    """The (weighted) mean of every value it is given: `sum(w * x) / sum(w)`, as
    `numpy.average`.

    Statistics: the weighted `total` and the total `weight`. A typical use is the
    mean loss over the steps of an epoch (`update(loss)` with a scalar loss) or the
    mean per-example loss over an evaluation set (`update(losses, mask=mask)` with
    padded batches).

    **Arguments:**

    - `nan_strategy`: what a NaN among the (unmasked) values or sample
        weights does: `"propagate"` (default: the result becomes NaN, as numpy),
        `"ignore"` (the entry is skipped, as if masked; torchmetrics' `"ignore"`) or
        `"error"` (the update raises, through `eqx.error_if`; see
        [misuse](../misuse.md#nan-and-inf-in-a-batch) for when it raises).
    - `axis_name`: reduce each update over this named axis (see
        [`eqx_state.metrics.Metric`][]).
    - `dtype`: the dtype of the statistics, floating (default float32: counts are
        exact up to 2**24 examples, and the float32 running sums round at every
        update: 2·10^6 single values in [0.5, 1.5] give a mean ~4e-5 off relative,
        fewer, larger batches less; pass `jnp.float64` with x64 enabled for more).
        An integer dtype is refused: a mean is fractional.

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

    _wide_cells = ("total", "weight")

    total: MetricState
    weight: MetricState
    nan_strategy: str = eqx.field(static=True)

    def __init__(
        self,
        *,
        nan_strategy: str = "propagate",
        axis_name: Hashable | None = None,
        dtype=jnp.float32,
    ):
        dtype = _check_dtype("Mean", dtype, "floating")
        self.total = statistic("sum", dtype=dtype)
        self.weight = statistic("sum", dtype=dtype)
        self.nan_strategy = _check_nan_strategy("Mean", nan_strategy)
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
            Negative weights are allowed (as `numpy.average`).
        - `mask`: which values count (shape as for `sample_weight`); masked-out
            values contribute nothing, even if they are NaN.
        """
        dtype = self.total.dtype
        _check_inputs("Mean", dtype, values=values, sample_weight=sample_weight)
        values = jnp.asarray(values).astype(dtype)
        w = _weights(values, mask, sample_weight, dtype)
        values, w, keep = _nan_policy(
            "Mean", self.nan_strategy, values, w, _kept(values, mask)
        )
        total = jnp.sum(jnp.where(keep, values * w, jnp.zeros_like(values)))
        self.accumulate(total=total, weight=jnp.sum(w))

    def compute(self) -> FloatScalar:
        """The weighted mean, `total / weight` (negative total weights included);
        0 if nothing (or only a total weight of 0) was added — `weight` tells the
        two apart."""
        return _div(self.total[...], self.weight[...])


class Sum(Metric):
    """The (weighted) sum of every value it is given: `sum(w * x)`.

    **Arguments:**

    - `nan_strategy`: what a NaN among the (unmasked) values or sample
        weights does: `"propagate"` (default: the result becomes NaN, as numpy),
        `"ignore"` (the entry is skipped, as if masked; torchmetrics' `"ignore"`) or
        `"error"` (the update raises, through `eqx.error_if`; see
        [misuse](../misuse.md#nan-and-inf-in-a-batch) for when it raises).
    - `axis_name`: reduce each update over this named axis (see
        [`eqx_state.metrics.Metric`][]).
    - `dtype`: the dtype of the sum (default float32), or a signed integer dtype
        (e.g. `jnp.int32`) to sum whole numbers exactly; then `values` and
        `sample_weight` must be integers (a float raises a `TypeError` at `update`
        rather than being truncated), and the sum wraps past the dtype's maximum.

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

    _wide_cells = ("total",)

    total: MetricState
    nan_strategy: str = eqx.field(static=True)

    def __init__(
        self,
        *,
        nan_strategy: str = "propagate",
        axis_name: Hashable | None = None,
        dtype=jnp.float32,
    ):
        dtype = _check_dtype("Sum", dtype, "counts")
        self.total = statistic("sum", dtype=dtype)
        self.nan_strategy = _check_nan_strategy("Sum", nan_strategy)
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
        dtype = self.total.dtype
        _check_inputs("Sum", dtype, values=values, sample_weight=sample_weight)
        values = jnp.asarray(values).astype(dtype)
        w = _weights(values, mask, sample_weight, dtype)
        values, w, keep = _nan_policy(
            "Sum", self.nan_strategy, values, w, _kept(values, mask)
        )
        self.accumulate(
            total=jnp.sum(jnp.where(keep, values * w, jnp.zeros_like(values)))
        )

    def compute(self) -> RealScalar:
        """The sum; 0 if nothing was added."""
        return self.total[...]
