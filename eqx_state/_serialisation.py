"""Filter specs for Equinox's own serialisation (`eqx.tree_serialise_leaves` /
`eqx.tree_deserialise_leaves`) that save ref-mode cells and typed PRNG keys, which
Equinox's default filter specs skip (refs) or cannot write (typed keys).

A filter spec sees one leaf at a time, never its path, so it cannot ask
`_checkpoint._witness_paths` which leaves are the shape witnesses of ref-mode cells
(`Buffer.witness`). It finds them by the order in which every pytree flattens a
cell: its witness is the leaf right after its ref, an array of shape
`(*ref.shape, 0)`. Like `es.save`, neither spec writes or reads a witness, so a file
holds what the model's value-mode copy (`es.freeze`) holds and loads into either
mode.
"""

from __future__ import annotations

import functools
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ._buffer import new_cell_ref
from ._checkpoint import (
    CheckpointError,
    _is_key_dtype,
    _key_impl_of_dtype,
    _make_weak,
    _python_leaf,
    _python_type,
    saved_value,
)
from ._modes import _WITNESS_DTYPE


# Per file object (by identity; the object is held, so its id cannot be reused while
# an entry is here): the shape of the witness expected as the next leaf, set by a
# ref and taken by the next call on the same file, whatever its leaf.
_NEXT_WITNESS: dict[int, tuple[Any, tuple[int, ...]]] = {}


def _after_ref(f: Any, ref: Any) -> None:
    _NEXT_WITNESS[id(f)] = (f, (*ref.shape, 0))


def _is_witness(f: Any, x: Any) -> bool:
    """Whether `x`, the leaf after a ref on the file `f`, is that ref's witness."""
    _, shape = _NEXT_WITNESS.pop(id(f), (None, None))
    return (
        shape is not None
        and isinstance(x, jax.Array | jax.ShapeDtypeStruct)
        and x.dtype == _WITNESS_DTYPE
        and tuple(x.shape) == shape
    )


def _what(x: Any) -> str:
    """The leaf being written, for an error message. A filter spec does not see the
    leaf's path; Equinox's `TreePathError`, raised from the error, names it."""
    if isinstance(x, jax.Ref | jax.Array | np.ndarray | np.generic):
        kind = "a ref-mode cell" if isinstance(x, jax.Ref) else "an array"
        kind = f"{kind} of {x.dtype}{list(x.shape)}"
    else:
        kind = f"a {type(x).__name__}"
    return (
        f"leaf that `eqx.tree_serialise_leaves` was writing ({kind}; Equinox's "
        "`TreePathError`, raised from this error, names its path)"
    )


@functools.cache
def _npy_keeps(dtype: Any) -> bool:
    """Whether an array of `dtype` written by `np.save` reads back as that dtype
    (Equinox's `tree_deserialise_leaves` restores bfloat16 itself; NumPy's format
    has no other of JAX's narrow dtypes, float8 and int4 among them)."""
    if dtype == jnp.bfloat16:
        return True
    try:
        descr = np.lib.format.dtype_to_descr(np.dtype(dtype))
        return np.lib.format.descr_to_dtype(descr) == dtype
    except (TypeError, ValueError):
        return False


def serialise_filter_spec(f: Any, x: Any) -> None:
    """A `filter_spec` for `eqx.tree_serialise_leaves` that also writes ref-mode cells
    and typed PRNG keys.

    Equinox's default (`eqx.default_serialise_filter_spec`) writes JAX and NumPy arrays
    and Python numbers, and silently skips anything else: a `jax.Ref` is not an array
    to Equinox, so a ref-mode model would be saved **without its state**. This spec
    writes the current value of each ref, writes typed keys (`jax.random.key`) as their
    key data, raises [`eqx_state.StaleModelError`][] for an array consumed by a donating
    step, and otherwise does what Equinox's default does. Read the file back with
    [`eqx_state.deserialise_filter_spec`][].

    **Arguments:**

    - `f`: the binary file Equinox writes to.
    - `x`: one leaf of the tree.

    **Example:**

    ```python
    import equinox as eqx
    import eqx_state as es

    model = es.to_refs(es.nn.BatchNorm(3))
    eqx.tree_serialise_leaves("/tmp/bn.eqx", model, filter_spec=es.serialise_filter_spec)
    loaded = eqx.tree_deserialise_leaves(
        "/tmp/bn.eqx", model, filter_spec=es.deserialise_filter_spec
    )
    ```
    """
    if _is_witness(f, x):
        return  # derived from its cell: not saved
    # the rule of every persistence path (`es.save`, `es.to_orbax`)
    value = saved_value(x, "eqx.tree_serialise_leaves", _what(x))
    if isinstance(value, jax.Array) and _is_key_dtype(value.dtype):
        value = jax.random.key_data(value)
    if hasattr(value, "dtype") and not _npy_keeps(value.dtype):
        raise CheckpointError(
            f"Cannot save the {_what(x)}: Equinox's serialisation writes arrays "
            f"with NumPy's `np.save`, whose file format has no {value.dtype} (it "
            "would be read back as raw bytes). Save the model with `es.save`, which "
            "stores it, or keep such arrays out of the saved tree."
        )
    eqx.default_serialise_filter_spec(f, x if value is None else value)
    if isinstance(x, jax.Ref):
        _after_ref(f, x)


