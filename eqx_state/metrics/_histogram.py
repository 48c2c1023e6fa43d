"""`Histogram`: counts of values in fixed, equal-width bins (`numpy.histogram` with a
given `range`), accumulated across batches."""

from __future__ import annotations

import math
from collections.abc import Hashable

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float, Real, Shaped

from .._buffer import MetricState
from ._base import Metric, _replicated, _weights, statistic


class Histogram(Metric):
    """Counts of the values in `bins` equal-width bins over `range`, accumulated
    across updates: `numpy.histogram(values, bins=bins, range=range)` over every
    value seen (with `weights=` as `sample_weight`).

    The bins are fixed when the metric is built (a streaming histogram cannot move
    its edges), so that histograms of different batches, steps and devices add up.
    As in numpy, bin `i` holds `edges[i] <= x < edges[i + 1]`, the last bin also
    holds `x == range[1]`, and values outside the range are not in any bin; here
    they are counted in `below` and `above` (with -inf and +inf), so that a
    saturating or diverging activation shows. NaN values are in no count.

    Statistics: `counts` (shape `[bins]`), `below` and `above`, all summed
    (float32 by default: exact up to 2**24 per bin; pass `dtype=jnp.float64` with
    x64 enabled for more).

    **Arguments:**

    - `bins`: the number of bins (>= 1).
    - `range`: `(low, high)`, finite, `low < high`: the lower edge of the first
        bin and the upper edge of the last.
    - `axis_name`: reduce each update over this named axis (see
        [`eqx_state.metrics.Metric`][]).
    - `dtype`: the dtype of the counts (default float32).

    **Example:**

    ```python
    import jax.numpy as jnp
    import eqx_state as es

    hist = es.to_refs(es.metrics.Histogram(4, range=(0.0, 1.0)))
    hist.update(jnp.array([0.1, 0.3, 0.35, 1.0, 2.0]))
    print(hist.compute())  # [1. 2. 0. 1.]
    print(float(hist.above[...]))  # 1.0
    ```
    """

    counts: MetricState
    below: MetricState
    above: MetricState
    bins: int = eqx.field(static=True)
    range: tuple[float, float] = eqx.field(static=True)

    def __init__(
        self,
        bins: int,
        range: tuple[float | int, float | int],
        *,
        axis_name: Hashable | None = None,
        dtype=jnp.float32,
    ):
        if not isinstance(bins, int) or isinstance(bins, bool) or bins < 1:
            raise ValueError(f"Histogram: bins must be an int >= 1, got {bins!r}.")
        try:
            low, high = (float(r) for r in range)
        except (TypeError, ValueError):
            raise ValueError(
                f"Histogram: range must be a pair (low, high), got {range!r}."
            ) from None
        if not (math.isfinite(low) and math.isfinite(high) and low < high):
            raise ValueError(
                f"Histogram: range must be finite with low < high, got {range!r}."
            )
        if not jnp.issubdtype(dtype, jnp.inexact):
            raise ValueError(f"Histogram: dtype must be floating, got {dtype}.")
        self.bins = bins
        self.range = (low, high)
        self.counts = statistic("sum", shape=(bins,), dtype=dtype)
        self.below = statistic("sum", dtype=dtype)
        self.above = statistic("sum", dtype=dtype)
        self.axis_name = axis_name

    @property
    def edges(self) -> Float[Array, " bins_plus_1"]:
        """The `bins + 1` bin edges, `numpy.linspace(low, high, bins + 1)`."""
        low, high = self.range
        return jnp.linspace(low, high, self.bins + 1, dtype=jnp.float32)

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
        - `sample_weight`: a weight per value (numpy's `weights=`): a scalar, the
            values' shape or a prefix of it.
        - `mask`: which values count; masked-out values are in no count.
        """
        dtype = self.counts.dtype
        values = jnp.asarray(values)
        if not jnp.issubdtype(values.dtype, jnp.floating):
            values = values.astype(jnp.float32)
        w = _weights(values, mask, sample_weight, dtype)
        low, high = self.range
        x = values.astype(jnp.promote_types(values.dtype, jnp.float32))
        edges = jnp.linspace(low, high, self.bins + 1, dtype=x.dtype)
        inside = (x >= edges[0]) & (x <= edges[-1])
        # bin i holds edges[i] <= x < edges[i + 1], x == high the last bin: the bin
        # is the number of inner edges <= x (compared elementwise, no gather, so
        # a batch sharded across devices stays sharded)
        index = jnp.zeros(x.shape, jnp.int32)
        for k in range(1, self.bins):
            index = index + (x >= edges[k]).astype(jnp.int32)
        index = jnp.where(inside, index, self.bins).reshape(-1)  # out of range: drop
        zero = jnp.zeros_like(w)
        counts = jnp.zeros((self.bins,), dtype)
        counts = counts.at[index].add(
            jnp.where(inside, w, zero).reshape(-1), mode="drop", **_replicated(index)
        )
        below = jnp.sum(jnp.where(x < edges[0], w, zero))
        above = jnp.sum(jnp.where(x > edges[-1], w, zero))
        self.accumulate(counts=counts, below=below, above=above)

    def compute(self) -> Real[Array, " bins"]:
        """The counts per bin (zeros before any data)."""
        return self.counts[...]
