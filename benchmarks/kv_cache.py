"""KV-cache decoding: eqx_state's `KVCache` against a hand-written pure-JAX cache loop.

Greedy decoding of the tiny causal transformer of `examples/decode_kv_cache.py`
(token + position embeddings, blocks of `es.nn.CausalSelfAttention` + MLP with
pre-LayerNorm, output head). After a prefill of `--prompt-len` tokens, every variant
decodes `--tokens` tokens, one position at a time, attending over a cache of
`--max-len` positions per layer:

- `pure_jax`: hand-written JAX: the same transformer as pure functions of a weight
  dict, the cache a tuple of `(keys, values)` arrays per layer and a cursor, updated
  with `lax.dynamic_update_slice`; one `jax.jit(..., donate_argnums=cache)` call per
  token. The reference (ratio 1.0) for the per-token variants.
- `pure_jax_scan`: the same, all tokens in one jitted `lax.scan` (cache donated);
  the reference for the scan variants.
- `pure_jax_nodonate`: `pure_jax` without donation: every token copies the cache.
  A control for the memory columns (a copy must show there).
- `es_value`: the eqx_state model in value mode: one `eqx.filter_jit` call per token
  around `es.apply`, donating the state cells only (parameters are not donated).
- `es_value_jit`: the same with `jax.jit` over the flat list of state arrays
  (donated) instead of `eqx.filter_jit` over the model: what a compiled `es.apply`
  with donation costs without Equinox's per-call filtering.
- `es_value_scan`: value mode, `es.apply` around a `lax.scan` over the tokens (the
  example's decoder), jitted as `es_value_jit`, state cells donated.
- `es_ref`: ref mode (`es.to_refs`): one `eqx.filter_jit` call per token, the cache
  refs written in place.
- `es_ref_scan`: ref mode, one jitted `lax.scan`.

Correctness first: every variant decodes the same prompt; its tokens must equal the
hand-written loop's, and its logits must match the uncached full forward on the
decoded sequence. Then the variants are timed in interleaved rounds (the order
rotated each round), each round decoding `--tokens` tokens from a fresh cache between
two `jax.block_until_ready`. The table reports the median µs per token with the
min–max over rounds, the median ratio to the hand-written loop of the same kind
(per-token or scan) in the same round, and memory:

- `XLA extra MB`: from the compiled decode step's memory analysis: the output bytes
  that do not alias an input plus temporaries. An in-place cache update keeps this
  far below the cache size; a copy adds the whole cache.
- `peak MB`: the peak memory while decoding, above what was in use just before
  (model, cache and compiled steps): on GPU/TPU the device's `peak_bytes_in_use`,
  each variant in a fresh process (the counter cannot be reset; that process runs
  the variant once to compile it, so its peak is an upper bound); on Linux CPU the
  process's peak RSS (`VmHWM`, reset through `/proc/self/clear_refs` before each
  variant), which is noisier: the allocator may serve a copy from memory it already
  holds.

Printed as Markdown, written to `results_kv_cache.md`, and plotted to `kv_cache.png`
in `--out`. Run: `python benchmarks/kv_cache.py` (`--tiny` for a seconds-long smoke
run).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.util
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import eqx_state as es


_ROOT = Path(__file__).resolve().parent.parent


def _stats() -> Any:
    """`benchmarks/bench_stats.py` (ratios with bootstrap intervals), loaded once."""
    name = "bench_stats"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            name, _ROOT / "benchmarks" / f"{name}.py"
        )
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def _load_example() -> Any:
    name = "_decode_kv_cache_example"
    if name in sys.modules:
        return sys.modules[name]
    path = _ROOT / "examples" / "decode_kv_cache.py"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


ex = _load_example()


@dataclasses.dataclass(frozen=True)
class Config:
    vocab: int
    dim: int
    heads: int
    layers: int
    max_len: int
    prompt_len: int
    tokens: int
    seed: int = 0
    on_overflow: Literal["raise", "nan"] = "raise"  # eqx_state's overflow check

    @property
    def cache_bytes(self) -> int:
        return 2 * self.layers * self.max_len * self.dim * 4


DEFAULT = Config(
    vocab=256, dim=256, heads=8, layers=4, max_len=8192, prompt_len=16, tokens=64
)
TINY = Config(vocab=32, dim=32, heads=4, layers=2, max_len=48, prompt_len=4, tokens=8)


def build(cfg: Config) -> tuple[Any, jax.Array]:
    key_model, key_prompt = jax.random.split(jax.random.key(cfg.seed))
    model = ex.TinyTransformer(
        cfg.vocab, cfg.dim, cfg.heads, cfg.layers, cfg.max_len, key=key_model
    )
    prompt = jax.random.randint(key_prompt, (cfg.prompt_len,), 0, cfg.vocab)
    return model, prompt


# ---------------------------------------------------------------------------------
# The hand-written reference: the same transformer as pure functions.


def pure_weights(model: Any) -> dict[str, Any]:
    """The model's weights as a plain dict (own copies: nothing is shared with the
    eqx_state variants, which donate their buffers)."""

    def lin(m):
        return (m.weight, m.bias)

    def ln(m):
        return (m.weight, m.bias)

    w = {
        "embed": model.embed.weight,
        "pos": model.pos,
        "blocks": [
            {
                "ln1": ln(b.ln1),
                "q": lin(b.attn.query_proj),
                "k": lin(b.attn.key_proj),
                "v": lin(b.attn.value_proj),
                "o": lin(b.attn.output_proj),
                "ln2": ln(b.ln2),
                "fc1": lin(b.fc1),
                "fc2": lin(b.fc2),
            }
            for b in model.blocks
        ],
        "ln_f": ln(model.ln_f),
        "head": lin(model.head),
    }
    return jax.tree.map(lambda a: jnp.array(a, copy=True), w)


def _layer_norm(x, wb, eps=1e-5):
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + eps) * wb[0] + wb[1]


def _linear(x, wb):
    # `x @ W.T`, contracting W's input axis directly (`x @ wb[0].T` makes XLA on CPU
    # materialise the transposed weight at every step)
    return jax.lax.dot_general(x, wb[0], (((1,), (1,)), ((), ()))) + wb[1]


def pure_forward(w, heads: int, tokens, cache):
    """Logits for the chunk `tokens` and the new cache `(layers, cursor)`, where
    `layers` is a tuple of `(keys, values)` of shape `[heads, max_len, head_dim]`
    (heads first, so that attention needs no transposed copy of the cache)."""
    layers, start = cache
    seq = tokens.shape[0]
    x = w["embed"][tokens] + jax.lax.dynamic_slice_in_dim(w["pos"], start, seq)
    new_layers = []
    for b, (kc, vc) in zip(w["blocks"], layers, strict=True):
        h = _layer_norm(x, b["ln1"])
        dim = h.shape[-1]
        hd = dim // heads
        q = _linear(h, b["q"]).reshape(seq, heads, hd)
        k, v = (
            _linear(h, b[n]).reshape(seq, heads, hd).transpose(1, 0, 2) for n in "kv"
        )
        zero = jnp.zeros((), start.dtype)
        kc = jax.lax.dynamic_update_slice(kc, k, (zero, start, zero))
        vc = jax.lax.dynamic_update_slice(vc, v, (zero, start, zero))
        new_layers.append((kc, vc))
        logits = jnp.einsum("qhd,htd->hqt", q, kc) / math.sqrt(hd)
        mask = jnp.arange(kc.shape[1])[None, :] <= (start + jnp.arange(seq))[:, None]
        logits = jnp.where(mask, logits, jnp.finfo(logits.dtype).min)
        att = jnp.einsum("hqt,htd->qhd", jax.nn.softmax(logits, axis=-1), vc)
        x = x + _linear(att.reshape(seq, dim), b["o"])
        h = _layer_norm(x, b["ln2"])
        x = x + _linear(jax.nn.gelu(_linear(h, b["fc1"])), b["fc2"])
    logits = _linear(_layer_norm(x, w["ln_f"]), w["head"])
    return logits, (tuple(new_layers), start + seq)


def pure_empty_cache(cfg: Config):
    hd = cfg.dim // cfg.heads
    shape = (cfg.heads, cfg.max_len, hd)
    layers = tuple(
        (jnp.zeros(shape, jnp.float32), jnp.zeros(shape, jnp.float32))
        for _ in range(cfg.layers)
    )
    return layers, jnp.zeros((), jnp.int32)


def _next(logits):
    return jnp.argmax(logits[-1]).astype(jnp.int32)


# ---------------------------------------------------------------------------------
# Variants. `reset()` gives a fresh empty cache (not timed); `prefill(prompt)` feeds
# the prompt and returns the first generated token; `decode(token, n)` generates `n`
# tokens and returns `(tokens, logits)` (device arrays, not blocked on).
# `compiled_step()` is the jitted decode executable whose memory analysis is shown.


class Variant:
    name: str
    label: str
    kind: str  # "token" or "scan": which hand-written loop it is compared with

    def __init__(self, cfg: Config, model: Any):
        self.cfg = cfg

    def reset(self) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def prefill(self, prompt: jax.Array) -> jax.Array:  # pragma: no cover
        raise NotImplementedError

    def decode(self, token: jax.Array, n: int) -> tuple[jax.Array, jax.Array]:
        tokens, logits = [], []
        for _ in range(n):
            token, lg = self.step(token)
            tokens.append(token)
            logits.append(lg)
        return jnp.stack(tokens), jnp.stack(logits)

    def step(self, token: jax.Array) -> tuple[jax.Array, jax.Array]:  # pragma: no cover
        raise NotImplementedError

    def memory_analysis(self, token: jax.Array) -> Any:  # pragma: no cover
        raise NotImplementedError


class PureJax(Variant):
    name = "pure_jax"
    label = "hand-written JAX, jax.jit per token, cache donated"
    kind = "token"
    donate = True

    def __init__(self, cfg, model):
        super().__init__(cfg, model)
        self.w = pure_weights(model)
        heads = cfg.heads

        def prefill(cache, w, prompt):
            logits, cache = pure_forward(w, heads, prompt, cache)
            return cache, _next(logits)

        def step(cache, w, token):
            logits, cache = pure_forward(w, heads, token[None], cache)
            return cache, _next(logits), logits[0]

        donate = (0,) if self.donate else ()
        self._prefill = jax.jit(prefill, donate_argnums=donate)
        self._step = jax.jit(step, donate_argnums=donate)
        self.reset()

    def reset(self):
        self.cache = pure_empty_cache(self.cfg)

    def prefill(self, prompt):
        self.cache, token = self._prefill(self.cache, self.w, prompt)
        return token

    def step(self, token):
        self.cache, token, logits = self._step(self.cache, self.w, token)
        return token, logits

    def memory_analysis(self, token):
        return self._step.lower(self.cache, self.w, token).compile().memory_analysis()


class PureJaxNoDonate(PureJax):
    name = "pure_jax_nodonate"
    label = "hand-written JAX, jax.jit per token, no donation (copies the cache)"
    donate = False


class PureJaxScan(PureJax):
    name = "pure_jax_scan"
    label = "hand-written JAX, one jitted lax.scan, cache donated"
    kind = "scan"

    def __init__(self, cfg, model):
        super().__init__(cfg, model)
        heads = cfg.heads

        @functools.partial(jax.jit, donate_argnums=(0,), static_argnums=(3,))
        def decode(cache, w, token, n):
            def body(carry, _):
                cache, token = carry
                logits, cache = pure_forward(w, heads, token[None], cache)
                new = _next(logits)
                return (cache, new), (new, logits[0])

            (cache, _), out = jax.lax.scan(body, (cache, token), None, length=n)
            return cache, out

        self._decode = decode

    def decode(self, token, n):
        self.cache, (tokens, logits) = self._decode(self.cache, self.w, token, n)
        return tokens, logits

    def memory_analysis(self, token):
        lowered = self._decode.lower(self.cache, self.w, token, self.cfg.tokens)
        return lowered.compile().memory_analysis()


def _es_prefill(model, prompt):
    return _next(model(prompt))


def _es_step(model, token):
    logits = model(token[None])
    return _next(logits), logits[0]


def _es_scan(model, token, n):
    def body(token, _):
        new, logits = _es_step(model, token)
        return new, (new, logits)

    return jax.lax.scan(body, token, None, length=n)[1]


def _state_only(model):
    return eqx.filter(model, es.is_state, is_leaf=es.is_state)


@eqx.filter_jit(donate="all-except-first")
def _value_call(fn_rest_args, state):
    """`es.apply(fn, model, *args)` on `model = state + rest`, returning only the new
    state: the state cells are donated and updated in place, the parameters (in the
    first, non-donated argument) are neither donated nor copied."""
    fn, rest, args = fn_rest_args
    model = eqx.combine(state, rest, is_leaf=es.is_state)
    out, model = es.apply(fn, model, *args)
    return out, _state_only(model)


class EsValue(Variant):
    name = "es_value"
    label = "eqx_state value mode, eqx.filter_jit(es.apply) per token, state donated"
    kind = "token"

    def __init__(self, cfg, model):
        super().__init__(cfg, model)
        self.model = model
        self.reset()

    def reset(self):
        cached = es.nn.with_kv_cache(
            self.model, self.cfg.max_len, on_overflow=self.cfg.on_overflow
        )
        self.state, self.rest = eqx.partition(cached, es.is_state, is_leaf=es.is_state)

    def _call(self, fn, *args):
        out, self.state = _value_call((fn, self.rest, args), self.state)
        return out

    def prefill(self, prompt):
        return self._call(_es_prefill, prompt)

    def step(self, token):
        return self._call(_es_step, token)

    def memory_analysis(self, token):
        lowered = _value_call.lower((_es_step, self.rest, (token,)), self.state)
        return lowered.compile().compiled.memory_analysis()


class EsValueJit(EsValue):
    name = "es_value_jit"
    label = "eqx_state value mode, jax.jit(es.apply) on the state leaves, donated"
    kind = "token"

    def reset(self):
        super().reset()
        self._leaves, self._state_def = jax.tree.flatten(self.state)
        self._rest_arrays, self._rest_static = eqx.partition(self.rest, eqx.is_array)

    def _jit(self, fn, *static):
        """What a compiled `es.apply` with donation does: the state cells' arrays
        are the only donated argument; parameters pass through undonated and
        uncopied. A flat list of arrays keeps `jax.jit` on its C++ fast path."""
        cache = self.__dict__.setdefault("_jitted", {})
        if (fn, static) not in cache:
            state_def, rest_static = self._state_def, self._rest_static

            def call(leaves, rest_arrays, *args):
                state = jax.tree.unflatten(state_def, leaves)
                rest = eqx.combine(rest_arrays, rest_static)
                model = eqx.combine(state, rest, is_leaf=es.is_state)
                out, model = es.apply(fn, model, *args, *static)
                return out, jax.tree.leaves(_state_only(model))

            cache[(fn, static)] = jax.jit(call, donate_argnums=(0,))
        return cache[(fn, static)]

    def _call(self, fn, *args, static=()):
        jitted = self._jit(fn, *static)
        out, self._leaves = jitted(self._leaves, self._rest_arrays, *args)
        return out

    def memory_analysis(self, token):
        lowered = self._jit(_es_step).lower(self._leaves, self._rest_arrays, token)
        return lowered.compile().memory_analysis()


class EsValueScan(EsValueJit):
    name = "es_value_scan"
    label = "eqx_state value mode, jax.jit(es.apply) around one lax.scan, donated"
    kind = "scan"

    def decode(self, token, n):
        return self._call(_es_scan, token, static=(n,))

    def memory_analysis(self, token):
        jitted = self._jit(_es_scan, self.cfg.tokens)
        lowered = jitted.lower(self._leaves, self._rest_arrays, token)
        return lowered.compile().memory_analysis()


def _is_kv_cache(x):
    return isinstance(x, es.nn.KVCache)


_ref_call = eqx.filter_jit(lambda fn, model, *args: fn(model, *args))


class EsRef(Variant):
    name = "es_ref"
    label = "eqx_state ref mode (es.to_refs), eqx.filter_jit per token, in place"
    kind = "token"

    def __init__(self, cfg, model):
        super().__init__(cfg, model)
        cached = es.nn.with_kv_cache(model, cfg.max_len, on_overflow=cfg.on_overflow)
        self.model = es.to_refs(cached)

    def reset(self):
        # Zeros and cursor 0 (what es.reset(model, es.Cache) writes). Eager: writes
        # into the refs.
        for leaf in jax.tree.leaves(self.model, is_leaf=_is_kv_cache):
            if _is_kv_cache(leaf):
                leaf.reset()

    def prefill(self, prompt):
        return _ref_call(_es_prefill, self.model, prompt)

    def step(self, token):
        return _ref_call(_es_step, self.model, token)

    def memory_analysis(self, token):
        lowered = _ref_call.lower(_es_step, self.model, token)
        return lowered.compile().compiled.memory_analysis()


class EsRefScan(EsRef):
    name = "es_ref_scan"
    label = "eqx_state ref mode, one jitted lax.scan, in place"
    kind = "scan"

    def decode(self, token, n):
        return _ref_call(_es_scan, self.model, token, n)

    def memory_analysis(self, token):
        lowered = _ref_call.lower(_es_scan, self.model, token, self.cfg.tokens)
        return lowered.compile().compiled.memory_analysis()


class EsMakeApply(Variant):
    name = "es_make_apply"
    label = "eqx_state value mode, es.make_apply per token (state donated)"
    kind = "token"
    ref_mode = False

    def __init__(self, cfg, model):
        super().__init__(cfg, model)
        self.model = model
        self.prefill_fn = es.make_apply(_es_prefill)
        self.step_fn = es.make_apply(_es_step)
        self.reset()

    def reset(self):
        cached = es.nn.with_kv_cache(
            self.model, self.cfg.max_len, on_overflow=self.cfg.on_overflow
        )
        self.cached = es.to_refs(cached) if self.ref_mode else cached

    def prefill(self, prompt):
        out, self.cached = self.prefill_fn(self.cached, prompt)
        return out

    def step(self, token):
        out, self.cached = self.step_fn(self.cached, token)
        return out

    def memory_analysis(self, token):
        # the program a call on the current cache runs
        return self.step_fn.lower(self.cached, token).compile().memory_analysis()


class EsRefMakeApply(EsMakeApply):
    name = "es_ref_make_apply"
    label = "eqx_state ref mode, es.make_apply per token (buffers passed by value)"
    kind = "token"
    ref_mode = True


VARIANTS: dict[str, type[Variant]] = {
    v.name: v
    for v in (
        PureJax,
        PureJaxScan,
        PureJaxNoDonate,
        EsValue,
        EsValueJit,
        EsValueScan,
        EsRef,
        EsRefScan,
        EsMakeApply,
        EsRefMakeApply,
    )
}
BASELINE = {"token": "pure_jax", "scan": "pure_jax_scan"}


# ---------------------------------------------------------------------------------
# Correctness, memory, timing


def run_once(v: Variant, prompt: jax.Array, n: int) -> tuple[np.ndarray, np.ndarray]:
    v.reset()
    first = v.prefill(prompt)
    tokens, logits = v.decode(first, n)
    return np.asarray(jnp.concatenate([first[None], tokens])), np.asarray(logits)


def check(
    variants: dict[str, Variant], model: Any, prompt: jax.Array, n: int
) -> dict[str, dict[str, Any]]:
    """Every variant decodes the prompt; the tokens must equal the hand-written
    loop's, the logits the uncached full forward's. Raises AssertionError naming the
    variant otherwise."""
    ref = PureJax(variants[next(iter(variants))].cfg, model)
    want_tokens, _ = run_once(ref, prompt, n)
    # The uncached forward on prompt + generated tokens: the logits at the positions
    # of the decode steps (each predicts the token after it).
    seq = jnp.concatenate([prompt, jnp.asarray(want_tokens[:-1])])
    full = np.asarray(model(seq))[len(prompt) :]
    scale = max(1.0, float(np.max(np.abs(full))))
    info = {}
    for name, v in variants.items():
        t0 = time.perf_counter()
        tokens, logits = run_once(v, prompt, n)
        compile_s = time.perf_counter() - t0
        np.testing.assert_array_equal(
            tokens, want_tokens, err_msg=f"{name}: decoded tokens differ"
        )
        err = float(np.max(np.abs(logits - full)))
        assert err <= 1e-4 * scale, (
            f"{name}: logits differ from the uncached forward by {err}"
        )
        info[name] = {"checked": True, "max_abs_diff": err, "compile_s": compile_s}
    return info


def memory_columns(v: Variant, cfg: Config) -> dict[str, float]:
    ma = v.memory_analysis(jnp.zeros((), jnp.int32))
    out = float(ma.output_size_in_bytes)
    alias = float(ma.alias_size_in_bytes)
    temp = float(ma.temp_size_in_bytes)
    return {
        "xla_extra_mb": (max(out - alias, 0.0) + temp) / 2**20,
        "xla_alias_mb": alias / 2**20,
    }


def time_variants(
    variants: dict[str, Variant], prompt: jax.Array, rounds: int, n: int
) -> dict[str, list[float]]:
    """Seconds per decoded token for each variant and round; variants interleaved
    in every round, the order rotated from round to round."""
    names = list(variants)
    per_round: dict[str, list[float]] = {k: [] for k in names}
    for r in range(rounds):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            v = variants[name]
            v.reset()
            first = jax.block_until_ready(v.prefill(prompt))
            t0 = time.perf_counter()
            tokens, logits = v.decode(first, n)
            jax.block_until_ready((tokens, logits))
            per_round[name].append((time.perf_counter() - t0) / n)
    return per_round


def _device_stats() -> dict[str, Any] | None:
    stats = jax.devices()[0].memory_stats()
    if not stats or "peak_bytes_in_use" not in stats:
        return None
    return stats


def _proc_status_bytes(field: str) -> float:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(field + ":"):
                return float(line.split()[1]) * 1024  # reported in kB
    raise KeyError(field)


def _reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark (VmHWM) to the current RSS (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
        return True
    except OSError:
        return False


def decode_peak(v: Variant, prompt: jax.Array, n: int, source: str) -> float:
    """Bytes in use at the peak of decoding `n` tokens, above those in use just
    before (the model, the cache and the compiled steps are already there)."""
    v.reset()
    first = jax.block_until_ready(v.prefill(prompt))
    if source == "device_peak":
        stats = _device_stats()
        assert stats is not None
        before = float(stats["bytes_in_use"])
    else:
        before = _proc_status_bytes("VmRSS")
        _reset_peak_rss()
    jax.block_until_ready(v.decode(first, n))
    if source == "device_peak":
        stats = _device_stats()
        assert stats is not None
        return float(stats["peak_bytes_in_use"]) - before
    return _proc_status_bytes("VmHWM") - before


def peak_source() -> str | None:
    """`device_peak` where the backend reports memory statistics (GPU/TPU),
    `rss_peak` on Linux CPU, else None (not measured)."""
    if _device_stats() is not None:
        return "device_peak"
    if sys.platform.startswith("linux") and _reset_peak_rss():
        return "rss_peak"
    return None


def child_peak(cfg: Config, name: str, source: str) -> dict[str, Any]:
    """In a fresh process (a device's peak counter cannot be reset): build one
    variant, run it once (compiling it), decode again, report the peak."""
    model, prompt = build(cfg)
    v = VARIANTS[name](cfg, model)
    run_once(v, prompt, cfg.tokens)
    return {"peak": decode_peak(v, prompt, cfg.tokens, source)}


def peak_memory(
    cfg: Config, variants: dict[str, Variant], prompt: jax.Array, how: str
) -> tuple[dict[str, float], str | None]:
    """Peak MB of each variant's decode above what was in use before it. `how`:
    `inprocess` (peak RSS, reset before each variant), `process` (a fresh process
    per variant), `auto` (`process` where the device reports memory statistics,
    else `inprocess`)."""
    source = peak_source()
    if source is None:
        return {}, None
    if how == "auto":
        how = "process" if source == "device_peak" else "inprocess"
    if how == "inprocess" and source == "device_peak":
        raise ValueError("a device's peak counter cannot be reset: use `process`")
    result: dict[str, float] = {}
    for name, v in variants.items():
        if how == "inprocess":
            result[name] = decode_peak(v, prompt, cfg.tokens, source) / 2**20
            continue
        cmd = [sys.executable, __file__, "--_child", name, "--_source", source]
        cmd += ["--_config", json.dumps(dataclasses.asdict(cfg))]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(_ROOT), *sys.path]))
        out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
        result[name] = json.loads(out.stdout.strip().splitlines()[-1])["peak"] / 2**20
    return result, source


def summarise(
    per_round: dict[str, list[float]], info: dict[str, dict[str, Any]]
) -> dict[str, dict[str, Any]]:
    out = {}
    for name, times in per_round.items():
        us = [t * 1e6 for t in times]
        row = dict(info[name])
        base = per_round.get(BASELINE[VARIANTS[name].kind])
        row.update(median_us=statistics.median(us), min_us=min(us), max_us=max(us))
        row["rounds_us"] = us
        if base is not None:
            s = _stats().ratio_summary(times, base)
            row["baseline"] = BASELINE[VARIANTS[name].kind]
            row["ratio"], row["ratio_ci"] = s["median"], s["ci"]
            row["ratio_fastest"] = s["fastest"]
        out[name] = row
    return out


# ---------------------------------------------------------------------------------
# Reporting


def environment() -> str:
    dev = jax.devices()[0]
    return (
        f"jax {jax.__version__}, equinox {eqx.__version__}, eqx_state {es.__version__}; "
        f"backend {jax.default_backend()} ({dev.device_kind}), {os.cpu_count()} CPUs, "
        f"Python {platform.python_version()}"
    )


def markdown(rows: dict[str, dict[str, Any]], cfg: Config, meta: dict[str, Any]) -> str:
    peak_src = meta.get("peak_source") or ""
    peak_name = {"device_peak": "device peak", "rss_peak": "peak RSS"}.get(
        peak_src, "peak"
    )
    lines = [
        "# KV-cache decoding",
        "",
        f"`{meta['command']}`",
        "",
        f"{meta['environment']}.",
        "",
        f"vocab {cfg.vocab}, dim {cfg.dim}, heads {cfg.heads}, layers {cfg.layers}, "
        f"cache {cfg.max_len} positions ({cfg.cache_bytes / 2**20:.1f} MB of keys and "
        f"values in all), prompt {cfg.prompt_len}, {cfg.tokens} tokens per round, "
        f"{meta['rounds']} interleaved rounds; eqx_state overflow check "
        f"`on_overflow={cfg.on_overflow!r}`.",
        "",
        f"| variant | µs/token (median) | min–max | × hand-written [95% CI] | "
        "XLA extra MB | "
        f"{peak_name} MB | check: max abs diff |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, row in rows.items():
        ratio = (
            _stats().fmt_ratio({"median": row["ratio"], "ci": row["ratio_ci"]})
            if "ratio_ci" in row
            else "-"
        )
        peak = f"{row['peak_mb']:.1f}" if row.get("peak_mb") is not None else "-"
        lines.append(
            f"| {name}: {VARIANTS[name].label} | {row['median_us']:.1f} | "
            f"{row['min_us']:.1f}–{row['max_us']:.1f} | {ratio} | "
            f"{row['xla_extra_mb']:.2f} | {peak} | {row['max_abs_diff']:.1e} |"
        )
    lines += [
        "",
        "× hand-written: per-token variants against `pure_jax`, scan variants against "
        "`pure_jax_scan`: the median of same-round ratios, with a bootstrap 95% "
        "interval over rounds. XLA extra MB: output bytes not aliased to an input plus "
        "temporaries of the compiled decode step (a copy of the cache adds "
        f"{cfg.cache_bytes / 2**20:.1f} MB). {peak_name} MB: the peak while decoding "
        "above what was in use just before (device: each variant in a fresh process; "
        "RSS: the kernel's VmHWM, reset before each variant).",
        "",
    ]
    return "\n".join(lines)


def plot(rows: dict[str, dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(rows)
    med = [rows[n]["median_us"] for n in names]
    lo = [rows[n]["median_us"] - rows[n]["min_us"] for n in names]
    hi = [rows[n]["max_us"] - rows[n]["median_us"] for n in names]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    colors = ["tab:gray" if n.startswith("pure") else "tab:blue" for n in names]
    ax1.barh(names, med, xerr=[lo, hi], color=colors)
    ax1.set_xlabel("µs per decoded token (median, min–max)")
    ax1.invert_yaxis()
    ax2.barh(names, [rows[n]["xla_extra_mb"] for n in names], color=colors)
    ax2.set_xlabel("XLA extra MB per decode call (copies + temporaries)")
    ax2.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, dict[str, Any]]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="seconds-long smoke run")
    for f in ("vocab", "dim", "heads", "layers", "max_len", "prompt_len", "tokens"):
        parser.add_argument("--" + f.replace("_", "-"), type=int, default=None)
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument(
        "--on-overflow",
        choices=["raise", "nan"],
        default="raise",
        help="the eqx_state caches' overflow check under jit: 'raise' (eqx.error_if, "
        "a conditional per layer and step) or 'nan' (an elementwise select); the "
        "hand-written loop has no check",
    )
    parser.add_argument(
        "--peak-memory",
        choices=["auto", "inprocess", "process", "off"],
        default="auto",
        help="how to measure each variant's peak memory: in this process (Linux CPU: "
        "peak RSS reset before each variant), in a fresh process per variant (needed "
        "for a device's peak counter), auto (process on GPU/TPU, else inprocess)",
    )
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent))
    parser.add_argument("--_child", help=argparse.SUPPRESS)
    parser.add_argument("--_config", help=argparse.SUPPRESS)
    parser.add_argument("--_source", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args._child:
        cfg = Config(**json.loads(args._config))
        print(json.dumps(child_peak(cfg, args._child, args._source)))
        return {}

    base = TINY if args.tiny else DEFAULT
    overrides = {
        f: getattr(args, f)
        for f in ("vocab", "dim", "heads", "layers", "max_len", "prompt_len", "tokens")
        if getattr(args, f) is not None
    }
    cfg = dataclasses.replace(base, on_overflow=args.on_overflow, **overrides)
    if cfg.prompt_len + cfg.tokens > cfg.max_len:
        parser.error("prompt-len + tokens must not exceed max-len")
    rounds = args.rounds if args.rounds is not None else (2 if args.tiny else 7)
    names = [n for n in args.variants.split(",") if n]
    for n in names:
        if n not in VARIANTS:
            parser.error(f"unknown variant {n!r}; choose from {', '.join(VARIANTS)}")

    model, prompt = build(cfg)
    variants = {n: VARIANTS[n](cfg, model) for n in names}
    info = check(variants, model, prompt, cfg.tokens)
    for n, v in variants.items():
        info[n].update(memory_columns(v, cfg))
    per_round = time_variants(variants, prompt, rounds, cfg.tokens)
    rows = summarise(per_round, info)
    source = None
    if args.peak_memory != "off":
        peaks, source = peak_memory(cfg, variants, prompt, args.peak_memory)
        for n, mb in peaks.items():
            rows[n]["peak_mb"] = mb

    meta = {
        "command": "python benchmarks/kv_cache.py " + " ".join(argv or sys.argv[1:]),
        "environment": environment(),
        "rounds": rounds,
        "peak_source": source,
    }
    text = markdown(rows, cfg, meta)
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results_kv_cache.md").write_text(text, encoding="utf-8")
    plot(rows, out / "kv_cache.png")
    return rows


if __name__ == "__main__":
    main()
