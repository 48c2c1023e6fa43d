"""Diagnose a training run from the inside: per-layer activation statistics,
recorded in place every step.

A deep ReLU MLP (8 hidden layers of 64 units) is trained three times on
scikit-learn's digits (1,797 8x8 images; no download) with plain SGD: once healthy
(He initialisation, learning rate 0.05), once with a bad initialisation (weights
drawn with a fixed standard deviation of 0.01, the pre-2015 habit that He et al.
showed stalls deep ReLU networks) and once with a learning rate ten times too large
(0.5). Every hidden layer holds an `es.nn.Record("std", "dead_fraction")` and calls
it on its activation; nothing else in the model or the training loop changes. After
every step the loop reads all recordings with one call, `es.recorded(model)`
(`{"acts.3.std": ..., ...}`), and starts them over with
`es.reset(model, es.RecordState)`.

The plot (one line per layer) shows where each bad run goes wrong:

* bad initialisation: from the first step the activations shrink ~18x per layer
  (each layer multiplies their scale by 0.01 * sqrt(64 / 2)); by layer 4 they are
  1e-4 of layer 1's, the gradients vanish with them, and the loss stays at
  ln(10) = 2.30 (chance);
* learning rate too large: a few steps in, large updates push most units of every
  layer below zero for every input: the dead-ReLU fraction jumps from ~10% to
  60-100%, layer 8 is 97% dead by step 21 and entirely dead later (its std drops
  to 0), and the loss sits near 2.30. This failure is chaotic: with other
  `--seed`s the same rate sends the activations to inf/NaN instead (the std lines
  shoot up and stop; the printed diagnosis says so) — either way the recordings
  say when, and in which layer.

The healthy run keeps its dead fractions low and its activations of order 1.

Run: `python examples/diagnose_training.py` (about 20 s on 2 CPU cores; writes
`examples/out/diagnose_training.png`). `--tiny` runs 20 steps of each.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import eqx_state as es


class MLP(eqx.Module):
    layers: list[eqx.nn.Linear]
    acts: list[es.nn.Record]
    head: eqx.nn.Linear

    def __init__(self, key, depth=8, width=64, n_in=64, init_std=None):
        keys = jax.random.split(key, depth + 1)
        sizes = [n_in] + [width] * depth
        self.layers = [
            init_linear(a, b, k, init_std)
            for a, b, k in zip(sizes[:-1], sizes[1:], keys)
        ]
        # one recorder per hidden layer: the activations' standard deviation and
        # the fraction of units that are zero for every example of the batch
        self.acts = [es.nn.Record("std", "dead_fraction") for _ in range(depth)]
        self.head = eqx.nn.Linear(width, 10, key=keys[-1])

    def hidden(self, x):
        """The plain forward pass: every hidden activation (no recording)."""
        out = []
        for lin in self.layers:
            x = jax.nn.relu(jax.vmap(lin)(x))
            out.append(x)
        return out

    def __call__(self, x):  # x: [batch, 64]
        for lin, record in zip(self.layers, self.acts):
            x = record(jax.nn.relu(jax.vmap(lin)(x)))
        return jax.vmap(self.head)(x)


def init_linear(n_in: int, n_out: int, key, std: float | None) -> eqx.nn.Linear:
    """A linear layer with normal weights of standard deviation `std` (He's
    `sqrt(2 / n_in)` if `None`) and zero bias."""
    lin = eqx.nn.Linear(n_in, n_out, key=key)
    std = np.sqrt(2.0 / n_in) if std is None else std
    weight = jax.random.normal(key, (n_out, n_in)) * std
    return eqx.tree_at(lambda m: (m.weight, m.bias), lin, (weight, jnp.zeros(n_out)))


def loss_fn(model: MLP, x, y):
    logits = model(x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def load_digits():
    from sklearn.datasets import load_digits as sk_digits
    from sklearn.model_selection import train_test_split

    images, labels = sk_digits(return_X_y=True)
    images = (images / 8.0 - 1.0).astype(np.float32)  # pixels 0..16 -> -1..1
    x_tr, x_te, y_tr, y_te = train_test_split(
        images, labels, test_size=0.25, random_state=0, stratify=labels
    )
    return x_tr, y_tr.astype(np.int32), x_te, y_te.astype(np.int32)


def batches(seed: int, n: int, steps: int, batch_size: int) -> np.ndarray:
    """The indices of every step's batch, `[steps, batch_size]`."""
    return np.random.default_rng(seed).integers(0, n, (steps, batch_size))


def train(model: MLP, lr: float, x, y, order: np.ndarray) -> tuple[MLP, dict]:
    """SGD over the batches `order`; returns the model and, per step, the loss and
    every layer's recorded statistics."""
    step = es.make_step(loss_fn, optax.sgd(lr), return_loss=True)
    opt_state = step.init(model)
    depth = len(model.layers)
    history: dict[str, list] = {"loss": [], "std": [], "dead_fraction": []}
    for idx in order:
        model, opt_state, loss = step(model, opt_state, x[idx], y[idx])
        recorded = es.recorded(
            model
        )  # {"acts.0.std": ..., "acts.0.dead_fraction": ...}
        model = es.reset(model, es.RecordState)  # the next step records afresh
        history["loss"].append(float(loss))
        for stat in ("std", "dead_fraction"):
            history[stat].append(
                [float(recorded[f"acts.{i}.{stat}"]) for i in range(depth)]
            )
    assert step.trace_count == 1  # recording adds no compilation
    return model, history


