"""State cells: `Buffer` and its kinds, how a layer reads and writes them, and the
filters that select cells, parameters and arrays."""

from __future__ import annotations

import contextlib
import contextvars
import operator
import re
import weakref
from collections.abc import Hashable, Iterator
from typing import Any, no_type_check

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ._compat import (
    REF_TYPES,
    Tracer,
    array_copy,
    declared_weak,
    is_batched,
    is_concrete_ref,
    is_escaped_ref_error,
    placed_as,
    ref_buffer,
    ref_is_consumed,
    ref_value_copy,
    set_ref_buffer,
    unbatched,
    under_trace,
)
from ._errors import (
    EqxStateError,
    StaleModelError,
    StateError,
    StateIndexError,
    StateTypeError,
    StateValueError,
    StateWriteError,
    is_whole,
    stale_message,
)


REF_KIND = "no_grad_no_remat"
# Every ref eqx_state makes has this kind. `no_grad_no_remat` refs accept writes of
# differentiated values (they are not differentiated through) and are written once
# under `jax.checkpoint` + `grad`; plain refs raise on the first and silently write
# twice on the second.
_REF_KIND = REF_KIND  # the old private name, kept for modules that import it


def _is_ref(x: Any) -> bool:
    return isinstance(x, REF_TYPES)


def _to_value(x: Any) -> Any:
    if _is_ref(x) or isinstance(x, Tracer):
        return x
    if isinstance(x, jax.Array):
        # a copy: a step donates the cell's array, which must not delete the caller's
        x = jnp.array(x, copy=True)
    x = host_value(
        x,
        "A state cell's initial value",
        "Give an array, or a number, that JAX holds as it is.",
        StateValueError,
        StateTypeError,
    )
    if getattr(x, "weak_type", False):
        x = jnp.asarray(x, dtype=x.dtype)  # a cell has a definite dtype
    return x


# The axis names of the `es.vmap` calls being traced, innermost last (`_vmap.py`
# sets it): a write that fails under one of them gets advice about `es.vmap`.
MAPPED_AXES: contextvars.ContextVar[tuple[Hashable | None, ...]] = (
    contextvars.ContextVar("eqx_state_mapped_axes", default=())
)


_object_getattribute = object.__getattribute__
_module_getattribute = eqx.Module.__getattribute__
_PLAIN_DICT_READ: dict[type, bool] = {}


class _LayerBase(eqx.Module):
    """The base of the library's layers: an `eqx.Module` that is cheaper to flatten.

    Equinox's generated flatten reads a module's `__dict__` twice, through
    `Module.__getattribute__` (a Python hook that turns bound methods into pytrees);
    a step flattens and rebuilds every layer of the model and of the optimizer's
    model-shaped state on every call. For `__dict__` that hook returns what
    `object.__getattribute__` returns (a magic name is never bound), so a layer
    reads it directly, unless a class below this one in the method resolution order
    has a `__getattribute__` of its own (a user's mixin): then, as for every other
    name, the read goes down the chain (`super()`), so `layer.method` is still
    Equinox's `BoundMethod` and every hook sees what it saw before.
    """

    @no_type_check  # called for every attribute read: keep it unwrapped in tests
    def __getattribute__(self, name: str, /) -> Any:
        if name == "__dict__":
            cls = type(self)
            plain = _PLAIN_DICT_READ.get(cls)
            if plain is None:
                plain = _PLAIN_DICT_READ[cls] = _plain_dict_read(cls)
            if plain:
                return _object_getattribute(self, name)
        return super().__getattribute__(name)


def _plain_dict_read(cls: type) -> bool:
    """Whether below `_LayerBase` in `cls`'s method resolution order only Equinox's
    and `object`'s `__getattribute__` are defined."""
    mro = cls.__mro__
    return all(
        c.__dict__.get("__getattribute__")
        in (None, _module_getattribute, _object_getattribute)
        for c in mro[mro.index(_LayerBase) + 1 :]
    )


