"""`vmap` for per-example code whose layers write state (Equinox's BatchNorm style)."""

from __future__ import annotations

import contextvars
import functools
from collections.abc import Callable, Hashable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

from ._buffer import (
    MAPPED_AXES as _MAPPED_AXES,
    REF_KIND,
    Buffer,
    _is_ref,
    is_state,
    unbatched_message,
)
from ._compat import (
    is_batched,
    is_unmapped_ref_write,
    mapped_by_same_vmap,
    ref_identity,
)
from ._errors import (
    StateError,
    StateTypeError,
    StateValueError,
    StateWriteError,
    is_whole,
)
from ._modes import model_path


def mapped_axes() -> tuple[Hashable | None, ...]:
    """The axis names of the `es.vmap` calls being traced (innermost last)."""
    return _MAPPED_AXES.get()


# The batched shadows of the `es.vmap` calls being traced (see `vmap`): a cell
# holding one of them is one state that the examples share, not per-example state.
_SHADOWS: contextvars.ContextVar[tuple[Any, ...]] = contextvars.ContextVar(
    "eqx_state_vmap_shadows", default=()
)


def varies_per_example(cell: Any, value: Any) -> bool:
    """Whether `value`, about to be merged into the ref `cell`, differs between the
    examples of an `es.vmap` whose examples share `cell` (`cell` is one of its
    batched shadows and `value` is mapped by that `vmap`). Reduced values (`psum`
    over the axis) and values common to every example are not."""
    shadows = _SHADOWS.get()
    while True:  # the shadows of nested `es.vmap`s wrap the outer ones' copies
        if any(cell is s for s in shadows) and mapped_by_same_vmap(value, cell):
            return True
        if not is_batched(cell):
            return False
        cell = cell.val


def _explicit_split(args: tuple, axes: tuple) -> Any:
    """The mesh axes that a mapped array argument is split over along its mapped
    axis, when they are Explicit axes (its type says so); None otherwise."""
    for a, ax in zip(args, axes):
        if ax is None:
            continue
        for leaf in jax.tree_util.tree_leaves(a):
            if not hasattr(leaf, "shape") or not jnp.ndim(leaf):
                continue
            spec = getattr(getattr(jax.typeof(leaf), "sharding", None), "spec", None)
            axis = int(ax) % jnp.ndim(leaf)
            if spec is not None and axis < len(spec) and spec[axis] is not None:
                return spec[axis]
    return None


def _shadow(cells: list[Any], size: int) -> list[Any]:
    return [
        jax.new_ref(jnp.broadcast_to(r[...], (size, *r.shape)), kind=REF_KIND)
        for r in cells
    ]


_LOOP_OVER_CELLS_MESSAGE = (
    "es.vmap: a loop inside the mapped function (a `lax.scan` over stacked "
    "layers) reads or writes state cells of the mapped model, and JAX "
    "cannot map a loop over per-example state (its error: \"'Ref' object has no "
    'attribute ..."). Put the loop outside and the map inside it: scan over the '
    "layers and call `es.vmap(layer, axis_name=...)` in the loop body, or call the "
    "layers on the whole batch (BatchNorm normalises a batch without `es.vmap`)."
)


