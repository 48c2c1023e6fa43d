"""Language-model training throughput: the same small GPT trained with eqx_state,
hand-written JAX, Equinox, Flax NNX and PyTorch.

One training step of a GPT-style decoder (token and position embeddings, pre-LayerNorm
blocks of causal multi-head self-attention and a GELU MLP, a final LayerNorm and an
untied linear head; no dropout), next-token cross-entropy averaged over every
position, AdamW (`lr`, betas, eps and decoupled weight decay identical everywhere,
no schedule). Every variant starts from one set of weights, copied into each
framework's layout (Flax's kernels are `W.T`), and sees the same batch of tokens.

Variants (`VARIANTS`; `--variants` picks some; the report ends with each one's exact
code form and where its family's docs recommend it):

- `pure_jax`: hand-written JAX, the reference (ratio 1.0) and the limit: pure
  functions on a dict of arrays, `jax.jit(step, donate_argnums=(0, 1))`;
  `pure_jax_scan`: the same step `K` times in one `lax.scan` per call.
- eqx_state: `es_step` (`es.make_step`, an `eqx.Module` built from
  `es.nn.CausalSelfAttention`, `eqx.nn.LayerNorm` and `eqx.nn.Linear`) and
  `es_scan` (`step.scan`, `K` steps per call); `es_step_dict` / `es_scan_dict`:
  the same on the hand-written model (`pure_jax`'s dict and forward), whose
  compiled program is `pure_jax`'s, so that they measure eqx_state's call path alone.
- Equinox (the same model with `eqx.nn.MultiheadAttention`): `eqx_partition`
  (`eqx.partition` once outside the loop, `jax.jit` on the arrays, donated), `equinox_flat` (the "low-overhead training loop" of
  Equinox's Tricks page: flatten once, `eqx.filter_jit` on flat leaves) and
  `equinox` (`eqx.filter_jit`, the form its examples start from).
- Flax NNX: `nnx_jit_partial` (tree mode), `nnx_split_flat` and `nnx_split` (the
  performance guide's functional loop), `nnx_cached_partial`, and `nnx_jit` (the
  default, which the guide marks "currently slow").
- PyTorch: `torch_eager` (fused AdamW) and `torch_compile` (`torch.compile` on the
  model and on `optimizer.step`, as PyTorch's "Compiling the optimizer" recipe), when
  it works here (else the report says why it was skipped).

A GPT has no running state while it trains (no BatchNorm; dropout is off so that
the losses can match), so this measures the call path of each library on a model
with many parameters of several kinds, not state threading.

**Correctness gate, before any timing.** Each variant runs `--check-steps` steps (a
`K`-steps variant: one call) from the shared weights; the loss of every step must
equal eqx_state's `es_step` losses and the hand-written reference's to relative
`LOSS_RTOL`, and its head and token-embedding weights the reference's to
`|w - w_ref| / |w_ref - w_init| <= WEIGHT_RTOL`. A variant that fails is reported
as failed with the reason and not timed; the others still are.

**Timing.** `step_overhead.py`'s helpers: interleaved rounds with the order rotated,
each variant timed pipelined (`--steps` steps, one `block_until_ready`) and blocking
(waiting for every call); ratios are medians of same-round ratios to `pure_jax`
with bootstrap 95% intervals (`bench_stats.py`). Throughput is tokens (batch × seq)
per second; a `K`-steps variant also reports its time per call.

Run: `python benchmarks/lm.py` (both sizes), `--sizes small`, `--tiny` (seconds-long
smoke run), `--device gpu` (JAX's GPU and CUDA for PyTorch), `--profile 300`
(cProfile of the dispatch path, µs per step by function).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import importlib.util
import json
import math
import os
import platform
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import eqx_state as es


_HERE = Path(__file__).resolve().parent


def _sibling(name: str) -> Any:
    """The module `benchmarks/<name>.py`, loaded once (run.py's loader: these
    scripts are not a package)."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, _HERE / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


stats = _sibling("bench_stats")  # bootstrap intervals, verdicts
so = _sibling("step_overhead")  # Runner, time_variants, summarise, profiling

LR = 3e-3
BETAS = (0.9, 0.95)
ADAM_EPS = 1e-8
WEIGHT_DECAY = 0.1  # large enough that a variant without it fails the weight check
LN_EPS = 1e-5
CHECK_STEPS = 4
WARMUP_CALLS = 2
# Tolerances of the gate. The variants compute the same function with different
# kernels (per-example `vmap` against batched matmuls, Flax's `W.T` layout,
# PyTorch's fused attention), so they agree to float32 rounding; AdamW turns
# rounding in near-zero gradient entries into updates of size ~lr, hence the
# weights' relative-to-movement measure (a missing weight decay moves it by ~0.1, a
# wrong gradient by ~1).
LOSS_RTOL = 1e-4
WEIGHT_RTOL = 3e-2


@dataclasses.dataclass(frozen=True)
class Size:
    name: str
    vocab: int
    d: int
    layers: int
    heads: int
    seq: int
    batch: int
    steps: int  # steps per variant per round, each way (pipelined, blocking)
    k: int  # steps per call of the K-steps variants

    @property
    def tokens(self) -> int:
        return self.batch * self.seq

    def describe(self) -> str:
        return (
            f"d = {self.d}, {self.layers} layers, {self.heads} heads, seq "
            f"{self.seq}, batch {self.batch}, vocab {self.vocab}"
        )


SIZES = {
    # dispatch-bound: the compiled step is tens of µs, a library's Python shows
    "small": Size("small", 64, 32, 2, 2, 32, 8, steps=100, k=20),
    # compute-bound on a 2-core CPU (about 0.1 s a step): the compiled code decides
    "medium": Size("medium", 256, 128, 4, 4, 128, 8, steps=4, k=4),
    "tiny": Size("tiny", 16, 16, 1, 2, 8, 2, steps=3, k=3),
}


# ---------------------------------------------------------------------------------
# One set of weights, Equinox's layout (Linear weights [out, in])


def init_params(size: Size, seed: int = 0) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    d, f = size.d, 4 * size.d

    def normal(*shape, std=0.02):
        return (std * rng.standard_normal(shape)).astype(np.float32)

    def ln():
        return {"w": 1 + normal(d, std=0.1), "b": normal(d)}

    def lin(d_out, d_in, bias=True):
        return {"w": normal(d_out, d_in), "b": normal(d_out) if bias else None}

    blocks = [
        {
            "ln1": ln(),
            "q": lin(d, d),
            "k": lin(d, d),
            "v": lin(d, d),
            "o": lin(d, d),
            "ln2": ln(),
            "fc1": lin(f, d),
            "fc2": lin(d, f),
        }
        for _ in range(size.layers)
    ]
    return {
        "tok": normal(size.vocab, d),
        "pos": normal(size.seq, d),
        "blocks": blocks,
        "ln_f": ln(),
        "head": lin(size.vocab, d, bias=False),
    }