class Buffer(eqx.Module):
    """A state cell: one array (value mode) or one `jax.Ref` (ref mode) inside a model.

    Buffers are how a layer keeps state that is not a trainable parameter: running
    statistics, counters, metric accumulators, RNG keys, caches. They are ordinary
    pytree nodes, so a model that holds them is still an ordinary Equinox module.

    * Read with `buf[...]` (or `buf.value` for the raw leaf).
    * Write with `buf[...] = new` (or any index: `buf[i] = row`). A write never
      carries a gradient, and keeps the cell's dtype and shape. In value mode a write
      is only possible inside [`eqx_state.make_step`][] or [`eqx_state.apply`][]; in
      ref mode ([`eqx_state.to_refs`][]) anywhere.

    A cell is a value like any other leaf of a pytree: the same cell object placed at
    two positions of a model is two independent states (as the same layer at two
    places is two layers in Equinox). To share one state between layers, declare it
    with [`eqx.nn.Shared`](https://docs.kidger.site/equinox/api/nn/shared/).

    Subclasses name the kind of state so that filters can select it:
    [`eqx_state.BatchStat`][], [`eqx_state.CounterState`][],
    [`eqx_state.MetricState`][], [`eqx_state.Cache`][], [`eqx_state.RngState`][],
    [`eqx_state.AverageState`][], [`eqx_state.PowerIterationState`][].

    **Arguments:**

    - `value`: the initial value; anything `jnp.asarray` accepts. JAX arrays are
        copied (a step donates its cells, which must not consume the caller's array).
    - `init`: the fill a reset writes back (a Python scalar, broadcast to the cell's
        shape), or `None` for a cell with no initial value to go back to.

    **Example:**

    ```python
    import jax.numpy as jnp
    import eqx_state as es

    buf = es.Buffer(jnp.zeros(3))
    assert buf[...].shape == (3,)
    ```
    """

    value: Any = eqx.field(converter=_to_value)
    init: bool | int | float | complex | None = eqx.field(
        default=None, static=True, kw_only=True
    )
    # Ref mode only: a zero-size array of shape `(*value.shape, 0)`. It is an array to
    # Equinox, so filtered transformations slice it along with the model's arrays,
    # while a ref they treat as static is not sliced: a shape mismatch between the two
    # says that a layer sees a ref its transformation did not slice (see `_check`).
    witness: Any = eqx.field(default=None, kw_only=True, repr=False)

    # A cell has no methods to bind (Equinox's `__getattribute__` turns bound methods
    # into pytrees); plain attribute access makes flattening a model, which every
    # step does once per cell, measurably cheaper.
    __getattribute__ = object.__getattribute__

    @property
    def shape(self) -> tuple[int, ...]:
        if _is_ref(self.value):
            _check_ref(self)
        return tuple(self.value.shape)

    @property
    def dtype(self) -> Any:
        return self.value.dtype

    def __getitem__(self, idx: Any) -> jax.Array:
        v = self.value
        if _is_ref(v):
            _check_ref(self)
        else:
            check_live(v, describe(self))
        if idx is not Ellipsis:
            index_shape(self, idx)
        elif is_concrete_ref(v) and not under_trace():
            # the value JAX's eager read gives, without committing the ref's
            # array to its device (see `_eager_whole_write`)
            copy = ref_value_copy(v)
            if copy is not None:
                return copy
        try:
            return v[idx]
        except jax.errors.UnexpectedTracerError as e:
            if _escaped(v, e):  # not a leaked index: JAX's error names that
                raise StateError(leaked_message(describe(self), v)) from e
            raise

    def __setitem__(self, idx: Any, new: Any) -> None:
        _write(self, idx, new)

    # A cell is not its value (PyTorch's buffers are tensors): a truth test, a
    # comparison with a number or an array, or a NumPy conversion would silently
    # use the cell object (`bn.num_batches_tracked == 0` was False,
    # `bool(counter.count)` True, `np.asarray(cell)` an object array), so they say
    # how to read the value. Anything else (another cell, None, a string) compares
    # as Equinox compares modules. No `__jax_array__`: Equinox's filters read its
    # presence as "array-like" (`eqx.is_array_like`).

    def __bool__(self) -> bool:
        raise StateTypeError(
            _not_the_value(self, "The truth value of", "bool(cell[...])")
        )

    def __eq__(self, other: object, /) -> Any:  # pyright: ignore[reportIncompatibleMethodOverride]
        if isinstance(other, _VALUES):
            raise StateTypeError(
                _not_the_value(self, "A comparison of", "cell[...] == x")
            )
        return eqx.Module.__eq__(self, other)

    def __ne__(self, other: object, /) -> Any:  # pyright: ignore[reportIncompatibleMethodOverride]
        if isinstance(other, _VALUES):
            raise StateTypeError(
                _not_the_value(self, "A comparison of", "cell[...] != x")
            )
        return not eqx.Module.__eq__(self, other)

    __hash__ = eqx.Module.__hash__

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        raise StateTypeError(
            _not_the_value(self, "A NumPy conversion of", "np.asarray(cell[...])")
        )


# What a cell compared with `==` is refused for: a number or an array (what its
# value would have been compared with); anything else compares as Equinox's
# modules do (False for another kind of object).
_VALUES = (bool, int, float, complex, np.generic, np.ndarray, jax.Array)


def _not_the_value(buf: Buffer, what: str, fix: str) -> str:
    return (
        f"{what} a state cell (the {describe(buf)}) uses the cell object, not its "
        f"value: read the value with `cell[...]`, e.g. `{fix}`."
    )


class BatchStat(Buffer):
    """A running statistic (BatchNorm's running mean/var, RunningNorm's moments)."""


class CounterState(Buffer):
    """An integer count (an [`eqx_state.nn.Counter`][]'s). BatchNorm's
    `num_batches_tracked` is a [`eqx_state.BatchStat`][], not a count of this kind:
    resetting the batch statistics resets it too, as PyTorch's
    `reset_running_stats` does."""


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


class RecordState(Buffer):
    """A recording of a model's intermediates: the statistics of an
    [`eqx_state.nn.Record`][] and the values of an [`eqx_state.nn.Capture`][].
    Not a [`eqx_state.MetricState`][]: `es.reset(model)` (metrics) leaves recordings
    alone, `es.reset(model, es.RecordState)` starts them over."""


# The paths of the cells of the model a step or an apply is running, by their ref:
# refs are mutable objects, so their identity is what names a cell during the call.
_PATHS: contextvars.ContextVar[dict[int, str] | None] = contextvars.ContextVar(
    "eqx_state_cell_paths", default=None
)


# Where a ref-mode cell was when `es.to_refs` last converted a model holding it:
# its path in that model, by the cell's ref (a mutable object: its identity names
# it; the entry goes with the ref). Outside a step or an apply (an eager call of a
# ref-mode model) errors name a cell by it, as its path *then*: a model rebuilt
# after (layers swapped, embedded in another) is not seen.
_ORIGINS: dict[int, tuple[weakref.ref, str]] = {}


def _forget_origin(key: int, dead: weakref.ref) -> None:
    entry = _ORIGINS.get(key)
    if entry is not None and entry[0] is dead:
        del _ORIGINS[key]


def remember_path(ref: Any, path: str | None) -> None:
    """Record `path` as where `ref`'s cell is (`es.to_refs`); nothing for a ref
    inside a trace, or without a path."""
    if path is None or isinstance(ref, Tracer) or not _is_ref(ref):
        return
    key = id(ref)
    _ORIGINS[key] = (weakref.ref(ref, lambda w: _forget_origin(key, w)), path)


