"""Every use of JAX (and Equinox) internals in eqx_state, in one place.

Each name here stands for something the public API does not offer. A test
(`tests/test_compat.py`) checks every one of them against the installed JAX, so an
upgrade that moves or changes one fails loudly there instead of somewhere deep in a
training step.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import operator
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.core
import jax.numpy as jnp
import numpy as np


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


def is_unmapped_ref_write(e: BaseException) -> bool:
    """Whether `e` is JAX's refusal of a write into a ref that an enclosing `vmap`
    does not map, where it reaches the caller from a transformation's batching rule
    (a write inside `jax.checkpoint` or `lax.scan` under `vmap`) rather than from
    the write itself. JAX raises a bare `Exception` for it; only its text tells it
    from others."""
    return type(e) is Exception and "unbatched array reference" in str(e)


# -- pytree registrations ---------------------------------------------------------

try:  # the Python side of JAX's registry of node types (`register_pytree_node`...)
    from jax._src.tree_util import _registry as _pytree_registry
except ImportError:  # pragma: no cover - depends on the JAX version
    _pytree_registry = None


def is_registered_node_type(cls: type) -> bool | None:
    """Whether `cls` was registered as a pytree node type (by a user, Equinox, or
    JAX for its built-in containers): a named tuple that is not unflattens as JAX's
    built-in rule does, `cls(*children)`; one that is, as its registration says.
    None where JAX's registry cannot be read."""
    if _pytree_registry is None:  # pragma: no cover - depends on the JAX version
        return None
    return cls in _pytree_registry


# -- the trace state --------------------------------------------------------------

try:
    from jax._src.core import trace_ctx as _trace_ctx
except ImportError:  # pragma: no cover - depends on the JAX version
    _trace_ctx = None


def under_trace() -> bool:
    """Whether a transformation is tracing the caller (an outer `jax.jit`, `vmap`,
    `grad`, a `lax.scan` body, ...), even when no value the caller holds is a tracer
    (a concrete ref closed over by an outer `jax.jit` is not one). JAX tells this by
    its current trace (`trace_ctx.is_top_level()`: an eager evaluation, also under
    `jax.ensure_compile_time_eval`); ~0.3 us."""
    return _trace_ctx is not None and not _trace_ctx.is_top_level()


try:
    from jax._src.core import EvalTrace as _EvalTrace
    from jax._src.interpreters.batching import BatchTrace as _BatchTrace
except ImportError:  # pragma: no cover - depends on the JAX version
    _EvalTrace = _BatchTrace = None


def only_vmapped() -> bool:
    """Whether the transformations tracing the caller are `vmap`s only, over an
    eager evaluation (`jax.vmap`, `eqx.filter_vmap` called eagerly): the inputs of
    a compiled call there are not kept by the transformation, so the call may
    donate them. Under `jax.grad` / `linearize` the transformation keeps inputs
    for the backward pass (a donation would delete them); under `jit` donation is
    ignored. JAX tells this by its chain of current traces (`parent_trace`)."""
    if (
        _trace_ctx is None or _BatchTrace is None or _EvalTrace is None
    ):  # pragma: no cover
        return False
    trace = getattr(_trace_ctx, "trace", None)
    while isinstance(trace, _BatchTrace):
        trace = getattr(trace, "parent_trace", None)
    return isinstance(trace, _EvalTrace)


def mapped_by_same_vmap(x: Any, like: Any) -> bool:
    """Whether `x` is mapped by the `vmap` that most closely maps `like` (a batch
    tracer): one of `x`'s batch tracers, at any depth, belongs to `like`'s trace.
    Tells a value that varies over `es.vmap`'s examples from one that varies only
    over an enclosing `vmap` (an ensemble). JAX keeps a tracer's trace in
    `._trace`."""
    if not is_batched(like):
        return False
    trace = getattr(like, "_trace", None)
    while is_batched(x):
        if getattr(x, "_trace", None) is trace:
            return True
        x = x.val
    return False


try:
    from jax._src.interpreters.ad import (
        JVPTracer as _JVPTracer,
        LinearizeTracer as _LinearizeTracer,
    )
except ImportError:  # pragma: no cover - depends on the JAX version
    _JVPTracer = _LinearizeTracer = None


def differentiation_trace(x: Any) -> Any:
    """The trace differentiating `x` (`jax.grad`, `jvp`, `linearize`: `x` carries a
    tangent), looking through the batch tracers of `vmap`s inside it; None when
    nothing differentiates `x`. JAX keeps a tracer's trace in `._trace`."""
    if _JVPTracer is None or _LinearizeTracer is None:  # pragma: no cover
        return None
    while isinstance(x, Tracer):
        if isinstance(x, _JVPTracer | _LinearizeTracer):
            return getattr(x, "_trace", None)
        if not is_batched(x):
            return None
        x = x.val
    return None


