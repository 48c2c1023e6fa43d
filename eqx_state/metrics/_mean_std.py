"""`MeanStd`: mean and standard deviation by Welford's method, merged with Chan et
al.'s parallel formula."""

from __future__ import annotations

from collections.abc import Hashable

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Real, Shaped

from .._buffer import MetricState
from ._base import (
    FloatScalar,
    Metric,
    _check_dtype,
    _check_inputs,
    _check_int,
    _check_nan_strategy,
    _div,
    _kept,
    _nan_policy,
    _weights,
    statistic,
)


class MeanStd(Metric):
    """The mean and standard deviation of every value it is given.

    Statistics: the total weight `count`, the `mean` and `m2`, the weighted sum of
    squared deviations from the mean (declared `merge="custom"`: they merge
    together). Each batch's moments are computed around the batch mean (two passes
    over the batch with the correction term of the corrected two-pass algorithm,
    numerically stable) and merged into the state with the parallel formula of
    Chan, Golub and LeVeque:

    `n = na + nb`, `d = mb - ma`, `mean = ma + d * nb / n`,
    `m2 = m2a + m2b + d**2 * na * nb / n`,

    which is exact and associative, so batches, merges and devices can be combined in
    any grouping. (The state's `mean` is kept in `dtype`: where the values' spread
    between batches is near that dtype's resolution at their size, the merged
    deviation is off, by an amount that depends on the offset, the number of
    updates and their sizes. Measured in float32 with N(0, 1) values updated one
    at a time: offset 1e5, 2·10^4 values: ~1e-4 relative (`numpy.std` in float32:
    ~1e-5); offset 1e6: ~1e-3 after 2·10^3 values, ~2e-2 after 2·10^4. With no
    offset the error grows with the number of updates: 2·10^6 single values,
    ~6e-4 relative (in batches of 1000: ~2e-7). Update with batches, or use
    `dtype=jnp.float64` with x64 for values far from zero relative to their
    spread, or subtract a known offset first.) Sample weights act as frequency weights (a weight of 2 counts a
    value twice), so they must not be negative (as `numpy.cov`'s `fweights`): a
    negative weight raises, through `eqx.error_if`.

    **Arguments:**

    - `ddof`: the "delta degrees of freedom" of the standard deviation:
        `std = sqrt(m2 / (count - ddof))`. `0` (default) is the population standard
        deviation (`numpy.std`), `1` the sample one (`numpy.std(..., ddof=1)`).
    - `nan_strategy`: what a NaN among the (unmasked) values or sample
        weights does: `"propagate"` (default: the result becomes NaN, as numpy),
        `"ignore"` (the entry is skipped, as if masked; torchmetrics' `"ignore"`) or
        `"error"` (the update raises, through `eqx.error_if`; see
        [misuse](../misuse.md#nan-and-inf-in-a-batch) for when it raises).
    - `axis_name`: reduce each update over this named axis (see
        [`eqx_state.metrics.Metric`][]).
    - `dtype`: the dtype of the statistics, floating (default float32; an integer
        dtype is refused: a mean and a variance are fractional).

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

    _wide_cells = ("count", "mean", "m2")

    count: MetricState
    mean: MetricState
    m2: MetricState
    ddof: int = eqx.field(static=True)
    nan_strategy: str = eqx.field(static=True)

    def __init__(
        self,
        *,
        ddof: int = 0,
        nan_strategy: str = "propagate",
        axis_name: Hashable | None = None,
        dtype=jnp.float32,
    ):
        ddof = _check_int("MeanStd", "ddof", ddof, 0)
        dtype = _check_dtype("MeanStd", dtype, "floating")
        self.count = statistic("custom", dtype=dtype, init=0)
        self.mean = statistic("custom", dtype=dtype, init=0)
        self.m2 = statistic("custom", dtype=dtype, init=0)
        self.ddof = ddof
        self.nan_strategy = _check_nan_strategy("MeanStd", nan_strategy)
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
        - `sample_weight`: frequency weights, >= 0 (scalar, the values' shape or a
            prefix of it).
        - `mask`: which values count; masked-out values contribute nothing, even if
            they are NaN.
        """
        dtype = self.count.dtype
        _check_inputs("MeanStd", dtype, values=values, sample_weight=sample_weight)
        values = jnp.asarray(values).astype(dtype)
        w = _weights(values, mask, sample_weight, dtype)
        if sample_weight is not None:
            w = eqx.error_if(
                w,
                jnp.any(w < 0),
                "MeanStd.update got a negative sample weight. MeanStd's weights are "
                "frequency weights (a weight of 2 counts a value twice), which "
                "cannot be negative (as numpy.cov's fweights). For a weighted mean "
                "with signed weights use Mean.",
            )
        values, w, keep = _nan_policy(
            "MeanStd", self.nan_strategy, values, w, _kept(values, mask)
        )
        zero = jnp.zeros_like(values)
        n = jnp.sum(w)
        mean = _div(jnp.sum(jnp.where(keep, values * w, zero)), n)
        dev = jnp.where(keep, values - mean, zero)
        # the corrected two-pass sum (Chan, Golub & LeVeque): the second term
        # removes the error of a mean rounded to the values' precision (1e7 + N(0,
        # 1) in float32 read a std of 1.44); >= 0 in exact arithmetic
        first = jnp.sum(w * dev)
        m2 = jnp.maximum(jnp.sum(w * dev * dev) - _div(first * first, n), 0)
        self.accumulate(count=n, mean=mean, m2=m2)

    def merge_statistics(
        self, a: dict[str, Array], b: dict[str, Array]
    ) -> dict[str, Array]:
        """Chan et al.'s parallel formula (see the class)."""
        na, nb = a["count"], b["count"]
        n = na + nb
        delta = b["mean"] - a["mean"]
        mean = a["mean"] + delta * _div(nb, n)
        m2 = a["m2"] + b["m2"] + delta * delta * _div(na * nb, n)
        # An infinite mean on either side makes `delta` infinite (or NaN), where the
        # formula gives `inf * 0` or `inf - inf`: NaN where one pass over all the
        # data gives inf. The weighted mean is right there; a side without data
        # leaves the other as it is.
        weighted = _div(na * a["mean"] + nb * b["mean"], n)
        mean = jnp.where(jnp.isfinite(delta), mean, weighted)
        mean = jnp.where(nb == 0, a["mean"], jnp.where(na == 0, b["mean"], mean))
        m2 = jnp.where(nb == 0, a["m2"], jnp.where(na == 0, b["m2"], m2))
        return {"count": n, "mean": mean, "m2": m2}

    def compute(self) -> tuple[FloatScalar, FloatScalar]:
        """`(mean, std)`. With no data the mean is 0; while `count <= ddof` the
        standard deviation is 0 (numpy gives NaN and a warning): read `count` to
        tell these apart."""
        n = self.count[...]
        dof = n - self.ddof
        var = jnp.where(dof > 0, _div(self.m2[...], dof), jnp.zeros_like(n))
        return self.mean[...], jnp.sqrt(var)