def new_cell_ref(
    value: Any, *, kind: Any, path: str | None = None, like: Any = None
) -> Any:
    """A ref-mode cell's new ref holding `value`: made eagerly by `es.to_refs`
    (`path`: the cell's path in the model it converts) or by a load into a
    ref-mode model (`like`: the ref it replaces, whose recorded path the new one
    keeps). The ref's array is where `value` is, committed as `value` is (JAX's
    eager `new_ref` copies an uncommitted array to the default device: a model
    made under `jax.default_device` had its cells moved off its device)."""
    if isinstance(value, jax.Array) and not isinstance(value, Tracer):
        with placed_as(value):
            ref = jax.new_ref(value, kind=kind)
    else:
        ref = jax.new_ref(value, kind=kind)
    remember_path(ref, path if path is not None or like is None else origin_path(like))
    return ref


def origin_path(ref: Any) -> str | None:
    """The path recorded for `ref` (`remember_path`), or None."""
    entry = _ORIGINS.get(id(ref))
    return entry[1] if entry is not None and entry[0]() is ref else None


def cell_path(value: Any) -> str | None:
    """How errors name the cell holding `value`: inside a step or an apply, its
    path in the call's model ("`model.blocks[0].bn.running_mean` (value mode)");
    elsewhere, for a ref-mode cell, its path when `es.to_refs` last converted a
    model holding it (`remember_path`)."""
    path = (_PATHS.get() or {}).get(id(value))
    if path is None and (origin := origin_path(value)) is not None:
        path = f"`{origin}` (ref mode; its path when `es.to_refs` last converted its model)"
    return path


@contextlib.contextmanager
def named_cells(paths: dict[int, str]) -> Iterator[None]:
    """Within the block, errors about the cells whose refs are in `paths` (by `id`)
    name their path in the model."""
    token = _PATHS.set({**(_PATHS.get() or {}), **paths})
    try:
        yield
    except EqxStateError as e:
        _name_the_layer(e)
        raise
    finally:
        _PATHS.reset(token)


def _name_the_layer(e: EqxStateError) -> None:
    """Prefix the message of `e`, raised inside a step or an apply, with the path
    of the innermost layer it came from (`In `model.metrics['val_f1']` (F1): ...`),
    so that of two layers of one kind the message says which one failed: found
    from the traceback, as the first method's `self` that holds cells of the
    model. Done once per error; a message that names that path (a cell's, or
    BatchNorm's own `at ...`) is left as it is. The one place every layer's and
    metric's errors get their path, instead of each message computing it."""
    if getattr(e, "_eqx_state_named", False) or not (
        e.args and isinstance(e.args[0], str)
    ):
        return
    e._eqx_state_named = True  # pyright: ignore[reportAttributeAccessIssue]
    # the error's own frames, innermost first; then its cause's (an error that
    # `_cond_note` converts is raised where that note is, away from the layer)
    frames: list[Any] = []
    for err in (e, e.__cause__):
        inner = []
        tb = getattr(err, "__traceback__", None)
        while tb is not None:
            inner.append(tb.tb_frame)
            tb = tb.tb_next
        frames += reversed(inner)
    message = e.args[0]
    for frame in frames:
        try:  # whatever a frame's `self` does, the user's error stays the error
            layer = frame.f_locals.get("self")
            if layer is None or isinstance(layer, Buffer):  # a cell names itself
                continue
            where = layer_path(layer)
        except Exception:
            continue
        if where.startswith(" at `"):
            path = where[len(" at `") : -1]
            # named already when the path appears as a whole: followed by the
            # end of the name, a field or an index (`model.a` is not in `model.ab`)
            if not re.search(f"`{re.escape(path)}(?=[`.\\[ ])", message):
                name = type(layer).__name__
                e.args = (f"In `{path}` ({name}): {message}", *e.args[1:])
            return


def describe(buf: Buffer) -> str:
    """How errors name a cell: its kind, shape and, where known (`cell_path`: inside
    a step or an apply, or a ref-mode cell `es.to_refs` recorded), its path in the
    model (`model.blocks[0].bn.running_mean`)."""
    shape = tuple(getattr(buf.value, "shape", ()))
    path = cell_path(buf.value)
    where = f" at {path}" if path else ""
    return f"{type(buf).__name__} cell{where} (shape {shape})"


def check_cell_dtype(
    owner: str, layer: Any, buf: Any, kind: type, min_bits: int = 0
) -> None:
    """Refuse a layer's cell whose dtype the layer cannot keep its state in: not of
    `kind` (`jnp.floating`, `jnp.integer`) or narrower than `min_bits`. A layer
    casts its updates into its cells' dtypes, so a cell replaced by one of another
    dtype (`eqx.tree_at`, a hand-edited checkpoint) would silently truncate them (an
    int32 running mean stays 0, an int8 count wraps at 127). Decided from dtypes
    while tracing: nothing is staged."""
    if not isinstance(buf, Buffer):  # not a cell at all: say which field
        from ._modes import check_cell_fields  # (an error path: no import cycle)

        check_cell_fields(layer, root=owner)
    dtype = jnp.dtype(buf.dtype)
    info = jnp.finfo if kind is jnp.floating else jnp.iinfo
    if jnp.issubdtype(dtype, kind) and info(dtype).bits >= min_bits:
        return
    name = "a real floating" if kind is jnp.floating else "an integer"
    field = next(
        (
            k if v is buf else f"{k}[{[x is buf for x in v].index(True)}]"
            for k, v in vars(layer).items()
            if v is buf or isinstance(v, tuple) and any(x is buf for x in v)
        ),
        "?",
    )
    raise StateTypeError(
        f"{owner}: its `{field}` ({describe(buf)}) holds {dtype}, "
        "but it keeps "
        f"this state in {name} dtype"
        + (f" of at least {min_bits} bits" if min_bits else "")
        + ": its values would be truncated or wrap around. The cell was replaced "
        "or cast after the layer was built (`eqx.tree_at`, a checkpoint of another "
        "dtype, or a model cast wholesale, `jax.tree.map(lambda x: "
        "x.astype(jnp.bfloat16), model)`); rebuild the layer, or put back a cell "
        "of the dtype the layer made. To cast a model's parameters only, hand "
        "each cell to the function whole: `jax.tree.map(lambda x: "
        "x.astype(jnp.bfloat16) if eqx.is_inexact_array(x) else x, model, "
        "is_leaf=es.is_state)`."
    )