def diagnose(history: dict) -> str | None:
    """The first step at which the recordings show a broken network, and how:
    non-finite activations, a layer (nearly) all dead, or a signal that vanished
    with depth (a layer's std below 1/1000 of the first layer's)."""
    std = np.asarray(history["std"])
    dead = np.asarray(history["dead_fraction"])
    for step in range(len(std)):
        bad = np.flatnonzero(~np.isfinite(std[step]))
        if len(bad):
            return f"layer {bad[0] + 1}'s activations are inf/NaN at step {step + 1}"
        bad = np.flatnonzero(dead[step] >= 0.95)
        if len(bad):
            return f"layer {bad[0] + 1} is {dead[step, bad[0]]:.0%} dead at step {step + 1}"
        bad = np.flatnonzero(std[step] < 1e-3 * std[step, 0])
        if len(bad):
            ratio = std[step, bad[0]] / std[step, 0]
            return (
                f"the signal vanishes with depth: layer {bad[0] + 1}'s std is "
                f"{ratio:.0e} of layer 1's at step {step + 1}"
            )
    return None


def accuracy(model: MLP, x, y) -> float:
    logits = eqx.nn.inference_mode(model)(jnp.asarray(x))  # recording off
    return float(np.mean(np.asarray(jnp.argmax(logits, -1)) == y))


def plot(runs: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(runs), 3, figsize=(13, 3.2 * len(runs)), squeeze=False)
    for row, (name, run) in zip(axes, runs.items()):
        history = run["history"]
        steps = np.arange(1, len(history["loss"]) + 1)
        std = np.asarray(history["std"])
        dead = np.asarray(history["dead_fraction"])
        colors = plt.get_cmap("viridis")(np.linspace(0, 0.9, std.shape[1]))
        row[0].plot(steps, history["loss"], color="black")
        row[0].axhline(np.log(10), ls=":", color="gray", label="chance, ln 10")
        finite = [v for v in history["loss"] if np.isfinite(v)]
        row[0].set_ylim(0, min(max(finite + [2.5]) * 1.05, 10.0))  # clip blow-ups
        row[0].set_ylabel(f"{name}\ntraining loss")
        row[0].legend(loc="upper right")
        for i, c in enumerate(colors):
            row[1].plot(steps, np.maximum(std[:, i], 1e-9), color=c)
            row[2].plot(steps, dead[:, i], color=c, label=f"layer {i + 1}")
        row[1].set_yscale("log")
        row[1].set_ylabel("activation std (0 drawn at 1e-9)")
        row[2].set_ylabel("dead-ReLU fraction")
        row[2].set_ylim(-0.02, 1.02)
        if run["diagnosis"]:
            row[1].set_title(
                run["diagnosis"], fontsize=9, color="firebrick", loc="left"
            )
        for ax in row:
            ax.set_xlabel("step")
    axes[0][2].legend(fontsize=7, ncol=2, loc="upper right")
    fig.suptitle(
        "es.nn.Record in every hidden layer of a deep MLP on sklearn digits "
        "(one line per layer)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.05, help="the healthy rate")
    parser.add_argument("--bad-lr", type=float, default=0.5)
    parser.add_argument("--bad-init-std", type=float, default=0.01)
    parser.add_argument(
        "--seed", type=int, default=2, help="of the initialisation and the batches"
    )
    parser.add_argument("--out", default="examples/out")
    parser.add_argument("--tiny", action="store_true", help="20 steps (for tests)")
    args = parser.parse_args(argv)
    if args.tiny:
        args.steps = 20
    if args.steps < 1:
        parser.error(f"--steps must be at least 1, got {args.steps}")

    x_tr, y_tr, x_te, y_te = load_digits()
    order = batches(args.seed, len(x_tr), args.steps, args.batch_size)
    configs = {
        f"healthy: He init, lr {args.lr:g}": (None, args.lr),
        f"bad init: std {args.bad_init_std:g}": (args.bad_init_std, args.lr),
        f"bad learning rate: {args.bad_lr:g}": (None, args.bad_lr),
    }
    runs = {}
    for name, (init_std, lr) in configs.items():
        model = MLP(
            jax.random.key(args.seed), args.depth, args.width, init_std=init_std
        )
        model, history = train(model, lr, x_tr, y_tr, order)
        runs[name] = {
            "model": model,
            "history": history,
            "diagnosis": diagnose(history),
            "test_accuracy": accuracy(model, x_te, y_te),
        }
        print(
            f"{name}: final loss {history['loss'][-1]:.3f}, test accuracy "
            f"{runs[name]['test_accuracy']:.3f}; {runs[name]['diagnosis'] or 'healthy'}"
        )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "diagnose_training.png"
    plot(runs, path)
    print(f"plot: {path}")
    return {"runs": runs, "plot": path, "data": (x_tr, y_tr), "order": order}


if __name__ == "__main__":
    main()
