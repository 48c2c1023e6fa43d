from __future__ import annotations

import math
from typing import Any, Literal, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from .._buffer import Cache, _LayerBase, is_state
from .._errors import (
    StateTypeError,
    StateValueError,
    check_bool,
    check_choice,
    check_dtype,
    check_int,
)
from .._modes import model_path
from ._complex import refuse_non_array
from ._kv_cache import _OVERFLOW, KVCache
from ._rng import as_key


_M = TypeVar("_M")


def _rows(
    proj: Any, x: Float[Array, "seq in"], matmul: bool
) -> Float[Array, "seq out"]:
    """`jax.vmap(proj)(x)`, or with `matmul` and an `eqx.nn.Linear` (exactly: not
    a subclass with its own `__call__`) one matmul `x @ W.T + b`: the same dot
    products. Both forms are the same function; they differ in what XLA's CPU
    backend makes of them, measured (`benchmarks/README.md`, `lm.py`, and
    `benchmarks/kv_cache.py`):

    - the full forward (training): the per-row form puts transposes around every
        matmul, 15-20% of a GPT's training step; the matmul form has none;
    - decoding with a cache: with the matmul form XLA lays the attention out so
        that it copies the cache on every call instead of updating it in place;
        the per-row form does not.

    Another projection (a wrapper put in with `eqx.tree_at`, e.g. a low-rank
    adapter) is always called per row."""
    if not matmul or type(proj) is not eqx.nn.Linear:
        return jax.vmap(proj)(x)
    y = x @ proj.weight.T
    return y if proj.bias is None else y + proj.bias


def _attend(
    q: Float[Array, "q heads d"],
    k: Float[Array, "..."],
    v: Float[Array, "..."],
    mask: Bool[Array, "q t"],
    kv_layout: str,
) -> Float[Array, "q heads d"]:
    # `kv_layout`: "khd" (the sequence's own keys, [t, heads, d]) or "hkd" (a
    # cache's, [heads, max_len, d]); einsum contracts either without a transpose
    dtype = jnp.result_type(q, k, v)
    if jnp.dtype(dtype).itemsize >= 4:
        logits = jnp.einsum(f"qhd,{kv_layout}->hqk", q, k) / math.sqrt(q.shape[-1])
        logits = jnp.where(mask, logits, jnp.finfo(logits.dtype).min)
        weights = jax.nn.softmax(logits, axis=-1)
        return jnp.einsum(f"hqk,{kv_layout}->qhd", weights, v)
    # bfloat16 / float16: the logits and the softmax in float32, the weights rounded
    # to the inputs' dtype and multiplied with the values accumulating in float32,
    # as PyTorch's CPU attention kernel computes them (in bfloat16 throughout, the
    # error against a float64 reference was 1.3-2.6x PyTorch's)
    f32 = jnp.float32
    logits = jnp.einsum(f"qhd,{kv_layout}->hqk", q, k, preferred_element_type=f32)
    logits = logits / math.sqrt(q.shape[-1])
    logits = jnp.where(mask, logits, jnp.finfo(f32).min)
    weights = jax.nn.softmax(logits, axis=-1).astype(dtype)
    out = jnp.einsum(f"hqk,{kv_layout}->qhd", weights, v, preferred_element_type=f32)
    return out.astype(dtype)