def layer_path(layer: Any) -> str:
    """How errors name a layer that holds cells: inside a step or an apply, ` at
    `path`` (its path in the model, found from one of its cells'); elsewhere ''."""
    paths = _PATHS.get()
    if not paths:
        return ""
    for name, value in vars(layer).items():
        if isinstance(value, Buffer) and id(value.value) in paths:
            # "`model.blocks[0].bn.running_mean` (value mode)"
            path = paths[id(value.value)]
            path = path.split("`")[1] if path.count("`") >= 2 else path
            path = path.removesuffix("." + name)
            if path == "model":
                return " (the model itself)"
            return f" at `{path}`"
    return ""


def is_consumed(x: Any) -> bool:
    """Whether `x` is an array or a ref whose buffer a donating call consumed (also
    when an eager `vmap` maps it: the array its batch tracer wraps)."""
    x = unbatched(x)
    if isinstance(x, Tracer):
        return False
    return (isinstance(x, jax.Array) and x.is_deleted()) or (
        _is_ref(x) and ref_is_consumed(x)
    )


def check_live(x: Any, what: str, where: str | None = None) -> None:
    """The one check that `x` (an array or a ref) was not consumed by donation:
    `StaleModelError` naming `what` (and the leaf's path, `where`) if it was."""
    if is_consumed(x):
        raise StaleModelError(stale_message(what, where))


def _check_ref(buf: Buffer) -> None:
    """Refuse to use a ref that a filtered transformation left unsliced, or one
    whose array was consumed."""
    ref, witness = buf.value, buf.witness
    # A ref with more leading axes than its witness was not sliced where the
    # model's arrays were. (Fewer is harmless: the ref was mapped and the witness
    # not, e.g. by `in_axes` written for the model at rest.)
    if witness is not None and ref.ndim > witness.ndim - 1:
        raise StateError(
            f"The {describe(buf)} holds a ref of shape {tuple(ref.shape)}, but the "
            f"layer was handed a slice of shape {tuple(witness.shape[:-1])}: a "
            "transformation sliced or batched the model's arrays but not its state "
            "refs, which Equinox's filters treat as static (`eqx.is_array` is False "
            "for a `jax.Ref`). The usual cause is scan-over-layers or "
            "`eqx.filter_vmap` with `eqx.partition(model, eqx.is_array)` (or "
            "`eqx.is_inexact_array`); use "
            "`eqx.partition(model, es.is_array_or_ref)` (arrays *and* refs) instead, so that "
            "each layer gets its own slice of every state ref. (If you replaced the "
            "cell's ref with `eqx.tree_at`, replace the whole cell instead.)"
        )
    check_live(ref, describe(buf))


def _write(buf: Buffer, idx: Any, new: Any) -> None:
    cell = buf.value
    if not _is_ref(cell) and _PATHS.get() is not None:
        raise StateWriteError(
            f"A layer tried to write the {describe(buf)}, which holds an array, not "
            "a ref, although a step or `es.apply` is running: the cell is not one "
            "of the cells that call was given. Either it was copied out of them "
            "(`jax.tree.map(lambda a: a[i], stack)` indexing stacked layers reads "
            "a copy of every ref: run stacked layers with `lax.scan` over "
            "`eqx.partition(stack, es.is_array_or_ref)`, which gives each layer its slice "
            "of every ref), or it belongs to a model that is not the call's model "
            "(a closure, or an extra argument: only the model argument's cells are "
            "writable; pass both, e.g. `es.apply(fn, (model_a, model_b), x)`), or "
            "the layer was made "
            "inside the call (build it before and pass it in the model). The write "
            "would be lost."
        )
    if not _is_ref(cell):
        raise StateWriteError(
            f"A layer tried to write the {describe(buf)}, but the model is in value "
            "mode and no step is running, so the cell holds an immutable array and "
            "the write would be lost. Do one of:\n"
            "  * run the call through `eqx_state.make_step` (training) or "
            "`out, model = eqx_state.apply(fn, model, *args)` (any state-writing "
            "forward pass, e.g. evaluation loops or BatchNorm recalibration);\n"
            "  * switch the model to ref mode with `model = eqx_state.to_refs(model)`, "
            "where cells are updated in place;\n"
            "  * or, if you meant to evaluate, call `eqx.nn.inference_mode(model)` "
            "first so that layers do not write state."
        )
    _check_ref(buf)
    new = _cast_for(buf, _write_value(buf, new))
    if idx is Ellipsis:
        if tuple(new.shape) != tuple(cell.shape):
            raise StateWriteError(
                f"Cannot write a value of shape {tuple(new.shape)} into the "
                f"{describe(buf)}: a whole-cell write `buf[...] = v` needs the same "
                "shape (no broadcasting). Reshape the value, or write part of the "
                "cell with an index, e.g. `buf[i] = row`."
            )
    else:
        part = index_shape(buf, idx)
        if part is not None and tuple(new.shape) != part:
            raise StateWriteError(
                f"Cannot write a value of shape {tuple(new.shape)} into "
                f"`[{_index_repr(idx)}]` of the {describe(buf)}: that part has shape "
                f"{part}, and a write needs the same shape (no broadcasting). "
                "Reshape or broadcast the value first (`jnp.broadcast_to(v, shape)`)."
            )
    if idx is Ellipsis and _eager_whole_write(cell, new):
        return
    try:
        # a write carries no gradient; an integer, boolean or key value has none
        # to stop (one staged operation less per count write)
        cell[idx] = (
            jax.lax.stop_gradient(new)
            if jnp.issubdtype(new.dtype, jnp.inexact)
            else new
        )
    except jax.errors.UnexpectedTracerError as e:
        if _escaped(cell, e):  # not a leaked value: JAX's error names that
            raise StateError(leaked_message(describe(buf), cell)) from e
        raise
    except Exception as e:
        # JAX refuses any write into a ref that an enclosing `vmap` does not batch
        # (even of an unbatched value) with a bare `Exception`; recognise the case by
        # that type and the ref not being batched, not by the message's text.
        if type(e) is Exception and not is_batched(cell):
            raise StateWriteError(unbatched_message(buf, e)) from e
        raise


