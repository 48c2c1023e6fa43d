"""`Histogram`: counts of values in fixed, equal-width bins (`numpy.histogram` with a
given `range`), accumulated across batches.

Binning is exactly numpy's. `numpy.histogram(x, bins, range)` rounds the edges
`linspace(low, high, bins + 1)` to the dtype of `x` (float64 for integer data),
computes a bin index with a formula and corrects it by one where a comparison with
the edges says so. The corrected index is the number of inner edges `<= x` whenever
the formula lands within one bin of it, which this module checks for each
configuration (`_plan`); where it does not, it applies numpy's correction itself.
Comparisons are made on integer keys that order floats as their values do (not on
floats), so that a backend that flushes subnormal numbers to zero still bins them
as numpy does."""

from __future__ import annotations

import functools
import math
from collections.abc import Hashable, Sequence
from typing import NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Bool, Float, Real, Shaped

from .._buffer import MetricState, host_value
from .._errors import (
    StateInputError,
    StateTypeError,
    StateValueError,
    check_real as _check_real,
)
from ._base import (
    Metric,
    _check_dtype,
    _check_inputs,
    _check_int,
    _replicated,
    _weights,
    statistic,
)


# ------------------------------------------------------------- numpy's binning


def _key_dtype(dtype: np.dtype) -> np.dtype:
    """The integer dtype of the order keys of values of `dtype`."""
    if dtype == np.float32:
        return np.dtype(np.int32)
    if dtype == np.float64:
        return np.dtype(np.int64)
    return dtype  # integers are their own keys


def _np_keys(x: np.ndarray) -> np.ndarray:
    """Floats (float32 / float64) to integers in the same order: `a < b` if and only
    if `key(a) < key(b)`, with `key(-0.0) == key(0.0)` (NaN aside)."""
    kd = _key_dtype(x.dtype)
    i = x.view(kd).astype(np.int64)
    magnitude = i & np.int64(np.iinfo(kd).max)
    return np.where(i < 0, -magnitude, i)


def _np_unkeys(keys: np.ndarray, dtype: np.dtype) -> np.ndarray:
    kd = _key_dtype(dtype)
    keys = np.asarray(keys, np.int64)
    bits = np.where(keys < 0, -keys | np.int64(np.iinfo(kd).min), keys)
    return bits.astype(kd).view(dtype)


def _formula_thresholds(
    low: float, high: float, bins: int, dtype: np.dtype
) -> np.ndarray:
    """The order keys `t_k`, `k = 1 .. bins - 1`, of the smallest values `x` of
    `dtype` for which numpy's uniform-bin formula,
    `int((x - dtype(low)) / float64(high - low) * bins)` (the subtraction in
    `dtype`, the rest in float64), is `>= k`. The formula is monotonic in `x`, so
    these are found by bisection over the keys."""
    first = dtype.type(low)
    denom = np.float64(high) - np.float64(low)
    k = np.arange(1, bins, dtype=np.float64)

    def formula(keys):
        x = _np_unkeys(keys, dtype)
        with np.errstate(all="ignore"):
            d = np.subtract(x, first, dtype=dtype)
            return d.astype(np.float64) / denom * bins

    # bisect on the keys offset by 2**63 (unsigned), whose differences fit
    bias = np.uint64(1 << 63)

    def biased(keys):
        return np.asarray(keys, np.int64).view(np.uint64) ^ bias

    def unbiased(b):
        return (b ^ bias).view(np.int64)

    lo = np.full(k.shape, biased(_np_keys(np.asarray(first, dtype))))  # formula: 0
    hi = np.full(k.shape, biased(_np_keys(np.asarray(np.inf, dtype))))
    one = np.uint64(1)
    while np.any(hi - lo > one):  # invariant: formula(lo) < k <= formula(hi)
        mid = lo + (hi - lo) // np.uint64(2)
        ok = formula(unbiased(mid)) >= k
        hi, lo = np.where(ok, mid, hi), np.where(ok, lo, mid)
    return unbiased(hi)