def trace_of(x: Any) -> Any:
    """The trace that `x` (a tracer) belongs to, the innermost transformation over
    it (a `jit`'s, a `vmap`'s, ...); None for a concrete value. JAX keeps it in
    `._trace`."""
    return getattr(x, "_trace", None) if isinstance(x, Tracer) else None


def unbatched(x: Any) -> Any:
    """The value a `vmap`'s batch tracers wrap (`.val`, through nested ones): the
    same ref under every `jax.vmap` call that maps it."""
    while is_batched(x):
        x = x.val
    return x


def is_escaped_ref_error(e: BaseException) -> bool:
    """Whether `e` is JAX's `UnexpectedTracerError` for a ref (not an array) that
    escaped the transformation that made it; only its text tells which value it
    is about ("... with type Ref{float32[3]} ...")."""
    return isinstance(e, jax.errors.UnexpectedTracerError) and "type Ref{" in str(e)


def batched_identity(x: Any) -> Any:
    """What `id(x)` is for aliasing, for a value `vmap` maps: the identity of the
    array a batch tracer wraps (`.val`) with its batch axis (`.batch_dim`), so that
    one array at two places of a vmapped call (tied weights) is seen as one, as it
    is eagerly."""
    key: Any = ()
    while _BatchTracer is not None and isinstance(x, _BatchTracer):
        key = (*key, getattr(x, "batch_dim", None))
        x = x.val
    return (id(x), key) if key else id(x)


# -- consumed refs -----------------------------------------------------------------


def ref_is_consumed(ref: Any) -> bool:
    """Whether a concrete ref's array was deleted (donated by a call that failed).

    JAX keeps a concrete ref's array in `ref._refs._buf` (see `ref_buffer`)."""
    if type(ref) is not jax.Ref:
        return False
    buf = getattr(getattr(ref, "_refs", None), "_buf", None)
    return buf is not None and bool(buf.is_deleted())


# -- a concrete ref's array -------------------------------------------------------


def is_concrete_ref(x: Any) -> bool:
    """Whether `x` is a ref made outside any trace (`jax.new_ref` called eagerly),
    whose array JAX holds in `x._refs._buf`."""
    return type(x) is jax.Ref


def ref_buffer(ref: Any) -> jax.Array:
    """The array a concrete ref holds, without a copy (an eager `ref[...]` runs a
    program: ~70 us; this is an attribute read). JAX itself hands this array to a
    compiled call that takes the ref (`pxla._shard_mutable_array`)."""
    return ref._refs._buf


def ref_identity(x: Any) -> int:
    """What makes two refs one state: for a concrete ref, the `ArrayRefImpl` that
    holds its array (`x._refs`), which `copy.copy` of a `jax.Ref` shares (the copy
    reads and writes the same array); otherwise the object itself (a ref under a
    trace)."""
    return id(x._refs) if type(x) is jax.Ref else id(x)


def ref_buffers(refs: Sequence[Any]) -> list[jax.Array]:
    """`ref_buffer` of each of `refs` (one call for all the cells of a step)."""
    return [r._refs._buf for r in refs]


def set_ref_buffer(ref: Any, new: jax.Array) -> None:
    """Make `new` the array a concrete ref holds. Every holder of the ref sees it:
    a `jax.Ref` reads its array through its `ArrayRefImpl` (`ref._refs._buf`, a
    mutable field) at each use, eager or compiled. JAX's own write-back of a
    compiled call instead moves the output's buffer into the old array object
    (`pxla.ExecuteReplicated`: `args[i]._refs._buf._replace_with(out)`, ~1 us per
    ref against a fraction of one); the two differ only for a holder of that old array
    object itself, and the library hands it to no one but the call it donates it
    to (`ref_buffer` in `_dispatch`), so after the call nothing holds it. `new` is
    taken as it is (not copied): it must be an array no one else holds."""
    ref._refs._buf = new


def ref_value_copy(ref: Any) -> jax.Array | None:
    """A copy of a concrete ref's value, as JAX's eager read `ref[...]` gives it
    (the ref's declared type; where its array lives), made without that read: a
    program that takes a ref commits its outputs, the ref's array among them, and
    `jax.jit` compiles a step on committed arrays again. None where public JAX
    cannot give the declared type (weak, over a strong array): read the ref then."""
    return array_copy(ref._refs._buf, declared_weak(ref))


def declared_weak(ref: Any) -> bool:
    """Whether a concrete ref's declared type is weak (what its reads give)."""
    return bool(jax.typeof(ref).inner_aval.weak_type)