class CausalSelfAttention(_LayerBase):
    """Multi-head causal self-attention that decodes with a [`eqx_state.nn.KVCache`][]
    kept inside the layer.

    On a sequence `x` of shape `[seq, embed_dim]` (one example, Equinox's
    convention; `jax.vmap` it over a batch, with one cache per sequence:
    [`eqx_state.nn.with_kv_cache`][]`(..., batch_size=B)` and
    `in_axes=(es.nn.kv_cache_axes(model), 0)`) it computes
    `softmax(q k^T / sqrt(head_dim) + causal mask) v` per head, with `q, k, v` and
    the output from `eqx.nn.Linear` projections named as in
    `eqx.nn.MultiheadAttention` (`query_proj`, `key_proj`, `value_proj`,
    `output_proj`). In bfloat16 and float16 the logits and the softmax are
    computed in float32 and the weighted sum accumulates in float32, as PyTorch's
    attention computes them.

    - Without a cache (`cache=None`, the default): the full causal forward, position
        `i` attends to positions `0..i` of `x`.
    - With a cache ([`eqx_state.nn.with_kv_cache`][] or `max_len=`): `x` is the next
        chunk of the sequence (a prompt, or one token at a time). Its keys and values
        are written into the cache at the cursor, and position `i` of the chunk
        attends to every cached position up to `cursor + i`. Decoding a sequence chunk
        by chunk gives the same outputs as the full forward on the whole sequence.
        A layer called twice in one forward pass (one attention object used at
        two depths inside a `__call__`) writes both calls into its one cache, and
        the second attends over the first's keys: give each depth its own layer
        (the same layer object listed twice in a model gets a cache per place).
        Each call writes state: run it through [`eqx_state.apply`][] (value mode) or
        in ref mode ([`eqx_state.to_refs`][]).

    **Arguments:**

    - `embed_dim`: the size of the input and output features.
    - `num_heads`: the number of heads; must divide `embed_dim`.
    - `max_len`: if given, build the layer with a cache of this many positions.
    - `use_bias`: whether the projections have biases.
    - `dtype`: the dtype of the parameters and the cache (default float32).
    - `on_overflow`: the cache's overflow policy, see [`eqx_state.nn.KVCache`][].
    - `key`: a `jax.random.key` for the initialisation.

    **Example:**

    ```python
    import jax, jax.numpy as jnp
    import eqx_state as es

    attn = es.nn.CausalSelfAttention(8, num_heads=2, key=jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (5, 8))
    full = attn(x)                                  # the uncached causal forward
    cached = es.to_refs(es.nn.with_kv_cache(attn, max_len=16))
    steps = jnp.concatenate([cached(x[:3]), cached(x[3:4]), cached(x[4:5])])
    assert jnp.allclose(full, steps, atol=1e-5)
    ```
    """

    query_proj: eqx.nn.Linear
    key_proj: eqx.nn.Linear
    value_proj: eqx.nn.Linear
    output_proj: eqx.nn.Linear
    cache: KVCache | None
    embed_dim: int = eqx.field(static=True)
    num_heads: int = eqx.field(static=True)
    head_dim: int = eqx.field(static=True)

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        *,
        max_len: int | None = None,
        use_bias: bool = True,
        dtype=None,
        on_overflow: Literal["raise", "nan"] = "raise",
        key: PRNGKeyArray,
    ):
        embed_dim = check_int("CausalSelfAttention", "embed_dim", embed_dim, 1)
        num_heads = check_int("CausalSelfAttention", "num_heads", num_heads, 1)
        use_bias = check_bool("CausalSelfAttention", "use_bias", use_bias)
        if embed_dim % num_heads:
            raise StateValueError(
                f"CausalSelfAttention: num_heads={num_heads} must divide "
                f"embed_dim={embed_dim}."
            )
        dtype = check_dtype("CausalSelfAttention", "dtype", dtype)
        if not jnp.issubdtype(dtype, jnp.inexact):
            raise StateTypeError(
                "CausalSelfAttention: dtype must be a floating (or complex) dtype, "
                f"got {dtype.name}: its projections are trained."
            )
        check_choice("CausalSelfAttention", "on_overflow", on_overflow, _OVERFLOW)
        key = as_key(key, "CausalSelfAttention(key=...)")
        kq, kk, kv, ko = jax.random.split(key, 4)
        lin = lambda k: eqx.nn.Linear(  # noqa: E731
            embed_dim, embed_dim, use_bias=use_bias, dtype=dtype, key=k
        )
        self.query_proj, self.key_proj = lin(kq), lin(kk)
        self.value_proj, self.output_proj = lin(kv), lin(ko)
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.cache = (
            None
            if max_len is None
            else KVCache(
                max_len, num_heads, self.head_dim, dtype=dtype, on_overflow=on_overflow
            )
        )

    def position(self) -> Int[Array, "*batch"]:
        """The position of the next input: the cache's cursor, or 0 without a cache
        (for positional encodings)."""
        if self.cache is None:
            return jnp.zeros((), jnp.int32)
        return self.cache.length

    def _heads(self, proj: Any, x: Array, matmul: bool) -> Array:
        y = _rows(proj, x, matmul)
        return y.reshape(x.shape[0], self.num_heads, self.head_dim)

    def __call__(
        self, x: Float[Array, "seq embed"], *, key: PRNGKeyArray | None = None
    ) -> Float[Array, "seq embed"]:
        """Attend causally over `x` (and, with a cache, over the cached positions).

        **Arguments:**

        - `x`: `[seq, embed_dim]`: the whole sequence (no cache) or its next chunk
            (with a cache).
        - `key`: ignored; accepted for compatibility with `eqx.nn.Sequential`.

        **Returns:**

        `[seq, embed_dim]`.
        """
        del key
        refuse_non_array("CausalSelfAttention", x)
        if x.ndim != 2 or x.shape[1] != self.embed_dim:
            raise StateValueError(
                f"CausalSelfAttention(embed_dim={self.embed_dim}) expects one sequence "
                f"of shape [seq, {self.embed_dim}], got {x.shape}. For a batch, use "
                "`jax.vmap(attn)(x)`."
            )
        seq = x.shape[0]
        matmul = self.cache is None  # see `_rows`
        q = self._heads(self.query_proj, x, matmul)
        k = self._heads(self.key_proj, x, matmul)
        v = self._heads(self.value_proj, x, matmul)
        if self.cache is None:
            mask = jnp.tril(jnp.ones((seq, seq), bool))
            layout = "khd"
        else:
            start, k, v = self.cache.append(k, v)
            if self.cache.on_overflow == "nan":  # an overflowing chunk: NaN out
                over = start + seq > self.cache.max_len
                q = jnp.where(over, jnp.asarray(jnp.nan, q.dtype), q)
            query_pos = start + jnp.arange(seq, dtype=start.dtype)
            key_pos = jnp.arange(self.cache.max_len, dtype=start.dtype)
            mask = key_pos[None, :] <= query_pos[:, None]
            layout = "hkd"
        out = _attend(q, k, v, mask, layout).reshape(seq, self.embed_dim)
        return _rows(self.output_proj, out, matmul)


