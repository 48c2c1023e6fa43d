"""The one refusal of complex input by the layers that keep real state."""

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
