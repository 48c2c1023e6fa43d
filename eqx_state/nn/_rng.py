from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Inexact, Key, PRNGKeyArray, UInt32

from .._buffer import RngState, _LayerBase
from .._errors import (
    StateTypeError,
    StateValueError,
    StateWriteError,
    check_axis_name,
    check_bool,
    check_int,
    check_real,
    is_whole,
)
from .._vmap import mapped_axes
from ._complex import refuse_non_array
from ._flag import inference_flag


KeyBatch = Key[Array, "*batch"] | UInt32[Array, "*batch 2"]
"""A typed key (`jax.random.key`) or a raw `uint32[2]` key, possibly batched."""


def as_key(seed_or_key: Any, where: str = "Rng") -> KeyBatch:
    """A JAX PRNG key from a seed (a Python or NumPy integer) or a key (typed, or
    raw `uint32[..., 2]`); else a `StateTypeError` naming `where` (the layer that
    takes it)."""
    if is_whole(seed_or_key):
        try:
            return jax.random.key(int(seed_or_key))  # type: ignore[arg-type]
        except OverflowError as e:
            raise StateValueError(
                f"{where}: the seed {int(seed_or_key)} does not fit in 64 bits; "  # type: ignore[arg-type]
                "give a seed in [-2**63, 2**63), or a key (`jax.random.key`)."
            ) from e
    key = seed_or_key
    if not isinstance(key, jax.Array):
        raise StateTypeError(
            f"{where} expects an integer seed or a JAX PRNG key "
            "(`jax.random.key(seed)`, or a raw `jax.random.PRNGKey(seed)`), got "
            f"{key!r} of type {type(key).__name__}."
        )
    is_typed = jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
    if not (is_typed or (key.dtype == jnp.uint32 and key.shape[-1:] == (2,))):
        raise StateTypeError(
            f"{where} expects an integer seed or a JAX PRNG key (`jax.random.key(seed)`, "
            "or a raw `jax.random.PRNGKey(seed)` of dtype uint32 and shape (2,)), got "
            f"an array of dtype {key.dtype} and shape {key.shape}."
        )
    return key


_VMAP_HINT = (
    "An `Rng` stream was drawn inside `jax.vmap`, but its key is not batched over "
    "that vmap: every vmapped example would get the same random numbers, and JAX "
    "cannot write the advanced key into an unbatched state cell. Do one of:\n"
    "  * call the layer on the whole batch instead of per example (outside the "
    "vmap): `Dropout` is elementwise, so `dropout(x)` with `x` of shape "
    "`[batch, ...]` draws an independent mask for every entry;\n"
    "  * or map per-example calls with `eqx_state.vmap(model, axis_name=name)` and "
    "build the layer with that axis name (`Dropout(p, key=..., axis_name=name)`, or "
    "draw with `rng.next_key(axis_name=name)`), so that each example gets its own "
    "key and the stream advances once per call;\n"
    "  * or vmap over models that each hold their own stream (an ensemble), e.g. "
    "`models = eqx.filter_vmap(make_model)(jax.random.split(key, n))`, so that the "
    "key cell has the vmapped axis."
)


