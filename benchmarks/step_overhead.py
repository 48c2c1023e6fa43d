"""Training-step overhead: eqx_state against hand-written JAX, Equinox and Flax NNX,
each peer written both the way its docs start (default usage) and the fastest way its
docs recommend (expert forms).

One training step (forward, backward, Adam, BatchNorm running-statistics update) of
an MLP `(Linear -> BatchNorm -> ReLU) x depth -> Linear(10)` at a small
(dispatch-bound) and a medium size, and of a small CNN `(Conv 3x3 -> BatchNorm2d ->
ReLU) x 2 -> global average pooling -> Linear(10)` (`--sizes cnn`), each with a
cross-entropy loss. The variants (`VARIANTS`; `--variants` picks some; the table at
the end of the report gives each one's exact code form and where its family's docs
recommend it):

- `pure_jax`: hand-written JAX, the reference (ratio 1.0): parameters and BatchNorm
  statistics in tuples threaded by hand with PyTorch semantics (momentum 0.1,
  unbiased running variance); `jax.jit` with `donate_argnums`.
- eqx_state: `es_value` (`es.make_step` over an `eqx.Module` with `es.nn.BatchNorm`),
  `es_ref` (the same model after `es.to_refs`), and slots that run once the core has
  them: `es_scan10` / `es_scan100` (`step.scan`, K steps per call, issue 16) and
  `es_owned` (an explicit-ownership loop).
- Equinox: `eqx_jit` (expert: `jax.jit` on the same Equinox model with the
  statistics threaded by hand, everything donated: issue 11's limit for a library
  whose models are Equinox modules), `eqx_jit_cells` (a diagnostic: `jax.jit` by
  hand on `es_value`'s own model, cells included, so that (es_value −
  eqx_jit_cells) is what eqx_state's call adds and (eqx_jit_cells − eqx_jit) what
  the cells cost as pytree nodes), `equinox_flat` (expert: `eqx.nn.State` with
  Equinox's low-overhead loop, flat leaves through `eqx.filter_jit`), `equinox`
  (default usage: `eqx.nn.State` + `eqx.filter_jit`).
- Flax NNX: `nnx_jit_partial`, `nnx_jit_tree` (expert: tree mode, donated),
  `nnx_split_flat`, `nnx_split` (expert: the functional loop), `nnx_cached_partial`
  (expert: cached graph traversal), `nnx_jit` (default usage: `@nnx.jit` in graph
  mode, the form Flax's performance guide marks "currently slow").

Every variant starts from the same weights (copied from one initialisation) and the
same batch, and is checked first: its loss trajectory, its first-layer weights and its
BatchNorm running statistics after a few steps must match the hand-written reference;
nothing is timed otherwise. Then the variants are timed in interleaved rounds (the
order rotated each round); in every round each variant is timed twice: *pipelined*
(`--steps` calls between two `jax.block_until_ready`) and *blocking* (waiting for
every call's result, the variants' calls interleaved one by one). The table reports
per variant the median µs per step with the min-max over rounds, the median over
rounds of the ratio to `pure_jax` timed in the same round with a bootstrap 95%
interval (`bench_stats.py`), the ratio of the fastest rounds, the same for the
blocking timings, and the compile time (first call: trace + compile + one run)
separately. It is printed as Markdown, written to
`results_step_overhead.md` and plotted to `step_overhead.png` in `--out`.

Run: `python benchmarks/step_overhead.py` (`--tiny` for a seconds-long smoke run).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.util
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import eqx_state as es


def _sibling(name: str) -> Any:
    """The module `benchmarks/<name>.py`, loaded once (these scripts are not a
    package: they run as `python benchmarks/<script>.py` and are loaded by path in
    the tests)."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            name, Path(__file__).resolve().parent / f"{name}.py"
        )
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


stats = _sibling("bench_stats")

LR = 1e-3
EPS = 1e-5
TORCH_MOMENTUM = 0.1  # PyTorch's convention: the weight of the new batch
NUM_CLASSES = 10
CHECK_STEPS = 4
WARMUP_STEPS = 3
# Tolerances of the correctness check. Variants compute the same function with
# different matmul kernels (x @ W.T, per-example W @ x under vmap, Flax's kernel
# layout), so they agree to float32 rounding, which Adam amplifies in the weights
# (see `_compare`); with the same kernels es_value/es_ref match bit for bit.
LOSS_RTOL = 1e-4  # elementwise, each step's loss
WEIGHT_RTOL = 3e-2  # |w - w_ref| / |w_ref - w_init|, first layer
# |s - s_ref| / |s_ref| for each running statistic (measured: <= 2e-5 for the mean,
# <= 1e-6 for the variance). The variance's is at most a third of the smallest
# difference between the biased and unbiased conventions at the size checked (see
# `build_and_check`): after a few steps they differ by only ~2e-4 at batch 256, ~3e-5
# with the CNN's 2048 values per channel, so a wrong convention must still fail.
STAT_RTOL = {"mean": 1e-3, "var": 1e-4}
MIN_VAR_RTOL = 1e-6  # below this the check could not tell rounding from convention
KERNEL = 3  # the CNN's convolutions are KERNEL x KERNEL


@dataclasses.dataclass(frozen=True)
class Size:
    """A model and its batch: one block `layer -> BatchNorm -> ReLU` per entry of
    `widths` (its output channels), then global average pooling over the spatial
    axes (a CNN's) and `Linear(10)`. The layer is a bias-free `Linear` when an example
    is a vector (`in_shape = (features,)`) and a bias-free 3x3 convolution (stride 1,
    padding 1, PyTorch's `Conv2d`) when it is an image (`in_shape = (C, H, W)`)."""

    name: str
    widths: tuple[int, ...]
    in_shape: tuple[int, ...]
    batch: int
    steps: int  # default steps per round
    # Residual blocks `x + ReLU(BatchNorm(layer(x)))` (equal widths): a deep plain
    # BatchNorm stack is chaotic at initialisation (rounding differences between
    # matmul kernels grow ~1.2x per layer: at depth 100 float32 results are
    # unrelated to float64 ones), so deep models are checked and run residual.
    residual: bool = False

    def __post_init__(self):
        if self.residual and set(self.widths) != {self.in_shape[0]}:
            raise ValueError(f"{self.name}: residual blocks need equal widths")

    @property
    def kernel(self) -> tuple[int, ...]:
        """The layers' kernel size: `()` for `Linear`, `(3, 3)` for a convolution."""
        return (KERNEL,) * (len(self.in_shape) - 1)

    def describe(self) -> str:
        kind = f"CNN (conv {KERNEL}×{KERNEL})" if self.kernel else "MLP"
        widths = "→".join(str(w) for w in self.widths)
        if len(set(self.widths)) == 1 and len(self.widths) > 1:
            widths = f"{self.widths[0]} × {len(self.widths)}"
        shape = "×".join(str(d) for d in self.in_shape)
        res = ", residual" if self.residual else ""
        return f"{kind}{res}, widths {widths}, batch {self.batch}, input {shape}"


SIZES = {
    "small": Size("small", widths=(32,) * 2, in_shape=(32,), batch=16, steps=300),
    "medium": Size("medium", widths=(512,) * 4, in_shape=(512,), batch=256, steps=30),
    "cnn": Size("cnn", widths=(8, 16), in_shape=(3, 8, 8), batch=32, steps=200),
    "tiny": Size("tiny", widths=(8,), in_shape=(8,), batch=4, steps=3),
    "tiny_cnn": Size("tiny_cnn", widths=(4,), in_shape=(2, 4, 4), batch=4, steps=3),
}


# ---------------------------------------------------------------------------------
# Shared initialisation, data and layer arithmetic


def init_params(size: Size, key: jax.Array) -> dict[str, Any]:
    """Weights in PyTorch's layout (`W: [out, in, *kernel]`), Equinox's default init.

    The hidden layers have no bias, as usual before a BatchNorm (PyTorch's
    `bias=False`): the BatchNorm removes it, so its gradient is rounding noise that
    Adam would amplify into updates of size `lr`, which show up in the running mean
    and make variants differ by ~1e-4 for reasons unrelated to what is compared.
    """
    dims = [size.in_shape[0], *size.widths]
    keys = jax.random.split(key, len(size.widths) + 2)

    def uniform(k, shape):
        lim = 1.0 / np.sqrt(np.prod(shape[1:]))  # 1 / sqrt(fan_in)
        return jax.random.uniform(k, shape, jnp.float32, -lim, lim)

    layers = tuple(
        uniform(k, (d_out, d_in, *size.kernel))
        for k, d_in, d_out in zip(keys, dims[:-1], dims[1:])
    )
    norms = tuple(
        (jnp.ones(w, jnp.float32), jnp.zeros(w, jnp.float32)) for w in size.widths
    )
    head = (
        uniform(keys[-2], (NUM_CLASSES, size.widths[-1])),
        uniform(keys[-1], (NUM_CLASSES,)),
    )
    return {"layers": layers, "norms": norms, "head": head}