def _is_attn(x: Any) -> bool:
    return isinstance(x, CausalSelfAttention)


def with_kv_cache(
    model: Any,
    max_len: int,
    *,
    batch_size: int | None = None,
    dtype=None,
    on_overflow: Literal["raise", "nan"] = "raise",
) -> Any:
    """Give every [`eqx_state.nn.CausalSelfAttention`][] in `model` a fresh, empty
    [`eqx_state.nn.KVCache`][] of `max_len` positions (replacing any cache it had),
    switching it from the full causal forward to chunk-by-chunk decoding.

    **Arguments:**

    - `model`: any pytree holding attention layers.
    - `max_len`: the positions each cache holds (prompt plus generated tokens).
    - `batch_size`: if given, each cache holds this many sequences: every cell
        gets a leading batch axis (one cursor per sequence). Decode the batch by
        mapping the per-sequence model with
        `jax.vmap(model, in_axes=(es.nn.kv_cache_axes(model), 0))`. A batched
        model (parameters stacked over a leading axis, from `eqx.filter_vmap`)
        needs it, equal to that axis's size, and is decoded with `jax.vmap` over
        model and input; without it a `ValueError` names the size.
    - `dtype`: the cache dtype (default: the dtype of the layer's key projection).
    - `on_overflow`: `"raise"` or `"nan"`, see [`eqx_state.nn.KVCache`][].

    **Returns:**

    The model with caches, in value mode (call [`eqx_state.to_refs`][] for ref mode).

    **Example:**

    ```python
    import jax
    import eqx_state as es

    attn = es.nn.CausalSelfAttention(8, num_heads=2, key=jax.random.key(0))
    decoder = es.nn.with_kv_cache(attn, max_len=32)
    ```
    """

    if batch_size is not None:
        batch_size = check_int("with_kv_cache", "batch_size", batch_size, 1)

    found = 0

    def one(path: Any, x: Any) -> Any:
        nonlocal found
        if not _is_attn(x):
            return x
        found += 1
        _check_stacked(model_path(path), x, batch_size)
        cache = KVCache(
            max_len,
            x.num_heads,
            x.head_dim,
            dtype=x.key_proj.weight.dtype if dtype is None else dtype,
            on_overflow=on_overflow,
        )
        if batch_size is not None:
            cache = jax.tree.map(
                lambda a: jnp.zeros((batch_size, *a.shape), a.dtype), cache
            )
        return eqx.tree_at(lambda a: a.cache, x, cache, is_leaf=lambda c: c is None)

    out = jax.tree_util.tree_map_with_path(one, model, is_leaf=_is_attn)
    if not found:
        # a silent no-op would decode with the full causal forward on each chunk:
        # every token attending only to its own chunk, a wrong number, no error
        raise StateValueError(
            f"with_kv_cache: found no es.nn.CausalSelfAttention in the "
            f"{type(model).__name__} given, so there is nothing to give a cache. "
            "Build the model's attention from es.nn.CausalSelfAttention (other "
            "attention layers keep no cache), or give a KVCache to your own layer."
        )
    return out


def _check_stacked(where: str, attn: CausalSelfAttention, batch_size: int | None):
    """A layer of a batched model (stacked parameters, from `eqx.filter_vmap`) is
    mapped over its leading axis by `jax.vmap`: its cache needs that axis too."""
    shape: tuple[int, ...] = tuple(attn.key_proj.weight.shape)
    lead: tuple[int, ...] = shape[:-2]
    if not lead or (batch_size is not None and lead == (batch_size,)):
        return
    at = f" at `{where}`" if where else ""
    if len(lead) > 1 or batch_size is not None:
        raise StateValueError(
            f"with_kv_cache: the attention layer{at} has parameters stacked over "
            f"the axes {lead} (key_proj.weight of shape {shape}), and a cache can "
            f"have one leading batch axis: batch_size={batch_size} does not match. "
            "Give a model stacked over one axis, with batch_size equal to its size."
        )
    raise StateValueError(
        f"with_kv_cache: the attention layer{at} has parameters stacked over a "
        f"leading axis of size {shape[0]} (key_proj.weight of shape {shape}): a "
        "batched model (built with `eqx.filter_vmap`, or layers stacked for "
        "`lax.scan`), which `jax.vmap` or `lax.scan` map over that axis, so each "
        "slice needs its own cache (without it, JAX fails with 'rank should be at "
        "least 1'). Build the caches with that axis: "
        f"`es.nn.with_kv_cache(model, max_len, batch_size={shape[0]})`."
    )