class Rng(_LayerBase):
    """A random stream kept as state: a PRNG key in an [`eqx_state.RngState`][] cell,
    advanced on every draw, so that layers get fresh randomness on every call
    without any key plumbing.

    Each draw splits the current key `k` into `(new, sub)`, writes `new` back into
    the cell and returns `sub`. So the keys of a stream seeded with `k0` are exactly
    those of the hand-threaded loop `k, sub = jax.random.split(k)`: two runs from
    the same seed are identical, and two streams from different seeds are
    independent.

    The cell holds the key's raw `uint32` data (`jax.random.key_data`), so it is an
    ordinary integer array for every transformation, donation and serialisation;
    draws return keys of the kind the stream was seeded with (typed keys, with
    their PRNG implementation, or raw `uint32[2]` keys).

    A draw writes state: in value mode it runs inside [`eqx_state.make_step`][] /
    [`eqx_state.apply`][]; in ref mode ([`eqx_state.to_refs`][]) anywhere. An `Rng`
    has no `inference` field, so [`eqx.nn.inference_mode`](https://docs.kidger.site/equinox/api/nn/inference/)
    does not stop it; layers such as [`eqx_state.nn.Dropout`][] simply do not draw in
    evaluation.

    An `Rng` is a value like any Equinox layer: the same `Rng` object placed at two
    positions of a model is two streams that start from the same key (and so draw
    the same numbers). For one stream feeding several layers, keep it in one place
    and pass its keys (`dropout(x, key=self.rng())`), or declare the sharing with
    [`eqx.nn.Shared`](https://docs.kidger.site/equinox/api/nn/shared/). For
    independent streams from one seed, give each layer its own key
    (`jax.random.split`).

    **Arguments:**

    - `seed`: an integer seed (a typed key `jax.random.key(seed)` is made from it),
        or a key: a typed key from `jax.random.key`, or a raw `uint32[2]` key from
        `jax.random.PRNGKey`. The key is copied (a step donates state cells; the
        caller's key stays valid). A batch of keys makes a batch of streams (as
        `eqx.filter_vmap(Rng)(keys)` does), for ensembles.

    **Example:**

    ```python
    import jax
    import eqx_state as es

    rng = es.to_refs(es.nn.Rng(0))
    k1, k2 = rng.next_key(), rng.next_key()  # two different keys
    x = jax.random.normal(rng(), (3,))       # `rng()` is `rng.next_key()`
    ```
    """

    key: RngState
    impl: str | None = eqx.field(static=True)

    def __init__(self, seed: int | KeyBatch):
        key = as_key(seed)
        if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
            self.impl = str(jax.random.key_impl(key))
            data = jax.random.key_data(key)
        else:
            self.impl = None
            data = key
        # A copy: `make_step` donates state cells, which must not consume the
        # caller's key (users often reuse a key they passed in).
        self.key = RngState(jnp.copy(data))

    def _wrap(self, data: Array) -> KeyBatch:
        if self.impl is None:
            return data
        return jax.random.wrap_key_data(data, impl=self.impl)

    def _unwrap(self, key: Array) -> Array:
        return key if self.impl is None else jax.random.key_data(key)

    def peek(self) -> KeyBatch:
        """The stream's current key, without advancing it (the next draw splits
        it)."""
        return self._wrap(self.key[...])

    def next_key(
        self, num: int | None = None, *, axis_name: Hashable | None = None
    ) -> KeyBatch:
        """Draw from the stream: advance the key and return a fresh one.

        **Arguments:**

        - `num`: `None` for one key, or an integer for a batch of `num` keys (one
            draw: the stream advances once).
        - `axis_name`: for per-example calls under
            [`eqx_state.vmap`][]`(..., axis_name=name)`: the returned key is
            `jax.random.fold_in(key, jax.lax.axis_index(name))`, different for every
            example, while the stream advances once for the whole call (every example
            writes the same new key).

        **Returns:**

        A key of the stream's kind (typed or raw), of shape `()` (raw: `(2,)`), or a
        batch of `num` keys.
        """
        if num is not None:
            num = check_int("Rng.next_key", "num", num, 0)
        if axis_name is None and mapped_axes():
            raise StateWriteError(
                "An Rng stream was drawn from inside `es.vmap` without `axis_name`: "
                "every example would get the same key (the same dropout mask). Map "
                "with `es.vmap(model, axis_name=name)` and build the layer with "
                "`axis_name=name` (e.g. `Dropout(p, key=..., axis_name=name)`), so "
                "each example folds its index into the key; or call the layer on the "
                "whole batch."
            )
        mapped = mapped_axes()
        names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
        missing = [a for a in mapped if a is None or a not in names]
        if axis_name is not None and missing:
            unnamed = any(a is None for a in missing)
            raise StateWriteError(
                f"An Rng stream was drawn with axis_name={axis_name!r} inside "
                f"`es.vmap` calls over the axes {tuple(mapped)}: examples along "
                f"{tuple(missing)} would get the same key (the same dropout mask). "
                + (
                    "Name every `es.vmap` (`axis_name=...`) and pass "
                    if unnamed
                    else "Pass "
                )
                + "all of them, innermost last, e.g. "
                f"`axis_name={tuple(a for a in mapped if a is not None) or None!r}` "
                "(`Dropout(p, key=..., axis_name=...)`)."
            )
        current = self.peek()
        if num is None:
            new, out = jax.random.split(current)
        else:
            keys = jax.random.split(current, num + 1)
            new, out = keys[0], keys[1:]
        if axis_name is not None:
            out = jax.random.fold_in(out, jax.lax.axis_index(axis_name))
        try:
            self.key[...] = self._unwrap(new)
        except StateWriteError as e:
            if "jax.vmap" in str(e):
                raise StateWriteError(_VMAP_HINT) from e
            raise
        return out

    def __call__(
        self, num: int | None = None, *, axis_name: Hashable | None = None
    ) -> KeyBatch:
        """Same as `next_key(num, axis_name=axis_name)`."""
        return self.next_key(num, axis_name=axis_name)