def init_bn_state(size: Size) -> tuple[tuple[jax.Array, jax.Array], ...]:
    return tuple(
        (jnp.zeros(w, jnp.float32), jnp.ones(w, jnp.float32)) for w in size.widths
    )


def make_data(size: Size, key: jax.Array) -> tuple[jax.Array, jax.Array]:
    kx, ky = jax.random.split(key)
    x = jax.random.normal(kx, (size.batch, *size.in_shape), jnp.float32)
    y = jax.random.randint(ky, (size.batch,), 0, NUM_CLASSES)
    return x, y


def layer(w: jax.Array, h: jax.Array) -> jax.Array:
    """A batch through a bias-free `Linear` (`w: [out, in]`) or a 3x3 convolution
    with padding 1 (`w: [out, in, 3, 3]`), PyTorch's layouts (`h: [N, C, ...]`)."""
    if w.ndim == 2:
        return h @ w.T
    return jax.lax.conv_general_dilated(
        h, w, (1,) * (w.ndim - 2), "SAME", dimension_numbers=("NCHW", "OIHW", "NCHW")
    )


def global_pool(h: jax.Array, keep: tuple[int, ...]) -> jax.Array:
    """Mean over every axis but `keep` (the batch and channel axes): a CNN's global
    average pooling; the identity for an MLP, which has no other axis."""
    keep = tuple(k % h.ndim for k in keep)
    axes = tuple(i for i in range(h.ndim) if i not in keep)
    return jnp.mean(h, axis=axes) if axes else h


def flax_layout(ndim: int) -> tuple[int, ...]:
    """The transposition from PyTorch's weight layout to Flax's kernel layout:
    `[in, out]` for `Linear`, `[kh, kw, in, out]` for a convolution."""
    return (*range(2, ndim), 1, 0)


def fresh(tree: Any) -> Any:
    """Own copies: every variant donates its buffers, so none may share an array."""
    return jax.tree.map(lambda a: jnp.array(a, copy=True), tree)


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels))


# ---------------------------------------------------------------------------------
# Variants. Each runner owns its model/optimizer state; `step()` runs one call of
# the variant's compiled step (one training step, or `steps_per_call` of them) and
# returns the loss(es) (every variant returns them, as a training loop that logs the
# loss would); `snapshot()` returns numpy copies of what the check compares.
#
# Each runner says what it is: `family` (whose code), `usage` ("reference",
# "eqx_state", "expert": the fastest form that family's docs recommend, or "default
# usage": the form their docs start from and most users write), `form` (the exact
# code form) and `source` (where the family's docs recommend that form).

REFERENCE, ES, EXPERT, DEFAULT = "reference", "eqx_state", "expert", "default usage"
# Not a form anyone recommends: a variant that splits another's time into parts.
DIAGNOSTIC = "diagnostic"


class Runner:
    name: str
    label: str
    family: str
    usage: str
    form: str
    source: str = "-"
    steps_per_call: int = 1  # training steps per call of `step()`
    biased_running_var: bool = False  # compared against the biased-variance reference

    @classmethod
    def available(cls) -> bool:
        """Whether this variant can run with the installed packages (a slot for an
        eqx_state API that has not landed yet returns False until it has)."""
        return True

    @classmethod
    def default_for(cls, size: Size) -> bool:
        """Whether this variant runs at `size` unless `--variants` says otherwise."""
        del size
        return True

    @classmethod
    def meta(cls) -> dict[str, Any]:
        """What the report says about this variant (stored with its results)."""
        return {
            "label": cls.label,
            "family": cls.family,
            "usage": cls.usage,
            "form": cls.form,
            "source": cls.source,
            "steps_per_call": cls.steps_per_call,
        }

    def step(self) -> jax.Array:  # pragma: no cover - abstract
        raise NotImplementedError

    def snapshot(self) -> dict[str, Any]:  # pragma: no cover - abstract
        raise NotImplementedError


# (a) hand-written JAX --------------------------------------------------------------


def batch_norm(h, gamma, beta, rm, rv, *, unbiased: bool):
    """Training-mode BatchNorm of `h: [N, C, ...]` over every axis but the channels,
    and the new running statistics (PyTorch's momentum; running variance unbiased
    when `unbiased`, else the biased batch variance as Equinox and Flax keep)."""
    axes = tuple(i for i in range(h.ndim) if i != 1)  # all but the channels
    per_channel = (1, -1) + (1,) * (h.ndim - 2)  # broadcasts [C] against h
    mean = jnp.mean(h, axis=axes)
    var = jnp.mean(jnp.square(h - mean.reshape(per_channel)), axis=axes)
    n = h.size // h.shape[1]
    run_var = var * (n / (n - 1)) if unbiased else var
    m = TORCH_MOMENTUM
    new_stats = (
        jax.lax.stop_gradient((1 - m) * rm + m * mean),
        jax.lax.stop_gradient((1 - m) * rv + m * run_var),
    )
    h = (h - mean.reshape(per_channel)) * jax.lax.rsqrt(var.reshape(per_channel) + EPS)
    return h * gamma.reshape(per_channel) + beta.reshape(per_channel), new_stats


def pure_forward(params, bn_state, x, *, unbiased: bool, residual: bool = False):
    h = x
    new_state = []
    for w, (gamma, beta), (rm, rv) in zip(
        params["layers"], params["norms"], bn_state, strict=True
    ):
        h_in = h
        h, stats = batch_norm(layer(w, h), gamma, beta, rm, rv, unbiased=unbiased)
        new_state.append(stats)
        h = jax.nn.relu(h)
        h = h_in + h if residual else h
    w, b = params["head"]
    return global_pool(h, keep=(0, 1)) @ w.T + b[None, :], tuple(new_state)


def make_pure_step(
    optimizer: optax.GradientTransformation,
    *,
    unbiased: bool = True,
    residual: bool = False,
):
    def step(params, bn_state, opt_state, x, y):
        def loss_fn(p):
            logits, new_state = pure_forward(
                p, bn_state, x, unbiased=unbiased, residual=residual
            )
            return cross_entropy(logits, y), new_state

        (loss, bn_state), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, bn_state, opt_state, loss

    return jax.jit(step, donate_argnums=(0, 1, 2))


@functools.cache
def _shared_pure_step(unbiased: bool, residual: bool):
    return make_pure_step(optax.adam(LR), unbiased=unbiased, residual=residual)


class PureJax(Runner):
    name = "pure_jax"
    label = "hand-written JAX on dicts and tuples"
    family, usage = "JAX", REFERENCE
    form = (
        "jax.jit(step, donate_argnums=(0, 1, 2)) over step(params, bn_state, "
        "opt_state, x, y); params and statistics in tuples/dicts threaded by hand"
    )
    source = "JAX's jax.jit documentation (donate_argnums)"

    def __init__(
        self, params, bn_state, data, *, residual=False, unbiased=True, shared=False
    ):
        """`shared`: reuse one jitted step per (unbiased, residual), compiled once
        per process (the check's references); the timed instance compiles its own,
        so that its first call measures a real compile."""
        optimizer = optax.adam(LR)
        self.params, self.bn_state = fresh(params), fresh(bn_state)
        self.opt_state = optimizer.init(self.params)
        self.x, self.y = data
        if shared:
            self._step = _shared_pure_step(unbiased, residual)
        else:
            self._step = make_pure_step(optimizer, unbiased=unbiased, residual=residual)

    def step(self):
        self.params, self.bn_state, self.opt_state, loss = self._step(
            self.params, self.bn_state, self.opt_state, self.x, self.y
        )
        return loss

    def snapshot(self):
        return {
            "w0": np.asarray(self.params["layers"][0]),
            "mean": [np.asarray(m) for m, _ in self.bn_state],
            "var": [np.asarray(v) for _, v in self.bn_state],
        }


# (b), (c) eqx_state ----------------------------------------------------------------


def _eqx_layer(w: jax.Array, b: jax.Array | None = None) -> eqx.Module:
    """`eqx.nn.Linear` or `eqx.nn.Conv` (padding "SAME") holding `w` (and `b`)."""
    d_out, d_in = w.shape[:2]
    key = jax.random.key(0)
    if w.ndim == 2:
        mod = eqx.nn.Linear(d_in, d_out, use_bias=b is not None, key=key)
    else:
        mod = eqx.nn.Conv(
            w.ndim - 2,
            d_in,
            d_out,
            w.shape[2:],
            padding="SAME",
            use_bias=False,
            key=key,
        )
    return _set(mod, weight=w, bias=b)


