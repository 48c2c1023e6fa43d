"""Every use of JAX (and Equinox) internals in eqx_state, in one place.

Each name here stands for something the public API does not offer. A test
(`tests/test_compat.py`) checks every one of them against the installed JAX, so an
upgrade that moves or changes one fails loudly there instead of somewhere deep in a
training step.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.core


# -- types -----------------------------------------------------------------------

# `jax.core.Tracer` is public; imported here so that the whole package names one type.
Tracer: type = jax.core.Tracer

try:  # a view of a ref (`ref.at[i]`, what `lax.scan` hands its body for a ref `xs`)
    from jax._src.state.types import TransformedRef as _TransformedRef

    REF_TYPES: tuple[type, ...] = (jax.Ref, _TransformedRef)
except ImportError:  # pragma: no cover - depends on the JAX version
    REF_TYPES = (jax.Ref,)

try:
    from jax._src.interpreters.batching import BatchTracer as _BatchTracer
except ImportError:  # pragma: no cover - depends on the JAX version
    _BatchTracer = None


def is_batched(x: Any) -> bool:
    """Whether `x` is a value being mapped by `jax.vmap` (a batch tracer)."""
    return _BatchTracer is not None and isinstance(x, _BatchTracer)


# -- consumed refs -----------------------------------------------------------------


def ref_is_consumed(ref: Any) -> bool:
    """Whether a concrete ref's array was deleted (donated by a call that failed).

    JAX keeps a concrete ref's array in `ref._refs._buf` (read only here, never
    written)."""
    if type(ref) is not jax.Ref:
        return False
    buf = getattr(getattr(ref, "_refs", None), "_buf", None)
    return buf is not None and bool(buf.is_deleted())


# -- Equinox's run-time errors -----------------------------------------------------


def equinox_runtime_error(e: BaseException) -> BaseException | None:
    """The `equinox.EquinoxRuntimeError` that `eqx.filter_jit` would raise for `e`, a
    run-time error of a compiled call whose program contains an `eqx.error_if` check
    that fired; `None` if `e` is not one.

    Equinox records the message of the failed check in `equinox._jit.last_error_info`
    and marks the XLA error with `_EquinoxRuntimeError: `; only `eqx.filter_jit`
    turns that into its own exception type, and our steps use `jax.jit`."""
    try:
        from equinox import _jit as eqx_jit
    except ImportError:  # pragma: no cover
        return None
    info = getattr(eqx_jit, "last_error_info", None)
    cls = getattr(eqx_jit, "EquinoxRuntimeError", None)
    if info is None or cls is None or "_EquinoxRuntimeError: " not in str(e):
        return None
    msg, _ = info
    return cls(msg)
