"""`Metric`, the base class of every metric, and `statistic`, the declaration of one of
its sufficient statistics (the public extension API); plus the helpers metrics share
(sample weights and masks, safe division, NaN strategies, cross-device reductions)."""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from collections.abc import Callable, Hashable
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Float, Real

from .._buffer import (
    MetricState,
    _exact_widening,
    _LayerBase,
    check_cell_dtype,
    describe,
    host_value,
    is_state,
)
from .._compat import Tracer
from .._errors import (
    StateInputError,
    StateNotImplementedError,
    StateTypeError,
    StateValueError,
    StateWriteError,
    check_axis_name,
    check_dtype,
    check_int,
    check_shape,
)
from .._vmap import mapped_axes, varies_per_example


# Return annotations (aliases keep jaxtyping's shape strings out of signatures, which
# linters would otherwise parse as forward references).
FloatScalar = Float[Array, ""]
RealScalar = Real[Array, ""]
ConfusionArray = Real[Array, "..."]
Scores = Float[Array, "*classes"]

Merge = str | Callable[[Array, Array], Array]
_MERGES = ("sum", "min", "max", "custom")


# ------------------------------------------------------------------ statistics


class Statistic(MetricState):
    """A metric's sufficient statistic: a [`eqx_state.MetricState`][] cell that also
    says how two of its values merge (`merge`: `"sum"`, `"min"`, `"max"`, a function
    `(a, b) -> merged`, or `"custom"`). Make one with
    [`eqx_state.metrics.statistic`][]; it is selected by
    `eqx_state.reset(model, eqx_state.MetricState)` like every metric cell.

    **Example:**

    ```python
    import eqx_state as es

    cell = es.metrics.statistic("min")
    assert isinstance(cell, es.metrics.Statistic) and isinstance(cell, es.MetricState)
    assert cell.merge == "min" and cell.init == float("inf")
    ```
    """

    merge: Merge = eqx.field(static=True, default="sum", kw_only=True)


def _default_init(merge: Merge, dtype: Any) -> bool | int | float:
    dtype = jnp.dtype(dtype)
    if merge == "sum":
        return False if dtype == jnp.bool_ else 0
    if merge in ("min", "max"):
        if jnp.issubdtype(dtype, jnp.inexact):
            return float("inf") if merge == "min" else float("-inf")
        if dtype == jnp.bool_:
            return merge == "min"
        info = jnp.iinfo(dtype)
        return int(info.max) if merge == "min" else int(info.min)
    raise StateValueError(
        f"statistic(merge={merge!r}) has no natural initial value: pass `init=` (the "
        "value of the statistic before any data, which `eqx_state.reset` writes back)."
    )


def statistic(
    merge: Merge = "sum",
    *,
    shape: tuple[int, ...] = (),
    dtype: Any = jnp.float32,
    init: bool | int | float | None = None,
) -> Any:
    """Declare one sufficient statistic of a metric: a fresh
    [`eqx_state.metrics.Statistic`][] cell (a [`eqx_state.MetricState`][]) that
    starts at `init` and knows how it merges.

    Use it as the value of a metric's field, either as the field's default (for
    statistics of a fixed shape) or assigned in `__init__` (for shapes that depend
    on the arguments, e.g. a `[num_classes, num_classes]` matrix). The field's name
    is the statistic's name in [`eqx_state.metrics.Metric.accumulate`][] and
    [`eqx_state.metrics.Metric.statistics`][].

    **Arguments:**

    - `merge`: how two values of the statistic combine, elementwise — when batches
        are accumulated, when two metrics are merged, and across devices:
        - `"sum"`: added (reduced over a named axis with `psum`);
        - `"min"` / `"max"`: the smaller / larger (`pmin` / `pmax`);
        - a function `(a, b) -> merged`, associative (e.g. `jnp.logaddexp`);
          define it at module level so that two metrics compare equal;
        - `"custom"`: statistics that merge together, not one by one (a mean and
          its count): the metric overrides
          [`eqx_state.metrics.Metric.merge_statistics`][].
    - `shape`: the statistic's shape (default `()`, a scalar).
    - `dtype`: its dtype (default float32).
    - `init`: its value before any data, a Python scalar broadcast to `shape`, and
        what [`eqx_state.reset`][] writes back. Default: 0 for `"sum"`, +inf / -inf
        for `"min"` / `"max"` (the dtype's extremes for integers); required for the
        others.

    **Returns:**

    The cell.

    **Example:**

    ```python
    import jax.numpy as jnp
    import eqx_state as es

    class MaxAbs(es.metrics.Metric):
        largest: es.MetricState = es.metrics.statistic("max")

        def update(self, values):
            self.accumulate(largest=jnp.max(jnp.abs(values)))

        def compute(self):
            return self.largest[...]

    metric = es.to_refs(MaxAbs())
    metric.update(jnp.array([1.0, -3.0]))
    assert float(metric.compute()) == 3.0
    ```
    """
    if not (callable(merge) or merge in _MERGES):
        raise StateValueError(
            f"statistic: merge must be one of {_MERGES} or a function (a, b) -> "
            f"merged, got {merge!r}."
        )
    shape = check_shape("statistic", "shape", shape)
    dtype = check_dtype("statistic", "dtype", dtype)
    if init is None:
        init = _default_init(merge, dtype)
    if not isinstance(init, (bool, int, float)):
        raise StateTypeError(
            f"statistic: init must be a Python scalar (it is a static fill value), "
            f"got {type(init).__name__}."
        )
    # what a fresh or reset cell holds, computed on the host (a model may be built
    # inside a trace: `eqx.filter_eval_shape` of an abstract model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # NumPy's overflow to inf
        try:
            start = np.array(init, dtype=jnp.dtype(dtype)).item()
        except (OverflowError, ValueError):  # NumPy refuses -1 as uint32
            start = None
    if (
        start is None
        or not jnp.issubdtype(dtype, jnp.inexact)
        and start != init
        or jnp.issubdtype(dtype, jnp.floating)
        and math.isinf(start)
        and not math.isinf(init)
    ):
        held = "it cannot hold it" if start is None else f"it would be {start!r}"
        raise StateValueError(
            f"statistic: init={init!r} is not a value of dtype "
            f"{jnp.dtype(dtype).name}: {held} in the cell, which starts and resets "
            "at its init. Give an init the dtype holds, or another dtype."
        )
    value = jnp.full(tuple(shape), init, dtype)
    return Statistic(value, init=init, merge=merge)