def _set(module, **values):
    """`module` with the named array fields replaced (`None` values are skipped)."""
    names = [k for k, v in values.items() if v is not None]
    return eqx.tree_at(
        lambda m: [getattr(m, k) for k in names], module, [values[k] for k in names]
    )


class EqxFamilyNet(eqx.Module):
    """The model as an `eqx.Module` (eqx_state's and Equinox's variants): the layers
    from `params`, each followed by the BatchNorm `make_norm(channels)` made by the
    variant."""

    # Typed `Any`: which Equinox layers they are depends on the size and variant.
    layers: tuple[Any, ...]
    norms: tuple[Any, ...]
    head: Any
    residual: bool = eqx.field(static=True)

    def __init__(self, params, residual: bool, make_norm: Callable[[int], Any]):
        self.residual = residual
        self.layers = tuple(_eqx_layer(w) for w in params["layers"])
        self.norms = tuple(
            _set(make_norm(g.shape[0]), weight=g, bias=b) for g, b in params["norms"]
        )
        self.head = _eqx_layer(*params["head"])


class EsNet(EqxFamilyNet):
    """Batched, with `es.nn.BatchNorm` (PyTorch's momentum convention)."""

    def __init__(self, params, residual: bool):
        super().__init__(
            params,
            residual,
            lambda c: es.nn.BatchNorm(c, momentum=TORCH_MOMENTUM, eps=EPS),
        )

    def __call__(self, x):
        for lay, bn in zip(self.layers, self.norms, strict=True):
            y = jax.nn.relu(bn(jax.vmap(lay)(x)))
            x = x + y if self.residual else y
        return jax.vmap(self.head)(global_pool(x, keep=(0, 1)))


def es_loss(model: EsNet, x, y):
    loss = cross_entropy(model(x), y)
    return loss, loss


def _es_snapshot(model: EsNet) -> dict[str, Any]:
    mean, var = [], []
    for bn in model.norms:
        assert bn.running_mean is not None and bn.running_var is not None
        mean.append(np.asarray(bn.running_mean[...]))
        var.append(np.asarray(bn.running_var[...]))
    return {"w0": np.asarray(model.layers[0].weight), "mean": mean, "var": var}


class EsValue(Runner):
    name = "es_value"
    label = "eqx_state make_step, value mode"
    family, usage = "eqx_state", ES
    form = (
        "step = es.make_step(loss_fn, optax.adam(lr), has_aux=True); "
        "model, opt_state, loss = step(model, opt_state, x, y)"
    )
    source = "README, docs/tutorial.md"

    def __init__(self, params, bn_state, data, *, residual=False):
        del bn_state  # es.nn.BatchNorm starts at PyTorch's init (mean 0, var 1)
        self.model = self._model(EsNet(fresh(params), residual))
        self._step = es.make_step(es_loss, optax.adam(LR), has_aux=True)
        self.opt_state = self._step.init(self.model)
        self.x, self.y = data

    def _model(self, model):
        return model

    def step(self):
        self.model, self.opt_state, loss = self._step(
            self.model, self.opt_state, self.x, self.y
        )
        return loss

    def snapshot(self):
        return _es_snapshot(self.model)


class EsRef(EsValue):
    name = "es_ref"
    label = "eqx_state make_step, ref mode (es.to_refs)"
    form = "the same step on model = es.to_refs(model)"

    def _model(self, model):
        return es.to_refs(model)


class EsValueAgain(EsValue):
    """The A/A control of the many-cells benchmark: `es_value` again, a second
    instance built, checked and timed as a variant of its own. Its same-round
    difference to `es_value` measures nothing but the harness (two instances, two
    places in a round), so the interval of its slope is the resolution of every
    same-round difference's slope, ref − value among them."""

    name = "es_value_again"
    label = "es_value again: a second instance (the A/A control)"
    usage = DIAGNOSTIC
    form = "the step of es_value, a second instance"
    source = "many_cells.py (the resolution of a same-round difference)"

    @classmethod
    def default_for(cls, size: Size) -> bool:
        return size.residual  # the many-cells sizes only


def _is_many_steps_size(size: Size) -> bool:
    """The sizes where issue 16 asks for `step.scan` rows: the small MLP (and its
    tiny stand-in) and the many-cells models (residual)."""
    return size.name in ("small", "tiny") or size.residual


class EsScan(EsValue):
    """Slot (issue 16): `K` training steps per compiled call with `step.scan`, on a
    batch stacked `K` times. Runs once `es.Step` has `scan`."""

    K = 0
    family, usage = "eqx_state", ES
    source = "issue 16 (step.scan)"

    @classmethod
    def available(cls) -> bool:
        return True  # `step.scan` exists (issue 16)

    @classmethod
    def default_for(cls, size: Size) -> bool:
        return _is_many_steps_size(size)

    def __init__(self, params, bn_state, data, *, residual=False):
        super().__init__(params, bn_state, data, residual=residual)
        # Own copies, one slice per step (the same batch every step, as elsewhere).
        self.xs = jnp.stack([self.x] * self.K)
        self.ys = jnp.stack([self.y] * self.K)

    def step(self):
        self.model, self.opt_state, losses = self._step.scan(  # type: ignore[attr-defined]
            self.model, self.opt_state, self.xs, self.ys
        )
        return losses


class EsScan10(EsScan):
    name = "es_scan10"
    K = steps_per_call = 10
    label = "eqx_state step.scan, K = 10 steps per call (value mode)"
    form = "model, opt_state, losses = step.scan(model, opt_state, xs, ys)  # xs: [10, ...]"


class EsScan100(EsScan):
    name = "es_scan100"
    K = steps_per_call = 100
    label = "eqx_state step.scan, K = 100 steps per call (value mode)"
    form = "model, opt_state, losses = step.scan(model, opt_state, xs, ys)  # xs: [100, ...]"


class EsOwned(EsValue):
    """Slot (issue 19, item 4): an explicit-ownership loop, if the core adds one.
    Assumed protocol (adapt here if the core names it differently): `loop =
    step.own(model, opt_state)` takes the model and optimizer state over, `loss =
    loop(x, y)` runs one step, `model, opt_state = loop.release()` hands them back."""

    name = "es_owned"
    label = "eqx_state explicit-ownership loop (value mode)"
    form = "loop = step.own(model, opt_state); loss = loop(x, y); loop.release()"
    source = "issue 19 (explicit ownership)"

    @classmethod
    def available(cls) -> bool:
        return True  # `step.own` exists (issue 16)

    def __init__(self, params, bn_state, data, *, residual=False):
        super().__init__(params, bn_state, data, residual=residual)
        self._loop = self._step.own(self.model, self.opt_state)  # type: ignore[attr-defined]
        del self.model, self.opt_state  # owned by the loop now

    def step(self):
        return self._loop(self.x, self.y)

    def snapshot(self):
        model, opt_state = self._loop.release()
        self._loop = self._step.own(model, opt_state)  # type: ignore[attr-defined]
        return _es_snapshot(model)


# (d) Equinox: the same model, statistics threaded by hand, jax.jit -------------------


class Affine(eqx.Module):
    """A BatchNorm's parameters; its running statistics are threaded by hand."""

    weight: jax.Array
    bias: jax.Array

    def __init__(self, channels: int):
        self.weight = jnp.ones(channels, jnp.float32)
        self.bias = jnp.zeros(channels, jnp.float32)


class EqxJitNet(EqxFamilyNet):
    """eqx_state's model (`EsNet`: the same Equinox layers, batched) with the
    BatchNorm statistics passed in and returned by hand instead of kept in cells."""

    def __init__(self, params, residual: bool):
        super().__init__(params, residual, Affine)

    def __call__(self, x, stats):
        new_stats = []
        for lay, bn, (rm, rv) in zip(self.layers, self.norms, stats, strict=True):
            h, s = batch_norm(
                jax.vmap(lay)(x), bn.weight, bn.bias, rm, rv, unbiased=True
            )
            new_stats.append(s)
            y = jax.nn.relu(h)
            x = x + y if self.residual else y
        return jax.vmap(self.head)(global_pool(x, keep=(0, 1))), tuple(new_stats)


