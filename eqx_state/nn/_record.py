"""Recorders: layers that record what happens inside a model into state cells —
streaming statistics of an intermediate (`Record`) or its last value (`Capture`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array

from .._buffer import RecordState, _is_ref, _LayerBase, cells_of, host_value, is_state
from .._errors import (
    StateTypeError,
    StateValueError,
    StateWriteError,
    check_axis_name,
    check_bool,
    check_dtype,
    check_shape,
    is_whole,
)
from .._modes import freeze
from .._vmap import mapped_axes
from ..metrics._base import Metric, Statistic, _fit, _gather, _truthy
from ..metrics._extrema import Max, Min
from ..metrics._mean import Mean
from ..metrics._mean_std import MeanStd
from ._complex import refuse_complex, refuse_non_array
from ._counter import saturating_add
from ._flag import inference_flag


def _rekind(cell: Any, cls: type, **fields: Any) -> Any:
    """`cell` as a cell of type `cls` with the same value, witness and reset fill
    (and `fields`), without running `__init__` (the value may be a ref or a
    tracer)."""
    new = object.__new__(cls)
    for f in dataclasses.fields(cls):
        value = fields[f.name] if f.name in fields else getattr(cell, f.name)
        object.__setattr__(new, f.name, value)
    return new


Rules = tuple[Any, ...]  # the merge rule of each statistic of a metric, in tree order


def _as_recorded(metric: Metric) -> tuple[Metric, Rules]:
    """The metric with its statistics as plain [`eqx_state.RecordState`][] cells
    (so that `es.reset(model)`, which resets metrics, leaves them alone), and the
    statistics' merge rules, which the recorder keeps as static configuration."""
    leaves, treedef = jax.tree_util.tree_flatten(metric, is_leaf=is_state)
    rules = tuple(c.merge for c in leaves if isinstance(c, Statistic))
    leaves = [
        _rekind(c, RecordState) if isinstance(c, Statistic) else c for c in leaves
    ]
    return jax.tree_util.tree_unflatten(treedef, leaves), rules


def _as_metric(metric: Metric, rules: Rules, *, read: bool = False) -> Metric:
    """The metric again, its recorder cells as metric statistics holding the *same*
    values (refs included), so that the metric's `update` writes the recorder's
    cells. With `read=True`, a value-mode copy (each cell read once)."""
    leaves, treedef = jax.tree_util.tree_flatten(metric, is_leaf=is_state)
    rule = iter(rules)
    out = []
    for c in leaves:
        if is_state(c):
            extra = {"value": c[...], "witness": None} if read else {}
            c = _rekind(c, Statistic, merge=next(rule), **extra)
        out.append(c)
    return jax.tree_util.tree_unflatten(treedef, out)


def _not_writable(recorder: str) -> StateWriteError:
    return StateWriteError(
        f"{recorder} was called to record a value, but the model is in value mode "
        "and no step is running, so its cells hold immutable arrays and the "
        "recording would be lost. Do one of:\n"
        "  * run the call through `eqx_state.make_step` or `eqx_state.apply` "
        "(recording then happens inside the compiled call);\n"
        "  * switch the model to ref mode, `model = eqx_state.to_refs(model)`;\n"
        "  * or switch recording off where you do not want it: "
        "`eqx_state.inference_mode(model, only=eqx_state.nn.Recorder)` (or "
        "`eqx.nn.inference_mode(model)` for evaluation), which records nothing."
    )


