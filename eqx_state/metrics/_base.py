"""`Metric`: the base class of every metric, and the helpers metrics share (sample
weights and masks, safe division, cross-device reductions)."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Real

from .._buffer import MetricState


# Return annotations (aliases keep jaxtyping's shape strings out of signatures, which
# linters would otherwise parse as forward references).
FloatScalar = Float[Array, ""]
RealScalar = Real[Array, ""]
ConfusionArray = Real[Array, "num_classes num_classes"]
Scores = Float[Array, "*classes"]


# How each kind of cell starts, merges and reduces over a named axis:
#   "sum": starts at 0, merges by +, reduces with psum;
#   "min" / "max": start at +inf / -inf (the dtype's extremes for integers), merge
#       with minimum / maximum, reduce with pmin / pmax;
#   "last": starts at NaN (0 for integers); metrics that use it merge it themselves.
_KINDS = ("sum", "min", "max", "last")


def _fill(kind: str, shape: tuple[int, ...], dtype: Any) -> Array:
    dtype = jnp.dtype(dtype)
    if kind == "sum":
        return jnp.zeros(shape, dtype)
    inexact = jnp.issubdtype(dtype, jnp.inexact)
    if kind == "min":
        top = jnp.inf if inexact else jnp.iinfo(dtype).max
        return jnp.full(shape, top, dtype)
    if kind == "max":
        bottom = -jnp.inf if inexact else jnp.iinfo(dtype).min
        return jnp.full(shape, bottom, dtype)
    if kind == "last":
        return jnp.full(shape, jnp.nan if inexact else 0, dtype)
    raise ValueError(f"Unknown metric cell kind {kind!r}; expected one of {_KINDS}.")


def _cell(kind: str, shape: tuple[int, ...], dtype: Any) -> MetricState:
    """A fresh [`eqx_state.MetricState`][] cell for a statistic of the given kind."""
    return MetricState(_fill(kind, shape, dtype))


def _safe_div(num: Array, den: Array) -> Array:
    """`num / den` where `den > 0`, else 0 (no NaN, no division warning)."""
    ok = den > 0
    return jnp.where(
        ok, num / jnp.where(ok, den, jnp.ones_like(den)), jnp.zeros_like(num)
    )


def _fit(what: str, a: Array, shape: tuple[int, ...]) -> Array:
    """Give `a` (a scalar, or an array whose shape is `shape` or a prefix of it) the
    rank of `shape`, aligning the leading (batch) axes, so that it broadcasts against
    the values. It is not materialised at the full shape: a batch sharded across
    devices keeps its sharding."""
    if a.shape == shape or a.ndim == 0:
        return a
    if a.shape == shape[: a.ndim]:
        return a.reshape(a.shape + (1,) * (len(shape) - a.ndim))
    raise ValueError(
        f"`{what}` has shape {a.shape}, which does not fit values of shape {shape}. "
        f"`{what}` must be a scalar, have the values' shape, or a prefix of it "
        "(e.g. shape [batch] for values of shape [batch, time]); its axes line up "
        "with the leading axes of the values."
    )


def _truthy(a: Any) -> Array:
    """`a != 0` as a bool array (without mixing bool and int under strict dtype
    promotion)."""
    a = jnp.asarray(a)
    return a if a.dtype == jnp.bool_ else a != jnp.zeros((), a.dtype)


def _weights(like: Array, mask: Any, sample_weight: Any, dtype: Any) -> Array:
    """Per-element weights of the shape (and sharding) of `like`: `sample_weight`
    (default 1) where `mask` is true, 0 where it is false."""
    w = jnp.ones_like(like, dtype=dtype)
    if sample_weight is not None:
        sw = jnp.asarray(sample_weight).astype(dtype)
        w = w * _fit("sample_weight", sw, like.shape)
    if mask is not None:
        w = jnp.where(_fit("mask", _truthy(mask), like.shape), w, jnp.zeros_like(w))
    return w


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


def _varying_axes(x: Any) -> frozenset:
    """The mesh axes over which `x` varies inside `shard_map` (empty elsewhere)."""
    try:
        return frozenset(jax.typeof(x).mat.varying)  # pyright: ignore
    except Exception:  # noqa: BLE001 -- older/newer JAX: no varying-axes tracking
        return frozenset()


def _reduce_kind(kind: str, x: Array, axis_name: Hashable) -> Array:
    if kind == "sum":
        return jax.lax.psum(x, axis_name)
    if kind == "min":
        return jax.lax.pmin(x, axis_name)
    if kind == "max":
        return jax.lax.pmax(x, axis_name)
    raise NotImplementedError(
        f"A cell of kind {kind!r} has no default reduction over a named axis; the "
        "metric must override `_reduce_states`."
    )


def _merge_kind(kind: str, a: Array, b: Array) -> Array:
    if kind == "sum":
        return a + b
    if kind == "min":
        return jnp.minimum(a, b)
    if kind == "max":
        return jnp.maximum(a, b)
    raise NotImplementedError(
        f"A cell of kind {kind!r} has no default merge; the metric must override "
        "`_combine`."
    )


class Metric(eqx.Module):
    """The base class of all metrics: a stateful layer whose
    [`eqx_state.MetricState`][] cells hold the metric's sufficient statistics (sums,
    counts, extremes, a confusion matrix).

    A metric is an ordinary `eqx.Module`: it can live inside a model (updated in the
    loss function during [`eqx_state.make_step`][]) or on its own (updated in an
    evaluation loop through [`eqx_state.apply`][] or in ref mode,
    [`eqx_state.to_refs`][]).

    - `update(...)` adds a batch to the statistics (a state write; masks and sample
      weights let padded batches contribute only their real entries).
    - `compute()` reads the statistics and returns the metric's value.
    - `merge(other)` returns a new (value-mode) metric whose statistics are those of
      both; merging is associative, so merging per-batch or per-device metrics in any
      grouping equals one pass over all the data.
    - `reduce(axis_name)` merges the metric over a named axis of `jax.vmap`,
      `jax.shard_map` or `jax.pmap` (a new value-mode metric, the same on every
      member of the axis).
    - [`eqx_state.metrics.reset`][] returns a model whose metrics start over.

    Metrics have no `inference` field: they keep updating under
    [`eqx.nn.inference_mode`](https://docs.kidger.site/equinox/api/nn/inference/), because evaluation loops are
    where they are used most.

    Every metric takes `axis_name` (default `None`): when set, each `update` first
    sums (or min/max-es) the batch's statistics over that named axis, so that inside
    `shard_map` / `pmap` / `vmap(axis_name=...)` every member holds the statistics of
    the global batch, exactly one pass over it.

    **Writing a metric.** A subclass declares its cells as `MetricState` fields, lists
    them in the class variable `_kinds` (`{"field": "sum" | "min" | "max" |
    "last"}`: how each cell starts, merges and reduces over devices), computes a
    batch's statistics in `update` and hands them to `self._accumulate(...)` (which
    reduces them over `axis_name` and merges them into the cells), and turns
    statistics into a value in `_result`. `compute`, `merge`, `reduce` and
    [`eqx_state.metrics.reset`][] then work without further code; statistics that do
    not merge elementwise (e.g. [`eqx_state.metrics.MeanStd`][]) also override
    `_combine(a, b)` and `_reduce_states(states, axis_name)`.

    **Example:**

    ```python
    import equinox as eqx, jax.numpy as jnp
    import eqx_state as es

    class FractionAbove(es.metrics.Metric):
        hits: es.MetricState
        total: es.MetricState
        threshold: float = eqx.field(static=True)

        _kinds = {"hits": "sum", "total": "sum"}

        def __init__(self, threshold, *, axis_name=None):
            self.hits = es.MetricState(jnp.zeros(()))
            self.total = es.MetricState(jnp.zeros(()))
            self.threshold = threshold
            self.axis_name = axis_name

        def update(self, values):
            self._accumulate((jnp.sum(values > self.threshold), values.size))

        def _result(self, states):
            hits, total = states
            return jnp.where(total > 0, hits / total, jnp.nan)

    metric = es.to_refs(FractionAbove(0.5))
    metric.update(jnp.array([0.1, 0.7, 0.9, 0.2]))
    assert float(metric.compute()) == 0.5
    ```
    """

    axis_name: Hashable | None = eqx.field(static=True, default=None, kw_only=True)

    _kinds: ClassVar[dict[str, str]] = {}

    # ----------------------------------------------------------- for subclasses

    def update(self, *args: Any, **kwargs: Any) -> None:
        """Add a batch to the metric's statistics (a state write)."""
        raise NotImplementedError

    def _result(self, states: tuple[Array, ...]) -> Any:
        raise NotImplementedError

    def _combine(self, a: tuple[Array, ...], b: tuple[Array, ...]) -> tuple[Array, ...]:
        return tuple(
            _merge_kind(kind, x, y) for kind, x, y in zip(self._kinds.values(), a, b)
        )

    def _reduce_states(
        self, states: tuple[Array, ...], axis_name: Hashable
    ) -> tuple[Array, ...]:
        return tuple(
            _reduce_kind(kind, x, axis_name)
            for kind, x in zip(self._kinds.values(), states)
        )

    # ------------------------------------------------------------------ machinery

    def _cells(self) -> tuple[MetricState, ...]:
        return tuple(getattr(self, name) for name in self._kinds)

    def _read(self) -> tuple[Array, ...]:
        return tuple(cell[...] for cell in self._cells())

    def _with_states(self, states: tuple[Array, ...]) -> Any:
        """A copy of this metric in value mode holding `states`."""
        cells = tuple(
            MetricState(jnp.asarray(s).astype(c.dtype))
            for c, s in zip(self._cells(), states)
        )
        return eqx.tree_at(lambda m: m._cells(), self, cells)

    def _accumulate(self, batch: tuple[Any, ...]) -> None:
        """Merge a batch's statistics into the cells (reduced over `axis_name` first
        when the metric has one)."""
        cells = self._cells()
        batch = tuple(jnp.asarray(b).astype(c.dtype) for b, c in zip(batch, cells))
        if self.axis_name is not None:
            batch = self._reduce_states(batch, self.axis_name)
        current = self._read()
        for b, c in zip(batch, current):
            extra = _varying_axes(b) - _varying_axes(c)
            if extra:
                axes = ", ".join(repr(a) for a in sorted(extra, key=str))
                raise ValueError(
                    f"{type(self).__name__}.update got per-device values (they vary "
                    f"over the mesh axes {axes} inside `shard_map`), but the metric's "
                    "state is replicated over those axes, so each device would keep "
                    "different statistics in a state declared identical. Either "
                    f"build the metric with `axis_name={sorted(extra, key=str)[0]!r}` "
                    "so that every update is reduced over the devices (each device "
                    "then holds the global statistics), or give each device its own "
                    "state (`jax.tree.map(lambda v: jax.lax.pcast(v, axis_name, "
                    "to='varying'), metric)`) and combine at the end with "
                    "`metric.reduce(axis_name)`."
                )
        new = self._combine(current, batch)
        for cell, value in zip(cells, new):
            cell[...] = jnp.asarray(value).astype(cell.dtype)

    def _reset(self, memo: dict[int, Any] | None = None) -> Any:
        """Fresh statistics: written in place for cells that hold refs (ref mode, or
        inside a step), a new value-mode cell otherwise. `memo` maps the ids of old
        arrays to their fresh replacements, so that tied cells stay tied."""
        memo = {} if memo is None else memo
        new_cells = []
        for cell, kind in zip(self._cells(), self._kinds.values()):
            old = cell.value
            if isinstance(old, jax.Ref):
                cell[...] = _fill(kind, cell.shape, cell.dtype)
                new_cells.append(cell)
                continue
            if id(old) not in memo:  # keep `old` alive so that its id is not reused
                fresh = MetricState(_fill(kind, cell.shape, cell.dtype))
                memo[id(old)] = (old, fresh)
            new_cells.append(memo[id(old)][1])  # one cell object: tied stay tied
        return eqx.tree_at(lambda m: m._cells(), self, tuple(new_cells))

    def _check_mergeable(self, other: Any, what: str) -> None:
        if type(other) is not type(self):
            raise TypeError(
                f"{type(self).__name__}.{what}: cannot combine with a "
                f"{type(other).__name__}; both must be the same kind of metric."
            )
        mine = jax.tree_util.tree_structure(self)
        theirs = jax.tree_util.tree_structure(other)
        shapes = [c.shape for c in self._cells()]
        other_shapes = [c.shape for c in other._cells()]
        if mine != theirs or shapes != other_shapes:
            raise ValueError(
                f"{type(self).__name__}.{what}: the two metrics are configured "
                f"differently ({self._config()} vs {other._config()}), so their "
                "statistics cannot be combined. Merge metrics built with the same "
                "arguments."
            )

    def _config(self) -> str:
        shapes = ", ".join(
            f"{n}{tuple(c.shape)}" for n, c in zip(self._kinds, self._cells())
        )
        return f"{type(self).__name__}[{shapes}; axis_name={self.axis_name!r}]"

    # ------------------------------------------------------------------ public API

    def compute(self) -> Any:
        """The metric's value from the statistics accumulated so far (a read; never
        writes). See each metric for what it returns on no data."""
        return self._result(self._read())

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
        return self._with_states(self._combine(self._read(), other._read()))

    def reduce(self, axis_name: Hashable) -> Any:
        """Merge this metric over the named axis `axis_name` of an enclosing
        `jax.vmap(..., axis_name=...)`, `jax.shard_map` or `jax.pmap`: sums and counts
        are `psum`-ed, extremes `pmin`/`pmax`-ed, moments combined exactly (Chan et
        al.), the last value taken from the highest axis index that has one.

        Use it when each member of the axis has updated its own metric with its shard
        of the batch; the result equals one pass over the global batch (members in
        axis order). Pure: returns a new value-mode metric, identical on every member.

        Each member's state must hold only its own data: a state that was already
        the same on every member before the updates (e.g. the result of an earlier
        `reduce`) would be counted once per member. Update a fresh metric per batch
        and merge the reduced result into the running one,
        `total = total.merge(local.reduce(axis_name))`, or build the metric with
        `axis_name=...`, which reduces each update's statistics instead. Inside
        `shard_map`, a fresh local state must be marked per-device:
        `local = jax.tree.map(lambda v: jax.lax.pcast(v, axis_name,
        to="varying"), es.metrics.reset(metric))`.

        **Arguments:**

        - `axis_name`: the name of the mapped axis.

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
        return self._with_states(self._reduce_states(self._read(), axis_name))