def _fresh_copy(cell: Statistic) -> Statistic:
    return eqx.tree_at(lambda c: c.value, cell, jnp.array(cell.value, copy=True))


# --------------------------------------------------------------------- helpers


def _div(num: Array, den: Array, zero_division: float = 0.0) -> Array:
    """`num / den` where `den != 0`, else `zero_division` (no NaN produced, no
    division warning, unless `zero_division` is NaN)."""
    ok = den != 0
    safe = jnp.where(ok, den, jnp.ones_like(den))
    return jnp.where(ok, num / safe, jnp.full_like(num / safe, zero_division))


def _fit(what: str, a: Array, shape: tuple[int, ...]) -> Array:
    """Give `a` (a scalar, or an array whose shape is `shape` or a prefix of it) the
    rank of `shape`, aligning the leading (batch) axes, so that it broadcasts against
    the values. It is not materialised at the full shape: a batch sharded across
    devices keeps its sharding."""
    if a.shape == shape or a.ndim == 0:
        return a
    if a.shape == shape[: a.ndim]:
        return a.reshape(a.shape + (1,) * (len(shape) - a.ndim))
    raise StateValueError(
        f"`{what}` has shape {a.shape}, which does not fit values of shape {shape}. "
        f"`{what}` must be a scalar, have the values' shape, or a prefix of it "
        "(e.g. shape [batch] for values of shape [batch, time]); its axes line up "
        "with the leading axes of the values."
    )


def _truthy(a: Any) -> Array:
    """A `mask=` as a bool array: a bool mask as it is, an integer one as `a != 0`
    (without mixing bool and int under strict dtype promotion). A floating or
    complex mask is refused: 0.5 or NaN is no answer to "does this entry count"
    (a fraction is a weight: `sample_weight=`)."""
    a = jnp.asarray(a)
    if a.dtype == jnp.bool_:
        return a
    if not jnp.issubdtype(a.dtype, jnp.integer):
        raise StateTypeError(
            f"mask= must be boolean (True where an entry counts), or integers "
            f"(nonzero counts); got {a.dtype}. A fractional weight goes in "
            "`sample_weight=`; for a mask, e.g. `mask=lengths[:, None] > "
            "jnp.arange(T)`."
        )
    return a != jnp.zeros((), a.dtype)


def _kept(like: Array, mask: Any) -> Array:
    """Which elements of `like` count: `mask` broadcast to its shape (all, without
    one). The mask, not a weight of 0, leaves an element out: a NaN value with
    weight 0 still makes a weighted sum NaN (`0 * nan`), as in `numpy.average`."""
    if mask is None:
        return jnp.ones_like(like, dtype=bool)  # with `like`'s sharding
    return _fit("mask", _truthy(mask), like.shape)


def _weights(like: Array, mask: Any, sample_weight: Any, dtype: Any) -> Array:
    """Per-element weights of the shape (and sharding) of `like`: `sample_weight`
    (default 1) where `mask` is true, 0 where it is false."""
    w = jnp.ones_like(like, dtype=dtype)
    if sample_weight is not None:
        sw = jnp.asarray(sample_weight).astype(dtype)
        w = w * _fit("sample_weight", sw, like.shape)
    if mask is not None:
        w = jnp.where(_kept(like, mask), w, jnp.zeros_like(w))
    return w


# The dtypes a metric's statistics may have. "floating": statistics that can be
# fractional whatever the data (a mean, a standard deviation). "counts": sums of
# (weighted) examples or values; a signed integer counts whole numbers exactly
# (beyond float32's 2**24) and refuses fractional inputs at update. "values": a
# value kept as it is (min, max, last): any real dtype.
_DTYPE_KINDS = {
    "floating": "a floating dtype of 32 bits or more (jnp.float32, jnp.float64 with "
    "x64)",
    "counts": "a floating dtype of 32 bits or more (jnp.float32, jnp.float64 with "
    "x64) or, to count whole numbers exactly, a signed integer dtype (jnp.int32, "
    "jnp.int64 with x64)",
    "values": "a floating or integer dtype",
}


def _check_dtype(metric: str, dtype: Any, kind: str) -> Any:
    """`dtype` if a metric of this `kind` (a key of `_DTYPE_KINDS`) may keep its
    statistics in it, else a ValueError that says which dtypes are accepted (a
    TypeError, from `check_dtype`, for what is no dtype at all).
    `None` is the default, float32 (as JAX reads `dtype=None`; it made integer
    statistics from the statistics' integer fill)."""
    if dtype is None:
        return jnp.dtype(jnp.float32)
    # not a dtype at all: the one check of every `dtype=` argument (a TypeError
    # naming the argument, as the layers' `dtype=` say it)
    d = check_dtype(metric, "dtype", dtype)
    if jnp.issubdtype(d, jnp.floating) and kind != "values" and d.itemsize < 4:
        raise StateValueError(
            f"{metric}: dtype must be {_DTYPE_KINDS[kind]}; got {d.name}. Its "
            "statistics accumulate over a whole run, and a "
            f"{d.name} sum stops growing without a word once it is large "
            f"(adding 1 changes nothing past {2 ** (jnp.finfo(d).nmant + 1)}: "
            "a count of 300 would stay there). Keep the "
            "statistics in jnp.float32 (the default); the inputs may be "
            f"{d.name}."
        )
    if jnp.issubdtype(d, jnp.integer) and d.itemsize < 4 and kind != "values":
        raise StateValueError(
            f"{metric}: dtype must be {_DTYPE_KINDS[kind]}; got {d.name}. "
            f"An {d.name} statistic would wrap around silently (a count of "
            f"{jnp.iinfo(d).max + 1} reads {jnp.iinfo(d).min}) or hold less "
            "than a reduction of its inputs gives (JAX sums narrow integers "
            "in 32 bits). Keep integer statistics in jnp.int32 (jnp.int64 with "
            f"x64); the inputs may be {d.name}."
        )
    if jnp.issubdtype(d, jnp.floating):
        return dtype
    if kind == "counts" and jnp.issubdtype(d, jnp.signedinteger):
        return dtype
    if kind == "values" and jnp.issubdtype(d, jnp.integer):
        return dtype
    why = {
        "floating": " Its statistics are fractional whatever the data (an integer "
        "dtype would truncate them).",
        "counts": " Weighted counts and sums need a dtype that holds them without "
        "wrapping or truncating.",
        "values": "",
    }[kind]
    raise StateValueError(
        f"{metric}: dtype must be {_DTYPE_KINDS[kind]}; got {dtype!r}.{why} The "
        "default, jnp.float32, fits most uses."
    )