class Dropout(_LayerBase):
    """Dropout that draws a fresh mask on every training call from a random stream
    kept in the model: no key plumbing.

    In training (the default) each entry of `x` is zeroed with probability `p` and
    the kept entries are scaled by `1 / (1 - p)`, with the mask drawn as
    `jax.random.bernoulli(key, 1 - p, x.shape)` from the next key of the stream (as
    `eqx.nn.Dropout` does with an explicit key). In evaluation
    ([`eqx.nn.inference_mode`](https://docs.kidger.site/equinox/api/nn/inference/)) it returns `x`
    unchanged and draws nothing, so no state is written. With `p=0` (identity) or
    `p=1` (zeros) the output does not depend on a mask, so nothing is drawn either.
    A dropped entry is 0, and NaN where `x` is NaN or infinite, as PyTorch's
    `x * mask * scale` gives (a kept infinite entry stays infinite).

    Call it on the whole batch: the mask has the shape of `x`, so every example
    gets its own. For per-example calls, map the model with
    [`eqx_state.vmap`][]`(model, axis_name=name)` and build the layer with
    `axis_name=name`: each example's mask then comes from its own key
    (`fold_in(key, axis_index)`), and the stream advances once per call. Under a
    plain `jax.vmap` a single stream would give every example the same mask; this
    raises a [`eqx_state.StateWriteError`][] that names the fixes, and so does a
    layer built without `axis_name` called under `eqx_state.vmap`.

    **Arguments:**

    - `p`: the probability of zeroing an entry, in `[0, 1]`.
    - `key`: a seed or key for a stream of its own (an [`eqx_state.nn.Rng`][] in the
        field `rng`). Without it, a key must be passed at every training call, as
        with `eqx.nn.Dropout` (e.g. drawn from an `Rng` the parent module keeps:
        `self.dropout(x, key=self.rng())`). To make several Dropouts draw from one
        stream, declare the sharing with `eqx.nn.Shared` (see the docs' "Sharing
        state" section).
    - `axis_name`: the vmapped axis of per-example calls (see above).
    - `inference`: start in evaluation mode.

    **Example:**

    ```python
    import jax, jax.numpy as jnp
    import eqx_state as es

    dropout = es.nn.Dropout(0.5, key=jax.random.key(0))
    y1, dropout = es.apply(lambda m, x: m(x), dropout, jnp.ones(8))
    y2, dropout = es.apply(lambda m, x: m(x), dropout, jnp.ones(8))
    # y1 and y2 have different masks; kept entries equal 2.0
    ```
    """

    rng: Rng | None
    p: float = eqx.field(static=True)
    axis_name: Hashable | None = eqx.field(static=True)
    inference: bool

    def __init__(
        self,
        p: float = 0.5,
        *,
        key: int | PRNGKeyArray | None = None,
        rng: Any = None,
        axis_name: Hashable | None = None,
        inference: bool = False,
    ):
        p = check_real("Dropout", "p", p)
        inference = check_bool("Dropout", "inference", inference)
        if not 0.0 <= p <= 1.0:
            raise StateValueError(f"Dropout: p must be in [0, 1], got {p}.")
        if rng is not None:
            raise StateTypeError(
                "Dropout(rng=...) was removed: an `Rng` is a value like any Equinox "
                "layer, so one `Rng` object given to two Dropouts would be two "
                "streams starting from the same key — the same masks. Give each "
                "Dropout its own stream (`Dropout(p, key=k)`, with keys from "
                "`jax.random.split`), pass keys drawn from one stream at the call "
                "(`dropout(x, key=self.rng())`), or declare one shared stream with "
                "`eqx.nn.Shared`."
            )
        self.p = float(p)
        self.rng = Rng(key) if key is not None else None
        self.axis_name = check_axis_name("Dropout", axis_name)
        self.inference = inference

    def __call__(
        self,
        x: Inexact[Array, "*shape"],
        *,
        key: PRNGKeyArray | None = None,
        inference: bool | None = None,
    ) -> Inexact[Array, "*shape"]:
        """Apply dropout to `x` (training) or return it unchanged (evaluation).

        **Arguments:**

        - `x`: any inexact array; usually a whole batch.
        - `key`: an explicit key for this call; the stream is then neither read nor
            advanced (as `eqx.nn.Dropout`). Also lets `eqx.nn.Sequential` pass its
            keys.
        - `inference`: overrides `self.inference` for this call.

        **Returns:**

        An array of the shape and dtype of `x`.
        """
        if inference is None:
            inference = inference_flag(self)
        if inference or self.p == 0.0:
            return x
        refuse_non_array("Dropout", x)
        if self.p == 1.0:
            # `x * 0`, as PyTorch: zeros, and NaN where `x` is NaN or infinite
            return x * jnp.zeros((), jnp.result_type(x))
        if not jnp.issubdtype(jnp.result_type(x), jnp.inexact):
            # the kept values are scaled by 1 / (1 - p): in an integer dtype that
            # scale would be truncated (to 1, or to inf for `x / 0`)
            raise StateTypeError(
                f"Dropout needs a floating-point input in training, got dtype "
                f"{jnp.result_type(x)} (as torch.nn.Dropout refuses it): the kept "
                "values are scaled by 1 / (1 - p). Convert it first, e.g. "
                "`x.astype(jnp.float32)`."
            )
        if key is None:
            if self.rng is None:
                raise StateValueError(
                    "This Dropout has no random stream and no key was passed. Build "
                    "it with `Dropout(p, key=jax.random.key(seed))` (a stream of its "
                    "own), or pass `key=` at every training call (e.g. drawn from an "
                    "`es.nn.Rng` the parent module keeps: `key=self.rng()`)."
                )
            key = self.rng.next_key(axis_name=self.axis_name)
        q = 1.0 - self.p
        mask = jax.random.bernoulli(key, q, x.shape)
        if jnp.dtype(x.dtype).itemsize < 4:
            # float16 / bfloat16: PyTorch's kept value, bit for bit: `x` times the
            # scale `1 / (1 - p)` rounded to the input's dtype (`x / q` with `q`
            # rounded first was 1 ulp off, e.g. 1.4277 for 1 / 0.7 in float16)
            kept = x * jnp.asarray(1.0 / q, x.dtype)
        else:
            kept = x / jnp.asarray(q, x.dtype)
        out = jnp.where(mask, kept, jnp.zeros((), x.dtype))
        # A dropped entry that is NaN or infinite gives NaN, as PyTorch's `x * mask
        # * scale` (`inf * 0`), so a diverged activation stays visible (docs/
        # misuse.md, "NaN and Inf in a batch"). Selected by `x`'s own finiteness:
        # a select between `kept` and `x * 0` by the mask alone is refused on a
        # mesh with explicit axes (the mask is drawn replicated, `x` is sharded).
        nan = jnp.asarray(jnp.nan, x.dtype)
        return jnp.where(jnp.isfinite(x), out, jnp.where(mask, kept, nan))