def deserialise_filter_spec(f: Any, x: Any) -> Any:
    """The `filter_spec` for `eqx.tree_deserialise_leaves` that reads files written with
    [`eqx_state.serialise_filter_spec`][].

    Where `like` holds a ref (ref mode), a new ref with the saved value is returned;
    typed PRNG keys are rebuilt with the implementation of the key in `like`; a weakly
    typed array of `like` comes back weakly typed; every other leaf is read as Equinox's
    default (`eqx.default_deserialise_filter_spec`) reads it.

    **Arguments:**

    - `f`: the binary file Equinox reads from.
    - `x`: the leaf of `like` at this position.

    **Returns:**

    The loaded leaf.
    """
    if _is_witness(f, x):  # not in the file: derived from its cell
        return x if isinstance(x, jax.Array) else jnp.zeros(x.shape, x.dtype)
    if isinstance(x, jax.Array | jax.Ref | jax.ShapeDtypeStruct):
        _refuse_x64(f, x.dtype)
    if isinstance(x, jax.Ref):
        value = _read_leaf(f, jax.ShapeDtypeStruct(x.shape, x.dtype))
        if value.shape != x.shape or value.dtype != x.dtype:
            # (Equinox checks an array's shape and dtype; a ref is no array to it)
            raise CheckpointError(
                f"A ref-mode cell of {x.dtype}{list(x.shape)} was saved as "
                f"{value.dtype}{list(value.shape)}: the file was saved from a "
                "different model. Load it into the model it was saved from (or "
                "convert the file's leaf and save it again)."
            )
        _after_ref(f, x)
        return new_cell_ref(value, kind=getattr(jax.typeof(x), "kind", None), like=x)
    return _read_leaf(f, x)


def _refuse_x64(f: Any, held: Any) -> None:
    """Refuse 64-bit integers that this JAX (without 64-bit types) would cut to 32
    bits: `jnp.load` turns 2**40 + 7 into 7, and Equinox's check compares the cut
    array. The file's header says what was saved; the values decide (a float64 is
    rounded to float32 as Equinox rounds it; a count that fits loads), as `es.load`
    refuses such a leaf."""
    if jax.config.read("jax_enable_x64"):
        return
    start = f.tell()
    try:
        version = np.lib.format.read_magic(f)
        read = (
            np.lib.format.read_array_header_1_0
            if version == (1, 0)
            else np.lib.format.read_array_header_2_0
        )
        saved = read(f)[2]
        f.seek(start)
        if not (
            saved.kind in "iu"
            and saved.itemsize == 8
            and jax.dtypes.canonicalize_dtype(saved) == np.dtype(held)
        ):
            return
        values = np.load(f)
    except ValueError:  # not an array: Equinox's reader says what it is
        return
    finally:
        f.seek(start)
    info = np.iinfo(held)
    if values.size and (values.min() < info.min or values.max() > info.max):
        raise CheckpointError(
            f"A leaf of the file holds {saved.name} values that {np.dtype(held).name} "
            f"cannot hold (e.g. {values.max() if values.max() > info.max else values.min()}"
            "): it was saved with 64-bit types on, or from NumPy data. Turn them on "
            "before building the model and `like` (`jax.config.update("
            "'jax_enable_x64', True)`)."
        )


def _read_leaf(f: Any, x: Any) -> Any:
    if isinstance(x, jax.Array | jax.ShapeDtypeStruct) and _is_key_dtype(x.dtype):
        data = jnp.load(f)
        impl = _key_impl_of_dtype(x.dtype)
        key = jax.random.wrap_key_data(data, impl=impl)
        if key.shape != x.shape:
            raise CheckpointError(
                f"A PRNG key array of shape {x.shape} was saved with shape "
                f"{key.shape}: the file was saved from a different model."
            )
        return key
    if _python_type(x) is not None:  # a Python number, by the one rule of every
        # load path (an `enum.IntEnum` member it lacks is a `CheckpointError`)
        return _python_leaf(np.load(f).item(), x, "a leaf", "the file")
    out = eqx.default_deserialise_filter_spec(f, x)
    if getattr(x, "weak_type", False) and isinstance(out, jax.Array):
        out = _make_weak(out)
    return out