_check_int = check_int  # the one check of a whole-number option (`_errors`)


def _kind(dtype: Any) -> int:
    """bool 0 < integer 1 < floating 2 < complex (and anything else) 3."""
    d = jnp.dtype(dtype)
    if d == jnp.bool_:
        return 0
    if jnp.issubdtype(d, jnp.integer):
        return 1
    return 2 if jnp.issubdtype(d, jnp.floating) else 3


def _check_inputs(metric: str, dtype: Any, **inputs: Any) -> None:
    """Refuse an input that the metric's statistics (of `dtype`) would truncate: a
    float (or a weight of 0.5) added into integer counts, a complex number into a
    float. The rule of a state write ([`eqx_state.Buffer`][]): never down the ladder
    bool < integer < floating < complex; within a kind, a dtype the statistics
    do not hold (uint32 into int32 statistics), or a Python int out of their range.
    By dtype (no runtime cost), except a concrete Python int, checked by value."""
    for name, x in inputs.items():
        if x is None and name in ("sample_weight", "mask"):
            continue  # None: the optional input is absent (required ones go on)
        if _kind(dtype) == 1 and isinstance(x, int) and not isinstance(x, bool):
            _check_in_range(metric, dtype, name, x, x)  # a Python int is cast
        if (
            _kind(dtype) == 1
            and isinstance(x, np.ndarray | np.generic)
            and np.issubdtype(x.dtype, np.integer)
            and np.size(x)
        ):  # a NumPy integer array is on the host: checked by value, as `jnp.asarray`
            # with x64 off would wrap an int64 past int32's range (2**40 read 0)
            _check_in_range(metric, dtype, name, int(np.min(x)), int(np.max(x)))
        x = host_value(  # None, a string; a float64 beyond float32 (inf)
            x,
            f"{metric}.update: `{name}`",
            "Give an array (or a number) its statistics hold.",
            StateTypeError,
            StateInputError,
        )
        src = x.dtype
        if (
            _kind(dtype) == 1
            and _kind(src) == 1
            and getattr(x, "weak_type", False)
            and not isinstance(x, Tracer)
            and x.size
        ):  # a concrete weakly typed integer (a Python int made an array): cast too
            v = np.asarray(x)  # read on the host: nothing staged into a trace
            _check_in_range(metric, dtype, name, int(v.min()), int(v.max()))
        if _kind(src) < _kind(dtype):
            continue
        if _kind(src) == _kind(dtype):
            _check_same_kind(metric, dtype, name, src, bool(getattr(x, "weak_type", 0)))
            continue
        where = f"{metric}(dtype={jnp.dtype(dtype).name}).update: `{name}` has dtype"
        if _kind(src) == 3:  # complex into real statistics: no real dtype holds it
            raise StateTypeError(
                f"{where} {src.name}, which real statistics would truncate (1+2j "
                "would become 1: the imaginary parts dropped). Update with real "
                f"values: `{name}.real` and `{name}.imag` (a metric for each), or "
                f"`jnp.abs({name})`."
            )
        example = (
            "a weight of 0.5 would count as 0"
            if name == "sample_weight"
            else "2.5 would become 2"
        )
        raise StateTypeError(
            f"{where} {src.name}, which statistics of dtype {jnp.dtype(dtype).name} "
            f"would truncate ({example}). Build the metric with a floating dtype "
            "(dtype=jnp.float32, the default) to accumulate fractional data, or "
            f"pass whole numbers as integers (`{name}.astype(jnp.int32)`)."
        )


def _check_in_range(metric: str, dtype: Any, name: str, low: int, high: int):
    """Refuse integers from `low` to `high` that integer statistics of `dtype` do
    not hold: a weakly typed input is cast, and the cast would wrap it (-1 into
    uint32 reads 4294967295)."""
    info = jnp.iinfo(dtype)
    if low < info.min or high > info.max:
        raise StateTypeError(
            f"{metric}(dtype={jnp.dtype(dtype).name}).update: `{name}` holds "
            f"{low if low < info.min else high}, which statistics of dtype "
            f"{jnp.dtype(dtype).name} do not hold (they hold {info.min} to "
            f"{info.max}). Build the metric with a dtype that holds it "
            "(jnp.float32, the default), or pass a value in range."
        )


