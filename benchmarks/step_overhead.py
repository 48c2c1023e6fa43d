"""Training-step overhead: eqx_state against hand-written JAX, Equinox and Flax NNX.

One training step (forward, backward, Adam, BatchNorm running-statistics update) of
an MLP `(Linear -> BatchNorm -> ReLU) x depth -> Linear(10)` with a cross-entropy
loss, at a small (dispatch-bound) and a medium size, written six ways:

- `pure_jax`: hand-written JAX, the reference (ratio 1.0). Parameters and BatchNorm
  statistics are tuples threaded by hand with PyTorch semantics (momentum 0.1,
  unbiased running variance); `jax.jit` with `donate_argnums`.
- `es_value`: `eqx_state.make_step` over an `eqx.Module` with `es.nn.BatchNorm`.
- `es_ref`: the same model after `es.to_refs` (ref mode).
- `equinox`: `eqx.nn.BatchNorm` + `eqx.nn.State` + `eqx.filter_jit`, the model
  called per example under `jax.vmap(..., axis_name="batch")` as in Equinox's docs.
- `nnx_jit`: Flax NNX (`nnx.BatchNorm`, `nnx.Optimizer(optax.adam)`, `nnx.jit`).
- `nnx_split`: Flax NNX split/merge: a pure function of `(graphdef, state)` under
  `jax.jit` with donation (Flax's "performance" recipe).

Every variant starts from the same weights (copied from one initialisation) and the
same batch, and is checked first: its loss trajectory, its first-layer weights and its
BatchNorm running statistics after a few steps must match the hand-written reference.
Then the variants are timed in interleaved rounds (the order rotated each round), each
timing `--steps` calls between two `jax.block_until_ready`. The table reports the
median microseconds per step with the min-max over rounds, the median over rounds of
the ratio to `pure_jax` timed in the same round, and the compile time (first call:
trace + compile + one run) separately. It is printed as Markdown, written to
`results_step_overhead.md` and plotted to `step_overhead.png` in `--out`.

Run: `python benchmarks/step_overhead.py` (`--tiny` for a seconds-long smoke run).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import platform
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
# |s - s_ref| / |s_ref| for each running statistic. The variance is tighter: after
# a few steps the biased and unbiased conventions differ by only ~6e-4 at batch 256.
STAT_RTOL = {"mean": 1e-3, "var": 1e-4}


@dataclasses.dataclass(frozen=True)
class Size:
    name: str
    width: int
    depth: int
    batch: int
    in_dim: int
    steps: int  # default steps per round


SIZES = {
    "small": Size("small", width=32, depth=2, batch=16, in_dim=32, steps=300),
    "medium": Size("medium", width=512, depth=4, batch=256, in_dim=512, steps=30),
    "tiny": Size("tiny", width=8, depth=1, batch=4, in_dim=8, steps=3),
}


# ---------------------------------------------------------------------------------
# Shared initialisation and data


def init_params(size: Size, key: jax.Array) -> dict[str, Any]:
    """Weights in PyTorch's layout (`W: [out, in]`), Equinox's default init.

    The hidden linear layers have no bias, as usual before a BatchNorm (PyTorch's
    `bias=False`): the BatchNorm removes it, so its gradient is rounding noise that
    Adam would amplify into updates of size `lr`, which show up in the running mean
    and make variants differ by ~1e-4 for reasons unrelated to what is compared.
    """
    dims = [size.in_dim] + [size.width] * size.depth
    keys = jax.random.split(key, size.depth + 2)

    def uniform(k, shape, d_in):
        lim = 1.0 / np.sqrt(d_in)
        return jax.random.uniform(k, shape, jnp.float32, -lim, lim)

    linears = tuple(
        uniform(keys[i], (dims[i + 1], dims[i]), dims[i]) for i in range(size.depth)
    )
    norms = tuple(
        (jnp.ones(size.width, jnp.float32), jnp.zeros(size.width, jnp.float32))
        for _ in range(size.depth)
    )
    head = (
        uniform(keys[-2], (NUM_CLASSES, size.width), size.width),
        uniform(keys[-1], (NUM_CLASSES,), size.width),
    )
    return {"linears": linears, "norms": norms, "head": head}


def init_bn_state(size: Size) -> tuple[tuple[jax.Array, jax.Array], ...]:
    return tuple(
        (jnp.zeros(size.width, jnp.float32), jnp.ones(size.width, jnp.float32))
        for _ in range(size.depth)
    )


def make_data(size: Size, key: jax.Array) -> tuple[jax.Array, jax.Array]:
    kx, ky = jax.random.split(key)
    x = jax.random.normal(kx, (size.batch, size.in_dim), jnp.float32)
    y = jax.random.randint(ky, (size.batch,), 0, NUM_CLASSES)
    return x, y


def fresh(tree: Any) -> Any:
    """Own copies: every variant donates its buffers, so none may share an array."""
    return jax.tree.map(lambda a: jnp.array(a, copy=True), tree)


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels))


# ---------------------------------------------------------------------------------
# Variants. Each runner owns its model/optimizer state; `step()` runs one training
# step and returns the loss (every variant returns it, as a training loop that logs
# the loss would); `snapshot()` returns numpy copies of what the check compares.


class Runner:
    name: str
    label: str
    biased_running_var: bool = False  # compared against the biased-variance reference

    def step(self) -> jax.Array:  # pragma: no cover - abstract
        raise NotImplementedError

    def snapshot(self) -> dict[str, Any]:  # pragma: no cover - abstract
        raise NotImplementedError


# (a) hand-written JAX --------------------------------------------------------------


def pure_forward(params, bn_state, x, *, unbiased: bool):
    h = x
    new_state = []
    for w, (gamma, beta), (rm, rv) in zip(
        params["linears"], params["norms"], bn_state, strict=True
    ):
        h = h @ w.T
        mean = jnp.mean(h, axis=0)
        var = jnp.mean(jnp.square(h - mean[None, :]), axis=0)
        n = h.shape[0]
        run_var = var * (n / (n - 1)) if unbiased else var
        m = TORCH_MOMENTUM
        new_state.append(
            (
                jax.lax.stop_gradient((1 - m) * rm + m * mean),
                jax.lax.stop_gradient((1 - m) * rv + m * run_var),
            )
        )
        h = (h - mean[None, :]) * jax.lax.rsqrt(var[None, :] + EPS)
        h = jax.nn.relu(h * gamma[None, :] + beta[None, :])
    w, b = params["head"]
    return h @ w.T + b[None, :], tuple(new_state)


def make_pure_step(optimizer: optax.GradientTransformation, *, unbiased: bool = True):
    def step(params, bn_state, opt_state, x, y):
        def loss_fn(p):
            logits, new_state = pure_forward(p, bn_state, x, unbiased=unbiased)
            return cross_entropy(logits, y), new_state

        (loss, bn_state), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, bn_state, opt_state, loss

    return jax.jit(step, donate_argnums=(0, 1, 2))


class PureJax(Runner):
    name = "pure_jax"
    label = "hand-written JAX (jax.jit, donate_argnums)"

    def __init__(self, params, bn_state, data, *, unbiased: bool = True):
        optimizer = optax.adam(LR)
        self.params, self.bn_state = fresh(params), fresh(bn_state)
        self.opt_state = optimizer.init(self.params)
        self.x, self.y = data
        self._step = make_pure_step(optimizer, unbiased=unbiased)

    def step(self):
        self.params, self.bn_state, self.opt_state, loss = self._step(
            self.params, self.bn_state, self.opt_state, self.x, self.y
        )
        return loss

    def snapshot(self):
        return {
            "w0": np.asarray(self.params["linears"][0]),
            "mean": [np.asarray(m) for m, _ in self.bn_state],
            "var": [np.asarray(v) for _, v in self.bn_state],
        }


# (b), (c) eqx_state ----------------------------------------------------------------


def _eqx_linear(w: jax.Array, b: jax.Array | None = None) -> eqx.nn.Linear:
    d_out, d_in = w.shape
    lin = eqx.nn.Linear(d_in, d_out, use_bias=b is not None, key=jax.random.key(0))
    if b is None:
        return eqx.tree_at(lambda m: m.weight, lin, w)
    return eqx.tree_at(lambda m: (m.weight, m.bias), lin, (w, b))


class EsMLP(eqx.Module):
    linears: tuple[eqx.nn.Linear, ...]
    norms: tuple[es.nn.BatchNorm, ...]
    head: eqx.nn.Linear

    def __init__(self, params):
        self.linears = tuple(_eqx_linear(w) for w in params["linears"])
        norms = []
        for gamma, beta in params["norms"]:
            bn = es.nn.BatchNorm(gamma.shape[0], momentum=TORCH_MOMENTUM, eps=EPS)
            norms.append(eqx.tree_at(lambda m: (m.weight, m.bias), bn, (gamma, beta)))
        self.norms = tuple(norms)
        self.head = _eqx_linear(*params["head"])

    def __call__(self, x):
        for lin, bn in zip(self.linears, self.norms, strict=True):
            x = jax.nn.relu(bn(jax.vmap(lin)(x)))
        return jax.vmap(self.head)(x)


def es_loss(model: EsMLP, x, y):
    loss = cross_entropy(model(x), y)
    return loss, loss


class EsValue(Runner):
    name = "es_value"
    label = "eqx_state make_step, value mode"

    def __init__(self, params, bn_state, data):
        del bn_state  # es.nn.BatchNorm starts at PyTorch's init (mean 0, var 1)
        self.model = self._model(EsMLP(fresh(params)))
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
        mean, var = [], []
        for bn in self.model.norms:
            assert bn.running_mean is not None and bn.running_var is not None
            mean.append(np.asarray(bn.running_mean[...]))
            var.append(np.asarray(bn.running_var[...]))
        return {
            "w0": np.asarray(self.model.linears[0].weight),
            "mean": mean,
            "var": var,
        }


class EsRef(EsValue):
    name = "es_ref"
    label = "eqx_state make_step, ref mode (es.to_refs)"

    def _model(self, model):
        return es.to_refs(model)


# (d) Equinox eqx.nn.BatchNorm + eqx.nn.State -----------------------------------------


class EqxMLP(eqx.Module):
    """Per-example model, as in Equinox's stateful example."""

    linears: tuple[eqx.nn.Linear, ...]
    norms: tuple[eqx.nn.BatchNorm, ...]
    head: eqx.nn.Linear

    def __init__(self, params):
        self.linears = tuple(_eqx_linear(w) for w in params["linears"])
        norms = []
        for gamma, beta in params["norms"]:
            # Equinox's momentum is the weight of the *old* statistic: 1 - PyTorch's.
            bn = eqx.nn.BatchNorm(
                gamma.shape[0],
                axis_name="batch",
                eps=EPS,
                momentum=1 - TORCH_MOMENTUM,
                mode="batch",
            )
            norms.append(eqx.tree_at(lambda m: (m.weight, m.bias), bn, (gamma, beta)))
        self.norms = tuple(norms)
        self.head = _eqx_linear(*params["head"])

    def __call__(self, x, state):
        for lin, bn in zip(self.linears, self.norms, strict=True):
            x, state = bn(lin(x), state)
            x = jax.nn.relu(x)
        return self.head(x), state