def array_copy(
    x: jax.Array, weak: bool, on: jax.Array | None = None
) -> jax.Array | None:
    """A copy of the concrete array `x` in a new buffer, weakly typed iff `weak`, on
    `x`'s devices (`on`'s, an uncommitted array that `x`, uncommitted too, is to
    replace): an uncommitted array is copied on its own device, which need not be
    the default one (a model made under `jax.default_device`). None for a strong
    `x` asked to be weak (public JAX cannot make it so)."""
    x_weak = jax.typeof(x).weak_type  # (a PRNG key array has no `weak_type`)
    if weak and not x_weak:
        return None
    if x_weak and not weak:  # a dtype given: a strongly typed result

        def make() -> jax.Array:
            return jnp.array(x, dtype=x.dtype, copy=True)
    else:
        make = x.copy
    with placed_as(x if on is None else on):
        return make()  # runs where `x` (`on`) is


@contextlib.contextmanager
def placed_as(like: jax.Array) -> Iterator[Any]:
    """The one rule for new data that replaces the concrete array `like` (a
    state reset, a load, a copy): placed and committed as `like` is. Yields the
    `device=` to create it with: `like`'s sharding where `like` is committed;
    else None, with `like`'s device the default in the block (a fresh model's
    arrays, and those made under `jax.default_device`, are uncommitted), so that
    what is made there is uncommitted on it. `jax.jit` compiles again for a
    committed input: a reset or a load that committed some of a fresh model's
    arrays cost a step two more compilations (the call that took them, then the
    next, all of whose inputs the step had committed). Public JAX only."""
    if like.committed:
        yield like.sharding
        return
    (device,) = like.devices()
    with jax.default_device(device):
        yield None


def placement_source(like: Any) -> jax.Array | None:
    """The concrete array whose placement new data that replaces `like` follows
    (`put_as`): `like` itself where it is a live array, a concrete ref's array
    (`ref_buffer`: JAX's eager read would commit it); None for a tracer, a
    deleted array, an abstract leaf, anything else."""
    if is_concrete_ref(like):
        return None if ref_is_consumed(like) else ref_buffer(like)
    if isinstance(like, jax.Array) and not isinstance(like, Tracer):
        return None if like.is_deleted() else like
    return None


def put_as(
    x: Any, like: Any, *, may_alias: bool | None = None, where: str | None = None
) -> jax.Array:
    """`jax.device_put` of `x` (NumPy or JAX data that replaces `like`: a live
    array or a concrete ref, `placement_source`) placed and committed as `like`'s
    array is (`placed_as`). A committed JAX array is put where `like` is,
    committed (public JAX uncommits an array only through the host). Where `like`
    has no array: an abstract leaf's data goes on the sharding it names, if any;
    a tracer's, a deleted array's (a model a donating step consumed) or a
    consumed ref's on the default device, uncommitted. `where`: the leaf, named in
    a note on JAX's error (a sharding that does not divide the leaf's shape)."""
    try:
        return _put_as(x, like, may_alias)
    except ValueError as e:
        if where is not None:
            e.add_note(f"(eqx_state: placing the value loaded for {where})")
        raise


def _put_as(x: Any, like: Any, may_alias: bool | None) -> jax.Array:
    src = placement_source(like)
    if src is None:  # an abstract leaf's sharding; a dead array's would commit
        sharding = getattr(like, "sharding", None)
        if not isinstance(like, jax.ShapeDtypeStruct) or not isinstance(
            sharding, jax.sharding.Sharding
        ):
            sharding = None
        return jax.device_put(x, sharding, may_alias=may_alias)
    with placed_as(src) as device:
        if device is None and isinstance(x, jax.Array):
            if x.committed:
                device = src.sharding
            elif x.devices() != src.devices():  # copied to `src`'s device
                return jnp.array(x, copy=True)
        return jax.device_put(x, device, may_alias=may_alias)


def any_committed(arrays: Sequence[jax.Array]) -> bool:
    """Whether any of `arrays` (concrete) is committed to its device: `x.committed`
    without its Python property (~0.07 us against ~0.2 us an array; a step reads
    it for every ref-mode cell)."""
    return any(map(_COMMITTED, arrays))


_COMMITTED = operator.attrgetter("_committed")


def set_ref_buffers(refs: Sequence[Any], new: Sequence[jax.Array]) -> None:
    """`set_ref_buffer` for each pair of `refs` and `new`."""
    for r, x in zip(refs, new):
        r._refs._buf = x


def is_incompatible_devices_error(e: BaseException) -> bool:
    """Whether `e` is JAX's refusal of a jitted call whose inputs live on different
    devices (a ref made on one device beside arrays on a mesh)."""
    return isinstance(e, ValueError) and "incompatible devices" in str(e)