def make_data(size: Size, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """One batch: tokens `[batch, seq]` and the next tokens (targets)."""
    rng = np.random.default_rng(seed)
    toks = rng.integers(0, size.vocab, (size.batch, size.seq + 1), dtype=np.int32)
    return toks[:, :-1], toks[:, 1:]


def optimizer() -> optax.GradientTransformation:
    return optax.adamw(
        LR, b1=BETAS[0], b2=BETAS[1], eps=ADAM_EPS, weight_decay=WEIGHT_DECAY
    )


def _jnp(tree: Any) -> Any:
    """Fresh device arrays (every variant owns its buffers: donation)."""
    return jax.tree.map(lambda a: jnp.array(a), tree)


# ---------------------------------------------------------------------------------
# (b) hand-written JAX


def _layer_norm(x, p):
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + LN_EPS) * p["w"] + p["b"]


def _linear(x, p):
    y = x @ p["w"].T
    return y if p.get("b") is None else y + p["b"]


def _attention(x, blk, heads: int):
    b, t, d = x.shape
    hd = d // heads
    q, k, v = (_linear(x, blk[n]).reshape(b, t, heads, hd) for n in "qkv")
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(hd)
    mask = jnp.tril(jnp.ones((t, t), bool))
    logits = jnp.where(mask, logits, jnp.finfo(logits.dtype).min)
    out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits, axis=-1), v)
    return _linear(out.reshape(b, t, d), blk["o"])


def pure_forward(params, tokens, heads: int):
    h = params["tok"][tokens] + params["pos"][: tokens.shape[-1]]
    for blk in params["blocks"]:
        h = h + _attention(_layer_norm(h, blk["ln1"]), blk, heads)
        m = jax.nn.gelu(_linear(_layer_norm(h, blk["ln2"]), blk["fc1"]), False)
        h = h + _linear(m, blk["fc2"])
    return _linear(_layer_norm(h, params["ln_f"]), params["head"])


def cross_entropy(logits, targets):
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


def _strip_none(tree):
    """Drop the `None` biases (the head has none): a pytree of arrays only."""
    if isinstance(tree, dict):
        return {k: _strip_none(v) for k, v in tree.items() if v is not None}
    if isinstance(tree, list):
        return [_strip_none(v) for v in tree]
    return tree


class PureJax(so.Runner):
    name = "pure_jax"
    label = "hand-written JAX, jax.jit with donation"
    family, usage = "JAX", so.REFERENCE
    form = (
        "jax.jit(step, donate_argnums=(0, 1)) over step(params, opt_state, x, y): "
        "pure functions on a dict of arrays, jax.value_and_grad, optax.adamw"
    )
    source = "JAX's jax.jit documentation (donate_argnums)"

    def __init__(self, size: Size, params, data):
        opt = optimizer()
        self.params = _jnp(_strip_none(params))
        self.opt_state = opt.init(self.params)
        self.x, self.y = (jnp.array(a) for a in data)
        heads = size.heads

        def one(params, opt_state, x, y):
            loss_fn = lambda p: cross_entropy(pure_forward(p, x, heads), y)  # noqa: E731
            loss, grads = jax.value_and_grad(loss_fn)(params)
            updates, opt_state = opt.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        self._one = one
        self._step = jax.jit(one, donate_argnums=(0, 1))

    def step(self):
        self.params, self.opt_state, loss = self._step(
            self.params, self.opt_state, self.x, self.y
        )
        return loss

    def snapshot(self):
        return {
            "head": np.asarray(self.params["head"]["w"]),
            "tok": np.asarray(self.params["tok"]),
        }


class PureJaxScan(PureJax):
    name = "pure_jax_scan"
    label = "hand-written JAX, K steps per call in one lax.scan"
    form = (
        "jax.jit(scan_steps, donate_argnums=(0, 1)): lax.scan of the same step over "
        "xs, ys stacked [K, ...]"
    )

    def __init__(self, size: Size, params, data):
        super().__init__(size, params, data)
        self.steps_per_call = size.k
        self.xs = jnp.stack([self.x] * size.k)
        self.ys = jnp.stack([self.y] * size.k)
        one = self._one

        def scan_steps(params, opt_state, xs, ys):
            def body(carry, xy):
                params, opt_state, loss = one(*carry, *xy)
                return (params, opt_state), loss

            (params, opt_state), losses = jax.lax.scan(
                body, (params, opt_state), (xs, ys)
            )
            return params, opt_state, losses

        self._scan = jax.jit(scan_steps, donate_argnums=(0, 1))

    def step(self):
        self.params, self.opt_state, losses = self._scan(
            self.params, self.opt_state, self.xs, self.ys
        )
        return losses


# ---------------------------------------------------------------------------------
# The Equinox model (eqx_state and Equinox), per sequence as Equinox's layers are


def _eqx_linear(p, key) -> eqx.nn.Linear:
    d_out, d_in = p["w"].shape
    lin = eqx.nn.Linear(d_in, d_out, use_bias=p["b"] is not None, key=key)
    lin = eqx.tree_at(lambda m: m.weight, lin, jnp.array(p["w"]))
    if p["b"] is not None:
        lin = eqx.tree_at(lambda m: m.bias, lin, jnp.array(p["b"]))
    return lin


def _eqx_ln(p) -> eqx.nn.LayerNorm:
    ln = eqx.nn.LayerNorm(p["w"].shape[0], eps=LN_EPS)
    return eqx.tree_at(
        lambda m: (m.weight, m.bias), ln, (jnp.array(p["w"]), jnp.array(p["b"]))
    )


def _set_projections(attn, blk):
    key = jax.random.key(0)
    return eqx.tree_at(
        lambda a: (a.query_proj, a.key_proj, a.value_proj, a.output_proj),
        attn,
        tuple(_eqx_linear(blk[n], key) for n in "qkvo"),
    )


class EqxMHA(eqx.Module):
    """`eqx.nn.MultiheadAttention` with a causal mask, on one sequence `[seq, d]`."""

    mha: eqx.nn.MultiheadAttention

    def __call__(self, x):
        mask = jnp.tril(jnp.ones((x.shape[0], x.shape[0]), bool))
        return self.mha(x, x, x, mask=mask)


def _es_attention(blk, heads: int):
    d = blk["q"]["w"].shape[0]
    attn = es.nn.CausalSelfAttention(d, heads, key=jax.random.key(0))
    return _set_projections(attn, blk)


def _eqx_attention(blk, heads: int):
    d = blk["q"]["w"].shape[0]
    mha = eqx.nn.MultiheadAttention(
        heads,
        d,
        use_query_bias=True,
        use_key_bias=True,
        use_value_bias=True,
        use_output_bias=True,
        key=jax.random.key(0),
    )
    return EqxMHA(_set_projections(mha, blk))


def rows(linear: eqx.nn.Linear, x):
    """`jax.vmap(linear)(x)` over the rows of `x` as one matmul: the same dot
    products, without the transposes XLA's CPU backend puts around the per-row
    form (measured: benchmarks/README.md, `lm.py`). Every Equinox-model variant
    shares this model code."""
    y = x @ linear.weight.T
    return y if linear.bias is None else y + linear.bias


