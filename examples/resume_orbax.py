"""Resume training from an Orbax-managed checkpoint, bit for bit.

A small MLP with BatchNorm, Dropout (its RNG stream kept as state) and a step counter
trains with `es.make_step`. An `orbax.checkpoint.CheckpointManager` saves
`(model, opt_state)` every `--save-every` steps, keeps the last `--keep`, and writes in
the background while training goes on (`es.to_orbax` snapshots the state first, so the
next donating step cannot touch what is being written).

Run it twice: the first run stops (or crashes) early, the second resumes from the
latest checkpoint, restored into an abstract model from `eqx.filter_eval_shape` (the
model is never allocated twice), and finishes. Each batch depends only on the step
number, so the resumed run ends with exactly the model of an uninterrupted run:
parameters, Adam moments, BatchNorm statistics, counter and RNG key, bit for bit.

    python examples/resume_orbax.py --dir /tmp/run --steps 40 --crash-at 25
    python examples/resume_orbax.py --dir /tmp/run --steps 40   # resumes, finishes

`--mode ref` trains a ref-mode model (`es.to_refs`); it is restored in ref mode.
Needs the `orbax` extra: `pip install eqx_state[orbax]`.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

import eqx_state as es


class Model(eqx.Module):
    hidden: eqx.nn.Linear
    norm: es.nn.BatchNorm
    dropout: es.nn.Dropout
    head: eqx.nn.Linear
    steps: es.nn.Counter

    def __init__(self, key, width=16):
        k1, k2, k3 = jax.random.split(key, 3)
        self.hidden = eqx.nn.Linear(8, width, key=k1)
        self.norm = es.nn.BatchNorm(width)
        self.dropout = es.nn.Dropout(0.1, key=k2)
        self.head = eqx.nn.Linear(width, 1, key=k3)
        self.steps = es.nn.Counter()

    def __call__(self, x):
        self.steps.increment()
        h = self.dropout(jax.nn.relu(self.norm(jax.vmap(self.hidden)(x))))
        return jax.vmap(self.head)(h)[:, 0]


def loss_fn(model, x, y):
    return jnp.mean((model(x) - y) ** 2)


def batch(step: int, size: int = 32):
    """The batch of a step: a function of the step number only."""
    kx, kn = jax.random.split(jax.random.fold_in(jax.random.key(1234), step))
    x = jax.random.normal(kx, (size, 8))
    y = (
        jnp.sin(x[:, 0])
        + 0.5 * x[:, 1] * x[:, 2]
        + 0.1 * jax.random.normal(kn, (size,))
    )
    return x, y


def make_step():
    return es.make_step(loss_fn, optax.adam(1e-2))


def fresh(seed: int, mode: str):
    model = Model(jax.random.key(seed))
    opt_state = make_step().init(model)  # an Adam state over es.params(model)
    return (es.to_refs(model) if mode == "ref" else model), opt_state


def manager(directory, save_every: int, keep: int):
    import orbax.checkpoint as ocp

    options = ocp.CheckpointManagerOptions(
        max_to_keep=keep, save_interval_steps=save_every
    )
    # naming the handler lets a fresh process read the checkpoints' metadata
    return ocp.CheckpointManager(
        Path(directory).absolute(),
        options=options,
        item_handlers=ocp.StandardCheckpointHandler(),
    )


def restore_latest(mngr, seed: int, mode: str):
    """(start step, model, opt_state): the latest checkpoint, or a fresh start."""
    import orbax.checkpoint as ocp

    start = mngr.latest_step()
    if start is None:
        return 0, *fresh(seed, mode)
    abstract = eqx.filter_eval_shape(fresh, seed, "value")  # allocates nothing
    target = es.orbax_target(abstract, mngr.item_metadata(start))  # checks dtypes
    restored = mngr.restore(start, args=ocp.args.StandardRestore(target))
    model, opt_state = es.from_orbax(restored, like=abstract)
    return start, (es.to_refs(model) if mode == "ref" else model), opt_state


def train(
    directory,
    *,
    steps: int,
    mode: str = "value",
    seed: int = 0,
    save_every: int = 5,
    keep: int = 2,
    stop_at: int | None = None,
    crash_at: int | None = None,
):
    """Train to `steps` (resuming from `directory` if it holds a checkpoint); return
    `(model, opt_state, first_step)`. `stop_at` ends cleanly after that step (saves
    finished); `crash_at` kills the process after that step, mid-save possibly."""
    import orbax.checkpoint as ocp

    step_fn = make_step()
    mngr = manager(directory, save_every, keep)
    start, model, opt_state = restore_latest(mngr, seed, mode)
    for i in range(start, steps):
        model, opt_state = step_fn(model, opt_state, *batch(i))
        # checkpoint `i + 1` holds the state after i + 1 steps; the manager decides
        # whether this step is saved (every `save_every`) and deletes old ones
        mngr.save(i + 1, args=ocp.args.StandardSave(es.to_orbax((model, opt_state))))
        if crash_at is not None and i + 1 == crash_at:
            os._exit(3)  # no cleanup: an in-flight save is lost, older ones stay
        if stop_at is not None and i + 1 == stop_at:
            break
    mngr.wait_until_finished()
    mngr.close()
    return model, opt_state, start


def main(argv: list[str] | None = None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dir", required=True, help="checkpoint directory")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--mode", choices=["value", "ref"], default="value")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save-every", type=int, default=5)
    parser.add_argument("--keep", type=int, default=2)
    parser.add_argument("--stop-at", type=int, default=None)
    parser.add_argument("--crash-at", type=int, default=None)
    parser.add_argument(
        "--final", default=None, help="also write the final state here (es.save)"
    )
    args = parser.parse_args(argv)
    model, opt_state, start = train(
        args.dir,
        steps=args.steps,
        mode=args.mode,
        seed=args.seed,
        save_every=args.save_every,
        keep=args.keep,
        stop_at=args.stop_at,
        crash_at=args.crash_at,
    )
    if args.final:
        es.save(args.final, (model, opt_state))
    loss = float(loss_fn(eqx.nn.inference_mode(model), *batch(10_000)))
    print(
        f"started at step {start}, finished at step {int(model.steps.value)}; "
        f"held-out loss {loss:.4f}"
    )
    return model, opt_state, start


if __name__ == "__main__":
    main()