def make_eqx_step(optimizer: optax.GradientTransformation):
    # The batch comes first so that everything else (model, state, opt_state) is
    # donated, as in the hand-written reference.
    @eqx.filter_jit(donate="all-except-first")
    def step(batch, model, state, opt_state):
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

    return step


class EqxState(Runner):
    name = "equinox"
    label = "Equinox eqx.nn.BatchNorm + eqx.nn.State (filter_jit)"
    # eqx.nn.BatchNorm(mode="batch") keeps the *biased* batch variance in its running
    # average (PyTorch keeps the unbiased one), so it is checked against the same
    # hand-written reference with a biased running variance.
    biased_running_var = True

    def __init__(self, params, bn_state, data):
        del bn_state  # mode="batch" starts at mean 0, var 1 like the reference
        model = EqxMLP(fresh(params))
        # As `eqx.nn.make_with_state` does: the State takes the initial arrays and
        # the model drops its copy (else one array would be donated twice).
        self.state = eqx.nn.State(model)
        self.model = model = eqx.nn.delete_init_state(model)
        optimizer = optax.adam(LR)
        self.opt_state = optimizer.init(eqx.filter(model, eqx.is_inexact_array))
        self.batch = data
        self._step = make_eqx_step(optimizer)

    def step(self):
        self.model, self.state, self.opt_state, loss = self._step(
            self.batch, self.model, self.state, self.opt_state
        )
        return loss

    def snapshot(self):
        stats = [self.state.get(bn.batch_state_index) for bn in self.model.norms]
        return {
            "w0": np.asarray(self.model.linears[0].weight),
            "mean": [np.asarray(m) for m, _ in stats],
            "var": [np.asarray(v) for _, v in stats],
        }


