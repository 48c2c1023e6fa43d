from __future__ import annotations

import weakref
from typing import Any, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Int, Num

from .._buffer import Cache, _LayerBase, host_value
from .._compat import Tracer, differentiation_trace, trace_of, unbatched
from .._errors import (
    StateTypeError,
    StateValueError,
    StateWriteError,
    check_choice,
    check_dtype,
    check_int,
)
from ._complex import refuse_complex, refuse_non_array


_OVERFLOW = ("raise", "nan")  # what `on_overflow` may be


# The caches appended to under each differentiation trace (`jax.grad` of a loss),
# by their key cell's ref; an entry goes with its trace.
_DIFFERENTIATED: weakref.WeakKeyDictionary[Any, list[Any]] = weakref.WeakKeyDictionary()


_SECOND_APPEND = (
    "KVCache.append: a second chunk was appended to this cache inside one "
    "differentiated call (`jax.grad` of a loss, a training step). A cache "
    "is state, and state is never differentiated: the earlier chunk's keys "
    "and values would reach this chunk's attention without their gradient, "
    "so the key and value projections would get a wrong one. Differentiate "
    "over the whole sequence without a cache (`es.nn.without_kv_cache("
    "model)`, the causal forward), or one chunk per differentiated call "
    "(or per `cache.reset()`, which starts a new sequence)."
)


@jax.custom_jvp
def _not_differentiated(keys: Array, values: Array) -> tuple[Array, Array]:
    """The identity, refusing to be differentiated: what a second append under one
    trace returns (see `_second_append`). Unless the function is differentiated
    later, nothing changes (the call is inlined when compiled)."""
    return keys, values


@_not_differentiated.defjvp
def _refuse_differentiation(primals: Any, tangents: Any) -> Any:
    raise StateWriteError(_SECOND_APPEND)


def _second_append(cache: KVCache, keys: Any, values: Any) -> bool:
    """A cache's cells are state, which is never differentiated: a chunk's own keys
    and values reach the attention live (see `append`), but those of an earlier
    chunk of the same differentiated call are read back from the cells, without
    their gradient. A second append inside a differentiated call is refused here
    rather than return a gradient that silently lacks them. Under another trace
    (a `jit`, a `vmap`), the function may be differentiated after it is traced
    (`jax.grad(jax.jit(loss))`): then `True`, and `append` returns what it
    attends over through `_not_differentiated`, which raises the same error if
    that happens."""
    trace = differentiation_trace(keys) or differentiation_trace(values)
    if trace is not None:
        if cache._appended_under(trace):
            raise StateWriteError(_SECOND_APPEND)
        return False
    inner = trace_of(keys) or trace_of(values)
    return inner is not None and cache._appended_under(inner)


def _overflow_message(max_len: int) -> str:
    return (
        f"KVCache overflow: this write would go past the cache's max_len={max_len} "
        "positions. A cache holds at most max_len positions (prompt plus generated "
        "tokens); writing past the end is refused rather than silently clamped. "
        "Build the cache with a larger max_len (e.g. "
        "`es.nn.with_kv_cache(model, max_len)`), stop decoding earlier, or reset "
        "the cache to start a new sequence (`es.reset(model, es.Cache)`, or "
        "`cache.reset()`)."
    )