def _eager_whole_write(ref: Any, new: Any) -> bool:
    """Write `new` into a concrete ref outside any trace by giving the ref a copy of
    it (in the ref's declared type, where the ref's array lives); whether it did.
    JAX's eager reads and writes of a ref run a program that takes the ref, and
    such a program commits the ref's array to its device (JAX counts a ref as
    committed). `jax.jit` compiles separately for committed and uncommitted inputs,
    and a committed input costs each call more (~0.1 us an array): a ref-mode model
    read or written between steps would lose the uncommitted arrays of a
    value-mode one. Only for a value of the array's shape and dtype, placed as the
    array is (JAX's write would move it there), or uncommitted as the array is (a
    value made on the default device for a model made under `jax.default_device`:
    copied onto the array's device). The copy is a new buffer, so a
    step that donates the ref's array never consumes the caller's `new`."""
    if not (
        is_concrete_ref(ref)
        and isinstance(new, jax.Array)
        and not isinstance(new, Tracer)
        and not under_trace()
    ):
        return False
    old = ref_buffer(ref)
    if new.shape != old.shape or new.dtype != old.dtype:
        return False
    if new.committed or old.committed:
        if new.committed != old.committed or new.sharding != old.sharding:
            return False
        on = None
    else:  # both uncommitted: copied onto the ref's device (where JAX would run)
        on = old
    copy = array_copy(new, declared_weak(ref), on)
    if copy is None:
        return False
    set_ref_buffer(ref, copy)
    return True


def _escaped(ref: Any, e: Exception) -> bool:
    """Whether JAX's `UnexpectedTracerError` `e` is about the cell's ref (a tracer
    that escaped the transformation that made or mapped it), not about an index
    or value given with it: a tracer used where no transformation traces, or
    JAX's error names a ref."""
    return isinstance(ref, Tracer) and (not under_trace() or is_escaped_ref_error(e))


def leaked_message(what: str, ref: Any) -> str:
    """The one message for a cell whose ref escaped the transformation that made
    or mapped it (a model returned by `eqx.filter_vmap` of a ref-mode step, or by
    a jitted function that called `es.to_refs`)."""
    if not is_batched(ref):
        return (
            f"The {what} holds a ref that escaped the transformation that made it: "
            "`es.to_refs` (or `jax.new_ref`) ran inside a traced function "
            "(`jax.jit`, `eqx.filter_jit`, a scan body...), whose refs exist only "
            "while it is traced, and the model was returned from it. Call "
            "`es.to_refs` once, outside, on the model before passing it in, or "
            "return `es.freeze(model)` (its values) from the traced function."
        )
    return (
        f"The {what} holds a ref that escaped the transformation that mapped it: "
        "this model was returned by a `vmap` (typically `eqx.filter_vmap` of a "
        "ref-mode step or `es.apply`) that could not return its state refs, "
        "because Equinox's filters treat a ref as static. The call did run: its "
        "new arrays are in the returned model and its state writes in the refs of "
        "the model passed in (whose arrays a step consumed). Put them together "
        "with `model = eqx.combine(eqx.filter(returned, eqx.is_array), "
        "eqx.filter(passed, lambda x: isinstance(x, jax.Ref)))`, and map such "
        "calls with `jax.vmap` over `eqx.partition(model, es.is_array_or_ref)`, "
        "returning `eqx.filter(model, es.is_array_or_ref)`: `jax.vmap` returns "
        "the refs themselves."
    )


def unbatched_message(buf: Buffer | str, e: Exception) -> str:
    """The one message for a write into a ref that an enclosing `vmap` does not map
    (`buf`: the cell, or a description of the cells when JAX does not say which)."""
    return _unbatched_advice(buf) + f" (JAX's message: {e})"


def _unbatched_advice(buf: Buffer | str) -> str:
    what = buf if isinstance(buf, str) else describe(buf)
    if MAPPED_AXES.get():
        return (
            f"The {what} was written inside `eqx_state.vmap`, but the cell "
            "was not given to `es.vmap`: it was "
            "reached through a closure. `es.vmap` gives batched shadows only to the "
            "cells it can see: those inside `fn` when `fn` is a module (pass the "
            "model itself, `es.vmap(model, ...)`), and those in arguments mapped with "
            "`in_axes=None`, e.g. `es.vmap(lambda m, x: m.update(x), in_axes=(None, "
            "0), axis_name=...)(metric, xs)`."
        )
    return (
        f"The {what} was written inside `jax.vmap`, but the cell itself is "
        "not batched: JAX cannot write into a ref that the vmap does not map, even "
        "a value that is the same for every example. Either map per-example calls with "
        "`eqx_state.vmap(model, axis_name=...)` (with layers that reduce over that "
        "axis, e.g. `BatchNorm(..., axis_name=...)`), call the layer on the whole "
        "batch instead, or vmap over an ensemble of models whose state has the same "
        "leading axis (`eqx.filter_vmap` of the step). (`jax.jacfwd` and "
        "`jax.hessian` map with `vmap` too: differentiate a function that writes "
        "state with `jax.jacrev`, or keep the write out of the differentiated "
        "function.)"
    )