class Block(eqx.Module):
    ln1: eqx.nn.LayerNorm
    attn: Any  # es.nn.CausalSelfAttention or EqxMHA
    ln2: eqx.nn.LayerNorm
    fc1: eqx.nn.Linear
    fc2: eqx.nn.Linear

    def __call__(self, h):  # [seq, d]
        h = h + self.attn(jax.vmap(self.ln1)(h))
        m = jax.nn.gelu(rows(self.fc1, jax.vmap(self.ln2)(h)), False)
        return h + rows(self.fc2, m)


class GPT(eqx.Module):
    tok: eqx.nn.Embedding
    pos: jax.Array
    blocks: tuple[Block, ...]
    ln_f: eqx.nn.LayerNorm
    head: eqx.nn.Linear

    def __init__(self, params, heads: int, attention):
        key = jax.random.key(0)
        self.tok = eqx.nn.Embedding(weight=jnp.array(params["tok"]))
        self.pos = jnp.array(params["pos"])
        self.blocks = tuple(
            Block(
                _eqx_ln(b["ln1"]),
                attention(b, heads),
                _eqx_ln(b["ln2"]),
                _eqx_linear(b["fc1"], key),
                _eqx_linear(b["fc2"], key),
            )
            for b in params["blocks"]
        )
        self.ln_f = _eqx_ln(params["ln_f"])
        self.head = _eqx_linear(params["head"], key)

    def __call__(self, tokens):  # [seq] -> [seq, vocab]
        h = jax.vmap(self.tok)(tokens) + self.pos[: tokens.shape[0]]
        for blk in self.blocks:
            h = blk(h)
        return rows(self.head, jax.vmap(self.ln_f)(h))


def gpt_loss(model, x, y):
    return cross_entropy(jax.vmap(model)(x), y)


def _eqx_snapshot(model: GPT) -> dict[str, Any]:
    return {"head": np.asarray(model.head.weight), "tok": np.asarray(model.tok.weight)}


# (a) eqx_state ----------------------------------------------------------------------


class EsStep(so.Runner):
    name = "es_step"
    label = "eqx_state make_step"
    family, usage = "eqx_state", so.ES
    form = (
        "step = es.make_step(loss_fn, optax.adamw(...), return_loss=True); "
        "model, opt_state, loss = step(model, opt_state, x, y)"
    )
    source = "README, docs/tutorial.md"

    def __init__(self, size: Size, params, data):
        self.model = GPT(params, size.heads, _es_attention)
        self._step = es.make_step(gpt_loss, optimizer(), return_loss=True)
        self.opt_state = self._step.init(self.model)
        self.x, self.y = (jnp.array(a) for a in data)

    def step(self):
        self.model, self.opt_state, loss = self._step(
            self.model, self.opt_state, self.x, self.y
        )
        return loss

    def snapshot(self):
        return _eqx_snapshot(self.model)


class EsScan(EsStep):
    name = "es_scan"
    label = "eqx_state step.scan, K steps per call"
    form = (
        "model, opt_state, losses = step.scan(model, opt_state, xs, ys)  # xs: [K, ...]"
    )
    source = "docs (step.scan)"

    def __init__(self, size: Size, params, data):
        super().__init__(size, params, data)
        self.steps_per_call = size.k
        self.xs = jnp.stack([self.x] * size.k)
        self.ys = jnp.stack([self.y] * size.k)

    def step(self):
        self.model, self.opt_state, losses = self._step.scan(
            self.model, self.opt_state, self.xs, self.ys
        )
        return losses


class EsStepDict(so.Runner):
    """eqx_state's step on the hand-written model itself (a dict of arrays and
    `pure_forward`): the compiled program is `pure_jax`'s, so the difference is
    eqx_state's call path alone."""

    name = "es_step_dict"
    label = "eqx_state make_step on the hand-written batched model (a dict)"
    family, usage = "eqx_state", so.ES
    form = (
        "step = es.make_step(lambda params, x, y: cross_entropy(pure_forward(params, "
        "x), y), optax.adamw(...), return_loss=True) on pure_jax's dict of arrays"
    )
    source = "docs: a model is any pytree (diagnostic: pure_jax's compiled program)"

    def __init__(self, size: Size, params, data):
        heads = size.heads

        def loss_fn(params, x, y):
            return cross_entropy(pure_forward(params, x, heads), y)

        self.model = _jnp(_strip_none(params))
        self._step = es.make_step(loss_fn, optimizer(), return_loss=True)
        self.opt_state = self._step.init(self.model)
        self.x, self.y = (jnp.array(a) for a in data)

    step = EsStep.step

    def snapshot(self):
        return {
            "head": np.asarray(self.model["head"]["w"]),
            "tok": np.asarray(self.model["tok"]),
        }


class EsScanDict(EsStepDict):
    name = "es_scan_dict"
    label = "eqx_state step.scan on the hand-written batched model (a dict)"
    form = "step.scan(params, opt_state, xs, ys) with es_step_dict's step"

    def __init__(self, size: Size, params, data):
        super().__init__(size, params, data)
        self.steps_per_call = size.k
        self.xs = jnp.stack([self.x] * size.k)
        self.ys = jnp.stack([self.y] * size.k)

    step = EsScan.step


# (c) Equinox ------------------------------------------------------------------------


def _eqx_train_step(opt, model, opt_state, x, y):
    loss, grads = eqx.filter_value_and_grad(gpt_loss)(model, x, y)
    params = eqx.filter(model, eqx.is_inexact_array)
    updates, opt_state = opt.update(grads, opt_state, params)
    return eqx.apply_updates(model, updates), opt_state, loss


class EqxRunner(so.Runner):
    family = "Equinox"

    def __init__(self, size: Size, params, data):
        self.opt = optimizer()
        self.model = GPT(params, size.heads, _eqx_attention)
        self.opt_state = self.opt.init(eqx.filter(self.model, eqx.is_inexact_array))
        self.x, self.y = (jnp.array(a) for a in data)

    def snapshot(self):
        return _eqx_snapshot(self.model)


class EqxPartition(EqxRunner):
    name = "eqx_partition"
    label = "Equinox: eqx.partition once outside the loop, jax.jit, donated"
    usage = so.EXPERT
    form = (
        "params, static = eqx.partition(model, eqx.is_array) once; "
        "jax.jit(step, donate_argnums=(0, 1)) over step(params, opt_state, x, y) "
        "with eqx.combine(params, static) inside"
    )
    source = (
        "Equinox docs, 'All of Equinox' §2: eqx.partition / eqx.combine around "
        "jax.jit ('both approaches are equally valid')"
    )

    def __init__(self, size: Size, params, data):
        super().__init__(size, params, data)
        self.params, static = eqx.partition(self.model, eqx.is_array)
        del self.model
        opt = self.opt

        def step(params, opt_state, x, y):
            model = eqx.combine(params, static)
            model, opt_state, loss = _eqx_train_step(opt, model, opt_state, x, y)
            return eqx.filter(model, eqx.is_array), opt_state, loss

        self._static, self._step = static, jax.jit(step, donate_argnums=(0, 1))

    def step(self):
        self.params, self.opt_state, loss = self._step(
            self.params, self.opt_state, self.x, self.y
        )
        return loss

    def snapshot(self):
        return _eqx_snapshot(eqx.combine(self.params, self._static))


