"""Orbax checkpoints of models and optimizer states of either storage mode: the two
conversions around Orbax's own `StandardSave` / `StandardRestore`. Orbax is not
imported here (it is an optional extra); these functions only shape the trees."""

from __future__ import annotations

from typing import Any, cast

import jax
import numpy as np

from ._buffer import new_cell_ref
from ._checkpoint import (
    CheckpointError,
    _check_refs_unshared,
    _like_kind,
    _make_weak,
    _numpy_leaf,
    _python_leaf,
    _python_type,
    cut_by_x64,
    kind_message,
    saved_value,
    saved_with_x64,
    shown_path,
)
from ._compat import Tracer, private_numpy_copy, put_as
from ._modes import with_witnesses, without_witnesses


def _where(path: Any) -> str:
    return shown_path(jax.tree_util.keystr(path))


def _saveable(path: Any, x: Any) -> Any:
    """The leaf as Orbax writes it, by the rule of every persistence path
    (`_checkpoint.saved_value`); None (skipped) for what is not state."""
    where = _where(path)
    x = saved_value(x, "es.to_orbax", f"leaf at {where}", f"ref-mode cell at {where}")
    if isinstance(x, np.generic | complex):
        x = np.asarray(x)  # Orbax stores NumPy scalars as 0-d arrays
    if isinstance(x, jax.Array | np.ndarray) and x.size == 0:
        raise CheckpointError(
            f"Cannot checkpoint the leaf at {where} with Orbax: it is an "
            f"array of shape {tuple(x.shape)}, with no elements, and Orbax refuses "
            "to save an array of zero size. Save the tree with `es.save` (which "
            "writes it), or keep the empty array out of the saved tree."
        )
    return x


def to_orbax(tree: Any) -> Any:
    """The tree that Orbax's `StandardSave` writes for `tree` (a model, an optimizer
    state, or any pytree of them), in either storage mode.

    Ref-mode cells are replaced by a snapshot (a copy) of their value, so a ref-mode
    model keeps training while Orbax writes in the background; leaves that are not
    arrays or numbers (activation functions, strings) become `None`, which Orbax
    skips. JAX arrays pass through unchanged, shardings included (Orbax writes each
    shard); typed PRNG keys are saved by Orbax as typed keys.

    Raises [`eqx_state.StaleModelError`][] if `tree` was consumed by a donating step
    (save the model the step returned), and [`eqx_state.CheckpointError`][] for a
    tracer, an abstract array (`jax.ShapeDtypeStruct`), a leaf that no checkpoint
    can restore (as [`eqx_state.save`][] refuses it: string arrays, masked arrays,
    another library's arrays, a `Fraction`) or a ref-mode model that holds one ref
    at two places. An `enum.IntEnum` is written as its int.

    **Arguments:**

    - `tree`: any pytree, e.g. `(model, opt_state)`.

    **Returns:**

    A pytree of arrays and numbers for `orbax.checkpoint.args.StandardSave`.

    **Example:**

    ```python
    import tempfile
    import orbax.checkpoint as ocp
    import eqx_state as es

    model = es.to_refs(es.nn.BatchNorm(3))
    with ocp.CheckpointManager(tempfile.mkdtemp()) as manager:
        manager.save(0, args=ocp.args.StandardSave(es.to_orbax(model)))
        manager.wait_until_finished()
        target = es.orbax_target(model, manager.item_metadata(0))
        restored = manager.restore(0, args=ocp.args.StandardRestore(target))
    model = es.from_orbax(restored, like=model)  # ref mode again
    ```
    """
    _check_refs_unshared(tree, "es.to_orbax", "a checkpoint")
    return jax.tree_util.tree_map_with_path(_saveable, without_witnesses(tree))


def _abstract(x: Any) -> Any:
    if isinstance(x, jax.Ref):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
    if isinstance(x, jax.Array):
        sharding = None if x.is_deleted() else x.sharding
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
    if isinstance(x, jax.ShapeDtypeStruct):
        return x
    if isinstance(x, np.ndarray | np.generic):
        return np.asarray(x)  # restored as NumPy
    base = _python_type(x)
    if base is not None:  # restored as a plain number (an IntEnum as its int)
        return np.asarray(x) if base is complex else base(x)
    return None


