"""State cells: `Buffer` and its kinds, the filters that select them, and the two
storage modes (`to_refs` / `freeze`)."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax._src import core as jax_core

from ._errors import StaleModelError, StateWriteError


_REF_KIND = "no_grad_no_remat"
# `no_grad_no_remat` refs accept writes of differentiated values (they are not
# differentiated through) and are written once under `jax.checkpoint` + `grad`;
# plain refs raise on the first and silently write twice on the second.


try:  # a view of a ref (`ref.at[i]`), e.g. one layer of a stacked state in a scan
    from jax._src.state.types import TransformedRef as _TransformedRef

    _REF_TYPES: tuple[type, ...] = (jax.Ref, _TransformedRef)
except ImportError:  # pragma: no cover - depends on the JAX version
    _REF_TYPES = (jax.Ref,)


def _is_ref(x: Any) -> bool:
    return isinstance(x, _REF_TYPES)


def _to_value(x: Any) -> Any:
    if _is_ref(x) or isinstance(x, jax_core.Tracer):
        return x
    if isinstance(x, jax.Array):
        # a copy: a step donates the cell's array, which must not delete the caller's
        x = jnp.array(x, copy=True)
    x = jnp.asarray(x)
    if getattr(x, "weak_type", False):
        x = jnp.asarray(x, dtype=x.dtype)  # a cell has a definite dtype
    return x


class Buffer(eqx.Module):
    """A state cell: one array (value mode) or one `jax.Ref` (ref mode) inside a model.

    Buffers are how a layer keeps state that is not a trainable parameter: running
    statistics, counters, metric accumulators, RNG keys, caches. They are ordinary
    pytree nodes, so a model that holds them is still an ordinary Equinox module.

    * Read with `buf[...]` (or `buf.value` for the raw leaf).
    * Write with `buf[...] = new` (or any index: `buf[i] = row`). A write never
      carries a gradient. In value mode a write is only possible inside
      [`eqx_state.make_step`][] or [`eqx_state.apply`][]; in ref mode
      ([`eqx_state.to_refs`][]) anywhere.

    Subclasses name the kind of state so that filters can select it:
    [`eqx_state.BatchStat`][], [`eqx_state.CounterState`][],
    [`eqx_state.MetricState`][], [`eqx_state.Cache`][], [`eqx_state.RngState`][].

    **Arguments:**

    - `value`: the initial value; anything `jnp.asarray` accepts.
    - `tie`: a hashable tag for a cell meant to be shared by several layers (an
        [`eqx_state.nn.Rng`][] stream has one): cells with one tag are one state
        even inside traces that rebuild the model leaf by leaf (`eqx.filter_jit`
        around `es.apply`, ensembles built with `eqx.filter_vmap`). Default `None`:
        cells are tied by array identity only.

    **Example:**

    ```python
    import jax.numpy as jnp
    import eqx_state as es

    buf = es.Buffer(jnp.zeros(3))
    assert buf[...].shape == (3,)
    ```
    """

    value: Any = eqx.field(converter=_to_value)
    # Cells made to be shared (an `Rng` stream several layers draw from) carry a tie
    # tag: inside a trace, where a shared array has become several tracers (under
    # `jax.jit` / `eqx.filter_jit`, or after `eqx.filter_vmap(make)`), cells with one
    # tag are still one state. Untagged cells are tied by array identity only.
    tie: Hashable | None = eqx.field(default=None, static=True)
    # What `es.reset` writes back (broadcast to the cell's shape): a Python scalar
    # fill, or `None` for a cell that has no initial value to go back to.
    init: bool | int | float | complex | None = eqx.field(
        default=None, static=True, kw_only=True
    )

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.value.shape)

    @property
    def dtype(self) -> Any:
        return self.value.dtype

    def __getitem__(self, idx: Any) -> jax.Array:
        v = self.value
        if type(v) is jax.Ref:  # a concrete ref: its array may have been consumed
            buf = getattr(getattr(v, "_refs", None), "_buf", None)
            if buf is not None and buf.is_deleted():
                raise StaleModelError(_stale_message(type(self).__name__))
        elif (
            isinstance(v, jax.Array)
            and not isinstance(v, jax_core.Tracer)
            and v.is_deleted()
        ):
            raise StaleModelError(_stale_message(type(self).__name__))
        return v[idx]

    def __setitem__(self, idx: Any, new: Any) -> None:
        _write(self, idx, new)


class BatchStat(Buffer):
    """A running statistic (BatchNorm's running mean/var, RunningNorm's moments)."""


class CounterState(Buffer):
    """An integer count (step counters, `num_batches_tracked`)."""


class MetricState(Buffer):
    """A metric's sufficient statistic (sums, counts, confusion matrices)."""