class EqxFilterJit(EqxRunner):
    name = "equinox"
    label = "Equinox eqx.filter_jit, donated"
    usage = so.DEFAULT
    form = (
        'eqx.filter_jit(donate="all-except-first") over step((x, y), model, opt_state)'
    )
    source = "Equinox examples 'Train RNN', 'BERT' (filter_jit make_step)"

    def __init__(self, size: Size, params, data):
        super().__init__(size, params, data)
        opt = self.opt

        @eqx.filter_jit(donate="all-except-first")
        def step(batch, model, opt_state):
            return _eqx_train_step(opt, model, opt_state, *batch)

        self._step = step

    def step(self):
        self.model, self.opt_state, loss = self._step(
            (self.x, self.y), self.model, self.opt_state
        )
        return loss


class EqxFlat(EqxRunner):
    name = "equinox_flat"
    label = "Equinox low-overhead loop (flatten once, flat leaves)"
    usage = so.EXPERT
    form = (
        "flat, treedef = jax.tree_util.tree_flatten((model, opt_state)) once; "
        'eqx.filter_jit(donate="all-except-first") over step((x, y), flat): '
        "tree_unflatten inside, returns tree_leaves"
    )
    source = "Equinox docs, 'Tricks' → 'Low-overhead training loops' (docs/tricks.md)"

    def __init__(self, size: Size, params, data):
        super().__init__(size, params, data)
        self.flat, treedef = jax.tree_util.tree_flatten((self.model, self.opt_state))
        del self.model, self.opt_state
        opt = self.opt

        @eqx.filter_jit(donate="all-except-first")
        def step(batch, flat):
            model, opt_state = jax.tree_util.tree_unflatten(treedef, flat)
            model, opt_state, loss = _eqx_train_step(opt, model, opt_state, *batch)
            return jax.tree_util.tree_leaves((model, opt_state)), loss

        self._treedef, self._step = treedef, step

    def step(self):
        self.flat, loss = self._step((self.x, self.y), self.flat)
        return loss

    def snapshot(self):
        model, _ = jax.tree_util.tree_unflatten(self._treedef, self.flat)
        return _eqx_snapshot(model)


# (d) Flax NNX -----------------------------------------------------------------------