# (e), (f) Flax NNX -------------------------------------------------------------------


def _nnx_model(params):
    from flax import nnx

    class NnxMLP(nnx.Module):
        def __init__(self, params, rngs: nnx.Rngs):
            def linear(w, b=None):
                d_out, d_in = w.shape
                lin = nnx.Linear(d_in, d_out, use_bias=b is not None, rngs=rngs)
                lin.kernel.set_value(w.T)  # Flax's kernel is [in, out]
                if b is not None:
                    assert lin.bias is not None
                    lin.bias.set_value(b)
                return lin

            self.linears = nnx.List([linear(w) for w in params["linears"]])
            norms = []
            for gamma, beta in params["norms"]:
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
                norms.append(bn)
            self.norms = nnx.List(norms)
            self.head = linear(*params["head"])

        def __call__(self, x):
            for lin, bn in zip(self.linears, self.norms, strict=True):
                x = nnx.relu(bn(lin(x)))
            return self.head(x)

    return NnxMLP(params, nnx.Rngs(0))


def _nnx_snapshot(model) -> dict[str, Any]:
    return {
        "w0": np.asarray(model.linears[0].kernel[...]).T,
        "mean": [np.asarray(bn.mean[...]) for bn in model.norms],
        "var": [np.asarray(bn.var[...]) for bn in model.norms],
    }


