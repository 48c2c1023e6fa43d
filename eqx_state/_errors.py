"""The library's exception types. Each message says what happened and how to fix it.

Every error eqx_state raises is an `EqxStateError`, so `except es.EqxStateError`
catches all of them. Each also derives from the built-in type it stands for (a wrong
argument value is a `ValueError`, a wrong type a `TypeError`), so existing `except
ValueError` clauses keep working.
"""

import numbers
from typing import Any

import jax
import numpy as np

from ._compat import Tracer


def user_stacklevel() -> int:
    """`warnings.warn`'s `stacklevel` for the user's line that called into the
    library, from the function that warns: frames of the package, of JAX (a
    warning given while a call is traced sits under `jax.jit`'s frames), and of the
    type-checking wrappers jaxtyping/beartype put around it are skipped."""
    import os
    import sys

    skipped = [os.path.dirname(os.path.abspath(__file__)), "<"]
    for name in ("jax", "jaxlib", "jaxtyping", "beartype"):
        file = getattr(sys.modules.get(name), "__file__", None)
        if isinstance(file, str):
            skipped.append(os.path.dirname(os.path.abspath(file)))
    prefixes = tuple(skipped)
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(prefixes):
        frame, level = frame.f_back, level + 1
    return level


def warn_deprecated(old: str, new: str) -> None:
    """The one warning for a name kept for one release after a rename, from a
    module's `__getattr__`, at the user's line. `from eqx_state import old` asks
    `hasattr` first (importlib's `_handle_fromlist`), then reads the name: it warns
    once, at the read (a few frames up: a type-checking import hook may wrap the
    `__getattr__`)."""
    import sys
    import warnings

    frame, callers = sys._getframe(1), []
    while frame is not None and len(callers) < 8:
        callers.append(frame.f_code.co_name)
        frame = frame.f_back
    if "_handle_fromlist" not in callers:
        warnings.warn(
            f"`{old}` is deprecated and will be removed in the next release: use "
            f"{new}.",
            DeprecationWarning,
            stacklevel=3,
        )


def stale_message(what: str, where: str | None = None) -> str:
    """The one message for a model (or optimizer state, or a cell) consumed by
    donation; `where`: the consumed leaves, by path (`model.lin.weight`)."""
    consumed = f" Consumed: {where}." if where else ""
    return (
        f"The {what} holds an array that was consumed (its buffer donated and "
        "deleted) by an earlier call: `make_step` and `make_apply` donate the "
        "buffers they replace, so after `model, opt_state = step(model, opt_state, "
        "...)` the old `model` and `opt_state` must not be used again. A donating "
        "call whose compiled program fails at run time (an `eqx.error_if` check, a "
        "NaN check) has also consumed what it was given. Use the model the call "
        "returned, or build the step with `make_step(..., donate=False)` / "
        "`make_apply(..., donate=False)` to keep old models valid. An owned loop "
        "(`loop = step.own(model, opt_state)`) takes its model and state over: get "
        "them back with `model, opt_state = loop.release()`." + consumed
    )


# One of Equinox's filtered transformations given the model inside a compiled call
# (`_pure._cond_note`, around the user's code in every step and apply).
FILTERED_TRANSFORM_MESSAGE = (
    "A function inside the step or apply passes the model (or a module that holds "
    "state cells) where it is a static argument: to one of Equinox's filtered "
    "transformations (`eqx.filter_jit`, `eqx.filter_closure_convert`), or as a "
    "`static_argnums` argument of `jax.jit`. Inside a compiled step or apply the "
    "cells are refs made by its trace, and a static leaf is hashed, not traced "
    "(Equinox's filters treat a ref as one), which a traced ref cannot be. Call "
    "the model directly (the step is already compiled: an inner "
    "`eqx.filter_jit` adds nothing), or close over it instead of passing it: "
    "`eqx.filter_jit(lambda x: model(x))(x)`. A function decorated with "
    "`@eqx.filter_jit` and given to `make_step` / `make_apply` itself is fine: "
    "its body is traced directly."
)


class EqxStateError(Exception):
    """Base class of every error eqx_state raises."""


class StateValueError(EqxStateError, ValueError):
    """An argument with the right type and a wrong value (a shape, a dtype, an
    option out of range, ...)."""


class StateTypeError(EqxStateError, TypeError):
    """An argument of the wrong type."""


class StateInputError(StateTypeError, ValueError):
    """An input that is not a number or an array of numbers (None, a string, a
    masked array): a `TypeError`, and a `ValueError` as JAX's conversion raised
    for some of them (None), so `except` clauses of either kind keep working."""


class StateNotImplementedError(EqxStateError, NotImplementedError):
    """A method a subclass must define (e.g. a custom metric's `update`)."""