class Cache(Buffer):
    """A cache written during inference (attention keys/values, cursors)."""


class RngState(Buffer):
    """A PRNG key advanced on every draw."""


class AverageState(Buffer):
    """A running average of parameters (the weights an `EMA` keeps)."""


class PowerIterationState(Buffer):
    """Power-iteration vectors (`SpectralNorm`'s `u` and `v`)."""


def _stale_message(what: str) -> str:
    return (
        f"This {what} holds an array that was consumed (donated) by an earlier "
        "call: `make_step` and `make_apply` donate the buffers they replace, so "
        "after `model, opt_state = step(model, opt_state, ...)` the old `model` and "
        "`opt_state` must not be used again (a jitted call that failed at run time "
        "can also have consumed the ref-mode cells it was given). Use the model the "
        "call returned, or build it with `make_step(..., donate=False)` / "
        "`make_apply(..., donate=False)` to keep old models valid."
    )


def _write(buf: Buffer, idx: Any, new: Any) -> None:
    cell = buf.value
    kind = type(buf).__name__
    if not _is_ref(cell):
        raise StateWriteError(
            f"A layer tried to write its state ({kind} of shape {tuple(cell.shape)}), "
            "but the model is in value mode and no step is running, so the cell holds "
            "an immutable array and the write would be lost. Do one of:\n"
            "  * run the call through `eqx_state.make_step` (training) or "
            "`out, model = eqx_state.apply(fn, model, *args)` (any state-writing "
            "forward pass, e.g. evaluation loops or BatchNorm recalibration);\n"
            "  * switch the model to ref mode with `model = eqx_state.to_refs(model)`, "
            "where cells are updated in place;\n"
            "  * or, if you meant to evaluate, call `eqx.nn.inference_mode(model)` "
            "first so that layers do not write state."
        )
    new = jnp.asarray(new)
    if new.dtype != cell.dtype:
        if getattr(new, "weak_type", False) or _is_weak(new):
            new = new.astype(cell.dtype)
        else:
            raise StateWriteError(
                f"Cannot write a value of dtype {new.dtype} into a {kind} cell of "
                f"dtype {cell.dtype}: state cells keep their dtype. Cast first, e.g. "
                f"`buf[...] = value.astype(buf.dtype)`."
            )
    if idx is Ellipsis and tuple(new.shape) != tuple(cell.shape):
        raise StateWriteError(
            f"Cannot write a value of shape {tuple(new.shape)} into a {kind} cell of "
            f"shape {tuple(cell.shape)}: a whole-cell write `buf[...] = v` needs the "
            "same shape (no broadcasting). Reshape the value, or write part of the "
            "cell with an index, e.g. `buf[i] = row`."
        )
    try:
        cell[idx] = jax.lax.stop_gradient(new)
    except Exception as e:  # noqa: BLE001 -- re-raised with the fix named
        msg = str(e)
        if "vmapped value on an unbatched" in msg:
            raise StateWriteError(
                f"A {kind} cell was written inside `jax.vmap` with a per-example "
                "(batched) value, but the cell itself is not batched: JAX cannot write "
                "a vmapped value into an unbatched ref. Either map per-example calls "
                "with `eqx_state.vmap(model, axis_name=...)` (with layers that reduce "
                "over that axis, e.g. `BatchNorm(..., axis_name=...)`), call the layer "
                "on the whole batch instead, or vmap over an ensemble of models whose "
                "state has the same leading axis (`eqx.filter_vmap` of the step)."
            ) from e
        raise


def _is_weak(x: Any) -> bool:
    try:
        return bool(jax.typeof(x).weak_type)
    except Exception:  # noqa: BLE001
        return False