def _nnx_loss(model, x, y):
    return cross_entropy(model(x), y)


class NnxJit(Runner):
    name = "nnx_jit"
    label = "Flax NNX (nnx.Optimizer, nnx.jit)"
    # nnx.BatchNorm keeps the biased batch variance in its running average.
    biased_running_var = True

    def __init__(self, params, bn_state, data):
        from flax import nnx

        del bn_state
        self.model = _nnx_model(fresh(params))
        self.optimizer = nnx.Optimizer(self.model, optax.adam(LR), wrt=nnx.Param)
        self.x, self.y = data

        @nnx.jit
        def train_step(model, optimizer, x, y):
            loss, grads = nnx.value_and_grad(_nnx_loss)(model, x, y)
            optimizer.update(model, grads)
            return loss

        self._step = train_step

    def step(self):
        return self._step(self.model, self.optimizer, self.x, self.y)

    def snapshot(self):
        return _nnx_snapshot(self.model)


class NnxSplit(Runner):
    name = "nnx_split"
    label = "Flax NNX split/merge + jax.jit (donated state)"
    biased_running_var = True

    def __init__(self, params, bn_state, data):
        from flax import nnx

        del bn_state
        model = _nnx_model(fresh(params))
        optimizer = nnx.Optimizer(model, optax.adam(LR), wrt=nnx.Param)
        self.graphdef, self.state = nnx.split((model, optimizer))
        self.x, self.y = data

        @functools.partial(jax.jit, donate_argnums=(1,))
        def train_step(graphdef, state, x, y):
            model, optimizer = nnx.merge(graphdef, state)
            loss, grads = nnx.value_and_grad(_nnx_loss)(model, x, y)
            optimizer.update(model, grads)
            return nnx.state((model, optimizer)), loss

        self._step = train_step

    def step(self):
        self.state, loss = self._step(self.graphdef, self.state, self.x, self.y)
        return loss

    def snapshot(self):
        from flax import nnx

        model, _ = nnx.merge(self.graphdef, self.state)
        return _nnx_snapshot(model)


VARIANTS: dict[str, Callable[..., Runner]] = {
    "pure_jax": PureJax,
    "es_value": EsValue,
    "es_ref": EsRef,
    "equinox": EqxState,
    "nnx_jit": NnxJit,
    "nnx_split": NnxSplit,
}


# ---------------------------------------------------------------------------------
# Correctness check and timing


def _rel_err(got: np.ndarray, want: np.ndarray, scale: np.ndarray) -> float:
    return float(np.linalg.norm(got - want) / max(float(np.linalg.norm(scale)), 1e-30))


def _compare(name: str, got: dict, want: dict, losses, want_losses, w_init) -> None:
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
            if not err <= STAT_RTOL[what]:
                raise AssertionError(
                    f"{name}: running {what} of BatchNorm {i} differs from the "
                    f"hand-written reference (relative error {err:.2e} > "
                    f"{STAT_RTOL[what]})"
                )


