"""Statistics for timings taken on a noisy, shared machine.

Every benchmark times its variants in interleaved rounds, so a variant's time in a
round is paired with the reference's time in the *same* round (machine drift hits
both). From those pairs this module computes:

- `ratio_summary`: the median over rounds of the same-round ratio, a bootstrap
  interval for it (rounds resampled with replacement, percentile interval), and the
  ratio of the fastest rounds (`min(variant) / min(reference)`), a point estimate
  robust to rounds slowed down by other jobs;
- `growth`: for a variant timed at several sizes N (the many-cells benchmark), the
  same-round difference to a reference per N (median over rounds), a least-squares
  line `a + b N` and a log-log line `log d = c + k log N` over all N, each slope with
  a bootstrap interval (rounds resampled independently at every N);
- `verdict`: ✓ when an interval lies inside a target, ✗ when it lies outside, ? when
  it straddles the limit.

The bootstrap uses a fixed seed, so the same raw rounds always give the same report
(`run.py --render-only` reproduces `results.md` exactly).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np


N_BOOT = 4000
LEVEL = 0.95
SEED = 19
# Fewer rounds than this give no interval (and so no ✓ or ✗): a bootstrap of one
# or two values says nothing about the spread.
MIN_ROUNDS = 3


def _interval(samples: np.ndarray, level: float) -> list[float]:
    lo, hi = np.quantile(samples, [(1 - level) / 2, (1 + level) / 2])
    return [float(lo), float(hi)]


def ratio_summary(
    times: Sequence[float],
    base: Sequence[float],
    *,
    n_boot: int = N_BOOT,
    level: float = LEVEL,
    seed: int = SEED,
) -> dict[str, Any]:
    """`times[i] / base[i]` are the same-round ratios. Returns `{"median": median
    ratio, "ci": [lo, hi] (bootstrap percentile interval of the median at `level`;
    None with fewer than MIN_ROUNDS rounds), "fastest": min(times) / min(base),
    "rounds": n}`."""
    t = np.asarray(times, dtype=float)
    b = np.asarray(base, dtype=float)
    if t.shape != b.shape or t.ndim != 1 or t.size == 0:
        raise ValueError(
            f"need as many rounds for the variant as for the reference, got "
            f"{t.shape} and {b.shape}"
        )
    r = t / b
    ci = None
    if r.size >= MIN_ROUNDS:
        idx = np.random.default_rng(seed).integers(0, r.size, (n_boot, r.size))
        ci = _interval(np.median(r[idx], axis=1), level)
    return {
        "median": float(np.median(r)),
        "ci": ci,
        "fastest": float(t.min() / b.min()),
        "rounds": int(r.size),
    }


def compile_ratio(
    rows: Mapping[str, Mapping[str, Any]], name: str, base: str = "pure_jax"
) -> dict[str, Any]:
    """`ratio_summary` of `name`'s first calls (`compile_samples_s`, or the one
    `compile_s`) against `base`'s from the same rounds."""

    def samples(row: Mapping[str, Any]) -> Sequence[float]:
        return row.get("compile_samples_s", [row["compile_s"]])

    return ratio_summary(samples(rows[name]), samples(rows[base]))


def compile_cell(rows: Mapping[str, Mapping[str, Any]], name: str) -> str:
    """A variant's median first call and its ratio to pure JAX's: `"8.42 (1.02×
    [0.91–1.15])"`, or `"-"` where it did not run."""
    if name not in rows:
        return "-"
    return f"{rows[name]['compile_s']:.2f} ({fmt_ratio(compile_ratio(rows, name))})"


def verdict(ci: Sequence[float] | None, limit: float, *, below: bool = True) -> str:
    """ "✓" when the interval `ci` lies inside the target (`≤ limit` when `below`,
    else `≥ limit`), "✗" when it lies entirely outside, "?" when it straddles the
    limit, "-" when there is no interval."""
    if ci is None or not all(math.isfinite(c) for c in ci):
        return "-"
    lo, hi = ci
    if not below:
        lo, hi, limit = -hi, -lo, -limit
    if hi <= limit:
        return "✓"
    if lo > limit:
        return "✗"
    return "?"


def fmt_ratio(summary: Mapping[str, Any] | None, digits: int = 2) -> str:
    """`1.07× [0.98–1.21]` (median and interval), or "-"."""
    if not summary:
        return "-"
    if summary["ci"] is None:
        return f"{summary['median']:.{digits}f}× [too few rounds for an interval]"
    lo, hi = summary["ci"]
    return f"{summary['median']:.{digits}f}× [{lo:.{digits}f}–{hi:.{digits}f}]"


