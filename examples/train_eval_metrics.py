"""Train a small MLP on scikit-learn's digits, with metrics kept as state.

* Train metrics (running mean loss, last loss, accuracy) live in the model and are
  updated inside the loss function, during the jit-compiled `es.make_step`; they are
  read after every step for the progress bar and reset at the start of each epoch
  with `es.reset`.
* Eval metrics (mean loss, accuracy, macro F1, confusion matrix) are a separate
  `es.metrics.Metrics` collection updated in a jitted evaluation loop through
  `es.apply`. The last batch is padded to the batch size and masked, so the eval
  step compiles once and the padding contributes nothing.

    python examples/train_eval_metrics.py --epochs 5
"""

import argparse

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits
from tqdm import tqdm

import eqx_state as es
from eqx_state import metrics as esm


NUM_CLASSES = 10


class Classifier(eqx.Module):
    mlp: eqx.nn.MLP
    train_metrics: esm.Metrics

    def __init__(self, hidden: int, *, key):
        self.mlp = eqx.nn.MLP(64, NUM_CLASSES, hidden, depth=2, key=key)
        self.train_metrics = esm.Metrics(
            mean_loss=esm.Mean(), loss=esm.LastValue(), accuracy=esm.Accuracy()
        )

    def __call__(self, x):  # x: [batch, 64]
        return jax.vmap(self.mlp)(x)


def cross_entropy(logits, labels):  # per example
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels)


def loss_fn(model, x, y):
    logits = model(x)
    loss = jnp.mean(cross_entropy(logits, y))
    # written where the values are computed; no gradient flows into metric state
    model.train_metrics.update(mean_loss=loss, loss=loss, accuracy=(logits, y))
    return loss


@eqx.filter_jit
def eval_step(model, metrics, x, y, mask):
    def update(metrics):
        logits = model(x)
        metrics.update(
            loss=cross_entropy(logits, y),
            accuracy=(logits, y),
            f1_macro=(logits, y),
            confusion=(logits, y),
            mask=mask,  # shared by every metric: padded rows count for nothing
        )
        return jnp.argmax(logits, axis=-1)

    return es.apply(update, metrics)


def load(train_size: int, eval_size: int, seed: int):
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int32)
    order = np.random.default_rng(seed).permutation(len(y))
    x, y = x[order], y[order]
    x_eval, y_eval = x[:eval_size], y[:eval_size]
    rest = slice(eval_size, eval_size + train_size if train_size > 0 else None)
    return (x[rest], y[rest]), (x_eval, y_eval)


def padded_batches(x, y, batch_size):
    """Fixed-size batches; the last one padded with zeros and masked."""
    for start in range(0, len(y), batch_size):
        xb, yb = x[start : start + batch_size], y[start : start + batch_size]
        n = len(yb)
        mask = np.arange(batch_size) < n
        xb = np.concatenate([xb, np.zeros((batch_size - n, x.shape[1]), x.dtype)])
        yb = np.concatenate([yb, np.zeros(batch_size - n, y.dtype)])
        yield xb, yb, mask


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--train-size", type=int, default=0, help="0: all the rest")
    parser.add_argument("--eval-size", type=int, default=360)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)

    (x_train, y_train), (x_eval, y_eval) = load(
        args.train_size, args.eval_size, args.seed
    )
    model = Classifier(args.hidden, key=jax.random.key(args.seed))
    step = es.make_step(loss_fn, optax.adam(args.lr))
    opt_state = step.init(model)
    eval_metrics = esm.Metrics(
        loss=esm.Mean(),
        accuracy=esm.Accuracy(),
        f1_macro=esm.F1(NUM_CLASSES, average="macro"),
        confusion=esm.ConfusionMatrix(NUM_CLASSES),
    )

    rng = np.random.default_rng(args.seed)
    steps_per_epoch = len(y_train) // args.batch_size
    history: dict = {"train": [], "eval": []}
    bar = tqdm(total=args.epochs * steps_per_epoch, disable=args.no_progress)
    for epoch in range(args.epochs):
        model = es.reset(model)  # the train metrics start over every epoch
        order = rng.permutation(len(y_train))
        logged = []
        for i in range(steps_per_epoch):
            idx = order[i * args.batch_size : (i + 1) * args.batch_size]
            model, opt_state = step(model, opt_state, x_train[idx], y_train[idx])
            train = {k: float(v) for k, v in model.train_metrics.compute().items()}
            logged.append(train)
            bar.set_postfix(epoch=epoch, **{k: f"{v:.3f}" for k, v in train.items()})
            bar.update()
        history["train"].append(logged)

        metrics = es.reset(eval_metrics)
        eval_model = eqx.nn.inference_mode(model)
        preds = []
        for xb, yb, mask in padded_batches(x_eval, y_eval, args.batch_size):
            pred, metrics = eval_step(eval_model, metrics, xb, yb, mask)
            preds.append(np.asarray(pred)[mask])
        result = metrics.compute()
        ev = {k: float(v) for k, v in result.items() if k != "confusion"}
        history["eval"].append(ev)
        history["confusion"] = np.asarray(result["confusion"])
        history["eval_preds"] = np.concatenate(preds)
        history["eval_labels"] = y_eval
        train = logged[-1] if logged else {}
        bar.write(
            f"epoch {epoch}: train mean_loss={train.get('mean_loss', float('nan')):.4f} "
            f"accuracy={train.get('accuracy', float('nan')):.4f} | "
            f"eval loss={ev['loss']:.4f} eval_accuracy={ev['accuracy']:.4f} "
            f"eval_f1_macro={ev['f1_macro']:.4f}"
        )
    bar.close()
    history["compiles"] = step.trace_count
    return history


if __name__ == "__main__":
    main()
