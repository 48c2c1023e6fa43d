"""`MeanStd`: mean and standard deviation by Welford's method, merged with Chan et
al.'s parallel formula."""

from __future__ import annotations

from collections.abc import Hashable

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Real, Shaped

from .._buffer import MetricState
from ._base import FloatScalar, Metric, _cell, _safe_div, _weights


class MeanStd(Metric):
    """The mean and standard deviation of every value it is given.

    Statistics: the total weight `count`, the `mean` and `m2`, the weighted sum of
    squared deviations from the mean. Each batch's moments are computed around the
    batch mean (two passes over the batch, numerically stable) and merged into the
    state with the parallel formula of Chan, Golub and LeVeque:

    `n = na + nb`, `d = mb - ma`, `mean = ma + d * nb / n`,
    `m2 = m2a + m2b + d**2 * na * nb / n`,

    which is exact and associative, so batches, merges and devices can be combined in
    any grouping. Sample weights act as frequency weights (a weight of 2 counts a
    value twice).

    **Arguments:**

    - `ddof`: the "delta degrees of freedom" of the standard deviation:
        `std = sqrt(m2 / (count - ddof))`. `0` (default) is the population standard
        deviation (`numpy.std`), `1` the sample one (`numpy.std(..., ddof=1)`).
    - `axis_name`: reduce each update over this named axis (see
        [`eqx_state.metrics.Metric`][]).
    - `dtype`: the dtype of the statistics (default float32).

    **Example:**

    ```python
    import jax.numpy as jnp
    import eqx_state as es

    ms = es.to_refs(es.metrics.MeanStd())
    ms.update(jnp.array([1.0, 2.0]))
    ms.update(jnp.array([3.0, 4.0]))
    mean, std = ms.compute()
    assert float(mean) == 2.5 and abs(float(std) - 1.118034) < 1e-6
    ```
    """

    count: MetricState
    mean: MetricState
    m2: MetricState
    ddof: int = eqx.field(static=True)

    _kinds = {"count": "sum", "mean": "sum", "m2": "sum"}

    def __init__(
        self, *, ddof: int = 0, axis_name: Hashable | None = None, dtype=jnp.float32
    ):
        if ddof < 0:
            raise ValueError(f"MeanStd: ddof must be >= 0, got {ddof}.")
        self.count = _cell("sum", (), dtype)
        self.mean = _cell("sum", (), dtype)
        self.m2 = _cell("sum", (), dtype)
        self.ddof = ddof
        self.axis_name = axis_name

    def update(
        self,
        values: Real[ArrayLike, "..."],
        *,
        sample_weight: Real[ArrayLike, "..."] | None = None,
        mask: Shaped[ArrayLike, "..."] | None = None,
    ) -> None:
        """Add `values` (any shape; every element counts).

        **Arguments:**

        - `values`: the values.
        - `sample_weight`: frequency weights (scalar, the values' shape or a prefix
            of it).
        - `mask`: which values count; masked-out values contribute nothing, even if
            they are NaN.
        """
        dtype = self.count.dtype
        values = jnp.asarray(values).astype(dtype)
        w = _weights(values, mask, sample_weight, dtype)
        zero = jnp.zeros_like(values)
        n = jnp.sum(w)
        mean = _safe_div(jnp.sum(jnp.where(w != 0, values * w, zero)), n)
        dev = jnp.where(w != 0, values - mean, zero)
        m2 = jnp.sum(w * dev * dev)
        self._accumulate((n, mean, m2))

    def _combine(self, a: tuple[Array, ...], b: tuple[Array, ...]) -> tuple[Array, ...]:
        na, ma, m2a = a
        nb, mb, m2b = b
        n = na + nb
        delta = mb - ma
        mean = ma + delta * _safe_div(nb, n)
        m2 = m2a + m2b + delta * delta * _safe_div(na * nb, n)
        return n, mean, m2

    def _reduce_states(
        self, states: tuple[Array, ...], axis_name: Hashable
    ) -> tuple[Array, ...]:
        n, mean, m2 = states
        n_all = jax.lax.psum(n, axis_name)
        mean_all = _safe_div(jax.lax.psum(n * mean, axis_name), n_all)
        delta = mean - mean_all
        m2_all = jax.lax.psum(m2 + n * delta * delta, axis_name)
        return n_all, mean_all, m2_all

    def _result(self, states: tuple[Array, ...]) -> tuple[FloatScalar, FloatScalar]:
        n, mean, m2 = states
        dof = n - self.ddof
        mean = jnp.where(n > 0, mean, jnp.nan)
        var = jnp.where(dof > 0, _safe_div(m2, dof), jnp.nan)
        return mean, jnp.sqrt(var)

    def compute(self) -> tuple[FloatScalar, FloatScalar]:
        """`(mean, std)`. The mean is NaN with no data; the standard deviation is NaN
        while `count <= ddof` (as `numpy.std` without its warning)."""
        return self._result(self._read())
