"""The `inference` flag of the layers: a Python bool, as in Equinox's layers."""

from __future__ import annotations

from typing import Any

import numpy as np

from .._compat import Tracer
from .._errors import StateTypeError


def inference_flag(layer: Any) -> bool:
    """`layer.inference` as a Python bool, or a `TypeError` that names the fix.

    The flag decides which program a layer traces (train or eval), so it must be a
    Python value; an array flag, traced or not, is refused the same way by eager
    calls, `es.apply`, steps and `jax.jit`. The usual cause is a map over every
    leaf of the model (`jax.tree.map(jnp.copy, model)`), which turns `True` /
    `False` into arrays."""
    value = layer.inference
    if isinstance(value, bool):
        return value
    kind = getattr(value, "dtype", type(value).__name__)
    if np.shape(value) == () and getattr(value, "dtype", None) == np.bool_:
        hint = (
            " A traced bool comes from a transformation that traces every leaf of "
            "the model (`jax.jit`, `jax.vmap`, `jax.lax.scan` over it: use "
            "`eqx.filter_jit` / `eqx.filter_vmap`, `es.make_apply`, or pass "
            "`eqx.partition(model, eqx.is_array)`'s arrays and close over the rest), "
            "or from a NumPy bool flag, which Equinox's filters treat as an array: "
            "set a Python bool, `bool(flag)`."
            if isinstance(value, Tracer)
            else " A NumPy bool (`np.True_`, an item of a NumPy array of flags) is an "
            "array to Equinox's filters (`eqx.is_array`), which a compiled call "
            "traces: set the Python bool, `bool(flag)`."
        )
    else:
        hint = ""
    raise StateTypeError(
        f"`{type(layer).__name__}.inference` must be a Python bool, got "
        f"{type(value).__name__} ({kind}{getattr(value, 'shape', '')}).{hint} A map over "
        "every leaf of the model, such as `jax.tree.map(jnp.copy, model)`, turns "
        "the layers' bool flags into arrays; map over the arrays only: "
        "`jax.tree.map(lambda x: jnp.copy(x) if eqx.is_array(x) else x, model)`. "
        "Switch modes with `eqx.nn.inference_mode(model, value)` or "
        "`es.inference_mode`."
    )