def index_shape(buf: Buffer, idx: Any) -> tuple[int, ...] | None:
    """The shape of `buf[idx]` by NumPy's indexing rules, which a cell follows for
    the parts of an index known while tracing: an integer out of its axis's range
    raises a `StateIndexError` (JAX's arrays clamp such a read and drop such a
    write; a ref would land it in another slot); a float a `StateTypeError`, and
    in a cell that holds a ref (ref mode, or any write) a boolean or `None`,
    which a ref does not take (a value-mode read takes them, as `jnp` does).
    Integer arrays that are traced are checked for their shape only; any other
    part (a list, a string) is a `StateTypeError`. `None` when the index holds a
    part NumPy cannot stand in for (a traced slice bound): JAX then has the last
    word."""
    shape = tuple(buf.value.shape)
    if not all(isinstance(d, int) for d in shape):
        return None  # a symbolic shape (`jax.export`): JAX checks the index
    ref = _is_ref(buf.value)
    parts = idx if isinstance(idx, tuple) else (idx,)
    probe: list[Any] = []
    for p in parts:
        boolean = isinstance(p, bool | np.bool_) or (
            hasattr(p, "dtype") and jnp.issubdtype(p.dtype, jnp.bool_)
        )
        if not ref and (p is None or boolean):
            # an array's read takes them, as `jnp` does (value mode, no step)
            if isinstance(p, Tracer):
                return None
            probe.append(np.asarray(p) if hasattr(p, "dtype") else p)
            continue
        if p is None or boolean:
            # a ref takes neither (it reads a boolean mask as the integers 0 and 1)
            raise StateTypeError(
                f"Cannot index the {describe(buf)} with `[{_index_repr(idx)}]`: a "
                "cell takes integers, slices, `...` and integer arrays, not `None` "
                "(a new axis: index, then add it, `cell[i][None]`) or booleans (a "
                "mask: `cell[...] = jnp.where(mask, new, cell[...])`)."
            )
        if p is Ellipsis or is_whole(p):
            probe.append(p)
        elif isinstance(p, slice):
            if any(isinstance(b, Tracer) for b in (p.start, p.stop, p.step)):
                return None
            if not all(b is None or _is_index(b) for b in (p.start, p.stop, p.step)):
                raise StateTypeError(
                    f"Cannot index the {describe(buf)} with `[{_index_repr(idx)}]`: "
                    "a slice's bounds are integers or None."
                )
            part = slice(*(_bound(b) for b in (p.start, p.stop, p.step)))
            if part.step == 0:
                raise StateValueError(
                    f"Cannot index the {describe(buf)} with `[{_index_repr(idx)}]`: "
                    "a slice step cannot be zero."
                )
            if ref and part.step is not None and part.step < 1:
                raise StateValueError(
                    f"Cannot index the {describe(buf)} with `[{_index_repr(idx)}]`: "
                    "a cell that holds a ref (ref mode, or any write) takes slices "
                    "with a positive step only. Read the cell and reverse the "
                    "array, e.g. `cell[...][::-1]`; write `cell[...] = new[::-1]`."
                )
            probe.append(part)
        elif (
            isinstance(p, list)
            and not ref
            and isinstance(idx, tuple)
            and all(_is_index(e) and not isinstance(e, bool | np.bool_) for e in p)
        ):
            # a list inside a tuple is an index array to `jnp` (a read of an array,
            # value mode, no step); a ref, and `jnp` at the top level, refuse it
            probe.append(np.asarray([operator.index(e) for e in p], np.intp))
        elif isinstance(p, float | complex) or (
            hasattr(p, "dtype") and not jnp.issubdtype(p.dtype, jnp.integer)  # pyright: ignore
        ):
            raise StateTypeError(
                f"Cannot index the {describe(buf)} with `[{_index_repr(idx)}]`: "
                "indices are integers, slices, `...` or integer arrays "
                f"(got {type(p).__name__}"
                + (
                    f" of dtype {getattr(p, 'dtype', '')}"
                    if hasattr(p, "dtype")
                    else ""
                )
                + "). Convert it, e.g. `i.astype(jnp.int32)`."
            )
        elif hasattr(p, "dtype"):  # an integer array (or scalar)
            # a traced index stands in by its shape (every position in range)
            probe.append(
                np.zeros(np.shape(p), np.intp)
                if isinstance(p, Tracer)
                else np.asarray(p)
            )
        else:
            # a list is an index array to NumPy, which `jnp` and a ref refuse
            raise StateTypeError(
                f"Cannot index the {describe(buf)} with `[{_index_repr(idx)}]`: "
                "indices are integers, slices, `...` or integer arrays (got "
                f"{type(p).__name__}"
                + (
                    f"; for several positions pass an array, `{_short(p)}`)."
                    if isinstance(p, list | range)
                    else ")."
                )
            )
    # a view of the cell's shape that holds no memory
    view = np.broadcast_to(np.zeros((), np.bool_), shape)
    try:
        return tuple(view[tuple(probe)].shape)
    except IndexError as e:
        raise StateIndexError(
            f"Index `[{_index_repr(idx)}]` does not fit the {describe(buf)}: {e}. A "
            "cell refuses an index out of range as NumPy and PyTorch do (an integer "
            "index of an axis of length n lies in [-n, n))."
        ) from None


def _is_index(b: Any) -> bool:
    """Whether `b` is a whole number an index takes: a Python or NumPy integer, or
    a concrete 0-d integer array (`jnp.argmax(...)`), as NumPy's `operator.index`."""
    if isinstance(b, bool | np.bool_) or (
        hasattr(b, "dtype") and not jnp.issubdtype(b.dtype, jnp.integer)
    ):
        return isinstance(b, bool | np.bool_)  # NumPy takes True as 1 in a slice
    try:
        operator.index(b)
    except TypeError:
        return False
    return True