def without_kv_cache(model: Any) -> Any:
    """Remove the cache of every [`eqx_state.nn.CausalSelfAttention`][] in `model`:
    back to the full causal forward (for training or scoring whole sequences).

    **Arguments:**

    - `model`: any pytree holding attention layers.

    **Returns:**

    The model without caches; parameters are shared with `model`.
    """

    def one(x: Any) -> Any:
        if not _is_attn(x) or x.cache is None:
            return x
        return eqx.tree_at(lambda a: a.cache, x, None)

    return jax.tree_util.tree_map(one, model, is_leaf=_is_attn)


def _is_cache(x: Any) -> bool:
    return isinstance(x, KVCache)


def kv_cache_axes(model: Any) -> Any:
    """The `in_axes` of `model` for `jax.vmap` over a batch of sequences whose caches
    were built with [`eqx_state.nn.with_kv_cache`][]`(..., batch_size=B)`: `0` for
    every [`eqx_state.nn.KVCache`][] (its cells have the batch axis), `None` for
    everything else (the parameters are shared).

    **Arguments:**

    - `model`: any pytree holding caches.

    **Returns:**

    A pytree prefix of `model` to pass as its entry of `in_axes`.

    **Raises:**

    `ValueError` for a cache without a batch axis (built without `batch_size=`),
    which `jax.vmap` could not map: it names `with_kv_cache(..., batch_size=B)`.

    **Example:**

    ```python
    import jax, jax.numpy as jnp
    import eqx_state as es

    attn = es.nn.CausalSelfAttention(8, num_heads=2, key=jax.random.key(0))
    batch = es.to_refs(es.nn.with_kv_cache(attn, max_len=16, batch_size=3))
    axes = es.nn.kv_cache_axes(batch)
    x = jax.random.normal(jax.random.key(1), (3, 4, 8))  # 3 sequences
    y = jax.vmap(lambda m, x: m(x), in_axes=(axes, 0))(batch, x)
    assert y.shape == (3, 4, 8) and batch.cache.length.tolist() == [4, 4, 4]
    ```
    """

    def axis(x: Any) -> int | None:
        if not _is_cache(x):
            return None
        if not x.cursor.value.ndim:
            raise StateValueError(
                f"kv_cache_axes: a KVCache of this model holds one sequence (its "
                f"cells have no batch axis: keys of shape {tuple(x.keys.shape)}), "
                "so `jax.vmap` cannot map it. Build the caches with a batch axis, "
                "`es.nn.with_kv_cache(model, max_len, batch_size=B)`, for B "
                "sequences decoded together."
            )
        return 0

    return jax.tree.map(axis, model, is_leaf=_is_cache)


def truncate_kv_cache(model: _M, length: int | Int[Array, "*batch"]) -> _M:
    """[`KVCache.truncate`][eqx_state.nn.KVCache.truncate] every cache in `model`:
    keep the first `length` positions, zero the rest. After prefilling a batch of
    prompts padded to one length, pass each prompt's length: each sequence then
    continues (writes and attends) from its own last token.

    * Value mode (outside a step): returns a new model; `model` is unchanged.
    * Ref mode ([`eqx_state.to_refs`][]), or inside [`eqx_state.apply`][] /
      [`eqx_state.make_step`][]: the cells are written in place, and the model is
      returned too, so `model = truncate_kv_cache(model, n)` works in both modes.

    **Arguments:**

    - `model`: any pytree holding caches.
    - `length`: the new length: one for every sequence, or one per sequence
        (shape `[batch_size]`) for caches built with `batch_size`.

    **Returns:**

    The model with truncated caches.
    """
    cells = [
        c for c in jax.tree.leaves(model, is_leaf=is_state) if isinstance(c, Cache)
    ]
    if all(isinstance(c.value, jax.Ref) for c in cells):
        _truncate_in_place(model, length)
        return model
    from .._step import apply  # a value-mode model: write through a pure apply

    _, model = apply(_truncate_in_place, model, length)
    return model


def _truncate_in_place(model: Any, length: Any) -> None:
    for leaf in jax.tree.leaves(model, is_leaf=_is_cache):
        if isinstance(leaf, KVCache):
            leaf.truncate(length)