def _check_same_kind(metric: str, dtype: Any, name: str, src: Any, weak: bool):
    """Refuse an input of the statistics' kind that a cast into their dtype would
    wrap or round: an integer dtype they do not hold (int32 into int8: 300 would
    read 44; uint32 into int32), or a float into floating statistics narrower than
    32 bits (float32 into bfloat16: 1.001 would read 1.0; into float16, 1e5 would
    read inf). A weakly-typed input (a Python number) is cast, as a state write
    casts it; float64 data (with x64) into float32 statistics is the documented
    precision of the default dtype."""
    src, dst = jnp.dtype(src), jnp.dtype(dtype)
    if weak or src == dst:
        return
    integer = _kind(dst) == 1
    if integer:  # the rule of a cell write: a range that holds the input's
        if _exact_widening(src, dst):
            return
    elif jnp.promote_types(src, dst) == dst or dst.itemsize >= 4:
        return
    example = (
        "uint32 3e9 into int32 would read -1294967296"
        if integer
        else "float32 1.001 into bfloat16 would read 1.0"
    )
    raise StateTypeError(
        f"{metric}(dtype={dst.name}).update: `{name}` has dtype {src.name}, which "
        f"statistics of dtype {dst.name} do not hold: a cast would "
        f"{'wrap' if integer else 'round'} it ({example}). Build the metric with a "
        f"dtype that holds {src.name} values (jnp.float32, the default, or "
        f"jnp.{src.name} where the metric takes it), or cast `{name}` yourself if "
        "that is what you mean."
    )


def _check_narrowing(metric: str, statistic: str, v: Array, dtype: Any) -> None:
    """Refuse a batch statistic that the cell's dtype would truncate or round: the
    rule of every state write ([`eqx_state.Buffer`][]), by dtype, never by value.
    Down the ladder bool < integer < floating < complex (a float into an integer
    statistic, even 2.0) is refused; within a kind, a strongly-typed value must fit
    (float32 into bfloat16, int64 into int32 are refused); a weakly-typed one (a
    Python scalar) is cast, as a state write casts it. Widening (an int32 count into
    a float32 sum) is fine. Static: no runtime cost."""
    src, dst = jnp.dtype(v.dtype), jnp.dtype(dtype)
    if src == dst:
        return
    weak = bool(getattr(v, "weak_type", False))
    down = _kind(src) > _kind(dst)
    narrower = (
        _kind(src) == _kind(dst) and not weak and jnp.promote_types(src, dst) != dst
    )
    if not (down or narrower):
        return
    what = "a weakly-typed " if weak else ""
    raise StateWriteError(
        f"{metric}.accumulate: the statistic {statistic!r} has dtype {dst.name}, "
        f"got {what}{src.name} value that it would "
        f"{'truncate' if down else 'round'} (e.g. "
        f"{'1.75 would be stored as 1' if down else 'float32 into bfloat16 loses digits'}"
        "). State cells keep their dtype and refuse a narrowing cast, whatever the "
        "value (2.0 included). Either declare the statistic with a dtype that holds "
        f"the values (`statistic(..., dtype=jnp.{src.name})`), or cast in `update` "
        f"if that is what you mean (`{statistic}=value.astype(jnp.{dst.name})`, "
        "e.g. after rounding)."
    )


_NAN_STRATEGIES = ("propagate", "ignore", "error")


def _same(a: Any, b: Any) -> bool:
    """Whether two options are equal (`False` where `==` is not a bool)."""
    try:
        return a is b or bool(a == b)
    except Exception:  # noqa: BLE001 -- e.g. arrays of several elements
        return False


def _check_nan_strategy(metric: str, nan_strategy: str) -> str:
    if nan_strategy not in _NAN_STRATEGIES:
        raise StateValueError(
            f"{metric}: nan_strategy must be one of {_NAN_STRATEGIES}, got "
            f"{nan_strategy!r}."
        )
    return nan_strategy


def _nan_policy(
    metric: str, nan_strategy: str, values: Array, w: Array, keep: Array
) -> tuple[Array, Array, Array]:
    """Apply a NaN strategy to `values`, their per-element weights `w` and which of
    them count, `keep` (all of the values' shape): masked-out entries never count;
    an entry with weight 0 does (`0 * nan` is NaN, as in `numpy.average`)."""
    if nan_strategy == "propagate":
        return values, w, keep
    bad = jnp.isnan(values) | jnp.isnan(w)
    if nan_strategy == "ignore":
        zero = jnp.zeros_like(w)
        return (
            jnp.where(bad, jnp.zeros_like(values), values),
            jnp.where(bad, zero, w),
            keep & ~bad,
        )
    values = eqx.error_if(
        values,
        jnp.any(bad & keep),
        f"{metric}.update(nan_strategy='error') got NaN among its (unmasked) values "
        "or sample weights. Mask the entries out (`mask=`), or build the metric with "
        "nan_strategy='ignore' (skip them) or 'propagate' (the result becomes NaN).",
    )
    return values, w, keep


def _replicated(x: Array) -> dict[str, Any]:
    """`out_sharding` for an op that gathers a batch sharded over *explicit* mesh axes
    into a small replicated result (e.g. a scatter into a confusion matrix); empty
    otherwise (no mesh, automatic sharding, inside `shard_map` or `vmap`)."""
    try:
        sharding = jax.typeof(x).sharding
        if any(axis is not None for axis in sharding.spec):
            replicated = jax.sharding.PartitionSpec()
            return {
                "out_sharding": jax.sharding.NamedSharding(sharding.mesh, replicated)
            }
    except Exception:  # noqa: BLE001 -- JAX without sharding in types
        pass
    return {}


def _iota_like(x: Array) -> Array:
    """`arange(len(x))` with the sharding of `x`'s leading axis."""
    try:
        sharding = jax.typeof(x).sharding
        return jax.lax.broadcasted_iota(jnp.int32, x.shape, 0, out_sharding=sharding)
    except Exception:  # noqa: BLE001 -- JAX without sharding in types
        return jnp.arange(x.shape[0], dtype=jnp.int32)


# ------------------------------------------------------------ named-axis logic


def _varying_axes(x: Any) -> frozenset:
    """The mesh axes over which `x` varies inside `shard_map` (empty elsewhere)."""
    try:
        return frozenset(jax.typeof(x).mat.varying)  # pyright: ignore
    except Exception:  # noqa: BLE001 -- older/newer JAX: no varying-axes tracking
        return frozenset()