def _bound(b: Any) -> Any:
    return None if b is None else operator.index(b)


def _short(p: Any) -> str:
    """How a message shows a list or a range index as an array."""
    if isinstance(p, range):
        return f"jnp.arange({p.start}, {p.stop}, {p.step})"
    text = repr(p[:8])[:-1] + (", ...]" if len(p) > 8 else "]")
    return f"jnp.asarray({text})"


def _index_repr(idx: Any) -> str:
    parts = idx if isinstance(idx, tuple) else (idx,)

    def one(p: Any) -> str:
        if p is Ellipsis:
            return "..."
        if isinstance(p, slice):
            bounds = (p.start, p.stop) if p.step is None else (p.start, p.stop, p.step)
            return ":".join("" if b is None else repr(b) for b in bounds)
        if isinstance(p, jax.Array | np.ndarray) and p.ndim:
            return f"<{p.dtype} array {tuple(p.shape)}>"
        return repr(p)

    return ", ".join(map(one, parts))


def _write_value(buf: Buffer, new: Any) -> Any:
    """The value a write gives, as a JAX array (`host_value`), or an error naming
    the cell."""
    dtype = buf.value.dtype
    if _is_ref(new):  # `a[...] = b.value` of a ref-mode cell `b`: its ref, not a value
        raise StateWriteError(
            f"A write into the {describe(buf)} got a ref (another cell's `.value`, "
            "which is a ref in ref mode and while a step or `es.apply` runs, or a "
            "`jax.new_ref`): a cell takes a value. Read the other cell first: "
            "`cell[...] = other[...]`."
        )
    return host_value(
        new,
        f"A write into the {describe(buf)}",
        f"A cell takes an array (or a number) of its dtype {dtype}, in its range.",
        StateWriteError,
    )


def host_value(
    x: Any,
    what: str,
    wants: str,
    error: type[Exception],
    type_error: type[Exception] | None = None,
    inf_ok: bool = False,
) -> jax.Array:
    """`x` as a JAX array (a JAX array or tracer as it is), or an error saying `what`
    got it and what it `wants`: `type_error` (default `error`) for a value that is
    not numeric (None, a string), `error` for a host value (a Python or NumPy number or array) that JAX's conversion
    would change, not just round: with 64-bit types off JAX keeps NumPy's 64-bit
    values in 32 bits, wrapping an integer that does not fit (`np.int64(2**33 + 5)`
    becomes 5) and turning a float beyond float32's range into `inf`. With
    `inf_ok`, that float is taken as the `inf` it becomes: for inputs only
    compared or ranked (scores, a histogram's values), where `inf` keeps its order.
    A NumPy masked array is refused (NumPy's conversion drops the mask, JAX's
    refuses it). The one conversion of user values that state is written from
    (cell writes, initial values, metric inputs, `KVCache.truncate`)."""
    if isinstance(x, jax.Array | Tracer) or _is_ref(x):
        return x
    if isinstance(x, list | tuple) and any(
        isinstance(leaf, jax.Array | Tracer) or _is_ref(leaf)
        for leaf in jax.tree_util.tree_leaves(x)
    ):  # JAX values in a list (tracers, keys): `jnp.asarray` stacks them on device
        try:
            return jnp.asarray(x)
        except (TypeError, ValueError) as e:
            raise (type_error or error)(
                f"{what} got a {type(x).__name__} JAX cannot stack into an array: "
                f"{e}. {wants}"
            ) from e
    if isinstance(x, np.ma.MaskedArray):  # np.asarray drops the mask; JAX refuses
        raise (type_error or error)(
            f"{what} got a NumPy masked array: the data under its mask would be "
            f"taken as values. Fill it first (`x.filled(value)`). {wants}"
        )
    try:
        host = np.asarray(x)
    except Exception as e:  # a ragged list, an object refusing conversion
        raise (type_error or error)(
            f"{what} got {x!r:.80}, which is not an array: {e}. {wants}"
        ) from e
    if host.dtype.kind not in "biufcV":
        raise (type_error or error)(
            f"{what} got {x!r:.80}: it is not a number or an array of numbers (or "
            f"not one JAX holds: a Python int beyond 64 bits). {wants}"
        )
    kept = jax.dtypes.canonicalize_dtype(host.dtype)
    if kept != host.dtype and host.dtype.kind in "iufc":
        with np.errstate(over="ignore", invalid="ignore"):
            narrowed = host.astype(kept)
        if host.dtype.kind in "fc":
            changed = bool(np.any(np.isfinite(host) & ~np.isfinite(narrowed)))
        else:
            changed = not np.array_equal(narrowed.astype(host.dtype), host)
        if changed and inf_ok and host.dtype.kind == "f":
            return jnp.asarray(narrowed)  # the infs, cast here without a warning
        if changed:
            given = (
                "a Python number"
                if isinstance(x, int | float) and not isinstance(x, np.generic)
                else f"a value of dtype {host.dtype.name}"
            )
            raise error(
                f"{what} got {given} that does not fit {kept.name}, the "
                "type JAX keeps it in (64-bit types are off): it would become "
                + (
                    "another number (wrapped around)"
                    if host.dtype.kind in "iu"
                    else "inf"
                )
                + f". {wants}"
            )
    return jnp.asarray(x)


