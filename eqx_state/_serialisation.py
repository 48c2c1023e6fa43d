"""Filter specs for Equinox's own serialisation (`eqx.tree_serialise_leaves` /
`eqx.tree_deserialise_leaves`) that save ref-mode cells and typed PRNG keys, which
Equinox's default filter specs skip (refs) or cannot write (typed keys)."""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

from ._checkpoint import (
    CheckpointError,
    _check_live,
    _is_key_dtype,
    _key_impl_of_dtype,
    _make_weak,
    _read_ref,
)


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
    if isinstance(x, jax.Ref):
        x = _read_ref(x, "A ref-mode cell")
    if isinstance(x, jax.Array):
        _check_live(x, "A leaf")
        if _is_key_dtype(x.dtype):
            x = jax.random.key_data(x)
    eqx.default_serialise_filter_spec(f, x)


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
    if isinstance(x, jax.Ref):
        value = deserialise_filter_spec(f, jax.ShapeDtypeStruct(x.shape, x.dtype))
        if value.shape != x.shape:
            raise CheckpointError(
                f"A ref-mode cell of shape {x.shape} was saved with shape "
                f"{value.shape}: the file was saved from a different model."
            )
        return jax.new_ref(value, kind=getattr(jax.typeof(x), "kind", None))
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
    out = eqx.default_deserialise_filter_spec(f, x)
    if getattr(x, "weak_type", False) and isinstance(out, jax.Array):
        out = _make_weak(out)
    return out