def _fit_slopes(x: np.ndarray, ys: np.ndarray) -> np.ndarray:
    """Least-squares slopes of each column of `ys` (shape `[len(x), m]`) on `x`."""
    xc = x - x.mean()
    return (xc @ (ys - ys.mean(axis=0))) / (xc @ xc)


def growth(
    rounds_by_n: Mapping[int, tuple[Sequence[float], Sequence[float]]],
    *,
    n_boot: int = N_BOOT,
    level: float = LEVEL,
    seed: int = SEED,
) -> dict[str, Any]:
    """How the same-round difference `variant - reference` grows with N.

    `rounds_by_n` maps each N to `(variant rounds, reference rounds)`, paired by
    round. Returns `{"n": [...], "diff": [median difference per N], "slope":
    b, "slope_ci" (None with fewer than MIN_ROUNDS rounds at some N), "intercept":
    a (line a + b N over all N), "exponent": k,
    "exponent_ci" (log-log line over all N; `None` where a median difference is not
    positive, or the interval where more than the interval's tail share of bootstrap
    samples is not positive), "exponent_valid": share of bootstrap samples where
    every difference was positive}`.
    """
    ns = sorted(rounds_by_n)
    if len(ns) < 2:
        raise ValueError(f"a growth needs at least two sizes N, got {ns}")
    rng = np.random.default_rng(seed)
    diffs, boots = [], []
    for n in ns:
        t, b = (np.asarray(a, dtype=float) for a in rounds_by_n[n])
        if t.shape != b.shape or t.size == 0:
            raise ValueError(f"N = {n}: unpaired rounds {t.shape} vs {b.shape}")
        d = t - b
        diffs.append(float(np.median(d)))
        idx = rng.integers(0, d.size, (n_boot, d.size))
        boots.append(np.median(d[idx], axis=1))
    x = np.asarray(ns, dtype=float)
    y = np.asarray(diffs)
    boot = np.stack(boots)  # [len(ns), n_boot]
    slope = float(_fit_slopes(x, y[:, None])[0])
    few = min(len(rounds_by_n[n][0]) for n in ns) < MIN_ROUNDS
    out: dict[str, Any] = {
        "n": ns,
        "diff": diffs,
        "slope": slope,
        "slope_ci": None if few else _interval(_fit_slopes(x, boot), level),
        "intercept": float(y.mean() - slope * x.mean()),
        "exponent": None,
        "exponent_ci": None,
        "exponent_valid": 0.0,
    }
    if np.all(y > 0):
        lx = np.log(x)
        out["exponent"] = float(_fit_slopes(lx, np.log(y)[:, None])[0])
        ok = np.all(boot > 0, axis=0)
        out["exponent_valid"] = float(ok.mean())
        if not few and ok.mean() >= 1 - (1 - level) / 2:
            # Samples where a difference is not positive have no log-log line; they
            # are at most the interval's lower tail share, so the interval of the
            # others is a fair (if slightly narrow) summary.
            out["exponent_ci"] = _interval(_fit_slopes(lx, np.log(boot[:, ok])), level)
    return out


def fmt_interval(value: float | None, ci: Sequence[float] | None, unit: str) -> str:
    """`8.81 [7.90–9.70] µs/BN`, or "-"."""
    if value is None:
        return "-"
    if ci is None:
        return f"{value:.2f}{unit} [interval undefined]"
    return f"{value:.2f} [{ci[0]:.2f}–{ci[1]:.2f}]{unit}"


def fit_many(
    rows_by_n: Mapping[int, Mapping[str, Mapping[str, Any]]],
    base: str = "pure_jax",
    *,
    key: str = "rounds_us",
) -> dict[str, dict[str, Any]]:
    """[`growth`][] of every variant's same-round difference to `base` (µs per step,
    rounds under `key` in each row of `rows_by_n[N][variant]`), over the N where
    both ran; for `base` itself, the growth of its own step time (against zero)."""
    ns = sorted(rows_by_n)
    names = list(dict.fromkeys(n for N in ns for n in rows_by_n[N]))
    out = {}
    for name in names:
        have = [N for N in ns if name in rows_by_n[N] and base in rows_by_n[N]]
        if len(have) < 2:
            continue
        pairs = {}
        for N in have:
            t = rows_by_n[N][name][key]
            b = [0.0] * len(t) if name == base else rows_by_n[N][base][key]
            pairs[N] = (t, b)
        out[name] = growth(pairs)
    return out


def markdown_table(
    header: Sequence[str], rows: Sequence[Sequence[str]], left: int = 1
) -> list[str]:
    """A Markdown table, the first `left` columns left-aligned, the others right
    (every benchmark's report uses it)."""
    align = ["---"] * left + ["---:"] * (len(header) - left)
    return [
        "| " + " | ".join(header) + " |",
        "|" + "|".join(align) + "|",
        *("| " + " | ".join(r) + " |" for r in rows),
    ]