class Recorder(_LayerBase):
    """The base class of the layers that record a model's intermediates:
    [`eqx_state.nn.Record`][] (streaming statistics) and [`eqx_state.nn.Capture`][]
    (the last value). Use it to select them:
    `es.inference_mode(model, only=es.nn.Recorder)` switches recording off (and
    `es.inference_mode(model, False, only=es.nn.Recorder)` on again) without
    touching the other layers; [`eqx_state.recorded`][] reads every recorder of a
    model.

    Every recorder has an `inference` field, like the other stateful layers: in
    inference mode ([`eqx.nn.inference_mode`](https://docs.kidger.site/equinox/api/nn/inference/),
    [`eqx_state.inference_mode`][]) it returns its input and records nothing: no
    operation is added to the traced program, which is then the program of the
    model without recorders (its cells are carried through a step unchanged).

    **Example:**

    ```python
    import equinox as eqx, jax, jax.numpy as jnp
    import eqx_state as es

    model = eqx.nn.Sequential([
        es.nn.Batched(eqx.nn.Linear(3, 4, key=jax.random.key(0))),
        es.nn.Record("max_abs"),
        es.nn.Dropout(0.5, key=1),
    ])
    quiet = es.inference_mode(model, only=es.nn.Recorder)
    print(quiet.layers[1].inference, quiet.layers[2].inference)  # True False
    ```
    """

    inference: eqx.AbstractVar[bool]

    def read(self) -> dict[str, Array]:
        """What this recorder holds, by name (`""` for the recorder itself): the
        entries [`eqx_state.recorded`][] reports under the recorder's path.
        A read: writes nothing; works eagerly, under `jit` and in both modes."""
        raise NotImplementedError

    def _stack_shape(self) -> tuple[int, ...]:
        """The leading axes of a stacked recorder (scan-over-layers, an ensemble):
        the cells' extra axes in front of their declared shapes."""
        return ()


# ------------------------------------------------------------------------ Record


def _identity(x: Array, rec: Record) -> Array:
    return x


def _square(x: Array, rec: Record) -> Array:
    x = x.astype(rec.dtype)
    return x * x


def _abs(x: Array, rec: Record) -> Array:
    return jnp.abs(x)


def _is_zero(x: Array, rec: Record) -> Array:
    zero = (x == 0).astype(rec.dtype)
    if not jnp.issubdtype(x.dtype, jnp.inexact):
        return zero
    # NaN is neither zero nor not: it propagates, as it does into the mean
    return jnp.where(jnp.isnan(x), jnp.full_like(zero, jnp.nan), zero)


def _nonfinite(x: Array, rec: Record) -> Array:
    if not jnp.issubdtype(x.dtype, jnp.inexact):
        return jnp.zeros(x.shape, rec.dtype)
    return (~jnp.isfinite(x)).astype(rec.dtype)


def _first(c: Any) -> Any:
    return c


def _std(c: Any) -> Any:
    return c[1]


def _sqrt(c: Any) -> Any:
    return jnp.sqrt(c)


@dataclasses.dataclass(frozen=True)
class _Builtin:
    metric: Callable[..., Metric]
    transform: Callable[[Array, Any], Array]
    read: Callable[[Any], Any]
    doc: str


_BUILTINS: dict[str, _Builtin] = {
    "mean": _Builtin(Mean, _identity, _first, "the mean of every value"),
    "std": _Builtin(
        MeanStd, _identity, _std, "the (population) standard deviation of every value"
    ),
    "rms": _Builtin(Mean, _square, _sqrt, "the root mean square, sqrt(mean(x**2))"),
    "min": _Builtin(Min, _identity, _first, "the smallest value"),
    "max": _Builtin(Max, _identity, _first, "the largest value"),
    "max_abs": _Builtin(Max, _abs, _first, "the largest |x|"),
    "zero_fraction": _Builtin(
        Mean, _is_zero, _first, "the fraction of values that are exactly 0"
    ),
    "nonfinite_fraction": _Builtin(
        Mean, _nonfinite, _first, "the fraction of values that are NaN or +-inf"
    ),
    "dead_fraction": _Builtin(
        Mean,
        _identity,  # computed in `Record._dead` (it needs the batch axes)
        _first,
        "the fraction of units that are <= 0 for every example of a batch "
        "(dead ReLUs), averaged over the calls",
    ),
}

# the built-in statistics of real values only: an order, a mean, a variance (the
# others, of |x| or of flags, take complex values as they are)
_REAL_ONLY = frozenset({"mean", "std", "rms", "min", "max", "dead_fraction"})


