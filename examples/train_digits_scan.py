"""The headline model trained with many steps per compiled call (`step.scan`).

`examples/train_digits.py` runs one `step(...)` per batch: every step is one Python
call, and for a small model the per-call dispatch is a large part of the time.
`step.scan(trainer, opt_state, xs, ys)` runs `K` steps in one compiled call, where
`xs` and `ys` stack `K` batches: every state write (BatchNorm statistics, the
Dropout stream, the EMA, the metrics) lands once per step, exactly as `K` calls of
the step would do.

This script trains the same model on the same batches both ways, checks that the
two runs end with the same weights, statistics and metrics, and reports the time
per step of each and the speed-up.

Run: `python examples/train_digits_scan.py` (under a minute on 2 CPU cores).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jax
import numpy as np
import optax


sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_digits import Trainer, load_digits, loss_fn  # noqa: E402

import eqx_state as es  # noqa: E402


def batches_of_epoch(rng, n, batch_size):
    order = rng.permutation(n)
    k = n // batch_size
    return order[: k * batch_size].reshape(k, batch_size)


def run(args, scan: bool) -> tuple[object, object, object, float, int]:
    x_tr, y_tr, _, _ = load_digits(0.25, args.seed, args.train_size)
    if args.float64:
        x_tr = x_tr.astype(np.float64)
    trainer = Trainer(jax.random.key(args.seed))
    # On CPU, XLA runs convolutions inside a compiled loop several times slower
    # than outside one: unroll the K steps (compile time grows with K instead).
    step = es.make_step(
        loss_fn, optax.adamw(args.lr, weight_decay=1e-4), scan_unroll=args.unroll
    )
    opt_state = step.init(trainer)
    rng = np.random.default_rng(args.seed)
    seconds, steps = 0.0, 0
    for epoch in range(args.epochs):
        trainer = es.reset(trainer)  # zero the metrics every epoch
        idx = batches_of_epoch(rng, len(x_tr), args.batch_size)
        idx = idx[: len(idx) // args.steps_per_call * args.steps_per_call]
        start = time.perf_counter()
        if scan:
            for chunk in idx.reshape(-1, args.steps_per_call, args.batch_size):
                trainer, opt_state = step.scan(
                    trainer, opt_state, x_tr[chunk], y_tr[chunk]
                )
        else:
            for b in idx:
                trainer, opt_state = step(trainer, opt_state, x_tr[b], y_tr[b])
        jax.block_until_ready((trainer, opt_state))
        if epoch > 0:  # the first epoch compiles
            seconds += time.perf_counter() - start
            steps += len(idx)
    return step, trainer, opt_state, seconds, steps


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--steps-per-call", type=int, default=10)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument(
        "--unroll",
        type=int,
        default=0,
        help="steps per iteration of the compiled loop (0: all K, the default)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--train-size", type=int, default=None)
    parser.add_argument(
        "--float64",
        action="store_true",
        help="train in float64 (needs JAX_ENABLE_X64=1): the two runs then agree to "
        "~1e-10, which shows that their float32 difference is round-off",
    )
    args = parser.parse_args(argv)
    if args.epochs < 2:
        parser.error("--epochs must be at least 2 (the first epoch compiles)")
    if args.float64 and not jax.config.jax_enable_x64:
        parser.error("--float64 needs JAX_ENABLE_X64=1")
    args.unroll = args.unroll or True

    step, a, a_state, t_step, n = run(args, scan=False)
    scan_step, b, b_state, t_scan, n_scan = run(args, scan=True)
    assert n == n_scan > 0, (n, n_scan)
    # the same training, step by step: weights, statistics, EMA, metrics, optimizer
    worst = 0.0  # over the float64 leaves with --float64
    for x, y in zip(jax.tree.leaves((a, a_state)), jax.tree.leaves((b, b_state))):
        x, y = np.asarray(x), np.asarray(y)
        if np.issubdtype(x.dtype, np.inexact):
            # equal up to float round-off: XLA fuses the scanned program differently,
            # and Adam amplifies round-off in small gradients (in float64: ~1e-10)
            scale = max(1.0, float(np.max(np.abs(x), initial=0.0)))
            diff = float(np.max(np.abs(x - y), initial=0.0))
            tol = 1e-8 if x.dtype == np.float64 else 1e-3
            assert diff <= tol * scale, (diff, scale, x.dtype)
            if x.dtype == (np.float64 if args.float64 else np.float32):
                worst = max(worst, diff)
        else:
            np.testing.assert_array_equal(x, y)
    per_step, per_scan_step = t_step / n * 1e6, t_scan / n_scan * 1e6
    print(
        f"{n} steps after the first epoch: {per_step:.0f} us per step one call at a "
        f"time, {per_scan_step:.0f} us per step with {args.steps_per_call} steps per "
        f"call: {per_step / per_scan_step:.2f}x faster; the two runs agree to "
        f"{worst:.1e} (compilations: {step.trace_count} and {scan_step.trace_count})"
    )
    return {
        "per_step_us": per_step,
        "per_scan_step_us": per_scan_step,
        "max_abs_difference": worst,
        "steps": n,
    }


if __name__ == "__main__":
    main()