def _nnx_model(size: Size, params):
    from flax import nnx

    heads = size.heads

    def linear(p, rngs):
        d_out, d_in = p["w"].shape
        lin = nnx.Linear(d_in, d_out, use_bias=p["b"] is not None, rngs=rngs)
        lin.kernel.set_value(jnp.array(p["w"].T))
        if p["b"] is not None:
            assert lin.bias is not None
            lin.bias.set_value(jnp.array(p["b"]))
        return lin

    def layer_norm(p, rngs):
        ln = nnx.LayerNorm(
            p["w"].shape[0], epsilon=LN_EPS, use_fast_variance=False, rngs=rngs
        )
        assert ln.scale is not None and ln.bias is not None
        ln.scale.set_value(jnp.array(p["w"]))
        ln.bias.set_value(jnp.array(p["b"]))
        return ln

    class NnxBlock(nnx.Module):
        def __init__(self, p, rngs):
            self.ln1, self.ln2 = layer_norm(p["ln1"], rngs), layer_norm(p["ln2"], rngs)
            self.q, self.k, self.v, self.o = (linear(p[n], rngs) for n in "qkvo")
            self.fc1, self.fc2 = linear(p["fc1"], rngs), linear(p["fc2"], rngs)

        def __call__(self, h):  # [batch, seq, d]
            b, t, d = h.shape
            a = self.ln1(h)
            q, k, v = (
                f(a).reshape(b, t, heads, d // heads) for f in (self.q, self.k, self.v)
            )
            mask = nnx.make_causal_mask(jnp.ones((b, t)))
            out = nnx.dot_product_attention(q, k, v, mask=mask)
            h = h + self.o(out.reshape(b, t, d))
            return h + self.fc2(nnx.gelu(self.fc1(self.ln2(h)), approximate=False))

    class NnxGPT(nnx.Module):
        def __init__(self, p, rngs):
            self.tok = nnx.Embed(size.vocab, size.d, rngs=rngs)
            self.tok.embedding.set_value(jnp.array(p["tok"]))
            self.pos = nnx.Param(jnp.array(p["pos"]))
            self.blocks = nnx.List([NnxBlock(b, rngs) for b in p["blocks"]])
            self.ln_f = layer_norm(p["ln_f"], rngs)
            self.head = linear(p["head"], rngs)

        def __call__(self, tokens):
            h = self.tok(tokens) + self.pos[...][: tokens.shape[-1]]
            for blk in self.blocks:
                h = blk(h)
            return self.head(self.ln_f(h))

    return NnxGPT(params, nnx.Rngs(0))


def _nnx_loss(model, x, y):
    return cross_entropy(model(x), y)


def nnx_train_step(model, optimizer, x, y):
    """The train step of Flax's performance guide."""
    from flax import nnx

    loss, grads = nnx.value_and_grad(_nnx_loss)(model, x, y)
    optimizer.update(model, grads)
    return loss


def _nnx_snapshot(model) -> dict[str, Any]:
    return {
        "head": np.asarray(model.head.kernel[...]).T,
        "tok": np.asarray(model.tok.embedding[...]),
    }


def _nnx_functional_step(graphdef, state, x, y):
    from flax import nnx

    model, opt = nnx.merge(graphdef, state)
    loss = nnx_train_step(model, opt, x, y)
    return nnx.state((model, opt)), loss


_FLAX_PERF = "Flax 0.12.8 docs, guides/performance ('Performance considerations')"


class NnxRunner(so.Runner):
    family = "Flax NNX"

    def __init__(self, size: Size, params, data):
        from flax import nnx

        self.model = _nnx_model(size, params)
        self.optimizer = nnx.Optimizer(self.model, optimizer(), wrt=nnx.Param)
        self.x, self.y = (jnp.array(a) for a in data)

    def snapshot(self):
        return _nnx_snapshot(self.model)


class NnxJit(NnxRunner):
    name = "nnx_jit"
    label = "Flax NNX nnx.jit (graph mode, the default)"
    usage = so.DEFAULT
    form = "@nnx.jit train_step(model, optimizer, x, y), no donation"
    source = f"{_FLAX_PERF}: the guide's first loop, marked '<== currently slow'"

    def __init__(self, size: Size, params, data):
        from flax import nnx

        super().__init__(size, params, data)
        self._step = nnx.jit(nnx_train_step)

    def step(self):
        return self._step(self.model, self.optimizer, self.x, self.y)


class NnxJitPartial(NnxRunner):
    name = "nnx_jit_partial"
    label = "Flax NNX nnx.jit_partial tree mode, donated"
    usage = so.EXPERT
    form = (
        "nnx.jit_partial(train_step, model, optimizer, graph=False, "
        "donate_argnums=0)(x, y)"
    )
    source = (
        "flax.nnx.jit_partial docstring, Flax 0.12.8 ('like nnx.cached_partial but "
        "designed for tree-mode')"
    )

    def __init__(self, size: Size, params, data):
        from flax import nnx

        super().__init__(size, params, data)
        self._step = nnx.jit_partial(
            nnx_train_step, self.model, self.optimizer, graph=False, donate_argnums=0
        )

    def step(self):
        return self._step(self.x, self.y)


class NnxCachedPartial(NnxRunner):
    name = "nnx_cached_partial"
    label = "Flax NNX nnx.cached_partial over nnx.jit, donated"
    usage = so.EXPERT
    form = (
        'nnx.cached_partial(nnx.jit(train_step, donate_argnames=("model", '
        '"optimizer")), model, optimizer)(x, y)'
    )
    source = f"{_FLAX_PERF}, 'Caching graph node traversals'"

    def __init__(self, size: Size, params, data):
        from flax import nnx

        super().__init__(size, params, data)
        jitted = nnx.jit(nnx_train_step, donate_argnames=("model", "optimizer"))
        self._step = nnx.cached_partial(jitted, self.model, self.optimizer)

    def step(self):
        return self._step(self.x, self.y)


class NnxSplit(NnxRunner):
    name = "nnx_split"
    label = "Flax NNX functional loop: nnx.split once, nnx.merge inside jax.jit"
    usage = so.EXPERT
    form = (
        "graphdef, state = nnx.split((model, optimizer)) once; "
        "jax.jit(step, donate_argnums=1)(graphdef, state, x, y), nnx.merge / "
        "nnx.state inside"
    )
    source = f"{_FLAX_PERF}, 'Functional training loop' (+ donation)"

    def __init__(self, size: Size, params, data):
        from flax import nnx

        super().__init__(size, params, data)
        self.graphdef, self.state = nnx.split((self.model, self.optimizer))
        del self.model, self.optimizer
        self._step = jax.jit(_nnx_functional_step, donate_argnums=(1,))

    def step(self):
        self.state, loss = self._step(self.graphdef, self.state, self.x, self.y)
        return loss

    def snapshot(self):
        from flax import nnx

        return _nnx_snapshot(nnx.merge(self.graphdef, self.state)[0])


class NnxSplitFlat(NnxRunner):
    name = "nnx_split_flat"
    label = "Flax NNX functional loop on flat leaves (split and flatten once)"
    usage = so.EXPERT
    form = (
        "graphdef, state = nnx.split((model, optimizer)); leaves, treedef = "
        "jax.tree.flatten(state) once; jax.jit(step, donate_argnums=0)(leaves, x, y)"
    )
    source = (
        f"{_FLAX_PERF}, 'Functional training loop', with Equinox's flat-leaves trick "
        "(not in Flax's docs)"
    )

    def __init__(self, size: Size, params, data):
        from flax import nnx

        super().__init__(size, params, data)
        graphdef, state = nnx.split((self.model, self.optimizer))
        del self.model, self.optimizer
        self.leaves, treedef = jax.tree.flatten(state)

        @functools.partial(jax.jit, donate_argnums=(0,))
        def step(leaves, x, y):
            state = jax.tree.unflatten(treedef, leaves)
            state, loss = _nnx_functional_step(graphdef, state, x, y)
            return jax.tree.leaves(state), loss

        self._graphdef, self._treedef, self._step = graphdef, treedef, step

    def step(self):
        self.leaves, loss = self._step(self.leaves, self.x, self.y)
        return loss

    def snapshot(self):
        from flax import nnx

        state = jax.tree.unflatten(self._treedef, self.leaves)
        return _nnx_snapshot(nnx.merge(self._graphdef, state)[0])


# (e) PyTorch ------------------------------------------------------------------------


def torch_device() -> str:
    return "cuda" if jax.default_backend() == "gpu" else "cpu"


class _TorchLoss:
    """A step's loss as `jax.block_until_ready` waits for it: on CUDA, where
    PyTorch runs asynchronously, waiting means synchronising the device (on CPU
    the step has finished when it returns)."""

    def __init__(self, loss: Any):
        self.loss = loss

    def detach(self) -> Any:
        return self.loss.detach()

    def block_until_ready(self) -> _TorchLoss:
        if self.loss.is_cuda:
            import torch

            torch.cuda.synchronize()
        return self


def _torch_model(size: Size, params):
    import torch
    from torch import nn
    from torch.nn import functional as F

    def t(a):
        return torch.tensor(np.asarray(a))

    def linear(p):
        d_out, d_in = p["w"].shape
        lin = nn.Linear(d_in, d_out, bias=p["b"] is not None)
        with torch.no_grad():
            lin.weight.copy_(t(p["w"]))
            if p["b"] is not None:
                lin.bias.copy_(t(p["b"]))
        return lin

    def layer_norm(p):
        ln = nn.LayerNorm(p["w"].shape[0], eps=LN_EPS)
        with torch.no_grad():
            ln.weight.copy_(t(p["w"]))
            ln.bias.copy_(t(p["b"]))
        return ln

    class TorchBlock(nn.Module):
        def __init__(self, p):
            super().__init__()
            self.ln1, self.ln2 = layer_norm(p["ln1"]), layer_norm(p["ln2"])
            self.q, self.k, self.v, self.o = (linear(p[n]) for n in "qkvo")
            self.fc1, self.fc2 = linear(p["fc1"]), linear(p["fc2"])

        def forward(self, h):
            b, t_, d = h.shape
            a = self.ln1(h)
            q, k, v = (
                f(a).view(b, t_, size.heads, d // size.heads).transpose(1, 2)
                for f in (self.q, self.k, self.v)
            )
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            h = h + self.o(out.transpose(1, 2).reshape(b, t_, d))
            return h + self.fc2(F.gelu(self.fc1(self.ln2(h))))

    class TorchGPT(nn.Module):
        def __init__(self, p):
            super().__init__()
            self.tok = nn.Embedding(size.vocab, size.d)
            with torch.no_grad():
                self.tok.weight.copy_(t(p["tok"]))
            self.pos = nn.Parameter(t(p["pos"]))
            self.blocks = nn.ModuleList([TorchBlock(b) for b in p["blocks"]])
            self.ln_f = layer_norm(p["ln_f"])
            self.head = linear(p["head"])

        def forward(self, tokens):
            h = self.tok(tokens) + self.pos[: tokens.shape[-1]]
            for blk in self.blocks:
                h = blk(h)
            return self.head(self.ln_f(h))

    return TorchGPT(params).to(torch_device())


class TorchEager(so.Runner):
    name = "torch_eager"
    label = "PyTorch eager, fused AdamW"
    family, usage = "PyTorch", so.EXPERT
    form = (
        "loss = F.cross_entropy(model(x), y); loss.backward(); opt.step(); "
        "opt.zero_grad(set_to_none=True); torch.optim.AdamW(..., fused=True), "
        "F.scaled_dot_product_attention(is_causal=True)"
    )
    source = "PyTorch docs: torch.optim ('fused ... typically fastest'), SDPA"

    def __init__(self, size: Size, params, data):
        import torch
        from torch.nn import functional as F

        self.model = _torch_model(size, params)
        self.opt = self._optimizer(torch)
        dev = torch_device()
        self.x, self.y = (
            torch.tensor(np.asarray(a), dtype=torch.long, device=dev) for a in data
        )
        self._step = self._loop(F, self.model, self.opt.step, size.vocab)

    fused = True  # AdamW's fused kernel; torch.compile compiles the foreach one

    def _optimizer(self, torch):
        return torch.optim.AdamW(
            self.model.parameters(),
            lr=LR,
            betas=BETAS,
            eps=ADAM_EPS,
            weight_decay=WEIGHT_DECAY,
            **({"fused": True} if self.fused else {}),
        )

    def _loop(self, F, model, opt_step, vocab):
        """One training step: the same loop for the eager and compiled forms."""

        def step():
            loss = F.cross_entropy(model(self.x).view(-1, vocab), self.y.view(-1))
            loss.backward()
            opt_step()
            self.opt.zero_grad(set_to_none=True)
            return loss.detach()

        return step

    def step(self):
        return _TorchLoss(self._step())

    def snapshot(self):
        return {
            "head": self.model.head.weight.detach().cpu().numpy(),
            "tok": self.model.tok.weight.detach().cpu().numpy(),
        }


class TorchCompile(TorchEager):
    name = "torch_compile"
    label = "PyTorch torch.compile (model and optimizer step)"
    form = (
        "model = torch.compile(model); opt_step = torch.compile(opt.step); "
        "the eager loop otherwise (AdamW foreach, as the recipe)"
    )
    source = (
        "PyTorch tutorials: 'Introduction to torch.compile', '(beta) Compiling the "
        "optimizer with torch.compile'"
    )

    def __init__(self, size: Size, params, data):
        import torch
        from torch.nn import functional as F

        super().__init__(size, params, data)
        self._step = self._loop(
            F, torch.compile(self.model), torch.compile(self.opt.step), size.vocab
        )

    fused = False


VARIANTS: dict[str, type[Any]] = {
    cls.name: cls
    for cls in (
        PureJax,
        PureJaxScan,
        EsStep,
        EsScan,
        EsStepDict,
        EsScanDict,
        EqxPartition,
        EqxFlat,
        EqxFilterJit,
        NnxJitPartial,
        NnxSplitFlat,
        NnxSplit,
        NnxCachedPartial,
        NnxJit,
        TorchEager,
        TorchCompile,
    )
}
SCAN_VARIANTS = ("pure_jax_scan", "es_scan", "es_scan_dict")


# ---------------------------------------------------------------------------------
# Correctness gate


def _as_losses(out: Any) -> list[float]:
    if hasattr(out, "detach"):  # a torch tensor
        out = out.detach().cpu().numpy()
    return [float(v) for v in np.atleast_1d(np.asarray(out))]


def _rel_err(got: np.ndarray, want: np.ndarray, scale: np.ndarray) -> float:
    return float(np.linalg.norm(got - want) / max(float(np.linalg.norm(scale)), 1e-30))


def run_check(runner: Any, check_steps: int) -> tuple[list[float], dict, float]:
    """`check_steps` steps (at least one call), the losses, the snapshot and the
    first call's wall time (trace + compile + one call)."""
    calls = -(-check_steps // runner.steps_per_call)
    t0 = time.perf_counter()
    first = runner.step()
    losses = _as_losses(first)  # waits for it
    compile_s = time.perf_counter() - t0
    for _ in range(calls - 1):
        losses += _as_losses(runner.step())
    return losses, runner.snapshot(), compile_s


def compare(
    name: str,
    losses: Sequence[float],
    snap: dict,
    ref: tuple[list[float], dict],
    es_losses: Sequence[float] | None,
    init: dict,
    errors: dict[str, float] | None = None,
) -> str | None:
    """Why `name` fails the gate (None if it passes): its losses against the
    hand-written reference's and eqx_state's (`es_losses`, same number of steps),
    its head and embedding weights against the reference's. The errors measured
    go into `errors` (`loss`: the largest relative loss error; `head`, `tok`)."""
    errors = {} if errors is None else errors
    want_losses, want = ref
    for what, target in (("hand-written JAX", want_losses), ("es_step", es_losses)):
        if target is None:
            continue
        got, exp = np.asarray(losses), np.asarray(target)
        if got.shape != exp.shape:
            return f"{len(got)} losses where {what} has {len(exp)}"
        err = float(np.max(np.abs(got - exp) / np.abs(exp)))
        errors["loss"] = max(errors.get("loss", 0.0), err)
        if not err <= LOSS_RTOL:
            return (
                f"losses differ from {what}'s (max relative error {err:.1e} > "
                f"{LOSS_RTOL:.0e}): {np.round(got, 6).tolist()} vs "
                f"{np.round(exp, 6).tolist()}"
            )
    for w in ("head", "tok"):
        err = _rel_err(np.asarray(snap[w]), np.asarray(want[w]), want[w] - init[w])
        errors[w] = err
        if not err <= WEIGHT_RTOL:
            return (
                f"{w} weights differ from the hand-written reference's "
                f"(|w - w_ref| / |w_ref - w_init| = {err:.2e} > {WEIGHT_RTOL})"
            )
    return None


def build_and_check(
    size: Size, names: Sequence[str], check_steps: int = CHECK_STEPS
) -> tuple[dict[str, Any], dict[str, dict[str, Any]], dict[str, str]]:
    """Build every variant from the same weights and batch and gate it. Returns
    `(runners that passed, {name: row info}, {name: why it failed or was
    skipped})`; the reference and `es_step` are always checked."""
    params, data = init_params(size), make_data(size)
    init = {"head": params["head"]["w"], "tok": params["tok"]}
    # One reference run (hand-written JAX, and eqx_state's step) as long as the
    # longest check, with the weights kept after every step: the checks of
    # different lengths (a K-steps call) share it, and it compiles once.
    longest = max(
        [
            check_steps,
            *(-(-check_steps // size.k) * size.k for n in names if n in SCAN_VARIANTS),
        ]
    )
    pure, es_step = PureJax(size, params, data), EsStep(size, params, data)
    ref_losses, es_losses, ref_snaps = [], [], []
    for _ in range(longest):
        ref_losses.append(float(pure.step()))
        es_losses.append(float(es_step.step()))
        ref_snaps.append(pure.snapshot())
    del pure, es_step

    def reference(n_steps: int) -> tuple[list[float], dict]:
        return ref_losses[:n_steps], ref_snaps[n_steps - 1]

    runners: dict[str, Any] = {}
    info: dict[str, dict[str, Any]] = {}
    failed: dict[str, str] = {}
    for name in names:
        cls = VARIANTS[name]
        try:
            runner = cls(size, params, data)
            losses, snap, compile_s = run_check(runner, check_steps)
        except Exception as e:  # noqa: BLE001 - reported, e.g. torch.compile here
            failed[name] = f"could not run: {type(e).__name__}: {str(e)[:300]}"
            print(f"[{size.name}] {name}: {failed[name]}", flush=True)
            traceback.print_exc(limit=3)
            continue
        ref = reference(len(losses))
        errors: dict[str, float] = {}
        why = compare(name, losses, snap, ref, es_losses[: len(losses)], init, errors)
        if why is not None:
            failed[name] = f"failed the correctness gate: {why}"
            print(f"[{size.name}] {name}: {failed[name]}", flush=True)
            continue
        for _ in range(WARMUP_CALLS):
            jax.block_until_ready(runner.step())
        runners[name] = runner
        info[name] = {
            **cls.meta(),
            "steps_per_call": runner.steps_per_call,
            "compile_samples_s": [compile_s],
            "compile_s": compile_s,
            "check_losses": losses,
            "gate_errors": errors,
            "checked": True,
        }
        print(f"[{size.name}] {name}: passed, first call {compile_s:.2f} s", flush=True)
    return runners, info, failed


# ---------------------------------------------------------------------------------
# Timing and report


def run_size(
    size: Size, names: Sequence[str], rounds: int, steps: int
) -> dict[str, Any]:
    print(
        f"[{size.name}] {size.describe()}: checking {len(names)} variants", flush=True
    )
    runners, info, failed = build_and_check(size, names)
    if "pure_jax" not in runners:
        raise AssertionError(f"{size.name}: the hand-written reference did not run")
    print(
        f"[{size.name}] timing {len(runners)} variants: {rounds} rounds x {steps} steps",
        flush=True,
    )
    pipelined, blocking = so.time_variants(runners, rounds, steps)
    rows = so.summarise(pipelined, blocking, info)
    for row in rows.values():
        k = row["steps_per_call"]
        row["tokens_per_s"] = size.tokens / (row["median_us"] * 1e-6)
        row["median_call_us"] = row["median_us"] * k
    return {"size": dataclasses.asdict(size), "rows": rows, "failed": failed}


def _fmt_tokens(x: float) -> str:
    return f"{x / 1e3:,.1f} k" if x < 1e6 else f"{x / 1e6:,.2f} M"


def _ratio(rows, name: str, base: str, prefix: str = "") -> dict[str, Any] | None:
    if name not in rows or base not in rows:
        return None
    key = prefix + "rounds_us"
    return stats.ratio_summary(rows[name][key], rows[base][key])


def fastest_peer(rows) -> str | None:
    """The peer variant (Equinox, Flax NNX, PyTorch; not the hand-written limit)
    with the lowest median same-round ratio to pure_jax, single steps."""
    best, best_r = None, math.inf
    for name, row in rows.items():
        if row["family"] in ("Equinox", "Flax NNX", "PyTorch"):
            r = _ratio(rows, name, "pure_jax")
            if r is not None and r["median"] < best_r:
                best, best_r = name, r["median"]
    return best


def targets(result: dict[str, Any]) -> list[list[str]]:
    """`[size, measure, target, value]` rows with ✓/✗/? verdicts."""
    out = []
    for size_name, res in result.items():
        rows = res["rows"]
        r = _ratio(rows, "es_step", "pure_jax")
        out.append([size_name, "`es_step` × `pure_jax`", "≤ 1.05×", _cell(r, 1.05)])
        best = fastest_peer(rows)
        r = _ratio(rows, "es_step", best) if best else None
        out.append(
            [
                size_name,
                f"`es_step` × the fastest peer form (`{best}`)",
                "< 1.00× (ahead)",
                _cell(r, 1.0),
            ]
        )
        if "es_scan" in rows:
            single = [n for n in rows if rows[n]["steps_per_call"] == 1]
            best_single = min(single, key=lambda n: rows[n]["median_us"])
            others = [n for n in rows if n != "es_scan"]
            best_any = min(others, key=lambda n: rows[n]["median_us"])
            for base in dict.fromkeys((best_single, best_any)):
                out.append(
                    [
                        size_name,
                        f"`es_scan` (K = {res['size']['k']}) per step × the fastest "
                        f"{'single-step' if base == best_single else 'other'} variant "
                        f"(`{base}`)",
                        "< 1.00× (ahead)",
                        _cell(_ratio(rows, "es_scan", base), 1.0),
                    ]
                )
    return out


def _cell(r: dict[str, Any] | None, limit: float) -> str:
    if r is None:
        return "not measured"
    return f"{stats.fmt_ratio(r)} {stats.verdict(r['ci'], limit)}"


def size_table(res: dict[str, Any]) -> list[str]:
    """One row per variant: tokens/s, µs per step and per call, × pure_jax
    pipelined and blocking [95% CI], first-call seconds."""
    rows = res["rows"]
    out = []
    for name, row in rows.items():
        k = row["steps_per_call"]
        call = f"{row['median_call_us']:,.0f}" if k > 1 else "="
        out.append(
            [
                f"`{name}`",
                row["family"],
                row["usage"],
                _fmt_tokens(row["tokens_per_s"]),
                f"{row['median_us']:,.1f} ({row['min_us']:,.1f}–{row['max_us']:,.1f})",
                call,
                stats.fmt_ratio(_ratio(rows, name, "pure_jax")),
                stats.fmt_ratio(_ratio(rows, name, "pure_jax", "blocking_")),
                f"{row['compile_s']:.1f}",
            ]
        )
    for name, why in res["failed"].items():
        cls = VARIANTS.get(name)
        fam = cls.family if cls else "-"
        out.append([f"`{name}`", fam, "-", "not timed: " + why, "", "", "", "", ""])
    return stats.markdown_table(
        [
            "variant",
            "family",
            "usage",
            "tokens/s",
            "µs/step median (min–max)",
            "µs/call",
            "× pure_jax, pipelined",
            "× pure_jax, blocking",
            "first call s",
        ],
        out,
        left=3,
    )


def _gate_line(res: dict[str, Any]) -> list[str]:
    """The largest errors the gate measured at a size (how much room it left)."""
    errs = {n: r["gate_errors"] for n, r in res["rows"].items() if r.get("gate_errors")}
    if not errs:
        return []
    parts = []
    for key, limit in (
        ("loss", LOSS_RTOL),
        ("head", WEIGHT_RTOL),
        ("tok", WEIGHT_RTOL),
    ):
        worst = max(errs, key=lambda n: errs[n].get(key, 0.0))
        parts.append(
            f"{key} {errs[worst].get(key, 0.0):.1e} (`{worst}`; limit {limit:g})"
        )
    return ["Largest gate errors: " + ", ".join(parts) + ".", ""]


def render(payload: dict[str, Any], level: int = 2) -> list[str]:
    """The report's sections (targets, one table per size, the variants' forms) as
    Markdown lines, headings at `level`: from what `main` returns, so that
    `run.py` renders the same tables into results.md and docs/performance.md."""
    result, meta = payload["result"], payload["meta"]
    h = "#" * level
    lines = [
        f"`{meta['command']}` — {meta['date']}; {meta['environment']}; "
        f"{meta['threads']}; load average {meta['load_before']} / "
        f"{meta['load_after']} (before / after).",
        "",
        "A GPT-style decoder (token + position embeddings, pre-LayerNorm blocks of "
        "causal self-attention and a GELU MLP, untied head, no dropout) trained on "
        "next-token cross-entropy with AdamW "
        f"(lr {LR}, betas {BETAS}, eps {ADAM_EPS}, weight decay {WEIGHT_DECAY}), "
        "written the same way in every library and started from the same weights. "
        "Every variant passed the correctness gate before it was timed "
        f"({CHECK_STEPS} steps, or one K-steps call: every loss within relative "
        f"{LOSS_RTOL:.0e} of the hand-written reference's and of `es_step`'s, head "
        f"and embedding weights within {WEIGHT_RTOL} of the reference's movement). "
        "Throughput: tokens (batch × seq) per second, median over rounds. Ratios: "
        "median of same-round ratios to `pure_jax` [bootstrap 95% interval]; "
        "*pipelined*: consecutive calls, one wait at the end; *blocking*: waiting "
        "for every call.",
        "",
        f"{h} Language-model targets",
        "",
        *stats.markdown_table(
            ["size", "measure", "target", "measured"], targets(result), left=3
        ),
        "",
        "✓: the interval lies inside the target; ✗: outside; ?: it straddles it.",
        "",
    ]
    for size_name, res in result.items():
        size = Size(**res["size"])
        lines += [
            f"{h} {size_name}: {size.describe()}",
            "",
            f"{size.tokens} tokens a step; the scan variants run K = {size.k} steps "
            "per call (µs/call).",
            "",
            *size_table(res),
            "",
            *_gate_line(res),
        ]
    ran = {n for res in result.values() for n in [*res["rows"], *res["failed"]]}
    lines += [
        f"{h} Language-model variants",
        "",
        *stats.markdown_table(
            ["variant", "family", "usage", "exact form", "where recommended"],
            [
                [f"`{n}`", c.family, c.usage, f"`{c.form}`", c.source]
                for n, c in VARIANTS.items()
                if n in ran
            ],
            left=5,
        ),
    ]
    return lines


def markdown(payload: dict[str, Any]) -> str:
    return "\n".join(["# Language-model training throughput", "", *render(payload), ""])


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(
        1, len(result), figsize=(6 * len(result), 4.5), squeeze=False
    )
    for ax, (size_name, res) in zip(axes[0], result.items(), strict=True):
        rows = res["rows"]
        names = list(rows)
        vals = [rows[n]["tokens_per_s"] / 1e3 for n in names]
        ax.barh(
            names,
            vals,
            color=["C0" if rows[n]["family"] != "eqx_state" else "C3" for n in names],
        )
        ax.set_xlabel("k tokens / s (median)")
        ax.set_title(size_name)
        ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--sizes", nargs="+", choices=list(SIZES), default=None)
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=None)
    p.add_argument(
        "--skip",
        nargs="+",
        choices=list(VARIANTS),
        default=(),
        help="variants to leave out",
    )
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument(
        "--steps", type=int, default=None, help="steps per variant per round"
    )
    p.add_argument(
        "--k", type=int, default=None, help="steps per call of the scan variants"
    )
    p.add_argument("--device", choices=("cpu", "gpu"), default="cpu")
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads for XLA and PyTorch (default on --device cpu: 1, see "
        "`set_threads`; 0: each library's own default)",
    )
    p.add_argument("--tiny", action="store_true", help="seconds-long smoke run")
    p.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="CALLS",
        help="cProfile the step variants over CALLS calls instead of timing",
    )
    p.add_argument("--out", type=Path, default=_HERE)
    args = p.parse_args(argv)
    if args.tiny:
        args.sizes = args.sizes or ["tiny"]
        args.rounds = min(args.rounds, 3)
    args.sizes = args.sizes or ["small", "medium"]
    return args


def set_threads(n: int) -> str:
    """Give XLA and PyTorch `n` CPU threads each (0: leave their defaults); what
    was set. One thread by default on CPU: on a shared 2-core machine PyTorch's
    OpenMP workers spin-wait for each other while other jobs hold the cores (a
    small step measured 25x slower with 2 threads than with 1 under a load of
    12), and XLA gets the same budget so that the comparison stays fair. XLA reads
    its flag when its backend starts: in a process that already ran JAX it keeps
    its threads (the report says so)."""
    if n <= 0:
        return "library defaults"
    bridge = sys.modules.get("jax._src.xla_bridge")
    started = bool(getattr(bridge, "_backends", {}))
    if n == 1 and not started:
        flags = os.environ.get("XLA_FLAGS", "")
        os.environ["XLA_FLAGS"] = (
            f"{flags} --xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
        ).strip()
    try:
        import torch

        torch.set_num_threads(n)
    except ImportError:  # pragma: no cover
        pass
    xla = "XLA 1 thread" if n == 1 and not started else "XLA its default threads"
    return f"{xla}, PyTorch {n} thread(s)"


def set_device(device: str) -> None:
    """Run JAX (and PyTorch) on `device`."""
    try:
        dev = jax.devices(device)[0]
    except RuntimeError as e:
        raise SystemExit(f"--device {device}: JAX has no such device here ({e})") from e
    jax.config.update("jax_default_device", dev)
    if device == "gpu":
        # PyTorch does not use TF32 for float32 matmuls by default; nor does JAX then.
        jax.config.update("jax_default_matmul_precision", "highest")


def _load() -> str:
    try:
        return " ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "-"


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    threads = args.threads if args.threads is not None else int(args.device == "cpu")
    threads_note = set_threads(threads)
    set_device(args.device)
    names = [n for n in args.variants or VARIANTS if n not in args.skip]
    if "pure_jax" not in names:
        names = ["pure_jax", *names]
    meta = {
        "command": "python benchmarks/lm.py "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "environment": (
            f"{so.environment()}; torch {_torch_version()}; {platform.processor() or platform.machine()}"
        ),
        "load_before": _load(),
        "threads": threads_note,
    }
    result: dict[str, Any] = {}
    for size_name in args.sizes:
        size = SIZES[size_name]
        if args.k is not None:
            size = dataclasses.replace(size, k=args.k)
        if args.profile:
            runners, _, failed = build_and_check(
                size, [n for n in names if n not in SCAN_VARIANTS]
            )
            so.profile_variants(runners, args.profile)
            continue
        steps = args.steps or size.steps
        result[size_name] = run_size(size, names, args.rounds, steps)
    if args.profile:
        return {}
    meta["load_after"] = _load()
    args.out.mkdir(parents=True, exist_ok=True)
    payload = {"meta": meta, "result": result}
    text = markdown(payload)
    (args.out / "results_lm.md").write_text(text, encoding="utf-8")
    (args.out / "results_lm.json").write_text(
        json.dumps(payload, indent=1, default=_jsonable),
        "utf-8",
    )
    try:
        plot(result, args.out / "lm.png")
    except ImportError:  # pragma: no cover - matplotlib is a bench extra
        pass
    print(text)
    return payload


def _jsonable(x: Any) -> Any:
    if hasattr(x, "tolist"):
        return x.tolist()
    return str(x)


def _torch_version() -> str:
    try:
        import torch

        return torch.__version__
    except ImportError:  # pragma: no cover
        return "-"


if __name__ == "__main__":
    main()