def build_and_check(
    size: Size, names: Sequence[str], check_steps: int = CHECK_STEPS
) -> tuple[dict[str, Runner], dict[str, dict[str, Any]]]:
    """Build every variant from the same weights and batch, time its first call
    (compile), run `check_steps` steps and compare with the hand-written reference.
    Raises `AssertionError` naming the variant if anything differs."""
    params = init_params(size, jax.random.key(0))
    bn_state = init_bn_state(size)
    data = make_data(size, jax.random.key(1))

    # References, not timed: PyTorch semantics (unbiased running variance) and the
    # same with the biased variance that Equinox and Flax keep.
    refs = {}
    for unbiased in (True, False):
        ref = PureJax(params, bn_state, data, unbiased=unbiased)
        losses = [float(ref.step()) for _ in range(check_steps)]
        refs[unbiased] = (ref.snapshot(), losses)
    w_init = np.asarray(params["linears"][0])
    # The check can tell the two conventions apart, and the statistics did move:
    var_u, var_b = refs[True][0]["var"][0], refs[False][0]["var"][0]
    assert _rel_err(var_b, var_u, var_u) > 2 * STAT_RTOL["var"]
    assert np.linalg.norm(refs[True][0]["mean"][0]) > 0

    runners: dict[str, Runner] = {}
    info: dict[str, dict[str, Any]] = {}
    for name in names:
        runner = VARIANTS[name](params, bn_state, data)
        t0 = time.perf_counter()
        first = jax.block_until_ready(runner.step())
        compile_s = time.perf_counter() - t0
        losses = [float(first)] + [float(runner.step()) for _ in range(check_steps - 1)]
        snap = runner.snapshot()
        want, want_losses = refs[not runner.biased_running_var]
        _compare(name, snap, want, losses, want_losses, w_init)
        # Warm-up outside the timed rounds. This matters for `es_ref`: reading a ref
        # eagerly (the snapshot) makes JAX commit its buffer to the device, and a
        # committed argument where the compiled step saw an uncommitted one is a new
        # jit cache entry, so the next two calls compile again (no retrace).
        for _ in range(WARMUP_STEPS):
            jax.block_until_ready(runner.step())
        runners[name] = runner
        info[name] = {
            "compile_s": compile_s,
            "check_losses": losses,
            "reference": "biased running var"
            if runner.biased_running_var
            else "PyTorch",
            "checked": True,
        }
    return runners, info


def time_variants(
    runners: dict[str, Runner], rounds: int, steps: int
) -> dict[str, list[float]]:
    """Seconds per step for each variant and round; variants interleaved in every
    round, order rotated from round to round."""
    names = list(runners)
    per_round: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            runner = runners[name]
            step = runner.step
            jax.block_until_ready(step())  # settle after the previous variant
            t0 = time.perf_counter()
            for _ in range(steps):
                loss = step()
            jax.block_until_ready(loss)
            per_round[name].append((time.perf_counter() - t0) / steps)
    return per_round


def summarise(
    per_round: dict[str, list[float]], info: dict[str, dict[str, Any]]
) -> dict[str, dict[str, Any]]:
    base = per_round.get("pure_jax")
    out = {}
    for name, times in per_round.items():
        us = [t * 1e6 for t in times]
        row = dict(info[name])
        row.update(
            median_us=statistics.median(us),
            min_us=min(us),
            max_us=max(us),
            rounds_us=us,
        )
        if base is not None:
            row["ratio"] = statistics.median(
                t / b for t, b in zip(times, base, strict=True)
            )
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


def markdown(
    results: dict[str, dict[str, dict[str, Any]]], meta: dict[str, Any]
) -> str:
    lines = [
        "# Training-step overhead",
        "",
        f"`{meta['command']}`",
        "",
        f"{meta['environment']}. {meta['rounds']} interleaved rounds per size.",
        "",
    ]
    for size_name, rows in results.items():
        s = SIZES[size_name]
        lines += [
            f"## {size_name}: width {s.width}, depth {s.depth}, batch {s.batch}, "
            f"input {s.in_dim} ({meta['steps'][size_name]} steps per round)",
            "",
            "| variant | µs/step (median) | min–max | × pure JAX | compile (s) |",
            "|---|---:|---:|---:|---:|",
        ]
        for name, row in rows.items():
            ratio = f"{row['ratio']:.2f}" if "ratio" in row else "-"
            lines.append(
                f"| {name}: {VARIANTS[name].label} | {row['median_us']:.1f} | "
                f"{row['min_us']:.1f}–{row['max_us']:.1f} | {ratio} | "
                f"{row['compile_s']:.2f} |"
            )
        lines.append("")
    lines += [
        "µs/step: wall time of `steps` consecutive calls between two "
        "`jax.block_until_ready`, divided by `steps`; median and min–max over rounds. "
        "× pure JAX: median over rounds of (variant / pure JAX in the same round). "
        "Compile: the first call (trace, compile, one step). Every variant was first "
        "checked against the hand-written reference (losses, weights, running "
        "statistics; Equinox and Flax against a reference with their biased running "
        "variance).",
        "",
    ]
    return "\n".join(lines)