class KVCache(_LayerBase):
    """The keys and values of past positions for autoregressive decoding, kept as
    [`eqx_state.Cache`][] cells: `keys` and `values` of shape
    `[num_heads, max_len, head_dim]` and an integer `cursor`, the number of
    positions written so far. (Heads first: attention reads each head's keys as one
    contiguous `[max_len, head_dim]` block, so no transposed copy of the cache is
    made at every step.) The reset fill of all three cells is 0.

    [`append`][eqx_state.nn.KVCache.append] writes a chunk (one token, or a whole
    prompt) at the cursor in place (`dynamic_update_slice` on the cell, which XLA
    performs in place: inside a jitted step with donation, or in ref mode, there is
    no second copy of the cache) and advances the cursor.

    **Positions past the cursor never reach the output.** Attention masks them out
    of the logits, and every way of moving the cursor back clears what lies past
    it: [`reset`][eqx_state.nn.KVCache.reset] (or `es.reset(model, es.Cache)`)
    writes zeros everywhere and the cursor 0, and
    [`truncate`][eqx_state.nn.KVCache.truncate] zeros the positions it drops. So
    a cache that was reset decodes exactly like a fresh one, whatever it held
    (NaN from an overflow with `on_overflow="nan"`, or from a sequence that
    contained NaN: a masked position holding NaN would otherwise leak in as
    `0 * NaN` in the weighted sum of values). Clearing costs one write of the
    cache per reset; the decoding step itself reads the cache once, with no
    select over it. (Writing the `cursor` cell by hand skips the clearing: use
    `reset` / `truncate`.)

    **Batches of sequences.** A cache holds one sequence. For a batch, give every
    cell a leading batch axis ([`eqx_state.nn.with_kv_cache`][]`(...,
    batch_size=B)`) and map the per-sequence model with
    `jax.vmap(model, in_axes=(es.nn.kv_cache_axes(model), 0))`: every sequence
    has its own cursor, so prompts of different lengths can be prefilled
    together, padded to one length (which must fit in `max_len`), and each
    cursor then set to its prompt's length with
    [`eqx_state.nn.truncate_kv_cache`][]. Pad with finite values (a pad token, or
    zeros): a NaN in a padding position reaches the earlier positions' outputs
    through the masked attention weights (`0 * NaN`), as it can in PyTorch's
    `scaled_dot_product_attention(is_causal=True)` (whose blocked CPU kernel keeps
    it to some rows at long lengths).

    **Overflow.** Writing past `max_len` is never a silent clamp. With
    `on_overflow="raise"` (default) it is an error:

    - when the cursor is a concrete value (eager calls, ref mode or inside
        `es.apply` without `jit`), a [`eqx_state.StateWriteError`][] is raised
        before anything is written;
    - under a trace (`jit`, `scan`, `vmap`) the check is an
        [`eqx.error_if`](https://docs.kidger.site/equinox/api/errors/) on the
        written keys. What is raised at run time depends on what compiled
        the call: under `eqx.filter_jit`, `es.make_apply` and `es.make_step` (the
        decode loops of the docs and the example) an `equinox.EquinoxRuntimeError`
        (a `RuntimeError`) carrying the message below; under
        a plain `jax.jit` the error of the failed XLA callback, whose text contains
        the same message after Equinox's note that it does not see `filter_jit`:
        a `jax.errors.JaxRuntimeError` (a `RuntimeError`; older JAX raised a
        `ValueError` on CPU). (The usual `EQX_ON_ERROR`
        environment variable applies: `nan` or `breakpoint` instead of raising.)
        A failing jitted call may already have consumed the cells it was given
        (donated buffers, or the buffers of ref-mode cells):
        after such an error, build a fresh cache (e.g. with
        [`eqx_state.nn.with_kv_cache`][]).

    With `on_overflow="nan"`, the overflowing chunk's outputs are NaN, and so is
    every later output, and the computation continues; the cache's positions from
    the cursor to `max_len` become NaN, those before it are kept (so `truncate` to
    a length at most the old cursor rewinds to a valid prefix). This is the same
    on every runner, eager calls included: the same NaN outputs and cache
    positions as the compiled call (the valid positions up to the rounding of
    eagerly computed projections). The check is an elementwise select; `"raise"` under a
    trace is a conditional per write, which on GPU reads the predicate back to
    the host at every step. (A chunk longer than `max_len` is refused under both
    policies: its shape alone cannot fit.)

    Under a trace with `"raise"`, and with `"nan"`, the cursor still advances past
    `max_len`, so every later write is flagged too, until a reset.

    **Arguments:**

    - `max_len`: the number of positions the cache holds.
    - `num_heads`: the number of attention heads.
    - `head_dim`: the size of each head's keys and values.
    - `dtype`: the dtype of keys and values (default float32).
    - `on_overflow`: `"raise"` or `"nan"`; see above.

    **Example:**

    ```python
    import jax.numpy as jnp
    import eqx_state as es

    cache = es.to_refs(es.nn.KVCache(max_len=8, num_heads=2, head_dim=4))
    start, keys, values = cache.append(jnp.ones((3, 2, 4)), jnp.ones((3, 2, 4)))
    assert int(start) == 0 and int(cache.length) == 3
    cache.truncate(2)
    assert int(cache.length) == 2 and float(cache.keys[...][:, 2:].sum()) == 0
    cache.reset()
    assert int(cache.length) == 0
    ```
    """

    keys: Cache
    values: Cache
    cursor: Cache
    max_len: int = eqx.field(static=True)
    on_overflow: Literal["raise", "nan"] = eqx.field(static=True)

    def __init__(
        self,
        max_len: int,
        num_heads: int,
        head_dim: int,
        *,
        dtype=None,
        on_overflow: Literal["raise", "nan"] = "raise",
    ):
        sizes = {"max_len": max_len, "num_heads": num_heads, "head_dim": head_dim}
        max_len, num_heads, head_dim = (
            check_int("KVCache", name, v, 1) for name, v in sizes.items()
        )
        check_choice("KVCache", "on_overflow", on_overflow, _OVERFLOW)
        dtype = check_dtype("KVCache", "dtype", dtype)
        name = dtype.name
        if not jnp.issubdtype(dtype, jnp.inexact):
            # keys and values are cast into the cache: an integer cache would
            # truncate 1.7 to 1 without a word
            raise StateTypeError(
                f"KVCache: dtype must be a floating (or complex) dtype, got "
                f"{name}. Keys and values are cast to it; the default is "
                "jnp.float32."
            )
        shape = (num_heads, max_len, head_dim)
        self.keys = Cache(jnp.zeros(shape, dtype), init=0)
        self.values = Cache(jnp.zeros(shape, dtype), init=0)
        self.cursor = Cache(jnp.zeros((), jnp.int32), init=0)
        self.max_len = max_len
        self.on_overflow = on_overflow

    @property
    def length(self) -> Int[Array, "*batch"]:
        """The number of positions written so far (the cursor; one per sequence
        for a cache holding a batch)."""
        return self.cursor[...]

    def append(
        self,
        keys: Num[Array, "seq heads head_dim"],
        values: Num[Array, "seq heads head_dim"],
    ) -> tuple[
        Int[Array, ""],
        Num[Array, "heads max_len head_dim"],
        Num[Array, "heads max_len head_dim"],
    ]:
        """Write `keys` / `values` for `seq` new positions at the cursor, in place,
        and advance the cursor by `seq`.

        **Arguments:**

        - `keys`, `values`: arrays of shape `[seq, num_heads, head_dim]`,
            cast to the cache's dtype; complex ones are refused (a `TypeError`)
            unless the cache is complex.

        **Returns:**

        `(start, all_keys, all_values)`: the cursor before the write (the position
        of the first new entry) and the whole cache after it, of shape
        `[num_heads, max_len, head_dim]`. Positions `>= start + seq` hold stale or
        zero entries and must be masked out (see
        [`eqx_state.nn.CausalSelfAttention`][]). With `on_overflow="nan"`, an
        overflowing write leaves NaN from `start` to `max_len`, in the cache and
        in the returned arrays, and nothing else: a write that starts at or past
        `max_len` returns no NaN. Code of your own over these arrays tells an
        overflow by `start + seq > max_len`; `CausalSelfAttention` makes that
        chunk's queries, and so its outputs, NaN. (Making the returned arrays
        NaN as well would cost a pass over the whole cache at every write.)

        **Raises:**

        [`eqx_state.StateWriteError`][] when the write would pass `max_len` and the
        cursor is concrete (under `jit`, see the class docstring); and for a
        second append inside one differentiated call (`jax.grad` of a loss, a
        step) without a `reset()` between: the returned keys and values carry the
        gradient of this chunk's, but the cache's earlier entries are state, read
        without one. Where the function is traced first and differentiated
        after (`jax.grad(jax.jit(loss))`), the error comes from `grad`.
        """
        if self.cursor.value.ndim:
            raise StateValueError(
                f"KVCache.append: this cache holds a batch of sequences (cursor of "
                f"shape {tuple(self.cursor.shape)}), and one call appends to one "
                "sequence. Map the per-sequence model over the batch with "
                "`jax.vmap(model, in_axes=(es.nn.kv_cache_axes(model), 0))`."
            )
        refuse_non_array("KVCache.append (keys)", keys)
        refuse_non_array("KVCache.append (values)", values)
        heads, _, head_dim = self.keys.shape
        if keys.shape != values.shape or tuple(keys.shape[1:]) != (heads, head_dim):
            raise StateValueError(
                "KVCache.append: expected keys and values of shape "
                f"[seq, {heads}, {head_dim}], got {keys.shape} and {values.shape}."
            )
        cache_dtype = self.keys.dtype
        if not jnp.issubdtype(cache_dtype, jnp.complexfloating):
            for x in (keys, values):
                refuse_complex(
                    "KVCache.append",
                    x.dtype,
                    f"the cache keeps {jnp.dtype(cache_dtype).name} keys and values",
                    "Build the cache with a complex dtype (`KVCache(..., "
                    "dtype=jnp.complex64)`, or `with_kv_cache(model, max_len, "
                    "dtype=jnp.complex64)`) to keep complex keys, or pass real ones.",
                )
        n = keys.shape[0]
        start = self.cursor[...]
        if n > self.max_len:
            raise StateWriteError(_overflow_message(self.max_len))
        marking = self.on_overflow == "nan"
        if marking:
            # an elementwise select, no conditional; the same computation whether
            # the cursor is traced or concrete (eager calls, ref mode), so every
            # runner gives the same NaN
            # (in the cells' dtypes, which the write casts to anyway: integer
            # keys have no NaN)
            overflow = start + n > self.max_len
            keys = keys.astype(self.keys.dtype)
            values = values.astype(self.values.dtype)
            keys = jnp.where(overflow, jnp.asarray(jnp.nan, keys.dtype), keys)
            values = jnp.where(overflow, jnp.asarray(jnp.nan, values.dtype), values)
        elif isinstance(start, Tracer):
            keys, values = eqx.error_if(
                (keys, values),
                start + n > self.max_len,
                _overflow_message(self.max_len),
            )
        elif int(start) + n > self.max_len:
            raise StateWriteError(
                f"{_overflow_message(self.max_len)} (cursor {int(start)}, writing {n} "
                "positions)"
            )
        second = _second_append(self, keys, values)
        zero = jnp.zeros((), start.dtype)
        full = []
        for cell, new in ((self.keys, keys), (self.values, values)):
            new = jnp.swapaxes(new, 0, 1).astype(cell.dtype)  # [heads, seq, head_dim]
            old = cell[...]
            at = start
            if marking:
                # `dynamic_update_slice` clamps a write past the end to end at
                # max_len, which would put the NaN (of an overflowing chunk) over
                # valid positions before the cursor: write the clamped slab with
                # those positions' old values, so that only [start, max_len) is
                # marked (O(seq), not a pass over the whole cache)
                at = jnp.minimum(start, jnp.asarray(self.max_len - n, start.dtype))
                kept = jax.lax.dynamic_slice(old, (zero, at, zero), new.shape)
                pos = at + jnp.arange(n, dtype=start.dtype)
                new = jnp.where((pos < start)[None, :, None], kept, new)
            updated = jax.lax.dynamic_update_slice(old, new, (zero, at, zero))
            cell[...] = updated
            full.append(updated)
        self.cursor[...] = start + n
        # What the chunk attends over: the values the cells now hold, with the new
        # keys and values keeping their gradient (a state write does not carry one)
        if second:
            return start, *_not_differentiated(full[0], full[1])
        return start, full[0], full[1]

    def _appended_under(self, trace: Any) -> bool:
        """Whether this cache was appended to before under the differentiation
        `trace` (and note that it now is)."""
        seen = _DIFFERENTIATED.setdefault(trace, [])
        ref = unbatched(self.keys.value)  # the same under each `vmap` call
        if any(r is ref for r in seen):
            return True
        seen.append(ref)
        return False

    def reset(self) -> None:
        """Start a new sequence: write zeros into the keys and values and set the
        cursor to 0 (state writes; the same as `es.reset(cache, es.Cache)`)."""
        for cell in (self.keys, self.values, self.cursor):
            cell[...] = jnp.zeros(cell.shape, cell.dtype)
        ref = unbatched(self.keys.value)  # nothing earlier is attended over now
        for seen in list(_DIFFERENTIATED.values()):
            seen[:] = [r for r in seen if r is not ref]

    def truncate(self, length: int | Int[Array, "*batch"]) -> None:
        """Keep the first `length` positions and drop the rest: set the cursor to
        `length` and write zeros into the positions from `length` on (state
        writes). Use it to rewind (e.g. to a shared prefix), or after prefilling
        a batch of prompts padded to one length, to set each sequence's cursor to
        its own prompt length.

        **Arguments:**

        - `length`: the new number of positions, at most the current one; for a
            cache holding a batch of sequences, one per sequence (or one for all).

        **Raises:**

        [`eqx_state.StateWriteError`][] (concrete values) or, under a trace, an
        `eqx.error_if` error at run time, when `length` is negative or beyond the
        cursor.
        """
        cursor = self.cursor[...]
        length = host_value(
            length,
            "KVCache.truncate",
            "Give the new length: a whole number between 0 and the current cursor.",
            StateWriteError,
            StateTypeError,
        )
        if length.ndim and not _broadcasts(length.shape, cursor.shape):
            held = (
                f"a batch of {cursor.shape[0]} sequences (built with `batch_size="
                f"{cursor.shape[0]}`): give one length per sequence, shape "
                f"{tuple(cursor.shape)}, or one for all"
                if cursor.ndim
                else "one sequence: give one length (a scalar)"
            )
            raise StateValueError(
                f"KVCache.truncate: got lengths of shape {tuple(length.shape)}, but "
                f"this cache holds {held}."
            )
        length = jnp.broadcast_to(length, cursor.shape)
        if not jnp.issubdtype(length.dtype, jnp.integer):
            raise StateTypeError(
                f"KVCache.truncate: length must be an integer, got {length.dtype}."
            )
        length = length.astype(cursor.dtype)
        bad = (length < 0) | (length > cursor)
        msg = (
            "KVCache.truncate: the new length must be between 0 and the current "
            "cursor (positions past the cursor hold nothing to keep)."
        )
        if isinstance(bad, Tracer) or isinstance(cursor, Tracer):
            length = jnp.asarray(eqx.error_if(length, bad, msg))
        elif bool(jnp.any(bad)):
            raise StateWriteError(
                f"{msg} Got length {length.tolist()} for cursor {cursor.tolist()}."
            )
        pos = jnp.arange(self.max_len, dtype=cursor.dtype)
        keep = pos < length[..., None]  # [*batch, max_len]
        keep = keep[..., None, :, None]  # against [*batch, heads, max_len, head_dim]
        for cell in (self.keys, self.values):
            cell[...] = jnp.where(keep, cell[...], jnp.zeros((), cell.dtype))
        self.cursor[...] = length


def _broadcasts(shape: tuple, to: tuple) -> bool:
    """Whether an array of `shape` broadcasts to `to` (NumPy's rule)."""
    try:
        return np.broadcast_shapes(shape, to) == tuple(to)
    except ValueError:
        return False