def _cast_for(buf: Buffer, new: jax.Array) -> jax.Array:
    """`new` in the cell's dtype, if that loses nothing; otherwise an error.

    A strongly-typed value must have the cell's dtype. A weakly-typed one (a Python
    scalar, or arithmetic between a cell and a Python scalar) is cast if it is of the
    same kind (a float into a float cell) or a whole number into an integer or float
    cell that holds it exactly; a float written into an integer cell, or -1 into an
    unsigned one, is an error rather than a silent truncation."""
    dtype = buf.value.dtype
    if new.dtype == dtype:
        return new
    weak = bool(getattr(new, "weak_type", False))
    if not weak and _exact_widening(new.dtype, dtype):
        return new.astype(dtype)  # (bfloat16 into float32, int8 into int32)
    if weak and _same_kind_or_wider(new.dtype, dtype):
        if not isinstance(new, Tracer) and jnp.issubdtype(dtype, jnp.integer):
            exact = np.asarray(new).astype(dtype).astype(new.dtype)
            if not np.array_equal(exact, np.asarray(new)):
                raise StateWriteError(
                    f"Cannot write {np.asarray(new).tolist()} into the "
                    f"{describe(buf)} of dtype {dtype}: it does not fit that dtype."
                )
        return new.astype(dtype)
    raise StateWriteError(
        f"Cannot write a value of dtype {new.dtype}{' (weakly typed)' if weak else ''} "
        f"into the {describe(buf)} of dtype {dtype}: state cells keep their dtype, "
        "and this cast could lose information or changes the kind of number (a "
        "cell takes its dtype, or a narrower one of the same kind). Cast "
        "explicitly if that is what you mean, e.g. `buf[...] = value.astype(buf.dtype)`"
        + (
            " (arithmetic with a Python float makes a float, e.g. `count + 0.5`)."
            if weak
            else "."
        )
    )


# The floating types whose values are a subset of every wider one's (IEEE-like:
# the same bias rule, infinities and NaN); float8 types are not among them.
_IEEE = {
    jnp.dtype(t)
    for t in (
        jnp.float16,
        jnp.bfloat16,
        jnp.float32,
        jnp.float64,
        jnp.complex64,
        jnp.complex128,
    )
}


def _exact_widening(src: Any, dst: Any) -> bool:
    """Whether every value of dtype `src` is exactly a value of `dst`, of the same
    kind of number: a float into a float with as many exponent and mantissa bits
    (bfloat16 or float16 into float32), an integer into one whose range holds its
    range (int8 into int32, uint8 into int16), complex into wider complex."""
    if any(jax.dtypes.issubdtype(t, jax.dtypes.extended) for t in (src, dst)):
        return False  # typed PRNG keys: only their own dtype
    for kind in (jnp.complexfloating, jnp.floating):
        if jnp.issubdtype(src, kind) and jnp.issubdtype(dst, kind):
            if not {jnp.dtype(src), jnp.dtype(dst)} <= _IEEE:
                return False  # float8 types differ in bias and inf/NaN, not only bits
            s, d = jnp.finfo(src), jnp.finfo(dst)
            return s.nexp <= d.nexp and s.nmant <= d.nmant
    if jnp.issubdtype(src, jnp.integer) and jnp.issubdtype(dst, jnp.integer):
        s, d = jnp.iinfo(src), jnp.iinfo(dst)
        return d.min <= s.min and s.max <= d.max
    return False


_KIND_ORDER = {"b": 0, "u": 1, "i": 1, "f": 2, "c": 3}


def _same_kind_or_wider(src: Any, dst: Any) -> bool:
    """Whether a weakly-typed value of dtype `src` may be written into a `dst` cell:
    bool < integers < floats < complex, never downwards."""
    s, d = np.dtype(src).kind, np.dtype(dst).kind
    if s == "V" or d == "V":  # bfloat16 and other extension types report "V"
        s = "f" if jnp.issubdtype(src, jnp.floating) else s
        d = "f" if jnp.issubdtype(dst, jnp.floating) else d
    if s not in _KIND_ORDER or d not in _KIND_ORDER:
        return False
    return _KIND_ORDER[s] <= _KIND_ORDER[d]


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


def cells_of(tree: Any) -> list[Any]:
    """The state cells of `tree`, in its leaves' order."""
    return [x for x in jax.tree_util.tree_leaves(tree, is_leaf=is_state) if is_state(x)]


def is_array_or_ref(x: Any) -> bool:
    """`eqx.is_array`, with state refs counted as arrays: the filter to partition a
    model whose cells may hold refs (inside [`eqx_state.make_step`][] /
    [`eqx_state.apply`][], or in ref mode).

    Equinox treats a `jax.Ref` as a static (non-array) leaf, so
    `eqx.partition(model, eqx.is_array)` puts state refs in the static half, where
    `lax.scan` over stacked layers or `eqx.filter_vmap` does not slice them. Use
    `eqx.partition(model, es.is_array_or_ref)` in those idioms: the refs then travel with
    the arrays and every layer writes its own slice.

    **Arguments:**

    - `x`: any object.

    **Returns:**

    Whether `x` is a JAX or NumPy array, or a `jax.Ref` (or a view of one).

    **Example:**

    ```python
    import equinox as eqx, jax, jax.numpy as jnp
    import eqx_state as es

    layers = eqx.filter_vmap(lambda k: es.nn.BatchNorm(3))(jnp.arange(4))

    def forward(stack, x):
        dynamic, static = eqx.partition(stack, es.is_array_or_ref)
        def body(x, layer_arrays):
            return eqx.combine(layer_arrays, static)(x), None
        return jax.lax.scan(body, x, dynamic)[0]

    y, layers = es.apply(forward, layers, jnp.ones((8, 3)))
    assert layers.num_batches_tracked[...].tolist() == [1, 1, 1, 1]
    ```
    """
    return eqx.is_array(x) or _is_ref(x)


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

    A model consumed by a donating step raises [`eqx_state.StaleModelError`][]
    (its arrays are deleted: an optimizer state made from them would fail later,
    at the step).
    """
    from ._modes import check_tree_live  # (`_modes` imports this module)

    check_tree_live(model)
    return eqx.filter(model, _is_param, is_leaf=is_state)
