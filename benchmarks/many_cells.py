"""Many cells: how the per-step overhead grows with the number of BatchNorms.

A deep narrow residual MLP, `x -> x + ReLU(BatchNorm(Linear(8)(x)))` N times, then
`Linear(10)` (no hidden bias, cross-entropy loss, Adam), for N = 1, 10, 30, 100
BatchNorms. (Residual because a plain 100-layer BatchNorm stack is chaotic at
initialisation: float32 rounding differences between matmul kernels grow ~1.2x per
layer, so no two implementations could be checked against each other.) Each
`es.nn.BatchNorm` holds three state cells (running mean, running variance, batch
count), so N = 100 is 300 cells. The training step is the one of
`step_overhead.py`, written the same ways (hand-written JAX, eqx_state in value and
ref mode, Equinox `eqx.nn.State` + `filter_jit`, Flax NNX `nnx.jit` and
split/merge), built and checked by its code: every variant starts from the same
weights and batch and must match the hand-written reference (losses, first-layer
weights, every BatchNorm's running statistics) before it is timed in interleaved
rounds.

At width 8 the compiled step does little arithmetic, so the time per step is
dispatch plus per-layer work; what a framework adds per cell shows up directly. The
table reports, per N, each variant's median µs/step and its median per-round ratio
to `pure_jax`, and the overhead: the median over rounds of (variant - `pure_jax`)
in the same round, in µs. A least-squares line `overhead = a + b N` gives the cost
per BatchNorm `b`, next to the hand-written step's own growth per layer; the growth
exponent `log(overhead(N_max) / overhead(N_mid)) / log(N_max / N_mid)` (N_mid the
second-largest N) is below 1 where the overhead grows sub-linearly. Written to
`results_many_cells.md` and plotted to `many_cells.png` in `--out`.

Run: `python benchmarks/many_cells.py` (`--tiny` for a seconds-long smoke run).
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np


_HERE = Path(__file__).resolve().parent
DEFAULT_VARIANTS = ("pure_jax", "es_value", "es_ref", "equinox", "nnx_split", "nnx_jit")


def _step_overhead() -> Any:
    """`step_overhead.py`, whose model, variants, check and timing this reuses."""
    name = "step_overhead"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, _HERE / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
    return sys.modules[name]


def default_steps(n: int) -> int:
    """Steps per variant per round: fewer for deeper (slower) models."""
    return max(20, int(300 / math.sqrt(n)))


def overhead_us(rows: dict[str, dict[str, Any]], name: str) -> float:
    """Median over rounds of (variant - pure_jax), same round, in µs."""
    pairs = zip(rows[name]["rounds_us"], rows["pure_jax"]["rounds_us"], strict=True)
    return statistics.median(t - p for t, p in pairs)


def fit(by_n: dict[int, dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per variant: the overhead at each N, the line `a + b N` through it (least
    squares), and the growth exponent between the two largest N (`None` when an
    overhead is not positive). For `pure_jax`, the same of its own step time."""
    ns = sorted(by_n)
    names = list(by_n[ns[0]])
    out = {}
    for name in names:
        if name == "pure_jax":
            ys = [by_n[n][name]["median_us"] for n in ns]
        else:
            ys = [overhead_us(by_n[n], name) for n in ns]
        b, a = np.polyfit(ns, ys, 1) if len(ns) > 1 else (float("nan"), ys[0])
        exponent = None
        if len(ns) > 1 and ys[-2] > 0 and ys[-1] > 0:
            exponent = math.log(ys[-1] / ys[-2]) / math.log(ns[-1] / ns[-2])
        out[name] = {
            "n": ns,
            "us": ys,
            "intercept_us": float(a),
            "per_cell_us": float(b),
            "exponent": exponent,
        }
    return out


# ---------------------------------------------------------------------------------
# Reporting


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    return [
        "| " + " | ".join(header) + " |",
        "|---|" + "---:|" * (len(header) - 1),
        *("| " + " | ".join(r) + " |" for r in rows),
    ]