class Record(Recorder):
    """Record streaming statistics of an intermediate value, anywhere in a model.

    Put a `Record` in a module and call it on the value to watch; it returns the
    value unchanged, so it can sit in an `eqx.nn.Sequential` or be a one-line call
    inside any layer, with no change to any signature between the training loop
    and that layer:

    ```python
    import equinox as eqx, jax
    import eqx_state as es

    class Block(eqx.Module):
        linear: eqx.nn.Linear
        act: es.nn.Record

        def __init__(self, key):
            self.linear = eqx.nn.Linear(64, 64, key=key)
            self.act = es.nn.Record("std", "dead_fraction")

        def __call__(self, x):  # x: [batch, 64]
            return self.act(jax.nn.relu(jax.vmap(self.linear)(x)))
    ```

    Each call adds the value's statistics to state cells (inside
    [`eqx_state.make_step`][] / [`eqx_state.apply`][], or in place in ref mode),
    accumulated over the calls since the last reset. Every statistic is a
    [metric](../api/metrics.md) of the recorded values, with the metric's
    sufficient statistics and merge rule: `std` is a
    [`eqx_state.metrics.MeanStd`][] (Chan et al.'s parallel formula), `max_abs` a
    [`eqx_state.metrics.Max`][] of `|x|`, and so on. So the statistics are exact
    over the global batch in a data-parallel step (`make_step(..., mesh=...)`),
    merge across devices (`axis_name`) and recorders
    ([`eqx_state.nn.Record.merge`][]), and start over with
    `es.reset(model, es.RecordState)`. Their cells are
    [`eqx_state.RecordState`][]s, not metrics: `es.reset(model)` (which resets
    metrics) leaves recordings alone.

    Read everything recorded in a model with [`eqx_state.recorded`][], a flat
    `{path: value}` mapping ready to log (`"blocks.3.act.std"`).

    **Statistics** (by name; each reads as one value):

    - `"mean"`, `"std"`, `"rms"`: the mean, the population standard deviation
        and the root mean square of every value recorded;
    - `"min"`, `"max"`, `"max_abs"`: the smallest, the largest value and the
        largest `|x|` (NaN propagates: a NaN activation shows);
    - `"zero_fraction"`: the fraction of values that are exactly 0;
    - `"nonfinite_fraction"`: the fraction that are NaN or +-inf;
    - `"dead_fraction"`: the fraction of *units* that are `<= 0` for every example
        of the batch (dead ReLUs; record the activation before or after the
        ReLU), averaged over the calls. A unit is a position along the axes that
        are not `batch_axis`.

    A NaN value (not masked out) makes every statistic but `nonfinite_fraction`
    NaN, `zero_fraction` and `dead_fraction` included (a NaN unit is neither
    dead nor alive), until the recorder is reset: a NaN activation shows.
    - any metric, as a keyword argument: `Record(hist=es.metrics.Histogram(20,
        range=(-3, 3)))` calls `metric.update(x)` (with `mask=` when given) and
        reads `metric.compute()` (a tuple result reads as `name.0`, `name.1`, ...).
        Such a metric keeps its own `axis_name`.

    **Arguments:**

    - `*statistics`: the names of built-in statistics (above).
    - `axis_name`: for per-example code mapped with [`eqx_state.vmap`][] (or
        per-device code in `jax.shard_map`): the named axis whose members together
        form the batch; each call's statistics are reduced over it first. Not for
        `make_step(..., mesh=...)`, which already sees the global batch.
    - `batch_axis`: for `"dead_fraction"`, the axes of one call's value that
        index examples (an int or a tuple; e.g. `(0, 2, 3)` for a channel of an
        `[N, C, H, W]` feature map to count as one unit). Default: `0`; none
        inside [`eqx_state.vmap`][] over `axis_name` (per-example code: the
        examples are the members of that axis).
    - `dtype`: the dtype of the statistics (default float32). The statistics that
        accumulate (`mean`, `std`, `rms`, `dead_fraction`, ...) refuse a float
        narrower than 32 bits, as the metrics do (a bfloat16 count stops at 256).
    - `inference`: start switched off (see [`eqx_state.nn.Recorder`][]).
    - `**metrics`: more statistics, as metrics by name.

    **Example:**

    ```python
    import jax.numpy as jnp
    import eqx_state as es

    rec = es.to_refs(es.nn.Record("mean", "std", "max_abs"))
    rec(jnp.array([1.0, -2.0]))
    rec(jnp.array([3.0, 4.0]))
    print({k: round(float(v), 4) for k, v in es.recorded(rec).items()})  # {'mean': 1.5, 'std': 2.2913, 'max_abs': 4.0}
    ```
    """

    metrics: dict[str, Metric]
    inference: bool
    names: tuple[str, ...] = eqx.field(static=True)
    custom: frozenset[str] = eqx.field(static=True, repr=False)
    axis_name: Hashable | None = eqx.field(static=True)
    batch_axis: tuple[int, ...] | None = eqx.field(static=True)
    dtype: Any = eqx.field(static=True, repr=False)
    shapes: tuple[tuple[int, ...], ...] = eqx.field(static=True, repr=False)
    rules: tuple[Rules, ...] = eqx.field(static=True, repr=False)  # by `names`

    def __init__(
        self,
        *statistics: str,
        axis_name: Hashable | None = None,
        batch_axis: int | tuple[int, ...] | None = None,
        dtype: Any = jnp.float32,
        inference: bool = False,
        **metrics: Any,
    ):
        axis_name = check_axis_name("Record", axis_name)  # before its metrics get it
        if not statistics and not metrics:
            raise StateValueError(
                "Record needs at least one statistic, e.g. "
                f"`Record('mean', 'std')`; the built-in ones are {list(_BUILTINS)}, "
                "and any metric can be given by name, `Record(hist=es.metrics."
                "Histogram(20, range=(-3.0, 3.0)))`."
            )
        for s in statistics:
            if s not in _BUILTINS:
                raise StateValueError(
                    f"Record: unknown statistic {s!r}. The built-in statistics are "
                    f"{list(_BUILTINS)}; record anything else with a metric by "
                    f"name, e.g. `Record({s}=es.metrics.Mean())`."
                )
        names = tuple(statistics) + tuple(metrics)
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise StateValueError(f"Record: the statistic(s) {dup} are given twice.")
        dtype = check_dtype("Record", "dtype", dtype)
        if not jnp.issubdtype(dtype, jnp.floating):
            raise StateValueError(f"Record: dtype must be floating, got {dtype}.")
        built: dict[str, Metric] = {}
        for s in statistics:
            # dead units are found over the whole axis in `_dead`: the flags are
            # then the same on every member, and are counted once
            axis = None if s == "dead_fraction" else axis_name
            built[s] = _BUILTINS[s].metric(axis_name=axis, dtype=dtype)
        for name, m in metrics.items():
            if not isinstance(m, Metric):
                raise StateTypeError(
                    f"Record({name}=...) must be a metric (an eqx_state.metrics."
                    f"Metric, e.g. es.metrics.Histogram(...)), got {type(m).__name__}."
                )
            # its current values, as arrays of its own (a step donates its cells)
            built[name] = jax.tree.map(
                lambda a: jnp.array(a, copy=True) if eqx.is_array(a) else a, freeze(m)
            )
        if is_whole(batch_axis):
            batch_axis = (batch_axis,)  # pyright: ignore[reportAssignmentType]
        if batch_axis is not None and not (
            isinstance(batch_axis, tuple | list)
            and all(map(is_whole, batch_axis))
            and len(set(batch_axis)) == len(batch_axis)
        ):
            raise StateTypeError(
                "Record: batch_axis must be an int or a tuple of distinct ints (the "
                f"axes of a value that hold examples), got {batch_axis!r}."
            )
        recorded = {k: _as_recorded(built[k]) for k in names}
        self.metrics = {k: m for k, (m, _) in recorded.items()}
        self.rules = tuple(r for _, r in recorded.values())
        self.inference = check_bool(type(self).__name__, "inference", inference)
        self.names = names
        self.custom = frozenset(metrics)
        self.axis_name = axis_name
        self.batch_axis = None if batch_axis is None else tuple(map(int, batch_axis))
        self.dtype = jnp.dtype(dtype)
        self.shapes = tuple(tuple(c.shape) for c in cells_of(self.metrics))

    def __call__(self, x: Any, *, mask: Any = None, key: Any = None) -> Any:
        """Record `x` and return it unchanged (in inference mode, only return it).

        **Arguments:**

        - `x`: the value to record (an array of any shape). Complex values are
            refused by the statistics of real values (`mean`, `std`, `rms`, `min`,
            `max`, `dead_fraction`), before anything is written.
        - `mask`: which values count (a bool array of `x`'s shape or a prefix of
            it, e.g. `[batch]` for padded batches); masked-out values are not
            recorded, even NaN ones.
        - `key`: ignored (accepted for `eqx.nn.Sequential`).

        **Returns:**

        `x`.
        """
        del key
        if inference_flag(self):
            return x
        refuse_non_array(f"Record({', '.join(map(repr, self.names))})", x, numbers=True)
        cells = cells_of(self.metrics)
        if not all(_is_ref(c.value) for c in cells):
            raise _not_writable(f"Record{self.names}")
        where = f"Record({', '.join(map(repr, self.names))})"
        v = jax.lax.stop_gradient(
            host_value(x, where, "Record a value JAX holds as it is.", StateTypeError)
        )
        real_only = [n for n in self.names if n in _REAL_ONLY and n not in self.custom]
        if real_only:  # checked before any statistic is written
            refuse_complex(
                f"Record({', '.join(map(repr, real_only))})",
                v.dtype,
                ("it is a statistic" if len(real_only) == 1 else "they are statistics")
                + f" of real values (kept in {self.dtype.name})",
                "Record the real and imaginary parts, or `jnp.abs(x)`, with "
                "recorders of their own; 'max_abs', 'zero_fraction' and "
                "'nonfinite_fraction' take complex values as they are.",
            )
        m = None if mask is None else jax.lax.stop_gradient(jnp.asarray(mask))
        for name in self.names:
            metric = _as_metric(self.metrics[name], self._rules(name))
            if name in self.custom:
                if m is None:
                    metric.update(v)
                else:
                    metric.update(v, mask=m)
            elif name == "dead_fraction":
                dead, seen = self._dead(v, m)
                metric.update(dead, mask=seen)
            else:
                values = _BUILTINS[name].transform(v, self)
                metric.update(values, mask=m)
        return x

    def _dead(self, x: Array, mask: Array | None) -> tuple[Array, Array]:
        """Per unit: whether it is `<= 0` for every (unmasked) example, and whether
        it saw any example at all (a unit of an empty or fully masked batch is
        neither dead nor alive: it is not counted)."""
        axes = self.batch_axis
        if axes is None:
            # per-example code mapped with `es.vmap` over `axis_name` has no batch
            # axis; elsewhere (a whole batch, a device's shard of it) it is axis 0
            names = (
                self.axis_name
                if isinstance(self.axis_name, tuple)
                else (self.axis_name,)
            )
            mapped = mapped_axes()
            per_example = self.axis_name is not None and all(a in mapped for a in names)
            axes = () if per_example else (0,)
        # a negative axis counts from the end, as NumPy's; 5 on a 2-d value is
        # out of range (not 5 % 2: a modulus took another axis as the batch)
        axes = tuple(a + x.ndim if a < 0 else a for a in axes)
        if any(not 0 <= a < x.ndim for a in axes) or len(set(axes)) != len(axes):
            raise StateValueError(
                f"Record('dead_fraction', batch_axis={self.batch_axis}) got a value "
                f"of shape {x.shape}: the batch axes must be distinct axes of the "
                f"value, in [-{x.ndim}, {x.ndim}). A unit is dead when it is <= 0 "
                "for every example, so the value needs its batch axis (record the "
                "batch, `[batch, features]`); "
                "per-example code mapped with `es.vmap` takes `axis_name=` instead."
            )
        keep = jnp.ones(x.shape, bool)
        if mask is not None:
            keep = jnp.broadcast_to(_fit("mask", _truthy(mask), x.shape), x.shape)
        dead = jnp.all((x <= 0) | ~keep, axis=axes)
        seen = jnp.any(keep, axis=axes)
        # a unit with a NaN (unmasked) value is neither dead nor alive: NaN, which
        # propagates into the fraction as it does into the mean
        nan = jnp.any(jnp.isnan(x) & keep, axis=axes)
        if self.axis_name is not None:
            dead = jax.lax.pmin(dead.astype(jnp.int32), self.axis_name) > 0
            seen = jax.lax.pmax(seen.astype(jnp.int32), self.axis_name) > 0
            nan = jax.lax.pmax(nan.astype(jnp.int32), self.axis_name) > 0
        dead = dead.astype(self.dtype)
        return jnp.where(nan, jnp.full_like(dead, jnp.nan), dead), seen

    def read(self) -> dict[str, Array]:
        """Every statistic's current value, by name (a read; `{"std": ...}`).

        **Returns:**

        `{name: value}`, in the order the statistics were given; a stacked
        recorder's values have its stacking axes in front.
        """
        out: dict[str, Array] = {}
        for name in self.names:
            metric = self._metric(name)
            reader = _first if name in self.custom else _BUILTINS[name].read

            def value(m: Metric, reader: Callable = reader) -> Any:
                return reader(m.compute())

            for _ in self._stack_shape():
                value = eqx.filter_vmap(value)
            result = value(metric)
            if isinstance(result, tuple):
                for i, r in enumerate(result):
                    out[f"{name}.{i}"] = r
            else:
                out[name] = result
        return out

    def _stack_shape(self) -> tuple[int, ...]:
        cells = cells_of(self.metrics)
        actual, declared = tuple(cells[0].value.shape), self.shapes[0]
        return actual[: len(actual) - len(declared)]

    def _check_mergeable(self, other: Any, what: str) -> None:
        if not isinstance(other, Record):
            raise StateTypeError(
                f"Record.{what}: can only combine with another Record, got a "
                f"{type(other).__name__}."
            )
        options = ("names", "custom", "axis_name", "batch_axis", "dtype")
        differ = [
            f"`{k}` is {getattr(self, k)!r} here and {getattr(other, k)!r} in the other"
            for k in options
            if getattr(self, k) != getattr(other, k)
        ]
        if differ:
            raise StateValueError(
                f"Record.{what}: can only combine recorders built with the same "
                f"statistics and options ({'; '.join(differ)})."
            )

    def _metric(self, name: str) -> Metric:
        """The statistic `name` as a value-mode metric."""
        return _as_metric(self.metrics[name], self._rules(name), read=True)

    def _rules(self, name: str) -> Rules:
        return self.rules[self.names.index(name)]

    def merge(self, other: Record) -> Record:
        """The recorder holding the statistics of both (pure: a new value-mode
        recorder; neither changes): each statistic merges by its metric's rule, so
        merging recorders of different shards of the data equals one recorder
        that saw it all.

        **Arguments:**

        - `other`: a recorder built with the same statistics and options.

        **Returns:**

        The merged recorder.
        """
        self._check_mergeable(other, "merge")
        new = {
            k: _as_recorded(self._metric(k).merge(other._metric(k)))[0]
            for k in self.names
        }
        return eqx.tree_at(lambda r: r.metrics, self, new)

    def reduce(self, axis_name: Hashable) -> Record:
        """Merge this recorder over the named axis `axis_name` (of `jax.shard_map`,
        `jax.pmap` or `jax.vmap`), as [`eqx_state.metrics.Metric.reduce`][]: for
        recorders that recorded per-device data without `axis_name`.

        **Arguments:**

        - `axis_name`: the axis (or tuple of axes).

        **Returns:**

        A new value-mode recorder, the same on every member of the axis.
        """
        new = {
            k: _as_recorded(self._metric(k).reduce(axis_name))[0] for k in self.names
        }
        return eqx.tree_at(lambda r: r.metrics, self, new)