def is_deleted_array_error(e: BaseException) -> bool:
    """Whether `e` is JAX's error for a call given an array whose buffer was deleted
    (donated to an earlier call)."""
    return "has been deleted" in str(e)


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


# JAX logs an exception raised by a `jax.pure_callback` (an `eqx.error_if` that
# fired raises one) on this logger, with this message, from the thread that runs the
# program: on the CPU, the caller's (`jax/_src/callback.py`, `pure_callback_impl`).
CALLBACK_LOGGER = "jax._src.callback"
CALLBACK_FAILED = "jax.pure_callback failed"


class _QuietEquinoxCallback(logging.Filter):
    """Drop JAX's log of an `eqx.error_if` that fired inside one of our calls: the
    call raises Equinox's own error for it (`equinox_runtime_error`), and the log
    would print, first, Equinox's banner telling the user to wrap the program in
    `eqx.filter_jit` (it cannot tell our `jax.jit` from a bare one). Anything else,
    and everything outside our calls, is logged as before."""

    def __init__(self, inside: Callable[[], bool]):
        super().__init__()
        self._inside = inside

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name != CALLBACK_LOGGER or record.getMessage() != CALLBACK_FAILED:
            return True
        exc = record.exc_info[1] if record.exc_info else None
        if type(exc).__name__ != "_EquinoxRuntimeError":
            return True
        return not self._inside()


def quiet_equinox_callback_log(inside: Callable[[], bool]) -> None:
    """Install `_QuietEquinoxCallback` (once per process), with `inside()` saying
    whether the log comes from one of our calls; it runs only when a callback
    failed, so the calls themselves pay nothing."""
    logger = logging.getLogger(CALLBACK_LOGGER)
    if not any(isinstance(f, _QuietEquinoxCallback) for f in logger.filters):
        logger.addFilter(_QuietEquinoxCallback(inside))


# -- Equinox's filtered transformations --------------------------------------------


def jit_body(fn: Any) -> Any:
    """The function an `eqx.filter_jit` wrapper compiles (`fn` itself if it is not
    one), for a call that is already inside a compiled program: there the wrapper
    would only trace `fn` again as a nested call of the same computation (JAX
    inlines it; Equinox's `donate` options do not apply inside a jit). A loss
    decorated with `@eqx.filter_jit` is one, and its wrapper cannot take a model
    whose cells are refs made by the trace (see `is_ref_in_filtered_transform`)."""
    try:
        from equinox._jit import _JitWrapper
    except ImportError:  # pragma: no cover - depends on the Equinox version
        return fn
    if isinstance(fn, _JitWrapper):
        return jit_body(fn.__wrapped__)  # `filter_jit(filter_jit(f))` too
    # a decorated method, bound (Equinox binds it as `eqx.Partial(wrapper, self)`),
    # or a decorated function given some of its arguments
    for partial in (eqx.Partial, functools.partial):
        if isinstance(fn, partial):
            body = jit_body(fn.func)
            if body is not fn.func:
                return partial(body, *fn.args, **fn.keywords)
    return fn


def is_ref_in_filtered_transform(e: BaseException) -> bool:
    """Whether `e` is what JAX raises when `eqx.filter_jit` or
    `eqx.filter_closure_convert` is given a ref made by a trace: Equinox's filters
    treat a ref as a static (hashed, not traced) leaf. Only the texts of JAX's
    errors tell them apart."""
    text = str(e)
    if isinstance(e, ValueError):  # `jax.jit` hashing its static arguments
        return "Non-hashable static arguments" in text and "Ref{" in text
    # Equinox's closure conversion compares static leaves with `_ne` (a user's
    # `cell.value.mean()` on a ref names another attribute)
    return (
        isinstance(e, AttributeError)
        and "'AbstractRef' object has no attribute '_ne'" in text
    )


# -- NumPy inputs ----------------------------------------------------------------


def private_numpy_copy(x: np.ndarray) -> np.ndarray:
    """A copy of a NumPy array that JAX may make the buffer of an array or of a
    running call's input. Not an internal of JAX: a workaround for how its public
    API treats NumPy. On the CPU `jax.device_put`, `make_array_from_process_local_data`
    and a compiled call may use a NumPy array's own buffer, also with
    `may_alias=False` (jax-ml/jax#37830), so a change the caller makes to the array
    afterwards (a refilled batch buffer, a learning rate set in place) would reach
    a JAX array or a call still running. The copy is in the machine's byte order
    (JAX read a big-endian array passed to a function it had already compiled as
    zeros), and a masked array stays one (`subok`), which JAX refuses, rather than
    losing its mask."""
    return np.array(x, dtype=x.dtype.newbyteorder("="), subok=True)
