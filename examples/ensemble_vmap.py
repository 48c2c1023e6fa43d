"""Eight independent models with BatchNorm, trained at once with `vmap` over `make_step`.

A value-mode step is a pure function of `(model, opt_state, batch)`, so an ensemble is
just `eqx.filter_vmap` of it: parameters, optimizer state and BatchNorm statistics get
a leading ensemble axis, every member trains on its own bootstrap sample of
scikit-learn's digits, and one compiled program runs all eight. The ensemble's
averaged prediction is evaluated on a held-out split, next to each member's own.

Run: `python examples/ensemble_vmap.py` (a few seconds on 2 CPU cores).
"""

import argparse

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import eqx_state as es


class MLP(eqx.Module):
    lin1: eqx.nn.Linear
    bn: es.nn.BatchNorm
    lin2: eqx.nn.Linear

    def __init__(self, key, hidden=64):
        k1, k2 = jax.random.split(key)
        self.lin1 = eqx.nn.Linear(64, hidden, use_bias=False, key=k1)
        self.bn = es.nn.BatchNorm(hidden)
        self.lin2 = eqx.nn.Linear(hidden, 10, key=k2)

    def __call__(self, x):  # x: [batch, 64]
        h = jax.nn.relu(self.bn(jax.vmap(self.lin1)(x)))
        return jax.vmap(self.lin2)(h)


def loss_fn(model, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--members", type=int, default=8)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    images, labels = load_digits(return_X_y=True)
    x_tr, x_te, y_tr, y_te = train_test_split(
        (images / 16.0).astype(np.float32),
        labels.astype(np.int32),
        test_size=0.25,
        random_state=args.seed,
        stratify=labels,
    )
    keys = jax.random.split(jax.random.key(args.seed), args.members)
    ensemble = eqx.filter_vmap(MLP)(keys)  # every array gets a leading member axis
    # donate=False: the step runs inside `eqx.filter_jit` below, where JAX donates
    # nothing anyway (an eager `filter_vmap(step)` would donate the old ensemble)
    step = es.make_step(loss_fn, optax.adam(3e-3), donate=False)
    opt_state = eqx.filter_vmap(step.init)(ensemble)
    ens_step = eqx.filter_jit(
        eqx.filter_vmap(step, in_axes=(eqx.if_array(0), eqx.if_array(0), 0, 0))
    )
    rng = np.random.default_rng(args.seed)
    for _ in range(args.steps):
        # a different bootstrap batch for every member: [members, batch, ...]
        idx = rng.integers(0, len(x_tr), (args.members, args.batch_size))
        ensemble, opt_state = ens_step(ensemble, opt_state, x_tr[idx], y_tr[idx])

    evaluate = eqx.filter_jit(
        eqx.filter_vmap(
            lambda m, x: jax.nn.softmax(m(x)), in_axes=(eqx.if_array(0), None)
        )
    )
    probs = evaluate(eqx.nn.inference_mode(ensemble), jnp.asarray(x_te))  # [m, n, 10]
    member_acc = np.mean(np.asarray(jnp.argmax(probs, -1)) == y_te[None], axis=1)
    ensemble_acc = float(np.mean(np.asarray(jnp.argmax(probs.mean(0), -1)) == y_te))
    batches = np.asarray(ensemble.bn.num_batches_tracked[...])
    print("member test accuracies:", " ".join(f"{a:.3f}" for a in member_acc))
    print(f"ensemble (mean probabilities) test accuracy: {ensemble_acc:.4f}")
    print(f"BatchNorm batches seen per member: {batches.tolist()}")
    return {
        "ensemble": ensemble,
        "member_acc": member_acc,
        "ensemble_acc": ensemble_acc,
        "test": (x_te, y_te),
    }


if __name__ == "__main__":
    main()