def is_state(x: Any) -> bool:
    """The filter for state cells: `True` for a [`eqx_state.Buffer`][] (any kind).

    Use it with Equinox's filters, e.g. `eqx.partition(model, es.is_state,
    is_leaf=es.is_state)`, or to select one kind with
    `lambda x: isinstance(x, es.BatchStat)`.

    **Arguments:**

    - `x`: any object.

    **Returns:**

    Whether `x` is a state cell.
    """
    return isinstance(x, Buffer)


def _is_param(x: Any) -> bool:
    return eqx.is_inexact_array(x)


def params(model: Any) -> Any:
    """The trainable parameters of `model`: every inexact array that is not inside a
    state cell. Everything else (state cells, integer arrays, Python values) is
    replaced by `None`. This is the tree an optimizer is initialised on.

    **Arguments:**

    - `model`: any pytree, typically an `eqx.Module`.

    **Returns:**

    A tree of the same structure with only the parameters kept.

    **Example:**

    ```python
    import equinox as eqx, jax, optax
    import eqx_state as es

    model = eqx.nn.Sequential([eqx.nn.Linear(2, 3, key=jax.random.key(0)),
                               es.nn.BatchNorm(3)])
    opt_state = optax.adam(1e-3).init(es.params(model))
    ```
    """
    return eqx.filter(model, _is_param, is_leaf=is_state)


def _map_cells(fn: Callable[[Any], Any], tree: Any) -> Any:
    """Apply `fn` to the value of every cell, once per distinct value (tied cells
    stay tied)."""
    memo: dict[Any, Any] = {}

    def one(x: Any) -> Any:
        if not isinstance(x, Buffer):
            return x
        v = x.value
        key: Any = id(v) if x.tie is None else ("tie", x.tie)
        if key not in memo:
            memo[key] = (v, fn(v))  # keep `v` alive so its id is not reused
        return eqx.tree_at(lambda b: b.value, x, memo[key][1])

    return jax.tree_util.tree_map(one, tree, is_leaf=is_state)


def _new_ref(v: Any) -> Any:
    if _is_ref(v):
        return v
    if (
        isinstance(v, jax.Array)
        and not isinstance(v, jax_core.Tracer)
        and v.is_deleted()
    ):
        raise StaleModelError(_stale_message("model's state cell"))
    return jax.new_ref(v, kind=_REF_KIND)


def to_refs(model: Any) -> Any:
    """Ref mode: every state cell of `model` holds a persistent `jax.Ref`, updated in
    place by every call, eager or jitted. Cells that are already refs are kept; cells
    that share one array (tied) share one ref.

    **Arguments:**

    - `model`: a model in value mode (or partly in ref mode).

    **Returns:**

    The same model with refs in its cells. Parameters are unchanged.

    **Example:**

    ```python
    import jax.numpy as jnp
    import eqx_state as es

    counter = es.to_refs(es.nn.Counter())
    counter.increment()
    counter.increment()
    assert int(counter.value) == 2
    ```
    """
    return _map_cells(_new_ref, model)


def _freeze_one(v: Any) -> Any:
    if not _is_ref(v):
        return v
    if jax_core.trace_state_clean():
        return jax.freeze(v)  # eagerly: a copy, the ref stays valid
    return v[...]  # in a trace the ref may come from outside it: read a snapshot


def freeze(model: Any) -> Any:
    """Value mode: every state cell of `model` holds an immutable array with the
    current value of its ref. Outside a trace this is a snapshot: the ref-mode model
    stays usable and later writes to it do not change the returned model.

    **Arguments:**

    - `model`: a model in ref mode (value-mode cells pass through).

    **Returns:**

    The model in value mode.
    """
    return _map_cells(_freeze_one, model)


def _thaw(model: Any) -> tuple[Any, set[int]]:
    """Inside a trace: turn every array cell into a fresh ref; return the ids of the
    refs made here (refs passed in from outside are left alone)."""
    made: set[int] = set()

    def make(v: Any) -> Any:
        if _is_ref(v):
            return v
        if isinstance(v, jax.Array) and not isinstance(v, jax_core.Tracer):
            if v.is_deleted():
                raise StaleModelError(_stale_message("model's state cell"))
        r = jax.new_ref(v, kind=_REF_KIND)
        made.add(id(r))
        return r

    return _map_cells(make, model), made


def _refreeze(model: Any, made: set[int]) -> Any:
    """Freeze exactly the refs that `_thaw` made."""
    return _map_cells(lambda v: jax.freeze(v) if id(v) in made else v, model)