def _axis_tuple(axis_name: Hashable) -> tuple[Hashable, ...]:
    return tuple(axis_name) if isinstance(axis_name, tuple) else (axis_name,)


def _tracks_varying(axis: Hashable) -> bool:
    """Whether JAX tracks which values vary over `axis` (a `shard_map` axis with
    `check_vma=True`). Elsewhere (`vmap`, `pmap`, `check_vma=False`) a value's type
    does not say whether it is the same on every member, so nothing is assumed."""
    try:
        probe = jax.lax.pcast(jnp.zeros((), jnp.float32), axis, to="varying")
    except Exception:  # noqa: BLE001 -- not a shard_map axis (vmap, pmap, ...)
        return False
    return axis in _varying_axes(probe)


def _unbound_axis_message(metric: str, axis: Hashable, what: str) -> str:
    return (
        f"{metric}.{what}: no axis named {axis!r} is bound here, so there is "
        "nothing to reduce over. A metric's `axis_name` (and `reduce(axis_name)`) "
        "names the axis of an enclosing `jax.shard_map`, `jax.pmap` or "
        "`jax.vmap(..., axis_name=...)` / `eqx_state.vmap`. Inside "
        "`eqx_state.make_step(..., mesh=...)`, or a plain `jax.jit` over inputs "
        "sharded across devices, there is no such axis and none is needed: the "
        "step already reduces over the global batch (XLA's SPMD partitioner makes "
        "the metric's sums cross-device sums), so build the metric without "
        "`axis_name`."
    )


def _refuse_per_example(
    name: str, cells: dict[str, Statistic], stats: dict[str, Array]
) -> None:
    """Refuse an update with values (reduced over the metric's `axis_name`, if
    any) that differ between the examples of an `es.vmap` that shares the
    metric's cells: each
    example would merge its own statistics into the one cell, which keeps one
    (examples that agree would be counted once instead of summed)."""
    for k, cell in cells.items():
        if any(varies_per_example(cell.value, v) for v in stats.values()):
            axes = mapped_axes() or (None,)
            axis = axes[-1] if len(axes) == 1 else tuple(axes)
            raise StateWriteError(
                f"{name}.update got per-example values inside `eqx_state.vmap` "
                f"(the {describe(cell)}, statistic {k!r}), but the metric does not "
                "reduce over the es.vmap's axis, so the examples' statistics would "
                "not be summed: the examples share one cell, which would keep one "
                "example's statistics. Build the metric with the axis name of every "
                f"es.vmap it is updated under, `{name}(..., axis_name={axis!r})`, so "
                "that each update sums the examples, or update it outside the "
                "`es.vmap`, on the whole batch."
            )


_UINT = {8: jnp.uint8, 16: jnp.uint16, 32: jnp.uint32, 64: jnp.uint64}


def to_bits(x: Array) -> Array:
    """A float array as the unsigned integers of its bits (other arrays as they
    are), so that a sum in which one term is nonzero gives that term exactly: a
    float sum starts from +0.0 and gives +0.0 for a -0.0 (NaN payloads are kept
    too). A float narrower than 8 bits (float4) goes through float32, which holds
    each of its values, -0.0 included. `from_bits` undoes it."""
    if not jnp.issubdtype(x.dtype, jnp.floating):
        return x
    bits = jnp.finfo(x.dtype).bits
    if bits not in _UINT:
        x, bits = x.astype(jnp.float32), 32
    return jax.lax.bitcast_convert_type(x, _UINT[bits])


def from_bits(b: Array, dtype: Any) -> Array:
    """The array of `dtype` whose bits `to_bits` gave."""
    if not jnp.issubdtype(dtype, jnp.floating):
        return b
    if jnp.finfo(dtype).bits not in _UINT:
        return jax.lax.bitcast_convert_type(b, jnp.float32).astype(dtype)
    return jax.lax.bitcast_convert_type(b, dtype)


def _gather(x: Array, axis_name: Hashable) -> Array:
    """Every member's `x`, stacked in axis order: `[axis_size, *x.shape]`, the same
    on every member. A `psum` of each member's slot rather than `all_gather`, whose
    result JAX types as per-device (varying) inside `shard_map`; exact (the other
    slots add zeros to the bits of floats, `to_bits`), -0.0, infinities and NaN
    included."""
    n = jax.lax.axis_size(axis_name)
    me = jax.lax.axis_index(axis_name)
    slot = (jnp.arange(n) == me).reshape((n,) + (1,) * x.ndim)
    bits = x.astype(jnp.int32) if x.dtype == jnp.bool_ else to_bits(x)
    stacked = jnp.where(slot, bits[None], jnp.zeros((), bits.dtype))
    out = jax.lax.psum(stacked, axis_name)
    return out.astype(jnp.bool_) if x.dtype == jnp.bool_ else from_bits(out, x.dtype)


def _fold(
    merge: Callable[[dict[str, Array], dict[str, Array]], dict[str, Array]],
    stats: dict[str, Array],
    axis_name: Hashable,
) -> dict[str, Array]:
    """Merge `stats` over a named axis with any associative `merge`: gather every
    member's statistics and merge them in axis order (the same on every member)."""
    gathered = {k: _gather(v, axis_name) for k, v in stats.items()}
    first = {k: g[0] for k, g in gathered.items()}
    rest = {k: g[1:] for k, g in gathered.items()}

    def body(acc: dict[str, Array], x: dict[str, Array]) -> tuple[Any, None]:
        new = merge(acc, x)
        return {k: jnp.asarray(new[k]).astype(acc[k].dtype) for k in acc}, None

    out, _ = jax.lax.scan(body, first, rest)
    return out


# ----------------------------------------------------------------------- Metric


