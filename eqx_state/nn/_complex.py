"""The layers' refusals of input they cannot take: complex values where the state is
real, and what is not an array."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from .._errors import StateTypeError


def refuse_complex(where: str, dtype: Any, why: str, fix: str) -> None:
    """Raise `StateTypeError` if `dtype` is complex: `where` (a layer, or a layer's
    method) keeps real values, and casting complex input to them would drop the
    imaginary parts without a word. `why` says why the layer has no complex
    counterpart, `fix` what to do instead."""
    if jnp.issubdtype(dtype, jnp.complexfloating):
        raise StateTypeError(
            f"{where} does not support complex input (got {jnp.dtype(dtype).name}): "
            f"{why}, and a cast to a real dtype would silently drop the imaginary "
            f"parts. {fix}"
        )


def refuse_non_array(where: str, x: Any, numbers: bool = False) -> None:
    """Raise `StateTypeError` if `x` is not an array (a list, a nested tuple):
    `where`'s checks read its shape and dtype, as `jnp` functions refuse a list.
    With `numbers=True` a Python number is taken too (a value `jnp.asarray`
    reads: the recorders record a scalar loss)."""
    if numbers and isinstance(x, bool | int | float | complex):
        return
    if not hasattr(x, "dtype") or not hasattr(x, "shape"):
        raise StateTypeError(
            f"{where} expects a JAX or NumPy array, got {type(x).__name__}. Convert "
            "it first, e.g. `jnp.asarray(x)`."
        )