class AxisNameError(EqxStateError, NameError):
    """A layer's `axis_name` is not bound where the layer runs."""


class StateError(EqxStateError, RuntimeError):
    """Base class of eqx_state's errors about state cells and steps."""


class StateWriteError(StateError, ValueError):
    """A state write that cannot land: outside a step in value mode, a wrong shape or
    dtype, or a write JAX cannot express (e.g. a vmapped value into an unbatched
    cell). Also a `ValueError`, which is what JAX raises for a wrong write into a
    `jax.Ref`, so `except ValueError` around ref writes keeps working."""


class StateIndexError(StateError, IndexError):
    """An index that does not fit a cell (an integer out of its axis's range), as
    NumPy refuses it; an `IndexError`."""


class StaleModelError(StateError):
    """A model (or optimizer state) whose buffers were donated to an earlier step."""


class StepError(StateError):
    """A misuse of `make_step` / `apply` (wrong loss output, changed structure, ...)."""


class NeedsFirstCall(StepError):
    """Raised while tracing a scan whose carry cannot keep one type: a call turns a
    Python number of the carry into an array (a float hyperparameter), returns a
    weakly typed array strongly typed (`jnp.asarray(1e-3)` as a learning rate, a
    weakly typed parameter such as `eqx.nn.PReLU`'s), or returns a leaf of another
    dtype (Adam's bfloat16 moment promoted by a float32 hyperparameter of
    `optax.inject_hyperparams`). `K` separate calls compute
    every call after such a change with the new type, so the runner makes the first
    call on its own and scans the others (`run_scan`), which equals `K` calls.
    Raised while tracing, before anything runs; never reaches the user.
    A compiled runner keeps the refusal for the input types it was raised for
    (`_dispatch.Compiled.call_flat`), as `jax.jit` keeps a trace: the same types
    are refused again without tracing again."""


class RecompileWarning(UserWarning):
    """A compiled step or apply was compiled again for arguments of new shapes or
    dtypes (e.g. a ragged last batch), or for a changed Python number (e.g. a float
    learning rate). Filter it with `warnings.simplefilter("ignore",
    es.RecompileWarning)` when that is intended."""


class ReadOnlyError(EqxStateError, AttributeError):
    """An attribute that cannot be changed after construction (a step's
    optimizer, loss function, ...)."""


def is_whole(x: object) -> bool:
    """A whole number given as an argument: a Python or NumPy integer, not a bool."""
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def check_int(
    where: str,
    name: str,
    value: object,
    minimum: int | None = None,
    maximum: int | None = None,
    hint: str = "",
) -> int:
    """The one check of a whole-number argument (a size, a count, a step): `value`
    as an `int` if it is a whole number (`is_whole`, or a concrete 0-d integer
    array) in `[minimum, maximum]` (either bound may be None); else a
    `StateTypeError` (not a whole number: `range` and `np.histogram` refuse one,
    and `jnp.asarray(1.5, jnp.int32)` would truncate it) or a `StateValueError`
    (out of range), naming `where` and `name` and ending with `hint`."""
    if (
        isinstance(value, jax.Array | np.ndarray)
        and not isinstance(value, Tracer)  # a traced value has no int to check
        and value.ndim == 0
        and np.issubdtype(value.dtype, np.integer)
    ):
        value = int(value)  # a concrete 0-d integer array
    hint = f" {hint}" if hint else ""
    if not is_whole(value):
        raise StateTypeError(
            f"{where}: {name} must be an int, got {value!r} of type "
            f"{type(value).__name__}.{hint}"
        )
    low = minimum is not None and value < minimum  # type: ignore[operator]
    high = maximum is not None and value > maximum  # type: ignore[operator]
    if low or high:
        bound = (
            f"in [{minimum}, {maximum}]"
            if minimum is not None and maximum is not None
            else f">= {minimum}"
            if minimum is not None
            else f"<= {maximum}"
        )
        raise StateValueError(f"{where}: {name} must be {bound}, got {value}.{hint}")
    return int(value)  # type: ignore[arg-type]


def check_bool(where: str, name: str, value: object) -> bool:
    """The one check of a flag argument (`affine=`, `inference=`, ...): `value` as
    a Python bool if it is one, a NumPy bool scalar, a concrete 0-d bool array, or
    the whole number 0 or 1; else a `StateTypeError` naming `where` and `name` (a
    truthy string or another number would pick a branch without a word:
    `affine="no"` made an affine layer)."""
    if isinstance(value, jax.Array | np.ndarray) and not isinstance(value, Tracer):
        if value.shape == () and value.dtype == np.bool_:
            return bool(value)  # a concrete 0-d bool array, as `check_int` takes
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if is_whole(value) and value in (0, 1):  # PyTorch's `affine=0` style
        return bool(value)
    raise StateTypeError(
        f"{where}: {name} must be True or False, got {value!r} of type "
        f"{type(value).__name__}."
    )