class Metric(_LayerBase):
    """The base class of all metrics: a stateful layer whose statistics — sums,
    counts, extremes, a confusion matrix — are [`eqx_state.MetricState`][] cells.

    A metric is an ordinary `eqx.Module`: it can live inside a model (updated in the
    loss function during [`eqx_state.make_step`][]) or on its own (updated in an
    evaluation loop through [`eqx_state.apply`][] or in ref mode,
    [`eqx_state.to_refs`][]).

    - `update(...)` adds a batch to the statistics (a state write; masks and sample
      weights let padded batches contribute only their real entries).
    - `compute()` reads the statistics and returns the metric's value (a read).
    - `merge(other)` returns a new (value-mode) metric whose statistics are those of
      both; merging is associative, so merging per-batch or per-device metrics in any
      grouping equals one pass over all the data.
    - `reduce(axis_name)` merges the metric over a named axis of `jax.vmap`,
      `jax.shard_map` or `jax.pmap` (a new value-mode metric, the same on every
      member of the axis).
    - [`eqx_state.reset`][] returns a model whose metrics start over.

    Metrics have no `inference` field: they keep updating under
    [`eqx.nn.inference_mode`](https://docs.kidger.site/equinox/api/nn/inference/),
    because evaluation loops are where they are used most. No built-in metric
    computes NaN for "no data" (they work under `jax.debug_nans`): each documents
    its value on no data, and keeps a count where that value could be mistaken for
    a result.

    **`axis_name`.** Every metric takes `axis_name` (default `None`; a name or a
    tuple of names): each `update` then first reduces the batch's statistics over
    that named axis, so that inside `shard_map` / `pmap` / `vmap(axis_name=...)`
    every member holds the statistics of the global batch, exactly one pass over
    it. Inside `jax.shard_map`, JAX knows which values are already the same on every
    device (replicated: a `pmean`-ed loss, an `all_gather`-ed batch): an update whose
    statistics are all replicated over an axis *is* the global batch already and is
    added once, not once per device (likewise `reduce` of a metric whose state is
    already replicated changes nothing). Under `vmap`, `pmap` or
    `shard_map(check_vma=False)` JAX does not track this, and every update is
    reduced. An `axis_name` that is not bound (e.g. inside
    `make_step(..., mesh=...)`, which needs none) raises a `ValueError` that says so.

    **Writing a metric.** Declare each sufficient statistic as a field holding an
    [`eqx_state.metrics.statistic`][] (its name, initial value and how it merges);
    in `update`, compute the batch's statistics and hand them to
    [`eqx_state.metrics.Metric.accumulate`][] (which reduces them over `axis_name`
    and merges them into the cells); in `compute`, read the cells
    (`self.total[...]`). `merge`, `reduce` and [`eqx_state.reset`][] then work
    without further code. Statistics that merge together rather than one by one
    (a mean and its count) are declared `merge="custom"` and the metric overrides
    [`eqx_state.metrics.Metric.merge_statistics`][].

    **Example:**

    ```python
    import jax.numpy as jnp
    import eqx_state as es

    class MeanAbsoluteError(es.metrics.Metric):
        total: es.MetricState = es.metrics.statistic("sum")
        count: es.MetricState = es.metrics.statistic("sum")

        def update(self, preds, targets):
            errors = jnp.abs(preds - targets)
            self.accumulate(total=jnp.sum(errors), count=errors.size)

        def compute(self):
            n = self.count[...]
            return jnp.where(n > 0, self.total[...] / jnp.maximum(n, 1), 0.0)

    mae = es.to_refs(MeanAbsoluteError())
    mae.update(jnp.array([1.0, 2.0]), jnp.array([1.5, 0.0]))
    assert float(mae.compute()) == 1.25
    ```
    """

    axis_name: Hashable | None = eqx.field(static=True, default=None, kw_only=True)
    # the statistics a built-in metric keeps in 32 bits or more (refused narrower
    # when built): `accumulate` refuses them cast narrower afterwards
    _wide_cells: ClassVar[tuple[str, ...]] = ()

    def __init_subclass__(cls, **kwargs: Any):
        # A statistic given as a field's default becomes a default factory, so that
        # every instance gets arrays of its own (a class attribute is one object).
        super().__init_subclass__(**kwargs)
        for name, default in list(vars(cls).items()):
            if isinstance(default, Statistic):
                factory = functools.partial(_fresh_copy, default)
                setattr(cls, name, eqx.field(default_factory=factory))

    def __check_init__(self):
        check_axis_name(type(self).__name__, self.axis_name)
        for f in dataclasses.fields(self):
            v = getattr(self, f.name, None)
            if isinstance(v, MetricState) and not isinstance(v, Statistic):
                raise StateTypeError(
                    f"{type(self).__name__}.{f.name} is a MetricState that does not "
                    "say how it merges. Declare a metric's statistics with "
                    "`eqx_state.metrics.statistic(merge, shape=..., dtype=..., "
                    "init=...)`, e.g. `total: es.MetricState = "
                    "es.metrics.statistic('sum')`."
                )

    # --------------------------------------------------- the hooks to override

    def update(self, *args: Any, **kwargs: Any) -> None:
        """Add a batch to the metric's statistics (a state write). A metric computes
        the batch's statistics and calls
        [`eqx_state.metrics.Metric.accumulate`][]."""
        raise StateNotImplementedError(
            f"{type(self).__name__} does not define `update`."
        )

    def compute(self) -> Any:
        """The metric's value from the statistics accumulated so far (a read; never
        writes). A metric reads its cells, e.g. `self.total[...]`."""
        raise StateNotImplementedError(
            f"{type(self).__name__} does not define `compute`."
        )

    def merge_statistics(
        self, a: dict[str, Array], b: dict[str, Array]
    ) -> dict[str, Array]:
        """Merge two sets of statistics (`{name: array}`; `b`'s data comes after
        `a`'s). The default merges each statistic by its declared rule; override it
        for statistics declared `merge="custom"`. It must be associative: it is used
        to accumulate batches, by `merge`, and (folded in axis order) by `reduce`.

        **Arguments:**

        - `a`, `b`: the statistics to merge, by name.

        **Returns:**

        The merged statistics, by name.
        """
        out = {}
        for name, cell in self._statistic_cells().items():
            rule, x, y = cell.merge, a[name], b[name]
            if rule == "sum":
                out[name] = x + y
            elif rule == "min":
                out[name] = jnp.minimum(x, y)
            elif rule == "max":
                out[name] = jnp.maximum(x, y)
            elif callable(rule):
                out[name] = rule(x, y)
            else:
                raise StateNotImplementedError(
                    f"{type(self).__name__}: the statistic {name!r} is declared "
                    "merge='custom', so the metric must override "
                    "`merge_statistics(self, a, b)`."
                )
        return out

    def reduce_statistics(
        self, statistics: dict[str, Array], axis_name: Hashable
    ) -> dict[str, Array]:
        """Merge each member's statistics over the named axis `axis_name` (the result
        is the same on every member). The default `psum`s / `pmin`s / `pmax`s
        statistics declared `"sum"` / `"min"` / `"max"`, and otherwise gathers every
        member's statistics and folds them with `merge_statistics` in axis order.
        Override it only for a cheaper exact reduction.

        **Arguments:**

        - `statistics`: this member's statistics, by name.
        - `axis_name`: the axis (or tuple of axes) to reduce over.

        **Returns:**

        The reduced statistics, by name.
        """
        cells = self._statistic_cells()
        elementwise = type(self).merge_statistics is Metric.merge_statistics and all(
            c.merge in ("sum", "min", "max") for c in cells.values()
        )
        if not elementwise:
            return _fold(self.merge_statistics, statistics, axis_name)
        ops = {"sum": jax.lax.psum, "min": jax.lax.pmin, "max": jax.lax.pmax}
        return {
            k: ops[str(cells[k].merge)](statistics[k], axis_name) for k in statistics
        }

    # ------------------------------------------------------------ for update

    def accumulate(self, **batch: ArrayLike) -> None:
        """Merge a batch's statistics into the metric's cells (a state write): reduce
        them over `axis_name` when the metric has one, then merge them into the
        current values with `merge_statistics`. Call it from `update`.

        **Arguments:**

        - `**batch`: one value per statistic, by name (cast to the statistic's
            dtype; broadcast to its shape).
        """
        cells = self._statistic_cells()
        name = type(self).__name__
        for k in self._wide_cells:
            # built 32 bits or wider (`_check_dtype`), cast narrower since (a
            # model cast wholesale): a bfloat16 sum stops growing at 256
            cell = cells[k]
            kind = (
                jnp.integer if jnp.issubdtype(cell.dtype, jnp.integer) else jnp.floating
            )
            check_cell_dtype(name, self, cell, kind, 32)
        if set(batch) != set(cells):
            raise StateTypeError(
                f"{name}.accumulate got the statistics {sorted(batch)}; it needs one "
                f"value for each statistic of the metric: {list(cells)}."
            )
        stats = {}
        for k, cell in cells.items():
            v = jnp.asarray(batch[k])
            try:
                v = jnp.broadcast_to(v, cell.shape)
            except ValueError:
                raise StateValueError(
                    f"{name}.accumulate: the statistic {k!r} has shape {cell.shape}, "
                    f"got a value of shape {v.shape}."
                ) from None
            _check_narrowing(name, k, v, cell.dtype)
            stats[k] = v.astype(cell.dtype)
        if self.axis_name is not None:
            stats = self._reduce_over(stats, self.axis_name, "update")
        _refuse_per_example(name, cells, stats)
        current = {k: cell[...] for k, cell in cells.items()}
        for k in cells:
            extra = _varying_axes(stats[k]) - _varying_axes(current[k])
            if extra:
                axes = ", ".join(repr(a) for a in sorted(extra, key=str))
                raise StateValueError(
                    f"{name}.update got per-device values (they vary over the mesh "
                    f"axes {axes} inside `shard_map`), but the metric's state is "
                    "replicated over those axes, so each device would keep "
                    "different statistics in a state declared identical. Either "
                    f"build the metric with `axis_name={sorted(extra, key=str)[0]!r}` "
                    "so that every update is reduced over the devices (each device "
                    "then holds the global statistics), or give each device its own "
                    "state (`jax.tree.map(lambda v: jax.lax.pcast(v, axis_name, "
                    "to='varying'), metric)`) and combine at the end with "
                    "`metric.reduce(axis_name)`."
                )
        new = self.merge_statistics(current, stats)
        for k, cell in cells.items():
            cell[...] = jnp.asarray(new[k]).astype(cell.dtype)

    def _reduce_over(
        self, stats: dict[str, Array], axis_name: Hashable, what: str
    ) -> dict[str, Array]:
        """Reduce `stats` over those axes of `axis_name` over which they are not
        already replicated (every axis where JAX does not track it)."""
        axes = _axis_tuple(axis_name)
        for axis in axes:
            try:
                jax.lax.axis_size(axis)
            except NameError:
                raise StateValueError(
                    _unbound_axis_message(type(self).__name__, axis, what)
                ) from None
        varying = frozenset().union(*(_varying_axes(v) for v in stats.values()))
        todo: tuple[Hashable, ...] = tuple(
            a for a in axes if a in varying or not _tracks_varying(a)
        )
        if not todo:
            return stats
        return self.reduce_statistics(
            stats, todo if len(todo) > 1 else next(iter(todo))
        )

    # ------------------------------------------------------------------ machinery

    def _statistic_cells(self) -> dict[str, Statistic]:
        return {
            f.name: v
            for f in dataclasses.fields(self)
            if isinstance(v := getattr(self, f.name, None), Statistic)
        }

    def _with_statistics(self, stats: dict[str, Array]) -> Any:
        """A copy of this metric in value mode holding `stats`."""
        cells = self._statistic_cells()
        names = list(cells)
        new = [
            eqx.tree_at(
                lambda c: c.value,
                cells[k],
                jnp.asarray(stats[k]).astype(cells[k].dtype),
            )
            for k in names
        ]
        return eqx.tree_at(lambda m: [getattr(m, k) for k in names], self, new)

    def _check_mergeable(self, other: Any, what: str) -> None:
        if type(other) is not type(self):
            raise StateTypeError(
                f"{type(self).__name__}.{what}: cannot combine with a "
                f"{type(other).__name__}; both must be the same kind of metric."
            )
        # cells as leaves: a ref-mode cell (with its shape witness) and a value-mode
        # one of the same shape merge alike
        mine = jax.tree_util.tree_structure(self, is_leaf=is_state)
        theirs = jax.tree_util.tree_structure(other, is_leaf=is_state)
        shapes = [(type(c), c.shape, c.dtype) for c in self._statistic_cells().values()]
        other_shapes = [
            (type(c), c.shape, c.dtype) for c in other._statistic_cells().values()
        ]
        if mine != theirs or shapes != other_shapes:
            differ = self._differences(other) or [
                f"{self._config()} vs {other._config()}: {mine} vs {theirs}"
            ]
            raise StateValueError(
                f"{type(self).__name__}.{what}: the two metrics are configured "
                f"differently ({'; '.join(differ)}), so their statistics cannot be "
                "combined. Merge metrics built with the same arguments."
            )

    def _differences(self, other: Any) -> list[str]:
        """What differs between two metrics of one type: the options they were
        built with (their static fields), or else their statistics' shapes and
        dtypes."""
        out = []
        for f in dataclasses.fields(self):
            if f.metadata.get("static", False):
                a, b = getattr(self, f.name, None), getattr(other, f.name, None)
                if not _same(a, b):
                    out.append(f"`{f.name}` is {a!r} here and {b!r} in the other")
        if out:
            return out
        theirs = other._statistic_cells()
        for name, a in self._statistic_cells().items():
            b = theirs.get(name)
            if b is None:
                out.append(f"the other has no statistic {name!r}")
            elif (a.shape, a.dtype, a.merge) != (b.shape, b.dtype, b.merge):
                out.append(
                    f"the statistic {name!r} has shape {tuple(a.shape)} and dtype "
                    f"{a.dtype} (merge {a.merge!r}) here, and shape "
                    f"{tuple(b.shape)} and dtype {b.dtype} (merge {b.merge!r}) in "
                    "the other"
                )
        return out

    def _config(self) -> str:
        shapes = ", ".join(
            f"{n}{tuple(c.shape)}" for n, c in self._statistic_cells().items()
        )
        return f"{type(self).__name__}[{shapes}; axis_name={self.axis_name!r}]"

    # ------------------------------------------------------------------ public API

    def statistics(self) -> dict[str, Array]:
        """The current values of the metric's statistics, by name (a read).

        **Returns:**

        `{name: array}` for every [`eqx_state.metrics.statistic`][] of the metric.
        """
        return {k: cell[...] for k, cell in self._statistic_cells().items()}

    def merge(self, other: Any) -> Any:
        """Combine the statistics of two metrics of the same kind and configuration.

        Pure: neither metric changes; the result is a new value-mode metric (even if
        the inputs are in ref mode). Merging is associative: merging per-batch (or
        per-device) metrics in any grouping gives the statistics of one pass over all
        the data. `a.merge(b)` treats `b`'s data as coming after `a`'s (this matters
        only for [`eqx_state.metrics.LastValue`][]).

        **Arguments:**

        - `other`: a metric of the same type, built with the same arguments.

        **Returns:**

        A new metric holding the combined statistics.

        **Example:**

        ```python
        import jax.numpy as jnp
        import eqx_state as es

        a, b = es.to_refs(es.metrics.Mean()), es.to_refs(es.metrics.Mean())
        a.update(jnp.array([1.0, 2.0]))
        b.update(jnp.array([6.0]))
        assert float(a.merge(b).compute()) == 3.0
        ```
        """
        self._check_mergeable(other, "merge")
        merged = self.merge_statistics(self.statistics(), other.statistics())
        return self._with_statistics(merged)

    def reduce(self, axis_name: Hashable) -> Any:
        """Merge this metric over the named axis `axis_name` of an enclosing
        `jax.vmap(..., axis_name=...)`, `jax.shard_map` or `jax.pmap` (see
        [`eqx_state.metrics.Metric.reduce_statistics`][]).

        Use it when each member of the axis has updated its own metric with its shard
        of the batch; the result equals one pass over the global batch (members in
        axis order). Pure: returns a new value-mode metric, identical on every member.

        Inside `shard_map`, a state that is already replicated over the axis (built
        with `axis_name=`, or the result of an earlier `reduce`) holds the global
        statistics: it is returned unchanged, so calling `reduce` twice does not
        count anything twice. A fresh per-device state must be marked as such,
        `local = jax.tree.map(lambda v: jax.lax.pcast(v, axis_name,
        to="varying"), es.reset(metric))`; merge the reduced result into the running
        metric, `total = total.merge(local.reduce(axis_name))`. Under `vmap` and
        `pmap`, JAX does not track what is replicated: there each member's state must
        hold only its own data, or it is counted once per member.

        **Arguments:**

        - `axis_name`: the name of the mapped axis (or a tuple of names).

        **Returns:**

        The reduced metric.

        **Example:**

        ```python
        import jax, jax.numpy as jnp
        import eqx_state as es

        def per_shard(metric, x):
            _, metric = es.apply(lambda m, x: m.update(x), metric, x)
            return metric.reduce("shards").compute()

        x = jnp.arange(8.0).reshape(4, 2)  # 4 shards of 2 values
        means = jax.vmap(per_shard, in_axes=(None, 0), axis_name="shards")(
            es.metrics.Mean(), x
        )
        assert means.tolist() == [3.5] * 4
        ```
        """
        stats = self._reduce_over(self.statistics(), axis_name, "reduce")
        return self._with_statistics(stats)
