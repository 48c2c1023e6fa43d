"""The headline job: a small CNN with BatchNorm and Dropout on scikit-learn's digits.

Real data that ships inside scikit-learn (1,797 8x8 images of handwritten digits; no
download), a stratified train/test split, and one `es.make_step` per batch. Every
piece of state lives in the model and is written where it is computed:

* `es.nn.BatchNorm` running statistics, in the convolution blocks;
* `es.nn.Dropout` draws a fresh mask each step from an RNG stream kept as state;
* `es.nn.EMA` keeps an exponential moving average of the weights, updated in the loss;
* `es.metrics.Mean` / `es.metrics.Accuracy` record the training loss and accuracy of
  each batch, shown in a tqdm progress bar and reset every epoch.

Evaluation runs the EMA weights in inference mode (running statistics, no dropout).
At the end the trainer and optimizer state are checkpointed with `es.save`, and the
training curves are plotted to a PNG.

Run: `python examples/train_digits.py` (about 30 s on 2 CPU cores; reaches about
98-99% test accuracy).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import eqx_state as es


class CNN(eqx.Module):
    convs: list[eqx.nn.Conv2d]
    norms: list[es.nn.BatchNorm]
    dropout: es.nn.Dropout
    head: eqx.nn.Linear

    def __init__(self, key, widths=(16, 32, 64), p_drop=0.25):
        keys = jax.random.split(key, len(widths) + 2)
        chans = (1, *widths)
        self.convs = [
            eqx.nn.Conv2d(cin, cout, 3, padding=1, use_bias=False, key=k)
            for cin, cout, k in zip(chans[:-1], chans[1:], keys)
        ]
        self.norms = [es.nn.BatchNorm(c) for c in widths]
        self.dropout = es.nn.Dropout(p_drop, key=keys[-2])
        self.head = eqx.nn.Linear(widths[-1], 10, key=keys[-1])

    def __call__(self, x):  # x: [batch, 1, 8, 8]
        for i, (conv, norm) in enumerate(zip(self.convs, self.norms)):
            x = jax.nn.relu(norm(jax.vmap(conv)(x)))
            if i == 1:  # 8x8 -> 4x4
                x = jax.lax.reduce_window(
                    x, -jnp.inf, jax.lax.max, (1, 1, 2, 2), (1, 1, 2, 2), "VALID"
                )
        x = self.dropout(jnp.mean(x, axis=(2, 3)))
        return jax.vmap(self.head)(x)


class Trainer(eqx.Module):
    net: CNN
    ema: es.nn.EMA
    loss: es.metrics.Mean
    accuracy: es.metrics.Accuracy

    def __init__(self, key, ema_decay=0.99):
        self.net = CNN(key)
        self.ema = es.nn.EMA(self.net, ema_decay, dynamic_decay=True)
        self.loss = es.metrics.Mean()
        self.accuracy = es.metrics.Accuracy()


def loss_fn(trainer: Trainer, x, y):
    logits = trainer.net(x)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    trainer.ema.update(trainer.net)  # state writes, all threaded by make_step
    trainer.loss.update(loss)
    trainer.accuracy.update(logits, y)
    return loss


@eqx.filter_jit
def predict(net: CNN, x):
    return jnp.argmax(eqx.nn.inference_mode(net)(x), axis=-1)


def load_digits(test_fraction: float, seed: int, train_size: int | None):
    from sklearn.datasets import load_digits as sk_digits
    from sklearn.model_selection import train_test_split

    images, labels = sk_digits(return_X_y=True)
    images = (images / 16.0).astype(np.float32).reshape(-1, 1, 8, 8)
    x_tr, x_te, y_tr, y_te = train_test_split(
        images, labels, test_size=test_fraction, random_state=seed, stratify=labels
    )
    if train_size is not None:
        x_tr, y_tr = x_tr[:train_size], y_tr[:train_size]
    return x_tr, y_tr.astype(np.int32), x_te, y_te.astype(np.int32)


def accuracy_of(net, x, y) -> float:
    return float(np.mean(np.asarray(predict(net, jnp.asarray(x))) == y))


def train(args) -> dict:
    x_tr, y_tr, x_te, y_te = load_digits(0.25, args.seed, args.train_size)
    trainer = Trainer(jax.random.key(args.seed))
    schedule = optax.cosine_decay_schedule(
        args.lr, args.epochs * (len(x_tr) // args.batch_size)
    )
    step = es.make_step(loss_fn, optax.adamw(schedule, weight_decay=1e-4))
    opt_state = step.init(trainer)
    rng = np.random.default_rng(args.seed)
    history: dict[str, list[float]] = {
        "train_loss": [],
        "train_accuracy": [],
        "test_accuracy": [],
        "test_accuracy_ema": [],
    }
    from tqdm import tqdm

    start = time.perf_counter()
    for epoch in range(args.epochs):
        trainer = es.reset(trainer)  # zero the metrics; statistics and EMA stay
        order = rng.permutation(len(x_tr))
        batches = range(len(x_tr) // args.batch_size)
        bar = tqdm(batches, desc=f"epoch {epoch + 1}/{args.epochs}", disable=args.quiet)
        for b in bar:
            idx = order[b * args.batch_size : (b + 1) * args.batch_size]
            trainer, opt_state = step(trainer, opt_state, x_tr[idx], y_tr[idx])
            bar.set_postfix(
                loss=f"{float(trainer.loss.compute()):.3f}",
                acc=f"{float(trainer.accuracy.compute()):.3f}",
            )
        history["train_loss"].append(float(trainer.loss.compute()))
        history["train_accuracy"].append(float(trainer.accuracy.compute()))
        history["test_accuracy"].append(accuracy_of(trainer.net, x_te, y_te))
        history["test_accuracy_ema"].append(
            accuracy_of(trainer.ema.averaged(trainer.net), x_te, y_te)
        )
        if not args.quiet:
            print(
                f"epoch {epoch + 1}: train loss {history['train_loss'][-1]:.4f}, "
                f"train acc {history['train_accuracy'][-1]:.4f}, test acc "
                f"{history['test_accuracy'][-1]:.4f} (EMA weights "
                f"{history['test_accuracy_ema'][-1]:.4f})"
            )
    seconds = time.perf_counter() - start
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    es.save(out / "digits.eqxs", (trainer, opt_state))
    plot(history, out / "digits_training.png")
    final = history["test_accuracy_ema"][-1]
    print(
        f"test accuracy with EMA weights: {final:.4f} "
        f"({len(x_te)} test images, {seconds:.1f} s of training, "
        f"{step.trace_count} compilation)"
    )
    return {
        "history": history,
        "seconds": seconds,
        "trainer": trainer,
        "opt_state": opt_state,
        "step": step,
        "test": (x_te, y_te),
    }


def plot(history: dict[str, list[float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    epochs = np.arange(1, len(history["train_loss"]) + 1)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.4))
    ax1.plot(epochs, history["train_loss"], marker="o")
    ax1.set_xlabel("epoch")
    ax1.set_ylabel("training loss (es.metrics.Mean)")
    for name, label in [
        ("train_accuracy", "train (es.metrics.Accuracy)"),
        ("test_accuracy", "test"),
        ("test_accuracy_ema", "test, EMA weights"),
    ]:
        ax2.plot(epochs, history[name], marker="o", label=label)
    ax2.set_xlabel("epoch")
    ax2.set_ylabel("accuracy")
    ax2.legend()
    fig.suptitle("eqx_state: CNN + BatchNorm + Dropout + EMA on sklearn digits")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--train-size", type=int, default=None)
    parser.add_argument("--out", default="examples/out")
    parser.add_argument("--quiet", action="store_true")
    return train(parser.parse_args(argv))


if __name__ == "__main__":
    main()