# ----------------------------------------------------------------------- Capture


class Capture(Recorder):
    """Capture the last value of an intermediate array (the latest batch's
    activations, attention weights), for inspection after a call.

    Like [`eqx_state.nn.Record`][], it is called on the value anywhere in a model
    and returns it unchanged; each call overwrites the captured array. The array
    has a fixed shape and dtype, given when the capture is built (state cells
    have fixed shapes: the batch size is part of it). Read it with `capture.value[...]`,
    `capture.last`, or through [`eqx_state.recorded`][] (under the capture's path).

    Its cells are [`eqx_state.RecordState`][]s: `value` (zeros before the first
    capture) and `count`, the number of captures (tells "nothing captured yet"
    apart from zeros). `es.reset(model, es.RecordState)` clears both. In inference
    mode it captures nothing (see [`eqx_state.nn.Recorder`][]).

    **Arguments:**

    - `shape`: the shape of the captured array (with `axis_name`: of the gathered
        array, `[axis_size, *per_member_shape]`).
    - `dtype`: its dtype (default float32). Values of a narrower dtype of the same
        kind are widened exactly; a wider one is an error (no silent rounding).
    - `axis_name`: for per-example code mapped with [`eqx_state.vmap`][] (or
        `jax.shard_map`): capture every member's value, stacked along a new
        leading axis in axis order.
    - `inference`: start switched off.

    **Example:**

    ```python
    import jax.numpy as jnp
    import eqx_state as es

    cap = es.to_refs(es.nn.Capture((2,)))
    cap(jnp.array([1.0, 2.0]))
    cap(jnp.array([3.0, 4.0]))
    print(cap.last, int(cap.count[...]))  # [3. 4.] 2
    ```
    """

    value: RecordState
    count: RecordState
    inference: bool
    shape: tuple[int, ...] = eqx.field(static=True)
    axis_name: Hashable | None = eqx.field(static=True)

    def __init__(
        self,
        shape: tuple[int, ...],
        dtype: Any = jnp.float32,
        *,
        axis_name: Hashable | None = None,
        inference: bool = False,
    ):
        shape = check_shape("Capture", "shape", shape)
        dtype = check_dtype("Capture", "dtype", dtype)
        init = False if dtype == jnp.bool_ else 0
        self.value = RecordState(jnp.zeros(shape, dtype), init=init)
        self.count = RecordState(jnp.zeros((), jnp.int32), init=0)
        self.inference = check_bool(type(self).__name__, "inference", inference)
        self.shape = shape
        self.axis_name = check_axis_name("Capture", axis_name)

    @property
    def last(self) -> Array:
        """The last captured array (zeros before the first capture)."""
        return self.value[...]

    def __call__(self, x: Any, *, key: Any = None) -> Any:
        """Capture `x` and return it unchanged (in inference mode, only return it).

        **Arguments:**

        - `x`: an array of the capture's shape (with `axis_name`: this member's
            part) and a dtype that widens exactly to the capture's.
        - `key`: ignored (accepted for `eqx.nn.Sequential`).

        **Returns:**

        `x`.
        """
        del key
        if inference_flag(self):
            return x
        refuse_non_array(f"Capture(shape={self.shape})", x, numbers=True)
        if not (_is_ref(self.value.value) and _is_ref(self.count.value)):
            raise _not_writable(f"Capture{self.shape}")
        v = jax.lax.stop_gradient(
            host_value(
                x,
                f"Capture(shape={self.shape})",
                "Capture a value JAX holds as it is.",
                StateTypeError,
            )
        )
        if self.axis_name is not None:
            v = _gather(v, self.axis_name)
        dtype = self.value.dtype
        if tuple(v.shape) != self.shape:
            what = " (gathered over the axis)" if self.axis_name is not None else ""
            raise StateValueError(
                f"Capture(shape={self.shape}) got a value of shape "
                f"{tuple(v.shape)}{what}. A capture keeps one array of a fixed shape "
                "(the batch size is part of it): build it with the shape of the "
                "value it records, e.g. `Capture((batch, features))`, or record "
                "statistics of values of any shape with `es.nn.Record`."
            )
        if v.dtype != dtype:
            if jnp.promote_types(v.dtype, dtype) != dtype or (
                jnp.issubdtype(v.dtype, jnp.inexact)
                != jnp.issubdtype(dtype, jnp.inexact)
            ):
                raise StateValueError(
                    f"Capture(dtype={jnp.dtype(dtype).name}) got a value of dtype "
                    f"{v.dtype}, which it cannot hold exactly. Build the capture "
                    f"with the value's dtype, `Capture(shape, dtype=jnp.{v.dtype})`."
                )
            v = v.astype(dtype)
        self.value[...] = _laid_out_like(v, self.value)
        self.count[...] = saturating_add(self.count[...], 1)
        return x

    def read(self) -> dict[str, Array]:
        """`{"": last value}`: a capture reports under its own path."""
        return {"": self.value[...]}

    def _stack_shape(self) -> tuple[int, ...]:
        actual = tuple(self.value.value.shape)
        return actual[: len(actual) - len(self.shape)]


def _sharded_spec(x: Any) -> Any:
    """The `PartitionSpec` of `x`'s type where it is sharded over explicit mesh axes
    (`None` otherwise: no mesh, automatic sharding, inside `shard_map`)."""
    try:
        spec = jax.typeof(x).sharding.spec
    except Exception:  # noqa: BLE001 -- JAX without sharding in types
        return None
    return spec if any(s is not None for s in spec) else None


def _laid_out_like(v: Array, cell: Any) -> Array:
    """`v` laid out as the cell is: a batch sharded over an explicit mesh is
    gathered into a replicated capture (which keeps its sharding, as every cell
    does: the next step takes it as it was)."""
    if _sharded_spec(v) is None:
        return v
    current = cell[...]
    return jax.sharding.reshard(v, jax.typeof(current).sharding)