class _Plan(NamedTuple):
    """How values of one dtype are binned, as order-key thresholds (Python ints):
    `x` is in the range when `key(x) >= lower` and not `key(x) >= above`, and its
    bin is the number of `inner` thresholds it reaches, corrected by numpy's rule
    with `formula` (None where the correction never applies)."""

    key_dtype: np.dtype
    lower: int
    above: int
    inner: tuple[int, ...]
    formula: tuple[int, ...] | None


def _needs_formula(inner: np.ndarray, formula: np.ndarray) -> bool:
    """Whether numpy's index formula can land two or more bins away from the number
    of inner edges `<= x` (`s`) for some `x`: then numpy's result is `s` clipped to
    within one of the formula's index, not `s`. With `f_k` / `s_k` the thresholds
    of the formula / edges, that happens iff some `f_{m+1} < s_m` or `s_{m+1} <
    f_m`."""
    return bool(np.any(formula[1:] < inner[:-1]) or np.any(inner[1:] < formula[:-1]))


@functools.lru_cache(maxsize=256)
def _plan(low: float, high: float, bins: int, dtype_name: str) -> _Plan:
    dtype = np.dtype(dtype_name)
    if np.issubdtype(dtype, np.integer):
        # numpy compares integers with float64 edges: x >= e iff x >= ceil(e) (exact
        # for |x| <= 2**53)
        edges = np.linspace(low, high, bins + 1)
        formula = _formula_thresholds(low, high, bins, np.dtype(np.float64))
        inner_keys = _np_keys(edges[1:-1])
        exact_formula = _np_unkeys(formula, np.dtype(np.float64))
        return _Plan(
            dtype,
            math.ceil(low),
            math.floor(high) + 1,
            tuple(math.ceil(e) for e in edges[1:-1].tolist()),
            tuple(math.ceil(t) for t in exact_formula.tolist())
            if _needs_formula(inner_keys, formula)
            else None,
        )
    with np.errstate(all="ignore"):  # overflow: refused below
        edges = np.linspace(low, high, bins + 1, dtype=dtype)
    if not (np.all(np.isfinite(edges)) and np.all(edges[1:] > edges[:-1])):
        raise StateValueError(
            f"Histogram(bins={bins}, range=({low!r}, {high!r})) cannot bin "
            f"{dtype.name} values: rounded to {dtype.name}, its edges are not all "
            "distinct and finite (the bins are narrower than the resolution of "
            f"{dtype.name} there); numpy.histogram refuses this too. Use fewer "
            "bins, a wider range, or float64 values (with x64 enabled)."
        )
    keys = _np_keys(edges)
    formula = _formula_thresholds(low, high, bins, dtype)
    return _Plan(
        _key_dtype(dtype),
        int(keys[0]),
        int(keys[-1]) + 1,
        tuple(keys[1:-1].tolist()),
        tuple(formula.tolist()) if _needs_formula(keys[1:-1], formula) else None,
    )


def _keys(x: Array) -> tuple[Array, Array]:
    """`(key, nan)`: the order keys of `x` (see `_np_keys`; integers are their own)
    and where `x` is NaN, without a floating-point comparison."""
    if not jnp.issubdtype(x.dtype, jnp.floating):
        return x, jnp.zeros(x.shape, bool)
    kd = _key_dtype(np.dtype(x.dtype))
    i = jax.lax.bitcast_convert_type(x, kd)
    magnitude = i & int(np.iinfo(kd).max)
    infinity = int(_np_keys(np.asarray(np.inf, x.dtype)))
    return jnp.where(i < 0, -magnitude, i), magnitude > infinity