def markdown(result: dict[str, Any], meta: dict[str, Any]) -> str:
    by_n, fits = result["by_n"], result["fit"]
    ns = sorted(by_n)
    names = list(by_n[ns[0]])
    cols = [f"N = {n}" for n in ns]
    so = _step_overhead()

    def fit_row(name: str) -> list[str]:
        f = fits[name]
        exp = "-" if f["exponent"] is None else f"{f['exponent']:.2f}"
        label = "pure_jax (its own step time)" if name == "pure_jax" else name
        return [
            label,
            *(f"{y:.1f}" for y in f["us"]),
            f"{f['per_cell_us']:.2f}",
            f"{f['intercept_us']:.1f}",
            exp,
        ]

    lines = [
        "# Many cells: overhead against the number of BatchNorms",
        "",
        f"`{meta['command']}`",
        "",
        f"{meta['environment']}. Model: {meta['model']}; {meta['rounds']} "
        "interleaved rounds per N.",
        "",
        "## µs per step (median) and × pure JAX",
        "",
        *_table(
            ["variant", *cols],
            [
                [
                    name,
                    *(
                        f"{by_n[n][name]['median_us']:.0f} "
                        f"({by_n[n][name]['ratio']:.2f}×)"
                        for n in ns
                    ),
                ]
                for name in names
            ],
        ),
        "",
        "## Overhead over pure JAX (µs per step) and its growth",
        "",
        *_table(
            [
                "variant",
                *cols,
                "a + b·N: b (µs per BatchNorm)",
                "a (µs)",
                "growth exponent",
            ],
            [fit_row(name) for name in names],
        ),
        "",
        "## Compile time (first call, s)",
        "",
        *_table(
            ["variant", *cols],
            [
                [name, *(f"{by_n[n][name]['compile_s']:.2f}" for n in ns)]
                for name in names
            ],
        ),
        "",
        "Overhead: median over rounds of (variant − pure JAX in the same round). The "
        "line is a least-squares fit over all N; the growth exponent is "
        f"log(overhead({ns[-1]}) / overhead({ns[-2] if len(ns) > 1 else ns[-1]})) / "
        "log of the ratio of the N (1: linear, below 1: sub-linear; - where an "
        "overhead is not positive). Each es.nn.BatchNorm holds 3 state cells. "
        "Variants: "
        + "; ".join(f"`{n}`: {so.VARIANTS[n].label}" for n in names)
        + ". All checked against the hand-written reference first.",
        "",
    ]
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_n, fits = result["by_n"], result["fit"]
    ns = sorted(by_n)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for i, name in enumerate(by_n[ns[0]]):
        style = {"marker": "o", "label": name, "color": f"C{i}"}
        ax1.plot(ns, [by_n[n][name]["median_us"] for n in ns], **style)
        if name != "pure_jax":
            ax2.plot(ns, fits[name]["us"], **style)
    ax1.set(xscale="log", yscale="log", ylabel="µs per step")
    ax1.set_title("step time (median)")
    ax2.set(xscale="log", ylabel="µs per step over pure JAX")
    ax2.set_yscale("symlog", linthresh=10)
    ax2.axhline(0, color="k", lw=0.8)
    ax2.set_title("overhead (median of same-round differences)")
    for ax in (ax1, ax2):
        ax.set_xticks(ns, [str(n) for n in ns])
        ax.minorticks_off()
        ax.set_xlabel("BatchNorms N")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; return `{"by_n": {N: {variant: row}}, "fit": {variant:
    {...}}}` (rows as in `step_overhead.py`, fits as in [`fit`][])."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--n", type=int, nargs="+", default=[1, 10, 30, 100])
    parser.add_argument("--width", type=int, default=8)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument(
        "--steps", type=int, default=None, help="default: max(20, 300 / sqrt(N))"
    )
    parser.add_argument(
        "--variants",
        nargs="+",
        default=list(DEFAULT_VARIANTS),
        help="pure_jax is always included, as the reference",
    )
    parser.add_argument(
        "--tiny", action="store_true", help="N = 1, 3; width 4; 2 rounds of 2 steps"
    )
    parser.add_argument("--out", type=Path, default=_HERE)
    args = parser.parse_args(argv)
    if args.tiny:
        args.n, args.width, args.batch = [1, 3], 4, 4
        args.rounds, args.steps = min(args.rounds, 2), args.steps or 2
    so = _step_overhead()
    unknown = set(args.variants) - set(so.VARIANTS)
    if unknown:
        parser.error(
            f"unknown variants {sorted(unknown)}; choose from {list(so.VARIANTS)}"
        )
    names = ["pure_jax", *(v for v in args.variants if v != "pure_jax")]

    by_n = {}
    for n in sorted(set(args.n)):
        size = so.Size(
            f"N={n}",
            widths=(args.width,) * n,
            in_shape=(args.width,),
            batch=args.batch,
            residual=True,
            steps=args.steps or default_steps(n),
        )
        by_n[n] = so.run_size(size, names, args.rounds, size.steps)
    result = {"by_n": by_n, "fit": fit(by_n)}
    meta = {
        "command": "python benchmarks/many_cells.py "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "environment": so.environment(),
        "rounds": args.rounds,
        "model": f"residual MLP, width {args.width}, batch {args.batch}",
    }
    so.write_report(args.out, "many_cells", markdown(result, meta), plot, result)
    return result


if __name__ == "__main__":
    main()