def check_choice(
    where: str, name: str, value: object, choices: tuple[str, ...]
) -> None:
    """The one check of an option that is one of some strings (`on_overflow=`): a
    `StateValueError` naming `where`, `name` and the choices if it is not."""
    if not (isinstance(value, str) and value in choices):
        listed = " or ".join(map(repr, choices))
        raise StateValueError(f"{where}: {name} must be {listed}, got {value!r}.")


def check_dtype(where: str, name: str, dtype: object) -> Any:
    """The one check of a `dtype=` argument: `dtype` as a NumPy dtype (anything
    `jnp.dtype` takes: `jnp.float32`, `"bfloat16"`, `np.dtype(...)`; `None`, "the
    default", is float32 whatever x64 says, as the layers' and metrics' defaults);
    else a `StateTypeError` naming `where` and `name`. The kind (floating,
    integer) is the caller's to check."""
    if dtype is None:
        return np.dtype(np.float32)
    # an array (or NumPy scalar) is a value, not a type: `jnp.dtype` would take
    # its dtype (`dtype=jnp.asarray(3)` an int32)
    is_value = isinstance(
        dtype, jax.Array | np.ndarray | np.generic | jax.ShapeDtypeStruct
    )
    try:
        if is_value:
            raise TypeError
        out = jax.numpy.dtype(dtype)  # type: ignore[arg-type]
    except (TypeError, ValueError) as e:
        raise StateTypeError(
            f"{where}: {name} must be a dtype (e.g. `jnp.float32`), got {dtype!r}."
        ) from e
    numeric = jax.numpy.issubdtype(out, jax.numpy.number) or out == np.bool_
    if not numeric:  # object, str, bytes, datetime: no JAX array holds them
        raise StateTypeError(
            f"{where}: {name} must be a numeric dtype a JAX array can hold (e.g. "
            f"`jnp.float32`), got {out}."
        )
    return out


def check_shape(where: str, name: str, shape: object) -> tuple[int, ...]:
    """The one check of a `shape=` argument: a tuple or list of whole numbers, each
    non-negative (`is_whole`: `int(2.5)` would make another shape without a word),
    as a tuple of ints; else a `StateTypeError` / `StateValueError` naming `where`
    and `name`."""
    if not isinstance(shape, tuple | list) or not all(map(is_whole, shape)):
        raise StateTypeError(f"{where}: {name} must be a tuple of ints, got {shape!r}.")
    dims = tuple(int(d) for d in shape)
    if any(d < 0 for d in dims):
        raise StateValueError(f"{where}: {name} must be non-negative, got {dims}.")
    return dims


def check_axis_name(where: str, value: object) -> Any:
    """The one check of an `axis_name=` argument: `None`, a name (a string or
    another hashable object), or a tuple of names; else a `StateTypeError`
    naming `where`. A list is unhashable (the layer's options are static, and
    `jax.jit` hashes them), and a whole number is not a name: JAX's collectives
    read `psum(x, 3)` as positional axis 3 of the value."""
    names = value if isinstance(value, tuple) else (value,)
    if value is None:
        return None
    for name in names:
        try:
            hash(name)
            hashable = True
        except TypeError:
            hashable = False
        if not hashable or isinstance(name, int | np.integer | tuple) or name is None:
            raise StateTypeError(
                f'{where}: axis_name must be a name (a string such as "batch", '
                "the name given to `jax.vmap`, `es.vmap`, `jax.shard_map` or a "
                f"mesh) or a tuple of names, got {value!r}. A list is not hashable; "
                "a number is not a name (JAX's collectives read it as a positional "
                "axis of the value)."
            )
    return value


def check_real(where: str, name: str, value: object, hint: str = "") -> float:
    """The one type check of a real-number option (an `eps`, a momentum, a decay,
    a probability): `value` as a `float` if it is a Python or NumPy real number (not
    a bool) or a concrete 0-d real array; else a `StateTypeError` naming `where` and
    `name` and ending with `hint`. The range is the caller's to check: each option
    has its own (`[0, 1)` for a decay, `> 0` for a bound)."""
    if (
        isinstance(value, jax.Array | np.ndarray | np.generic)
        and not isinstance(value, Tracer)
        and value.ndim == 0
        and (
            jax.numpy.issubdtype(value.dtype, jax.numpy.floating)
            or jax.numpy.issubdtype(value.dtype, jax.numpy.integer)
        )
    ):
        value = value.item()  # a concrete 0-d real array, a NumPy (bfloat16) scalar
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        hint = f" {hint}" if hint else ""
        raise StateTypeError(
            f"{where}: {name} must be a real number, got {value!r} of type "
            f"{type(value).__name__}.{hint}"
        )
    return float(value)