def _reaches(keys: Array, thresholds: tuple[int, ...]) -> Array:
    """`keys[:, None] >= thresholds[None, :]` for 1-D `keys`, with thresholds
    outside the range of the keys' dtype (integer data) handled exactly."""
    info = np.iinfo(keys.dtype)
    t = np.array([min(max(v, info.min), info.max) for v in thresholds], keys.dtype)
    out = keys[:, None] >= jnp.asarray(t)[None, :]
    never = np.array([v > info.max for v in thresholds], bool)
    if never.any():
        out = out & jnp.asarray(~never)[None, :]
    return out


def _count(reached: Array) -> Array:
    return jnp.sum(reached.astype(jnp.int32), axis=1)


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

    Each value lands in the bin `numpy.histogram` puts it in, values on an edge
    included. Like numpy, the edges are compared in the values' dtype: float32
    values with the float64 edges rounded to float32, float64 values (with x64
    enabled) with the float64 edges, integer values exactly with the float64
    edges. Values of a narrower float dtype (bfloat16, float16) are binned as
    float32 (numpy would round the edges to float16). A range too narrow for the
    values' dtype (edges that are equal once rounded) raises, as in numpy.

    Statistics: `counts` (shape `[bins]`), `below` and `above`, all summed
    (float32 by default: exact up to 2**24 per bin; pass `dtype=jnp.float64` with
    x64 enabled for more, or `dtype=jnp.int32` to count exactly).

    **Arguments:**

    - `bins`: the number of bins (>= 1).
    - `range`: `(low, high)` (or a list or 1-d array of the two, e.g.
        `np.percentile(x, [1, 99])`), finite, `low < high`: the lower edge of the first
        bin and the upper edge of the last, converted to Python floats: the bins
        are `numpy.histogram`'s for `range=(float(low), float(high))`. (Given
        float32 bounds, e.g. `(x.min(), x.max())` of a float32 array, numpy
        computes its edges in float32 and may put a value that lies on an edge in
        the neighbouring bin; compare with numpy using Python floats.)
    - `axis_name`: reduce each update over this named axis (see
        [`eqx_state.metrics.Metric`][]).
    - `dtype`: the dtype of the counts (default float32), or a signed integer
        dtype (e.g. `jnp.int32`) to count exactly; then `sample_weight` must be
        integers (a float weight raises a `TypeError` at `update` rather than being
        truncated).

    **Example:**

    ```python
    import jax.numpy as jnp
    import eqx_state as es

    hist = es.to_refs(es.metrics.Histogram(4, range=(0.0, 1.0)))
    hist.update(jnp.array([0.1, 0.3, 0.35, 1.0, 2.0]))
    print(hist.compute())  # [1. 2. 0. 1.]
    print(float(hist.above[...]))  # 1.0
    print(hist.edges)  # [0.   0.25 0.5  0.75 1.  ]
    ```
    """

    _wide_cells = ("counts", "below", "above")

    counts: MetricState
    below: MetricState
    above: MetricState
    bins: int = eqx.field(static=True)
    range: tuple[float, float] = eqx.field(static=True)

    def __init__(
        self,
        bins: int | np.integer,
        range: Sequence[float | int] | np.ndarray | jax.Array,
        *,
        axis_name: Hashable | None = None,
        dtype=jnp.float32,
    ):
        bins = _check_int("Histogram", "bins", bins, 1)
        try:  # a tuple, a list, a 1-d array (`np.percentile(x, [1, 99])`)
            pair = None if isinstance(range, str | bytes) else tuple(range)
        except TypeError:
            pair = None
        if pair is None or len(pair) != 2:
            raise StateValueError(
                f"Histogram: range must be a pair (low, high), got {range!r}."
            )
        # each edge a real number (not a string float() would parse, not a bool)
        low, high = (
            _check_real("Histogram", f"range[{i}]", r) for i, r in enumerate(pair)
        )
        if not (math.isfinite(low) and math.isfinite(high) and low < high):
            raise StateValueError(
                f"Histogram: range must be finite with low < high, got {range!r}."
            )
        edges = np.linspace(low, high, bins + 1)
        if not (np.all(np.isfinite(edges)) and np.all(edges[1:] > edges[:-1])):
            raise StateValueError(
                f"Histogram(bins={bins}, range={range!r}): the bin edges are not all "
                "distinct and finite in float64 (too many bins for the range, or a "
                "range wider than float64 can span); numpy.histogram refuses this "
                "too. Use fewer bins or another range."
            )
        dtype = _check_dtype("Histogram", dtype, "counts")
        self.bins = bins
        self.range = (low, high)
        self.counts = statistic("sum", shape=(bins,), dtype=dtype)
        self.below = statistic("sum", dtype=dtype)
        self.above = statistic("sum", dtype=dtype)
        self.axis_name = axis_name

    @property
    def edges(self) -> Float[np.ndarray, " bins_plus_1"]:
        """The `bins + 1` bin edges, `numpy.linspace(low, high, bins + 1)`: a
        float64 NumPy array, the edges `numpy.histogram` returns for float64 data
        (float32 values are compared with these edges rounded to float32, as in
        numpy)."""
        low, high = self.range
        return np.linspace(low, high, self.bins + 1)

    def update(
        self,
        values: Real[ArrayLike, "..."] | Bool[ArrayLike, "..."],
        *,
        sample_weight: Real[ArrayLike, "..."] | None = None,
        mask: Shaped[ArrayLike, "..."] | None = None,
    ) -> None:
        """Add `values` (any shape; every element counts).

        **Arguments:**

        - `values`: the values (floating, integer or bool).
        - `sample_weight`: a weight per value (numpy's `weights=`): a scalar, the
            values' shape or a prefix of it.
        - `mask`: which values count; masked-out values are in no count.
        """
        dtype = self.counts.dtype
        _check_inputs("Histogram", dtype, sample_weight=sample_weight)
        x = host_value(  # a float64 beyond float32 becomes inf: still above the range
            values,
            "Histogram.update: `values`",
            "Give an array of numbers.",
            StateTypeError,
            StateInputError,
            inf_ok=True,
        )
        if x.dtype == jnp.bool_:
            x = x.astype(jnp.int32)
        elif jnp.issubdtype(x.dtype, jnp.floating) and x.dtype.itemsize < 4:
            x = x.astype(jnp.float32)
        elif not (
            jnp.issubdtype(x.dtype, jnp.floating)
            or jnp.issubdtype(x.dtype, jnp.integer)
        ):
            raise StateTypeError(
                f"Histogram.update: values must be real numbers, got dtype {x.dtype}."
            )
        w = _weights(x, mask, sample_weight, dtype).reshape(-1)
        plan = _plan(*self.range, self.bins, np.dtype(x.dtype).name)
        keys, nan = _keys(x.reshape(-1))
        reaches_low = _reaches(keys, (plan.lower,))[:, 0]
        over = _reaches(keys, (plan.above,))[:, 0]
        inside = reaches_low & ~over & ~nan
        # the bin: how many inner edges x reaches (elementwise comparisons, no
        # gather, so a batch sharded across devices stays sharded)
        index = _count(_reaches(keys, plan.inner))
        if plan.formula is not None:  # numpy's correction (see the module)
            guess = _count(_reaches(keys, plan.formula))
            index = jnp.clip(index, guess - 1, guess + 1)
        index = jnp.where(inside, index, self.bins)  # out of range: dropped
        zero = jnp.zeros_like(w)
        counts = jnp.zeros((self.bins,), dtype)
        counts = counts.at[index].add(
            jnp.where(inside, w, zero), mode="drop", **_replicated(index)
        )
        below = jnp.sum(jnp.where(~reaches_low & ~nan, w, zero))
        above = jnp.sum(jnp.where(over & ~nan, w, zero))
        self.accumulate(counts=counts, below=below, above=above)

    def compute(self) -> Real[Array, " bins"]:
        """The counts per bin (zeros before any data)."""
        return self.counts[...]