def _orbax_name(path: Any) -> str:
    """The name Orbax gives the leaf at `path` (`0.bn.running_mean.value`)."""
    parts = []
    for k in path:
        for attr in ("name", "key", "idx"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:  # pragma: no cover - a key type Orbax would also not know
            parts.append(str(k))
    return ".".join(parts)


def _saved_leaves(metadata: Any) -> dict[str, Any]:
    if metadata is None:
        raise CheckpointError(
            "`metadata` is None: a `CheckpointManager` that has not saved this item "
            "in the current process cannot read its metadata unless it knows the "
            "handler. Build it with "
            "`ocp.CheckpointManager(directory, item_handlers=ocp.StandardCheckpointHandler())`."
        )
    tree = getattr(metadata, "tree", metadata)  # a TreeMetadata, or its tree
    leaves = jax.tree_util.tree_leaves(tree)
    out = {}
    for leaf in leaves:
        name = getattr(leaf, "name", None)
        if name is None or not hasattr(leaf, "dtype") or not hasattr(leaf, "shape"):
            raise CheckpointError(
                "`metadata` must be what Orbax's `CheckpointManager.item_metadata(step)` "
                f"returns for a `StandardSave` checkpoint; it holds {type(leaf).__name__}."
            )
        out[str(name)] = leaf
    return out


def _saved_kind(meta: Any) -> str:
    """What Orbax saved at a leaf, by its metadata: a Python scalar (its scalar
    metadata), a JAX array (an array with a sharding) or NumPy data."""
    from orbax.checkpoint import metadata as ocp_metadata

    if isinstance(meta, ocp_metadata.ScalarMetadata):
        return "python"
    return "numpy" if getattr(meta, "sharding", None) is None else "jax"


def _checked_target(path: Any, x: Any, saved: dict[str, Any]) -> Any:
    target = _abstract(x)
    if target is None:
        return None
    where = jax.tree_util.keystr(path)
    meta = saved.get(_orbax_name(path))
    if meta is None:
        raise CheckpointError(
            f"The Orbax checkpoint has no array at {where}: it was saved from a "
            "different model or optimizer. Restore into the structure it was saved from."
        )
    got_dtype, got_shape = np.dtype(meta.dtype), tuple(meta.shape)
    # a JAX array saved where `like` holds a Python scalar, or the reverse: refused
    # as `es.load` refuses it (the rule of `_checkpoint._check_against`)
    saved_kind = _saved_kind(meta)
    held_kind = _like_kind(x)
    if {saved_kind, held_kind} == {"jax", "python"}:
        raise CheckpointError(
            kind_message(where, "the Orbax checkpoint", saved_kind, held_kind, x)
        )
    base = _python_type(x)
    if base is not None and base is not complex:
        kinds = {bool: "b", int: "iu", float: "f"}[base]
        if got_shape != () or got_dtype.kind not in kinds:
            raise CheckpointError(
                f"At {where} the Orbax checkpoint holds {got_dtype.name}{got_shape} but "
                f"the model expects a Python {type(x).__name__}."
            )
        return target
    want = target
    if jax.dtypes.issubdtype(target.dtype, jax.dtypes.prng_key):
        want = jax.eval_shape(jax.random.key_data, target)  # keys are saved as data
    want_dtype, want_shape = np.dtype(want.dtype), tuple(want.shape)
    from_numpy = getattr(meta, "sharding", None) is None
    if (
        isinstance(x, jax.ShapeDtypeStruct)
        and from_numpy
        and got_shape == want_shape
        and jax.dtypes.canonicalize_dtype(got_dtype) == want_dtype
    ):
        # `eqx.filter_eval_shape` describes a NumPy int64 leaf as int32 (JAX without
        # x64): restore the NumPy leaf with its saved dtype instead of casting it.
        return np.zeros(got_shape, got_dtype)
    if (
        not from_numpy
        and got_shape == want_shape
        and cut_by_x64(got_dtype)
        and jax.dtypes.canonicalize_dtype(got_dtype)
        == jax.dtypes.canonicalize_dtype(want_dtype)
    ):  # Orbax would restore it in 32 bits, whatever the target says: `es.load`'s rule
        raise CheckpointError(
            f"At {where} the Orbax checkpoint holds a JAX {got_dtype.name}{got_shape} "
            "array, " + saved_with_x64(jax.dtypes.canonicalize_dtype(got_dtype))
        )
    if got_shape != want_shape or got_dtype != want_dtype:
        raise CheckpointError(
            f"At {where} the Orbax checkpoint holds {got_dtype.name}{got_shape} but the "
            f"model expects {want_dtype.name}{want_shape}. Build `like` with the same "
            "sizes and dtypes as the saved model (Orbax itself would cast silently)."
        )
    return target


def orbax_target(like: Any, metadata: Any) -> Any:
    """The abstract tree to give Orbax's `StandardRestore` so that it restores into the
    structure, dtypes and shardings of `like` — after checking `like` against what the
    checkpoint holds.

    JAX arrays and refs of `like` become `jax.ShapeDtypeStruct`s (with the array's
    sharding, so a sharded model is restored sharded); `jax.ShapeDtypeStruct` leaves
    (from `eqx.filter_eval_shape`: nothing allocated) are kept; NumPy leaves stay
    NumPy; other Python values become `None` (not restored).

    `metadata` (`manager.item_metadata(step)`) is required because Orbax casts a saved
    array to the target's dtype without a word: here every leaf of `like` must exist in
    the checkpoint with the same shape and dtype, or a [`eqx_state.CheckpointError`][]
    names the first that differs; the checkpoint may not hold leaves `like` lacks.
    (A NumPy `int64` leaf that `eqx.filter_eval_shape` describes as `int32` is restored
    as the saved NumPy `int64`.)

    **Arguments:**

    - `like`: a tree like the saved one: a freshly built `(model, opt_state)` in
        either mode, or `eqx.filter_eval_shape` of the function that builds it.
    - `metadata`: what `CheckpointManager.item_metadata(step)` returns for the step
        being restored.

    **Returns:**

    A pytree for `orbax.checkpoint.args.StandardRestore`.
    """
    saved = _saved_leaves(metadata)
    like = without_witnesses(like)
    target = jax.tree_util.tree_map_with_path(
        lambda p, x: _checked_target(p, x, saved), like
    )
    wanted = {
        _orbax_name(p)
        for p, x in jax.tree_util.tree_flatten_with_path(target)[0]
        if x is not None
    }
    extra = sorted(set(saved) - wanted)
    if extra:
        raise CheckpointError(
            f"The Orbax checkpoint holds an array named {extra[0]!r} that `like` does "
            "not have: it was saved from a different model or optimizer."
        )
    return target


def _rebuild(path: Any, like: Any, got: Any) -> Any:
    if got is None or not (
        isinstance(like, jax.Array | jax.Ref | jax.ShapeDtypeStruct | np.ndarray)
        or isinstance(like, np.generic)
        or _python_type(like) is not None
    ):
        return like  # not saved: Python values come from `like`
    if _python_type(like) is not None:
        value = np.asarray(got).item()
        return _python_leaf(value, like, _where(path), "the Orbax checkpoint")
    _check_restored(path, like, got)
    if isinstance(got, np.ndarray | np.generic) and isinstance(
        like, jax.Array | jax.Ref
    ):
        # NumPy data where the model holds a JAX array or a ref (restored without a
        # target, or by a handler that gives NumPy): the JAX array it stands for
        host = np.asarray(got)
        exact = _exact_cast(path, host, like.dtype)
        # `restored` is the caller's: not to be shared with the model's arrays
        # (a cast to `like`'s dtype is a new array already)
        if exact is host:
            exact = private_numpy_copy(exact)
        # where `like`'s array is (a ref's too: its new ref holds the restored
        # array where the old one's was, as a target restores it)
        got = put_as(exact, like, where=_where(path))
    elif isinstance(like, np.ndarray | np.generic) or isinstance(got, np.ndarray):
        # NumPy data (Orbax gives back 0-d arrays for NumPy scalars): the rule that
        # `es.load` follows too
        return _numpy_leaf(np.asarray(got), like)
    if isinstance(like, jax.Ref):
        return new_cell_ref(
            got, kind=getattr(jax.typeof(like), "kind", None), like=like
        )
    if isinstance(like, jax.Array) and not isinstance(like, Tracer):
        if like.is_deleted():
            return got
    if getattr(like, "weak_type", False) and not getattr(got, "weak_type", False):
        return _make_weak(cast(jax.Array, got))
    return got


def _exact_cast(path: Any, got: np.ndarray, dtype: Any) -> np.ndarray:
    """`got` in `dtype` (a 64-bit NumPy array where `like` holds JAX's 32-bit
    canonical type), or a `CheckpointError` when a value would change: an integer
    beyond the narrower range (it would wrap around), a float it does not hold
    exactly (the array was not saved from this `like`)."""
    if got.dtype == dtype:
        return got
    with np.errstate(over="ignore", invalid="ignore"):
        narrowed = got.astype(dtype)
    same = narrowed.astype(got.dtype) == got
    if got.dtype.kind in "fc":
        same |= np.isnan(got) & np.isnan(narrowed)
    if not np.all(same):
        raise CheckpointError(
            f"At {_where(path)} the Orbax checkpoint holds {got.dtype} values that "
            f"{np.dtype(dtype).name}, the dtype `like` holds there, does not hold "
            "exactly: the array was "
            "not saved from a model like `like`. Restore into a `like` of the saved "
            "dtype, or cast the restored tree yourself."
        )
    return narrowed


def _check_restored(path: Any, like: Any, got: Any) -> None:
    """What Orbax restored at `path` has `like`'s shape and dtype (Orbax restores
    what the checkpoint holds where the target does not say otherwise): a
    `CheckpointError` naming the leaf if not. A NumPy leaf that
    `eqx.filter_eval_shape` describes with JAX's canonical dtype (int64 as int32)
    fits it, as `orbax_target` allows."""
    want_shape, want_dtype = tuple(np.shape(like)), like.dtype
    got_shape, got_dtype = tuple(np.shape(got)), getattr(got, "dtype", None)
    if got_shape == want_shape and (
        got_dtype == want_dtype
        or (
            isinstance(got_dtype, np.dtype)
            and jax.dtypes.canonicalize_dtype(got_dtype) == want_dtype
        )
    ):
        return
    if any(
        d is not None and jax.dtypes.issubdtype(d, jax.dtypes.prng_key)
        for d in (got_dtype, want_dtype)
    ):  # the same key data, another kind of key: `orbax_target` cannot tell
        raise CheckpointError(
            f"At {_where(path)} the Orbax checkpoint holds {got_dtype}{got_shape} "
            f"keys but `like` holds {want_dtype}{want_shape}. Build `like` with the "
            "same keys (typed `jax.random.key` vs raw `jax.random.PRNGKey`, same "
            "implementation)."
        )
    if (
        got_shape == want_shape
        and got_dtype is not None
        and cut_by_x64(want_dtype)
        and got_dtype == jax.dtypes.canonicalize_dtype(want_dtype)
    ):  # restored without 64-bit types (`orbax_target` refuses it first)
        raise CheckpointError(
            f"At {_where(path)} Orbax restored {got_dtype}{got_shape} where `like` "
            f"holds {want_dtype}{want_shape}: the array was "
            + saved_with_x64(got_dtype)
        )
    raise CheckpointError(
        f"At {_where(path)} Orbax restored {got_dtype}{got_shape} "
        f"but `like` holds {want_dtype}{want_shape}: restore with "
        "`StandardRestore(es.orbax_target(like, metadata))`, which checks the "
        "checkpoint against `like` and tells Orbax the shapes and dtypes to restore, "
        "and pass the same `like` here."
    )


def from_orbax(restored: Any, like: Any) -> Any:
    """Rebuild the model (or any tree) that [`eqx_state.to_orbax`][] saved, from what
    Orbax's `StandardRestore` returned.

    Where `like` holds a ref (ref mode), the result holds a new ref with the restored
    value; Python numbers come back as their `like` type, and NumPy values by the
    rule of [`eqx_state.load`][]: as `like`'s leaf, a NumPy scalar or array, and
    where it is a `jax.ShapeDtypeStruct`, a 0-d value as a NumPy scalar; weakly
    typed arrays of `like` come back weakly typed; Python values that were not saved
    (activation functions, flags' static parts) come from `like`. Each restored
    array must have the shape and dtype of its `like` leaf (it does when restored
    with [`eqx_state.orbax_target`][]); a [`eqx_state.CheckpointError`][] names the
    first that does not.

    **Arguments:**

    - `restored`: what `CheckpointManager.restore(step, args=StandardRestore(
        es.orbax_target(like, metadata)))` returned.
    - `like`: the tree given to [`eqx_state.orbax_target`][].

    **Returns:**

    A tree with the structure and storage mode of `like`, holding the restored values.
    """
    flat, treedef = jax.tree_util.tree_flatten_with_path(without_witnesses(like))
    try:
        got = treedef.flatten_up_to(restored)
    except (ValueError, TypeError) as e:
        raise CheckpointError(
            "What Orbax restored does not have the structure of `like`: restore with "
            "`StandardRestore(es.orbax_target(like, metadata))` and pass the same "
            "`like` here."
        ) from e
    out = [_rebuild(p, leaf, g) for (p, leaf), g in zip(flat, got)]
    return with_witnesses(jax.tree_util.tree_unflatten(treedef, out))