def vmap(
    fn: Callable[..., Any],
    in_axes: Any = 0,
    out_axes: Any = 0,
    *,
    axis_name: Hashable | None = None,
    axis_size: int | None = None,
) -> Callable[..., Any]:
    """`jax.vmap` for per-example calls of a model whose layers write state.

    JAX cannot write a vmapped value into an unbatched ref, even one that is the
    same for every example (a `pmean`-ed batch statistic). `es.vmap` gives every
    state cell a batched shadow for the duration of the call, lets each example
    write its row, and writes the (common) value back into the cell once. This is
    the supported way to use `BatchNorm(..., axis_name=name)` per example, as
    `eqx.nn.BatchNorm` is used: `es.vmap(model, axis_name="batch")(x)`.

    Cells are found in `fn` when it is a pytree (an `eqx.Module`), and in the
    arguments whose `in_axes` is `None`. Every example must write the same value
    (reduce over `axis_name` first); otherwise the call fails at run time with an
    error rather than keeping one example's value. A metric updated per example
    needs the same `axis_name` to sum the examples: without it, its update is
    refused (`StateWriteError`) when it sees per-example values (not inside an
    inner `jax.checkpoint`, `jit` or `scan`: a known defect, see the misuse page).

    **Arguments:**

    - `fn`: the function (typically the model) to map.
    - `in_axes`, `out_axes`, `axis_name`, `axis_size`: as for `jax.vmap`.
        `in_axes` is an int or `None`, or a tuple with one entry per argument.

    **Returns:**

    The mapped function.

    **Example:**

    ```python
    import jax.numpy as jnp
    import eqx_state as es

    bn = es.nn.BatchNorm(3, channel_axis=0, axis_name="batch")
    y, bn = es.apply(lambda m, x: es.vmap(m, axis_name="batch")(x), bn, jnp.ones((4, 3)))
    assert int(bn.num_batches_tracked[...]) == 1
    ```
    """
    if not callable(fn):  # as `jax.vmap` refuses it, when built
        raise StateTypeError(
            f"es.vmap: expected a function to map, got {type(fn).__name__} {fn!r:.40}."
        )

    @functools.wraps(fn)
    def mapped(*args: Any) -> Any:
        axes = in_axes if isinstance(in_axes, tuple) else (in_axes,) * len(args)
        if len(axes) != len(args):
            raise StateValueError(
                f"es.vmap: in_axes has {len(axes)} entries for {len(args)} arguments."
            )
        for i, ax in enumerate(axes):
            if ax is not None and not is_whole(ax):
                raise StateValueError(
                    f"es.vmap: in_axes entry {i} is {ax!r}; es.vmap maps each "
                    "argument as a whole, so an entry is an int or None (not a pytree "
                    "of axes, as `jax.vmap` also takes). Move the mapped axis of every "
                    "array of that argument to one position (`jnp.moveaxis`), or pass "
                    "its mapped and unmapped parts as separate arguments."
                )
        size = axis_size
        for i, (a, ax) in enumerate(zip(args, axes)):
            if ax is None:
                continue
            for path, leaf in jax.tree_util.tree_flatten_with_path(a)[0]:
                shape = jnp.shape(leaf)
                where = f"`{model_path(path, f'args[{i}]')}`"  # as the call got it
                if not -len(shape) <= ax < len(shape):
                    has = (
                        f"has shape {shape}"
                        if hasattr(leaf, "shape")
                        else f"is a {type(leaf).__name__}, not an array"
                    )
                    raise StateValueError(
                        f"es.vmap: in_axes entry {i} is {ax}, but {where} {has}, "
                        f"with no axis {ax} to map. Give that argument's "
                        "mapped axis, or `None` to pass it whole to every example."
                    )
                if size is None:
                    size = int(shape[ax])
                elif shape[ax] != size:
                    raise StateValueError(
                        f"es.vmap: {where} has {shape[ax]} examples along its mapped "
                        f"axis {ax}, but "
                        + (
                            f"`axis_size` is {size}"
                            if axis_size is not None
                            else f"an earlier mapped array has {size}"
                        )
                        + ": every mapped array needs the same number."
                    )
        if size is None:
            raise StateValueError("es.vmap: no mapped argument; pass `axis_size=`.")
        # `fn` and the unmapped arguments are searched for ref cells
        carriers = (fn, *(a if ax is None else None for a, ax in zip(args, axes)))
        flat, treedef = jax.tree_util.tree_flatten(carriers, is_leaf=is_state)
        seen: dict[int, int] = {}
        cells: list[Any] = []
        slots: list[int | None] = []
        for leaf in flat:
            if isinstance(leaf, Buffer) and _is_ref(leaf.value):
                # one shadow per ref: a ref at two places (shared with
                # `eqx.nn.Shared`) is one state; refs are mutable objects, so their
                # identity (`_compat.ref_identity`: a copy of a ref is the same
                # state) is what says so
                k = seen.setdefault(ref_identity(leaf.value), len(cells))
                if k == len(cells):
                    cells.append(leaf.value)
                slots.append(k)
            else:
                slots.append(None)
        split = _explicit_split(args, axes) if cells else None
        if split is not None:
            raise StateError(
                f"es.vmap: the mapped batch is split over the mesh's Explicit axes "
                f"{split!r} (a `make_step(mesh=...)` step on a mesh from "
                "`jax.make_mesh`, whose axes are Explicit by default), and the "
                "per-example state of the cells cannot follow that split. Build the "
                "mesh with Auto axes, `jax.make_mesh(shape, names, axis_types="
                "(jax.sharding.AxisType.Auto,) * len(names))` (XLA places the "
                "communication; the result equals one device's), or call the model "
                "on the whole batch (BatchNorm's default `channel_axis=1`, no "
                "`axis_name`)."
            )
        shadows = _shadow(cells, size)

        def inner(shadow_refs: list[Any], *mapped_args: Any) -> Any:
            new = [
                leaf
                if k is None
                else eqx.tree_at(lambda b: b.value, leaf, shadow_refs[k])
                for leaf, k in zip(flat, slots)
            ]
            f, *unmapped = jax.tree_util.tree_unflatten(treedef, new)
            call_args = [
                u if ax is None else a for u, a, ax in zip(unmapped, mapped_args, axes)
            ]
            # the shadows as this map's examples see them and, for a cell that is
            # itself an enclosing `es.vmap`'s shadow, as made (a copy per outer
            # example, which the outer examples share as they share the cell)
            outer = _SHADOWS.get()
            copies = [
                sh
                for sh, c in zip(shadows, cells, strict=True)
                if any(c is s for s in outer)
            ]
            token = _SHADOWS.set((*outer, *copies, *shadow_refs))
            try:
                return f(*call_args)
            finally:
                _SHADOWS.reset(token)

        token = _MAPPED_AXES.set((*_MAPPED_AXES.get(), axis_name))
        try:
            out = jax.vmap(
                inner,
                in_axes=(0, *axes),
                out_axes=out_axes,
                axis_name=axis_name,
                axis_size=axis_size,
            )(shadows, *args)
        except AttributeError as e:
            if not _is_ref(getattr(e, "obj", None)):
                raise
            # JAX's batching rule of a loop (`lax.scan` over stacked layers) cannot
            # carry the per-example refs of this map's cells
            raise StateError(_LOOP_OVER_CELLS_MESSAGE) from e
        except Exception as e:
            # JAX's bare refusal of a write into a ref this map does not batch,
            # raised by a loop or `jax.checkpoint` inside the mapped function (a
            # direct write is translated where it happens, `_buffer._write`): a
            # cell reached through a closure; the advice names `es.vmap` while
            # this map is still being traced
            if not is_unmapped_ref_write(e):  # a user's own bare Exception
                raise
            what = (
                "state cell (JAX does not say which; in a loop or `jax.checkpoint` "
                "within the mapped function)"
            )
            raise StateWriteError(unbatched_message(what, e)) from e
        finally:
            _MAPPED_AXES.reset(token)
        for cell, shadow in zip(cells, shadows):
            rows = jax.freeze(shadow)
            differs = _rows_differ(rows) if size > 1 else jnp.array(False)
            value = eqx.error_if(
                rows[0],
                differs,
                "es.vmap: the examples of a vmapped call wrote different values into "
                "one state cell, which has room for one. Reduce the value over the "
                "vmapped axis first (e.g. BatchNorm(..., axis_name=...) or "
                "jax.lax.pmean), or keep per-example state in a batched cell.",
            )
            try:
                cell[...] = jax.lax.stop_gradient(value)
            except Exception as e:
                # as in `Buffer.__setitem__`: JAX refuses, with a bare `Exception`,
                # a write into a ref that an enclosing vmap does not batch
                if type(e) is Exception and not is_batched(cell):
                    raise StateWriteError(_NESTED_MESSAGE) from e
                raise
        return out

    return mapped


_NESTED_MESSAGE = (
    "es.vmap ran inside another vmap that was not given the model's cells: "
    "`es.vmap(es.vmap(model, ...), ...)` or a `jax.vmap` around `es.vmap` maps a "
    "function, so the outer map cannot give the cells per-example shadows. Pass "
    "the model to the outer map as an unmapped argument: `es.vmap(lambda m, x: "
    "es.vmap(m, axis_name='inner')(x), in_axes=(None, 0), axis_name='outer')"
    "(model, x)`, with the layers' `axis_name=('outer', 'inner')`."
)


def _rows_differ(rows: jax.Array) -> jax.Array:
    """Whether the examples wrote different values; NaN equals NaN here (a NaN
    batch statistic propagates, as on the whole-batch path, instead of failing)."""
    same = rows == rows[:1]
    if jnp.issubdtype(rows.dtype, jnp.inexact):
        same = same | (jnp.isnan(rows) & jnp.isnan(rows[:1]))
    return jnp.any(~same)