def plot(results: dict[str, dict[str, dict[str, Any]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(results)
    fig, axes = plt.subplots(1, n, figsize=(6 * n, 4), squeeze=False)
    for ax, (size_name, rows) in zip(axes[0], results.items(), strict=True):
        names = list(rows)
        med = np.array([rows[k]["median_us"] for k in names])
        lo = med - np.array([rows[k]["min_us"] for k in names])
        hi = np.array([rows[k]["max_us"] for k in names]) - med
        colors = ["tab:gray" if k == "pure_jax" else "tab:blue" for k in names]
        bars = ax.bar(names, med, yerr=[lo, hi], capsize=3, color=colors)
        for bar, k in zip(bars, names, strict=True):
            if "ratio" in rows[k]:
                ax.annotate(
                    f"{rows[k]['ratio']:.2f}×",
                    (bar.get_x() + bar.get_width() / 2, rows[k]["max_us"]),
                    ha="center",
                    va="bottom",
                    fontsize=8,
                    xytext=(0, 2),
                    textcoords="offset points",
                )
        s = SIZES[size_name]
        ax.set_title(f"{size_name} (width {s.width}, depth {s.depth}, batch {s.batch})")
        ax.set_ylabel("µs per training step (median, min–max)")
        ax.tick_params(axis="x", rotation=30)
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
        choices=sorted(SIZES),
        default=["small", "medium"],
        help="model sizes to run (default: small medium)",
    )
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds")
    parser.add_argument(
        "--steps",
        type=int,
        default=None,
        help="steps per variant per round (default: 300 small, 30 medium)",
    )
    parser.add_argument(
        "--variants",
        nargs="+",
        choices=list(VARIANTS),
        default=list(VARIANTS),
        help="variants to run (pure_jax is always included, as the reference)",
    )
    parser.add_argument(
        "--tiny",
        action="store_true",
        help="a seconds-long smoke run: tiny model, 2 rounds, 3 steps",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=Path(__file__).resolve().parent,
        help="folder for results_step_overhead.md and step_overhead.png",
    )
    args = parser.parse_args(argv)
    if args.tiny:
        args.sizes = ["tiny"]
        args.rounds = min(args.rounds, 2)
    if args.rounds < 1 or (args.steps is not None and args.steps < 1):
        parser.error("--rounds and --steps must be positive")
    if "pure_jax" not in args.variants:
        args.variants = ["pure_jax", *args.variants]
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, dict[str, dict[str, Any]]]:
    """Run the benchmark; return `{size: {variant: row}}` (each row: `median_us`,
    `min_us`, `max_us`, `rounds_us`, `ratio`, `compile_s`, `checked`, ...)."""
    args = parse_args(argv)
    jax.block_until_ready(jax.jit(lambda a: a + 1)(jnp.zeros(())))  # backend start-up
    results = {}
    steps_used = {}
    for size_name in args.sizes:
        size = SIZES[size_name]
        steps = args.steps if args.steps is not None else size.steps
        steps_used[size_name] = steps
        print(f"[{size_name}] checking {len(args.variants)} variants ...", flush=True)
        runners, info = build_and_check(size, args.variants)
        print(f"[{size_name}] timing: {args.rounds} rounds x {steps} steps", flush=True)
        per_round = time_variants(runners, args.rounds, steps)
        results[size_name] = summarise(per_round, info)
    command = "python benchmarks/step_overhead.py " + " ".join(
        sys.argv[1:] if argv is None else argv
    )
    meta = {
        "command": command.strip(),
        "environment": environment(),
        "rounds": args.rounds,
        "steps": steps_used,
    }
    table = markdown(results, meta)
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results_step_overhead.md").write_text(table, encoding="utf-8")
    plot(results, args.out / "step_overhead.png")
    return results


if __name__ == "__main__":
    main()