class EqxJit(Runner):
    name = "eqx_jit"
    label = (
        "jax.jit on the same Equinox model, statistics threaded by hand, "
        "everything donated"
    )
    family, usage = "Equinox", EXPERT
    form = (
        "jax.jit(step, donate_argnums=(0, 1, 2)) over step(model, stats, opt_state, "
        "x, y); model: the eqx.Module of es_value without cells, stats: tuples"
    )
    source = (
        "Equinox docs, 'All of Equinox' §1-2: jax.jit on a model whose leaves are "
        "all arrays ('both approaches are equally valid'); issue 11's limit"
    )

    net: type[EqxJitNet] = EqxJitNet

    def optimizer(self) -> optax.GradientTransformation:
        return optax.adam(LR)

    def __init__(self, params, bn_state, data, *, residual=False):
        optimizer = self.optimizer()
        self.model = self.net(fresh(params), residual)
        self.stats = fresh(bn_state)
        self.opt_state = optimizer.init(self.model)
        self.x, self.y = data

        @functools.partial(jax.jit, donate_argnums=(0, 1, 2))
        def step(model, stats, opt_state, x, y):
            def loss_fn(model):
                logits, new_stats = model(x, stats)
                return cross_entropy(logits, y), new_stats

            (loss, stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(model)
            updates, opt_state = optimizer.update(grads, opt_state, model)
            return eqx.apply_updates(model, updates), stats, opt_state, loss

        self._step = step

    def step(self):
        self.model, self.stats, self.opt_state, loss = self._step(
            self.model, self.stats, self.opt_state, self.x, self.y
        )
        return loss

    def snapshot(self):
        return {
            "w0": np.asarray(self.model.layers[0].weight),
            "mean": [np.asarray(m) for m, _ in self.stats],
            "var": [np.asarray(v) for _, v in self.stats],
        }


class EqxJitCells(Runner):
    """Where the cost of a model with cells goes: `jax.jit` by hand on eqx_state's
    own model (`EsNet`, its cells as pytree nodes), the statistics computed as
    `eqx_jit` computes them and put into the cells with `eqx.tree_at`. It passes
    and returns exactly the pytree `es_value` does, with no eqx_state code in the
    call: (es_value − eqx_jit_cells) is what eqx_state's call adds,
    (eqx_jit_cells − eqx_jit) what the cells cost as pytree nodes."""

    name = "eqx_jit_cells"
    label = (
        "jax.jit on eqx_state's own model (cells as pytree nodes), statistics by hand"
    )
    family, usage = "Equinox", DIAGNOSTIC
    form = (
        "jax.jit(step, donate_argnums=(0, 1)) over step(model, opt_state, x, y); "
        "model: es_value's model, cells included; new statistics put into the cells "
        "with eqx.tree_at"
    )
    source = "none: a decomposition of es_value's time, not a recommended form"

    def __init__(self, params, bn_state, data, *, residual=False):
        del bn_state  # es.nn.BatchNorm starts at PyTorch's init (mean 0, var 1)
        optimizer = optax.adam(LR)
        self.model = EsNet(fresh(params), residual)
        is_param = eqx.is_inexact_array
        params_only, _ = eqx.partition(self.model, is_param, is_leaf=es.is_state)
        self.opt_state = optimizer.init(params_only)
        self.x, self.y = data

        @functools.partial(jax.jit, donate_argnums=(0, 1))
        def step(model, opt_state, x, y):
            diff, rest = eqx.partition(model, is_param, is_leaf=es.is_state)

            def loss_fn(diff):
                m = eqx.combine(diff, rest)
                h, new_stats = x, []
                for lay, bn in zip(m.layers, m.norms, strict=True):
                    out, s = batch_norm(
                        jax.vmap(lay)(h),
                        bn.weight,
                        bn.bias,
                        bn.running_mean.value,
                        bn.running_var.value,
                        unbiased=True,
                    )
                    new_stats.append(s)
                    y_ = jax.nn.relu(out)
                    h = h + y_ if m.residual else y_
                logits = jax.vmap(m.head)(global_pool(h, keep=(0, 1)))
                return cross_entropy(logits, y), new_stats

            (loss, stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(diff)
            updates, opt_state = optimizer.update(grads, opt_state, diff)
            model = eqx.combine(eqx.apply_updates(diff, updates), rest)
            for i, (rm, rv) in enumerate(stats):
                bn = model.norms[i]
                model = eqx.tree_at(
                    lambda m, i=i: (
                        m.norms[i].running_mean.value,
                        m.norms[i].running_var.value,
                        m.norms[i].num_batches_tracked.value,
                    ),
                    model,
                    (rm, rv, bn.num_batches_tracked.value + 1),
                )
            return model, opt_state, loss

        self._step = step

    # called as `es_value`'s step is: `model, opt_state, loss = step(model, ...)`
    step = EsValue.step
    snapshot = EsValue.snapshot


# (e), (f) Equinox eqx.nn.BatchNorm + eqx.nn.State ------------------------------------


class EqxNet(EqxFamilyNet):
    """Per-example, with `eqx.nn.BatchNorm` + `eqx.nn.State`, as in Equinox's
    stateful example. Equinox's momentum is the weight of the *old* statistic."""

    def __init__(self, params, residual: bool):
        super().__init__(
            params,
            residual,
            lambda c: eqx.nn.BatchNorm(
                c, axis_name="batch", eps=EPS, momentum=1 - TORCH_MOMENTUM, mode="batch"
            ),
        )

    def __call__(self, x, state):
        for lay, bn in zip(self.layers, self.norms, strict=True):
            y, state = bn(lay(x), state)
            x = x + jax.nn.relu(y) if self.residual else jax.nn.relu(y)
        return self.head(global_pool(x, keep=(0,))), state


def _eqx_train_step(optimizer, batch, model, state, opt_state):
    """One step of Equinox's stateful example: the model per example under
    `jax.vmap(..., axis_name="batch")`, `filter_value_and_grad`, optax."""
    x, y = batch

    def loss_fn(model, state):
        batched = jax.vmap(
            model, axis_name="batch", in_axes=(0, None), out_axes=(0, None)
        )
        logits, state = batched(x, state)
        return cross_entropy(logits, y), state

    (loss, state), grads = eqx.filter_value_and_grad(loss_fn, has_aux=True)(
        model, state
    )
    updates, opt_state = optimizer.update(
        grads, opt_state, eqx.filter(model, eqx.is_inexact_array)
    )
    model = eqx.apply_updates(model, updates)
    return model, state, opt_state, loss


def make_eqx_step(optimizer: optax.GradientTransformation):
    # The batch comes first so that everything else (model, state, opt_state) is
    # donated, as in the hand-written reference.
    @eqx.filter_jit(donate="all-except-first")
    def step(batch, model, state, opt_state):
        return _eqx_train_step(optimizer, batch, model, state, opt_state)

    return step


class EqxState(Runner):
    name = "equinox"
    label = "Equinox eqx.nn.BatchNorm + eqx.nn.State, eqx.filter_jit"
    family, usage = "Equinox", DEFAULT
    form = (
        'eqx.filter_jit(donate="all-except-first") over step(batch, model, state, '
        "opt_state); eqx.nn.BatchNorm + eqx.nn.State, the model per example under "
        'jax.vmap(..., axis_name="batch")'
    )
    source = (
        "Equinox examples 'Stateful operations (BatchNorm)' and 'Train RNN' "
        "(filter_jit make_step)"
    )
    # eqx.nn.BatchNorm(mode="batch") keeps the *biased* batch variance in its running
    # average (PyTorch keeps the unbiased one), so it is checked against the same
    # hand-written reference with a biased running variance.
    biased_running_var = True

    def __init__(self, params, bn_state, data, *, residual=False):
        del bn_state  # mode="batch" starts at mean 0, var 1 like the reference
        model = EqxNet(fresh(params), residual)
        # As `eqx.nn.make_with_state` does: the State takes the initial arrays and
        # the model drops its copy (else one array would be donated twice).
        self.state = eqx.nn.State(model)
        self.model = model = eqx.nn.delete_init_state(model)
        self.optimizer = optax.adam(LR)
        self.opt_state = self.optimizer.init(eqx.filter(model, eqx.is_inexact_array))
        self.batch = data
        self._step = make_eqx_step(self.optimizer)

    def step(self):
        self.model, self.state, self.opt_state, loss = self._step(
            self.batch, self.model, self.state, self.opt_state
        )
        return loss

    def snapshot(self):
        stats = [self.state.get(bn.batch_state_index) for bn in self.model.norms]
        return {
            "w0": np.asarray(self.model.layers[0].weight),
            "mean": [np.asarray(m) for m, _ in stats],
            "var": [np.asarray(v) for _, v in stats],
        }


class EqxFlat(EqxState):
    """Equinox's "low-overhead training loops" recipe: flatten model, state and
    optimizer state once, pass the flat leaves through `eqx.filter_jit`, unflatten
    inside, return leaves."""

    name = "equinox_flat"
    label = "Equinox eqx.nn.State, low-overhead loop (flatten once, flat leaves)"
    usage = EXPERT
    form = (
        "flat, treedef = jax.tree_util.tree_flatten((model, state, opt_state)) once; "
        'eqx.filter_jit(donate="all-except-first") over step(batch, flat): '
        "tree_unflatten inside, returns jax.tree_util.tree_leaves(...)"
    )
    source = "Equinox docs, 'Tricks' → 'Low-overhead training loops' (docs/tricks.md)"

    def __init__(self, params, bn_state, data, *, residual=False):
        super().__init__(params, bn_state, data, residual=residual)
        self.flat, treedef = jax.tree_util.tree_flatten(
            (self.model, self.state, self.opt_state)
        )
        del self.model, self.state, self.opt_state  # only the leaves are kept
        optimizer = self.optimizer

        @eqx.filter_jit(donate="all-except-first")
        def step(batch, flat):
            model, state, opt_state = jax.tree_util.tree_unflatten(treedef, flat)
            *out, loss = _eqx_train_step(optimizer, batch, model, state, opt_state)
            return jax.tree_util.tree_leaves(out), loss

        self._treedef = treedef
        self._flat_step = step

    def step(self):
        self.flat, loss = self._flat_step(self.batch, self.flat)
        return loss

    def snapshot(self):
        model, state, _ = jax.tree_util.tree_unflatten(self._treedef, self.flat)
        stats = [state.get(bn.batch_state_index) for bn in model.norms]
        return {
            "w0": np.asarray(model.layers[0].weight),
            "mean": [np.asarray(m) for m, _ in stats],
            "var": [np.asarray(v) for _, v in stats],
        }


# (g)-(l) Flax NNX --------------------------------------------------------------------


def _nnx_model(params, residual: bool):
    from flax import nnx

    class NnxNet(nnx.Module):
        """Flax's layout: channels last, kernels `[*kernel, in, out]`."""

        def __init__(self, params, rngs: nnx.Rngs):
            self.residual = residual

            def make_layer(w, b=None):
                d_out, d_in = w.shape[:2]
                if w.ndim == 2:
                    lay = nnx.Linear(d_in, d_out, use_bias=b is not None, rngs=rngs)
                else:
                    lay = nnx.Conv(
                        d_in,
                        d_out,
                        w.shape[2:],
                        padding="SAME",
                        use_bias=False,
                        rngs=rngs,
                    )
                lay.kernel.set_value(jnp.transpose(w, flax_layout(w.ndim)))
                if b is not None:
                    assert lay.bias is not None
                    lay.bias.set_value(b)
                return lay

            def make_norm(gamma, beta):
                # Flax's momentum is the weight of the old statistic: 1 - PyTorch's.
                # Two-pass variance, as every other variant computes it.
                bn = nnx.BatchNorm(
                    gamma.shape[0],
                    momentum=1 - TORCH_MOMENTUM,
                    epsilon=EPS,
                    use_fast_variance=False,
                    rngs=rngs,
                )
                assert bn.scale is not None and bn.bias is not None
                bn.scale.set_value(gamma)
                bn.bias.set_value(beta)
                return bn

            self.layers = nnx.List([make_layer(w) for w in params["layers"]])
            self.norms = nnx.List([make_norm(g, b) for g, b in params["norms"]])
            self.head = make_layer(*params["head"])

        def __call__(self, x):
            for lay, bn in zip(self.layers, self.norms, strict=True):
                y = nnx.relu(bn(lay(x)))
                x = x + y if self.residual else y
            return self.head(global_pool(x, keep=(0, -1)))

    return NnxNet(params, nnx.Rngs(0))


def _nnx_data(data: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
    """The batch in Flax's channels-last layout (converted once, not per step)."""
    x, y = data
    return jnp.moveaxis(x, 1, -1), y


def _nnx_snapshot(model) -> dict[str, Any]:
    kernel = np.asarray(model.layers[0].kernel[...])
    return {
        "w0": np.transpose(kernel, np.argsort(flax_layout(kernel.ndim))),
        "mean": [np.asarray(bn.mean[...]) for bn in model.norms],
        "var": [np.asarray(bn.var[...]) for bn in model.norms],
    }


def _nnx_loss(model, x, y):
    return cross_entropy(model(x), y)


def nnx_train_step(model, optimizer, x, y):
    """The train step of Flax's performance guide: `nnx.value_and_grad`, then
    `optimizer.update(model, grads)` in place."""
    from flax import nnx

    loss, grads = nnx.value_and_grad(_nnx_loss)(model, x, y)
    optimizer.update(model, grads)
    return loss


_FLAX_PERF = "Flax 0.12.8 docs, guides/performance ('Performance considerations')"


class NnxRunner(Runner):
    family = "Flax NNX"
    # nnx.BatchNorm keeps the biased batch variance in its running average.
    biased_running_var = True

    def __init__(self, params, bn_state, data, *, residual=False):
        from flax import nnx

        del bn_state
        self.model = _nnx_model(fresh(params), residual)
        self.optimizer = nnx.Optimizer(self.model, optax.adam(LR), wrt=nnx.Param)
        self.x, self.y = _nnx_data(data)

    def snapshot(self):
        return _nnx_snapshot(self.model)


class NnxJit(NnxRunner):
    name = "nnx_jit"
    label = "Flax NNX nnx.jit (graph mode, the 0.12.8 default)"
    usage = DEFAULT
    form = "@nnx.jit train_step(model, optimizer, x, y), no donation"
    source = f"{_FLAX_PERF}: the guide's first loop, marked '<== currently slow'"

    def __init__(self, params, bn_state, data, *, residual=False):
        from flax import nnx

        super().__init__(params, bn_state, data, residual=residual)
        self._step = nnx.jit(nnx_train_step)

    def step(self):
        return self._step(self.model, self.optimizer, self.x, self.y)


class NnxJitTree(NnxRunner):
    name = "nnx_jit_tree"
    label = "Flax NNX nnx.jit tree mode (graph=False), donated"
    usage = EXPERT
    form = (
        'nnx.jit(train_step, graph=False, donate_argnames=("model", "optimizer"))'
        "(model, optimizer, x, y)"
    )
    source = (
        "flax.nnx.jit docstring, Flax 0.12.8 ('graph=False ... tree-mode is faster'; "
        "the note on donate_argnames); FLIP 5310 'Tree Mode NNX'"
    )

    def __init__(self, params, bn_state, data, *, residual=False):
        from flax import nnx

        super().__init__(params, bn_state, data, residual=residual)
        self._step = nnx.jit(
            nnx_train_step, graph=False, donate_argnames=("model", "optimizer")
        )

    def step(self):
        return self._step(self.model, self.optimizer, self.x, self.y)


class NnxJitPartial(NnxRunner):
    name = "nnx_jit_partial"
    label = "Flax NNX nnx.jit_partial tree mode (graph=False), donated"
    usage = EXPERT
    form = (
        "nnx.jit_partial(train_step, model, optimizer, graph=False, "
        "donate_argnums=0)(x, y)  # argument 0: the bound model and optimizer"
    )
    source = (
        "flax.nnx.jit_partial docstring, Flax 0.12.8 ('like nnx.cached_partial but "
        "designed for tree-mode')"
    )

    def __init__(self, params, bn_state, data, *, residual=False):
        from flax import nnx

        super().__init__(params, bn_state, data, residual=residual)
        self._step = nnx.jit_partial(
            nnx_train_step, self.model, self.optimizer, graph=False, donate_argnums=0
        )

    def step(self):
        return self._step(self.x, self.y)


class NnxCachedPartial(NnxRunner):
    name = "nnx_cached_partial"
    label = "Flax NNX nnx.cached_partial over nnx.jit (graph mode), donated"
    usage = EXPERT
    form = (
        'nnx.cached_partial(nnx.jit(train_step, donate_argnames=("model", '
        '"optimizer")), model, optimizer)(x, y)'
    )
    source = (
        f"{_FLAX_PERF}, 'Caching graph node traversals' (+ the nnx.jit docstring's "
        "donation note)"
    )

    def __init__(self, params, bn_state, data, *, residual=False):
        from flax import nnx

        super().__init__(params, bn_state, data, residual=residual)
        jitted = nnx.jit(nnx_train_step, donate_argnames=("model", "optimizer"))
        self._step = nnx.cached_partial(jitted, self.model, self.optimizer)

    def step(self):
        return self._step(self.x, self.y)


def _nnx_functional_step(graphdef, state, x, y):
    """The body of the performance guide's functional training loop."""
    from flax import nnx

    model, optimizer = nnx.merge(graphdef, state)
    loss = nnx_train_step(model, optimizer, x, y)
    return nnx.state((model, optimizer)), loss


class NnxSplit(NnxRunner):
    name = "nnx_split"
    label = "Flax NNX functional loop: nnx.split once, nnx.merge inside jax.jit"
    usage = EXPERT
    form = (
        "graphdef, state = nnx.split((model, optimizer)) once; "
        "jax.jit(step, donate_argnums=1)(graphdef, state, x, y) with nnx.merge / "
        "nnx.state inside"
    )
    source = f"{_FLAX_PERF}, 'Functional training loop' (+ donation)"

    def __init__(self, params, bn_state, data, *, residual=False):
        from flax import nnx

        super().__init__(params, bn_state, data, residual=residual)
        self.graphdef, self.state = nnx.split((self.model, self.optimizer))
        del self.model, self.optimizer  # the state lives in `self.state`
        self._step = jax.jit(_nnx_functional_step, donate_argnums=(1,))

    def step(self):
        self.state, loss = self._step(self.graphdef, self.state, self.x, self.y)
        return loss

    def snapshot(self):
        from flax import nnx

        model, _ = nnx.merge(self.graphdef, self.state)
        return _nnx_snapshot(model)


class NnxSplitFlat(NnxRunner):
    name = "nnx_split_flat"
    label = "Flax NNX functional loop on flat leaves (split and flatten once)"
    usage = EXPERT
    form = (
        "graphdef, state = nnx.split((model, optimizer)); leaves, treedef = "
        "jax.tree.flatten(state) once; jax.jit(step, donate_argnums=0)(leaves, x, y) "
        "with jax.tree.unflatten + nnx.merge inside, returning jax.tree.leaves"
    )
    source = (
        f"{_FLAX_PERF}, 'Functional training loop', with Equinox's flat-leaves trick "
        "applied to its state (not in Flax's docs)"
    )

    def __init__(self, params, bn_state, data, *, residual=False):
        from flax import nnx

        super().__init__(params, bn_state, data, residual=residual)
        graphdef, state = nnx.split((self.model, self.optimizer))
        del self.model, self.optimizer
        self.leaves, treedef = jax.tree.flatten(state)

        @functools.partial(jax.jit, donate_argnums=(0,))
        def step(leaves, x, y):
            state = jax.tree.unflatten(treedef, leaves)
            state, loss = _nnx_functional_step(graphdef, state, x, y)
            return jax.tree.leaves(state), loss

        self._graphdef, self._treedef = graphdef, treedef
        self._step = step

    def step(self):
        self.leaves, loss = self._step(self.leaves, self.x, self.y)
        return loss

    def snapshot(self):
        from flax import nnx

        state = jax.tree.unflatten(self._treedef, self.leaves)
        model, _ = nnx.merge(self._graphdef, state)
        return _nnx_snapshot(model)


# Report order: the reference, eqx_state, then each peer's expert forms before its
# default usage.
VARIANTS: dict[str, type[Runner]] = {
    cls.name: cls
    for cls in (
        PureJax,
        EsValue,
        EsRef,
        EsValueAgain,
        EsScan10,
        EsScan100,
        EsOwned,
        EqxJit,
        EqxJitCells,
        EqxFlat,
        EqxState,
        NnxJitPartial,
        NnxJitTree,
        NnxSplitFlat,
        NnxSplit,
        NnxCachedPartial,
        NnxJit,
    )
}


def available_variants() -> list[str]:
    """The variants that can run here (slots for APIs that have not landed yet are
    left out)."""
    return [name for name, cls in VARIANTS.items() if cls.available()]


def default_variants(size: Size) -> list[str]:
    return [n for n in available_variants() if VARIANTS[n].default_for(size)]


# ---------------------------------------------------------------------------------
# Correctness check and timing


def _rel_err(got: np.ndarray, want: np.ndarray, scale: np.ndarray) -> float:
    return float(np.linalg.norm(got - want) / max(float(np.linalg.norm(scale)), 1e-30))


def _compare(
    name: str, got: dict, want: dict, losses, want_losses, w_init, stat_rtol: dict
) -> None:
    """Raise `AssertionError` naming the variant and the quantity that differs."""
    np.testing.assert_allclose(
        losses,
        want_losses,
        rtol=LOSS_RTOL,
        err_msg=f"{name}: loss trajectory differs from the hand-written reference",
    )
    # Relative to how far training moved the weights: Adam divides each gradient
    # entry by its own magnitude, so entries whose gradient is ~0 turn rounding
    # differences (another matmul kernel) into updates of size ~lr. A wrong gradient
    # or optimizer gives an error of order 1 here.
    err = _rel_err(got["w0"], want["w0"], want["w0"] - w_init)
    if not err <= WEIGHT_RTOL:
        raise AssertionError(
            f"{name}: first-layer weights differ from the hand-written reference "
            f"(|dw| / |w - w_init| = {err:.2e} > {WEIGHT_RTOL})"
        )
    for what in ("mean", "var"):
        for i, (g, w) in enumerate(zip(got[what], want[what], strict=True)):
            err = _rel_err(g, w, w)
            if not err <= stat_rtol[what]:
                raise AssertionError(
                    f"{name}: running {what} of BatchNorm {i} differs from the "
                    f"hand-written reference (relative error {err:.2e} > "
                    f"{stat_rtol[what]:.1e})"
                )


def _references(
    size: Size, params, bn_state, data, n_steps: int
) -> tuple[dict[bool, tuple[dict[str, Any], list[float]]], dict[str, float]]:
    """The hand-written references after `n_steps` steps, `{unbiased: (snapshot,
    losses)}` (PyTorch's unbiased running variance, and the biased one that Equinox
    and Flax keep), and the tolerances of the statistics check at that length."""
    refs = {}
    for unbiased in (True, False):
        ref = PureJax(
            params,
            bn_state,
            data,
            residual=size.residual,
            unbiased=unbiased,
            shared=True,
        )
        losses = [float(ref.step()) for _ in range(n_steps)]
        refs[unbiased] = (ref.snapshot(), losses)
    # The check must tell the two running-variance conventions apart at every
    # BatchNorm: its tolerance is a third of their smallest difference.
    gap = min(
        _rel_err(var_b, var_u, var_u)
        for var_u, var_b in zip(
            refs[True][0]["var"], refs[False][0]["var"], strict=True
        )
    )
    stat_rtol = dict(STAT_RTOL, var=min(STAT_RTOL["var"], gap / 3))
    if not stat_rtol["var"] >= MIN_VAR_RTOL:
        raise AssertionError(
            f"{size.name}: the biased and unbiased running variances differ by only "
            f"{gap:.1e} after {n_steps} steps, too close to rounding for the check "
            "to tell them apart; use a smaller batch or more check steps."
        )
    assert all(np.linalg.norm(m) > 0 for m in refs[True][0]["mean"])  # they moved
    return refs, stat_rtol


def _losses(out: jax.Array) -> list[float]:
    """The losses of one call: one (a step) or `steps_per_call` (a scan)."""
    return [float(v) for v in np.atleast_1d(np.asarray(out))]


def build_and_check(
    size: Size,
    names: Sequence[str],
    check_steps: int = CHECK_STEPS,
    compile_repeats: int = 1,
) -> tuple[dict[str, Runner], dict[str, dict[str, Any]]]:
    """Build every variant from the same weights and batch, time its first call
    (compile), run `check_steps` steps (at least one call: `steps_per_call` steps for
    a many-steps variant) and compare its losses, first-layer weights and running
    statistics with the hand-written reference after as many steps. Raises
    `AssertionError` naming the variant if anything differs: nothing is timed
    unless every variant passes. The compile time is the median of
    `compile_repeats` first calls: the checked one, then fresh instances (new
    jitted functions: traced and compiled again) in interleaved rounds."""
    params = init_params(size, jax.random.key(0))
    bn_state = init_bn_state(size)
    data = make_data(size, jax.random.key(1))
    w_init = np.asarray(params["layers"][0])
    refs_by_len: dict[int, Any] = {}

    runners: dict[str, Runner] = {}
    info: dict[str, dict[str, Any]] = {}
    for name in names:
        cls = VARIANTS[name]
        if not cls.available():
            raise ValueError(f"{name}: not available here ({cls.source})")
        calls = -(-check_steps // cls.steps_per_call)  # ceil
        n_steps = calls * cls.steps_per_call
        if n_steps not in refs_by_len:
            refs_by_len[n_steps] = _references(size, params, bn_state, data, n_steps)
        refs, stat_rtol = refs_by_len[n_steps]
        runner = cls(params, bn_state, data, residual=size.residual)
        t0 = time.perf_counter()
        first = jax.block_until_ready(runner.step())
        compile_s = time.perf_counter() - t0
        losses = _losses(first)
        for _ in range(calls - 1):
            losses += _losses(runner.step())
        snap = runner.snapshot()
        want, want_losses = refs[not runner.biased_running_var]
        _compare(name, snap, want, losses, want_losses, w_init, stat_rtol)
        # Warm-up outside the timed rounds. This matters for `es_ref`: reading a ref
        # eagerly (the snapshot) makes JAX commit its buffer to the device, and a
        # committed argument where the compiled step saw an uncommitted one is a new
        # jit cache entry, so the next two calls compile again (no retrace).
        for _ in range(WARMUP_STEPS):
            jax.block_until_ready(runner.step())
        runners[name] = runner
        info[name] = {
            **cls.meta(),
            "compile_samples_s": [compile_s],
            "check_losses": losses,
            "reference": "biased running var"
            if runner.biased_running_var
            else "PyTorch",
            "checked": True,
        }
    for _ in range(compile_repeats - 1):
        for name in names:
            fresh_runner = VARIANTS[name](
                params, bn_state, data, residual=size.residual
            )
            t0 = time.perf_counter()
            jax.block_until_ready(fresh_runner.step())
            info[name]["compile_samples_s"].append(time.perf_counter() - t0)
            del fresh_runner
    for row in info.values():
        row["compile_s"] = statistics.median(row["compile_samples_s"])
    return runners, info


def _time_pipelined(runner: Runner, calls: int) -> float:
    """Seconds per training step over `calls` consecutive calls and one
    `block_until_ready` after the last (JAX dispatches asynchronously, so Python
    work overlaps the previous step's execution, as in a training loop that does
    not read the loss every step)."""
    step = runner.step
    jax.block_until_ready(step())  # settle after the previous variant
    t0 = time.perf_counter()
    for _ in range(calls):
        loss = step()
    jax.block_until_ready(loss)
    return (time.perf_counter() - t0) / (calls * runner.steps_per_call)


def _time_blocking(
    runners: dict[str, Runner], calls: dict[str, int], seed: int
) -> dict[str, float]:
    """Seconds per training step of each variant, blocking on every call's result
    (each step's full latency, nothing overlapped), the variants' calls interleaved
    one by one: cycle after cycle, each variant that has calls left makes one, in an
    order shuffled every cycle (`seed`). A variant's call is timed within
    milliseconds of every other's, so the machine's drift over a round, which
    pipelined timings of `steps` calls in a row pair only round by round, cancels
    call by call (at the medium size, two instances of one variant then differ by
    < 1 %, against several % timed in blocks)."""
    rng = random.Random(seed)
    total = dict.fromkeys(runners, 0.0)
    left = dict(calls)
    while order := [n for n in runners if left[n]]:
        rng.shuffle(order)
        for name in order:
            step = runners[name].step
            t0 = time.perf_counter()
            jax.block_until_ready(step())
            total[name] += time.perf_counter() - t0
            left[name] -= 1
    return {n: total[n] / (calls[n] * runners[n].steps_per_call) for n in runners}


def calls_per_round(runner: Runner, steps: int) -> int:
    """Calls per timing: about `steps` training steps, at least one call."""
    return max(1, round(steps / runner.steps_per_call))


def time_variants(
    runners: dict[str, Runner], rounds: int, steps: int
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Seconds per training step for each variant and round, pipelined and
    blocking: `({variant: [s per round]}, {variant: [s per round]})`. Every round
    times each variant both ways: pipelined, the variants one after another in an
    order rotated from round to round; blocking, the variants' calls interleaved one
    by one (`_time_blocking`); the two ways alternate which goes first. Drift of the
    machine hits all alike, and every variant's round pairs with the reference's
    same round."""
    names = list(runners)
    calls = {n: calls_per_round(runners[n], steps) for n in names}
    pipelined: dict[str, list[float]] = {n: [] for n in names}
    blocking: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        k = r % len(names)
        ways = ("pipelined", "blocking") if r % 2 == 0 else ("blocking", "pipelined")
        for way in ways:
            if way == "blocking":
                for name, t in _time_blocking(runners, calls, seed=r).items():
                    blocking[name].append(t)
            else:
                for name in names[k:] + names[:k]:
                    pipelined[name].append(_time_pipelined(runners[name], calls[name]))
    return pipelined, blocking


def run_size(
    size: Size,
    names: Sequence[str],
    rounds: int,
    steps: int,
    compile_repeats: int = 1,
) -> dict[str, dict[str, Any]]:
    """Check the variants `names` at `size`, then time them; `{variant: row}`."""
    print(f"[{size.name}] checking {len(names)} variants ...", flush=True)
    runners, info = build_and_check(size, names, compile_repeats=compile_repeats)
    print(f"[{size.name}] timing: {rounds} rounds x {steps} steps", flush=True)
    pipelined, blocking = time_variants(runners, rounds, steps)
    return summarise(pipelined, blocking, info)


def profile_variants(runners: dict[str, Runner], calls: int, top: int = 12) -> None:
    """Print, per variant, the functions with the most own time over `calls` steps
    (after warm-up), in µs per step."""
    import cProfile
    import pstats

    for name, runner in runners.items():
        step = runner.step
        for _ in range(min(calls, 100)):
            step()
        jax.block_until_ready(step())
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(calls):
            loss = step()
        jax.block_until_ready(loss)
        prof.disable()
        stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
        total = sum(v[2] for v in stats.values())
        print(f"\n{name}: {total / calls * 1e6:.1f} µs/step under cProfile")
        print(f"{'own µs/step':>12} {'calls/step':>10}  function")
        rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
        for (file, line, func), (_, ncalls, own, *_rest) in rows:
            where = f"{Path(file).name}:{line}({func})" if line else func
            print(f"{own / calls * 1e6:12.2f} {ncalls / calls:10.1f}  {where}")


def summarise(
    pipelined: dict[str, list[float]],
    blocking: dict[str, list[float]],
    info: dict[str, dict[str, Any]],
) -> dict[str, dict[str, Any]]:
    """One row per variant: what `info` says about it, and its timings (µs per
    training step). `rounds_us` / `blocking_rounds_us`: every round, pipelined and
    blocking; `median_us`, `min_us`, `max_us` (pipelined) and `blocking_median_us`,
    `blocking_min_us`; against `pure_jax` timed in the same rounds: `ratio` (median
    of the same-round ratios), `ratio_ci` (its bootstrap 95% interval),
    `ratio_fastest` (fastest round over fastest round), and the same for blocking
    (`blocking_ratio`, ...)."""
    out = {}
    for name, times in pipelined.items():
        us = [t * 1e6 for t in times]
        busy = [t * 1e6 for t in blocking[name]]
        row = dict(info[name])
        row.update(
            median_us=statistics.median(us),
            min_us=min(us),
            max_us=max(us),
            rounds_us=us,
            blocking_median_us=statistics.median(busy),
            blocking_min_us=min(busy),
            blocking_rounds_us=busy,
        )
        if "pure_jax" in pipelined:
            for prefix, mine, base in (
                ("", times, pipelined["pure_jax"]),
                ("blocking_", blocking[name], blocking["pure_jax"]),
            ):
                s = stats.ratio_summary(mine, base)
                row[prefix + "ratio"] = s["median"]
                row[prefix + "ratio_ci"] = s["ci"]
                row[prefix + "ratio_fastest"] = s["fastest"]
        out[name] = row
    return out


# ---------------------------------------------------------------------------------
# Reporting


def environment() -> str:
    import equinox

    try:
        import flax

        flax_v = flax.__version__
    except ImportError:  # pragma: no cover
        flax_v = "-"
    dev = jax.devices()[0]
    return (
        f"jax {jax.__version__}, equinox {equinox.__version__}, optax {optax.__version__}, "
        f"flax {flax_v}, eqx_state {es.__version__}; backend {jax.default_backend()} "
        f"({dev.device_kind}), {os.cpu_count()} CPUs, Python {platform.python_version()}"
    )


def _usage(row: dict[str, Any], name: str) -> str:
    """`es_value` / "expert" / "default usage" ...: what the row is, from its own
    record (older results: from this script's variant list)."""
    if "usage" in row:
        return row["usage"]
    cls = VARIANTS.get(name)
    return cls.usage if cls is not None else "-"


def variants_table(names: Sequence[str]) -> list[str]:
    """What each variant is: its family, usage, exact code form, and where its
    family's docs recommend that form."""
    lines = [
        "| variant | family | usage | exact form | where recommended |",
        "|---|---|---|---|---|",
    ]
    for name in names:
        cls = VARIANTS[name]
        lines.append(
            f"| `{name}` | {cls.family} | {cls.usage} | `{cls.form}` | {cls.source} |"
        )
    return lines


def markdown(
    results: dict[str, dict[str, dict[str, Any]]], meta: dict[str, Any]
) -> str:
    lines = [
        "# Training-step overhead",
        "",
        f"`{meta['command']}`",
        "",
        f"{meta['environment']}. {meta['rounds']} interleaved rounds per size; in "
        "every round each variant is timed pipelined and blocking.",
        "",
    ]
    for size_name, rows in results.items():
        s = SIZES[size_name]
        lines += [
            f"## {size_name}: {s.describe()} ({meta['steps'][size_name]} steps per "
            "round)",
            "",
            "| variant | usage | µs/step pipelined: median (min–max) | × pure JAX "
            "[95% CI] | fastest round × | µs/step blocking: median (min) | blocking "
            "× pure JAX [95% CI] | compile (s) |",
            "|---|---|---:|---:|---:|---:|---:|---:|",
        ]
        for name, row in rows.items():
            lines.append(
                f"| {name} | {_usage(row, name)} | {row['median_us']:.1f} "
                f"({row['min_us']:.1f}–{row['max_us']:.1f}) | "
                f"{_ratio_cell(row, '')} | {_fastest_cell(row, '')} | "
                f"{row['blocking_median_us']:.1f} ({row['blocking_min_us']:.1f}) | "
                f"{_ratio_cell(row, 'blocking_')} | {row['compile_s']:.2f} |"
            )
        lines.append("")
    names = list(dict.fromkeys(n for rows in results.values() for n in rows))
    lines += [
        "µs/step: wall time per training step. *Pipelined*: `steps` consecutive "
        "calls between two `jax.block_until_ready` (Python work overlaps the "
        "previous step's execution, as in a loop that does not read the loss every "
        "step). *Blocking*: `jax.block_until_ready` on every call's result (the full "
        "latency of each step), the variants' calls interleaved one by one in an "
        "order shuffled every cycle, so drift cancels call by call. × pure JAX: "
        "median over rounds of (variant / pure JAX in the same round), with a "
        "bootstrap 95% interval over rounds; fastest "
        "round ×: the variant's fastest round over pure JAX's fastest round. "
        "Compile: the first call (trace, compile, one call), median over "
        f"{meta['compile_repeats']} fresh instances. Every variant was first "
        "checked against the hand-written reference (losses, weights, running "
        "statistics; Equinox and Flax against a reference with their biased running "
        "variance). Many-steps variants (`step.scan`) report time per training "
        "step (per call / K).",
        "",
        "## Variants",
        "",
        *variants_table(names),
        "",
    ]
    return "\n".join(lines)


def _ratio_cell(row: dict[str, Any], prefix: str) -> str:
    if prefix + "ratio" not in row:
        return "-"
    return stats.fmt_ratio(
        {"median": row[prefix + "ratio"], "ci": row[prefix + "ratio_ci"]}
    )


def _fastest_cell(row: dict[str, Any], prefix: str) -> str:
    value = row.get(prefix + "ratio_fastest")
    return "-" if value is None else f"{value:.2f}×"


def write_report(
    out: Path, name: str, table: str, plot_fn: Callable[[Any, Path], None], result: Any
) -> None:
    """Print `table`, write it to `out/results_<name>.md`, plot to `out/<name>.png`."""
    print(table)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"results_{name}.md").write_text(table, encoding="utf-8")
    plot_fn(result, out / f"{name}.png")


USAGE_COLORS = {
    REFERENCE: "tab:gray",
    ES: "tab:blue",
    EXPERT: "tab:green",
    DEFAULT: "tab:orange",
    DIAGNOSTIC: "tab:purple",
}


def plot(results: dict[str, dict[str, dict[str, Any]]], path: Path) -> None:
    """Per size: each variant's × pure JAX (median of same-round ratios, bars with
    their 95% interval) pipelined, and blocking (black dots with intervals); bars
    coloured by usage (reference, eqx_state, a peer's expert form, its default
    usage); log scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    n = len(results)
    fig, axes = plt.subplots(1, n, figsize=(6.5 * n, 4.5), squeeze=False)
    for ax, (size_name, rows) in zip(axes[0], results.items(), strict=True):
        names = [k for k in rows if "ratio" in rows[k]]
        x = np.arange(len(names))

        def err(prefix, names=names, rows=rows):
            mid = np.array([rows[k][prefix + "ratio"] for k in names])
            ci = np.array(
                [rows[k][prefix + "ratio_ci"] or [m, m] for k, m in zip(names, mid)]
            )
            return mid, np.stack([mid - ci[:, 0], ci[:, 1] - mid])

        mid, yerr = err("")
        colors = [USAGE_COLORS.get(_usage(rows[k], k), "tab:purple") for k in names]
        ax.bar(x, mid, yerr=yerr, capsize=3, color=colors)
        bmid, byerr = err("blocking_")
        ax.errorbar(x, bmid, yerr=byerr, fmt="o", color="k", ms=3, capsize=2)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks(x, names, rotation=45, ha="right", fontsize=8)
        ax.set_yscale("log")
        s = SIZES[size_name]
        ax.set_title(f"{size_name}: {s.describe()}", fontsize=9)
        ax.set_ylabel("× pure JAX (same-round ratio, 95% CI)")
    handles = [Patch(color=c, label=u) for u, c in USAGE_COLORS.items()]
    handles.append(
        plt.Line2D([], [], color="k", marker="o", ls="", label="blocking every step")
    )
    axes[0][0].legend(handles=handles, fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--sizes",
        nargs="+",
        choices=list(SIZES),
        default=None,
        help="model sizes to run (default: small medium cnn; with --tiny: tiny)",
    )
    parser.add_argument(
        "--rounds", type=int, default=15, help="interleaved rounds (default 15)"
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=None,
        help="steps per variant per round (default: per size, "
        + ", ".join(f"{s.steps} {s.name}" for s in SIZES.values())
        + ")",
    )
    parser.add_argument(
        "--variants",
        nargs="+",
        choices=list(VARIANTS),
        default=None,
        help="variants to run (pure_jax is always included, as the reference; "
        "default: every available one, the step.scan slots at the small size only; "
        f"available here: {' '.join(available_variants())})",
    )
    parser.add_argument(
        "--compile-repeats",
        type=int,
        default=5,
        help="compile time = median over this many first calls (default 5; --tiny: 1)",
    )
    parser.add_argument(
        "--profile",
        type=int,
        metavar="CALLS",
        default=None,
        help="instead of timing, run CALLS steps of each variant under cProfile and "
        "print where the time goes (own time per function; the compiled call "
        "counts in its Python caller's own time)",
    )
    parser.add_argument(
        "--tiny",
        action="store_true",
        help="a seconds-long smoke run: at most 3 rounds, and the tiny MLP unless "
        "--sizes names others (tiny_cnn is the tiny CNN)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=Path(__file__).resolve().parent,
        help="folder for results_step_overhead.md and step_overhead.png",
    )
    args = parser.parse_args(argv)
    if args.sizes is None:
        args.sizes = ["tiny"] if args.tiny else ["small", "medium", "cnn"]
    if args.tiny:
        args.rounds = min(args.rounds, 3)
        args.compile_repeats = 1
    if min(args.rounds, args.compile_repeats, args.steps or 1) < 1:
        parser.error("--rounds, --steps and --compile-repeats must be positive")
    if args.variants is not None:
        missing = [v for v in args.variants if not VARIANTS[v].available()]
        if missing:
            parser.error(f"not available here: {missing}")
        if "pure_jax" not in args.variants:
            args.variants = ["pure_jax", *args.variants]
    return args


def variants_for(size: Size, chosen: Sequence[str] | None) -> list[str]:
    """`chosen` (with pure_jax first), or the defaults at `size`, in report order."""
    names = default_variants(size) if chosen is None else chosen
    return [n for n in VARIANTS if n in names]


def main(argv: Sequence[str] | None = None) -> dict[str, dict[str, dict[str, Any]]]:
    """Run the benchmark; return `{size: {variant: row}}` (rows as in
    [`summarise`][]: timings, ratios with intervals, compile time, the check's
    losses, and what the variant is)."""
    args = parse_args(argv)
    jax.block_until_ready(jax.jit(lambda a: a + 1)(jnp.zeros(())))  # backend start-up
    results = {}
    steps_used = {}
    for size_name in args.sizes:
        size = SIZES[size_name]
        if args.profile is not None:
            names = variants_for(size, args.variants)
            profile_variants(build_and_check(size, names)[0], args.profile)
            continue
        steps = args.steps if args.steps is not None else size.steps
        steps_used[size_name] = steps
        results[size_name] = run_size(
            size,
            variants_for(size, args.variants),
            args.rounds,
            steps,
            args.compile_repeats,
        )
    if args.profile is not None:
        return {}
    command = "python benchmarks/step_overhead.py " + " ".join(
        sys.argv[1:] if argv is None else argv
    )
    meta = {
        "command": command.strip(),
        "environment": environment(),
        "rounds": args.rounds,
        "steps": steps_used,
        "compile_repeats": args.compile_repeats,
    }
    write_report(args.out, "step_overhead", markdown(results, meta), plot, results)
    return results


if __name__ == "__main__":
    main()
