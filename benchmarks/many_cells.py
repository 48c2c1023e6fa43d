"""Many cells: how the per-step overhead grows with the number of BatchNorms.

A deep narrow residual MLP, `x -> x + ReLU(BatchNorm(Linear(8)(x)))` N times, then
`Linear(10)` (no hidden bias, cross-entropy loss, Adam), for N = 1, 10, 30, 100
BatchNorms. (Residual because a plain 100-layer BatchNorm stack is chaotic at
initialisation: float32 rounding differences between matmul kernels grow ~1.2x per
layer, so no two implementations could be checked against each other.) Each
`es.nn.BatchNorm` holds three state cells (running mean, running variance, batch
count), so N = 100 is 300 cells. The training step is the one of
`step_overhead.py`, written the same ways (hand-written JAX; eqx_state in value and
ref mode, and its `step.scan` slots; Equinox and Flax NNX each in their expert forms
and default usage), built and checked by its code: every variant starts from the same
weights and batch and must match the hand-written reference (losses, first-layer
weights, every BatchNorm's running statistics) before it is timed in interleaved
rounds, pipelined and blocking.

At width 8 the compiled step does little arithmetic, so the time per step is
dispatch plus per-layer work; what a framework adds per cell shows up directly. The
table reports, per N, each variant's median µs/step and its median same-round ratio
to `pure_jax` with a bootstrap 95% interval, and the overhead: the median over
rounds of (variant - `pure_jax`) in the same round, in µs. Over all N
(`bench_stats.growth`): a least-squares line `overhead = a + b N` (b: µs per
BatchNorm) and a log-log line `log overhead = c + k log N` (k: the growth exponent;
1 is linear), each slope with a bootstrap 95% interval (rounds resampled at every
N), and the same for each eqx_state variant's difference to `eqx_jit` (`jax.jit` on
the same Equinox model with the statistics threaded by hand): issue 11 asks that
eqx_state's overhead grows no faster than that variant's. Written to
`results_many_cells.md` and plotted to `many_cells.png` in `--out`.

Run: `python benchmarks/many_cells.py` (`--tiny` for a seconds-long smoke run).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any


_HERE = Path(__file__).resolve().parent
# The limit issue 11 sets for eqx_state's growth: the same Equinox model under jax.jit.
LIMIT = "eqx_jit"
# issue 23: ref mode's slope at most this × value mode's (run.py's ISSUE23_SLOPE,
# which its summary applies to the same difference)
ISSUE23_SLOPE = 1.10
# The A/A control (`step_overhead.EsValueAgain`): es_value again, a second instance
CONTROL = "es_value_again"


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


def fit(by_n: dict[int, dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """`{"pure_jax": growth of the overhead over pure JAX per variant (for pure_jax
    itself: of its own step time), "blocking": the same for the blocking timings,
    LIMIT: each eqx_state variant's difference to LIMIT}`; growths as in
    `bench_stats.growth` (median difference per N, line and log-log slopes over all
    N with bootstrap intervals)."""
    stats = _step_overhead().stats
    out = {
        "pure_jax": stats.fit_many(by_n),
        "blocking": stats.fit_many(by_n, key="blocking_rounds_us"),
    }
    if all(LIMIT in rows for rows in by_n.values()):
        vs = stats.fit_many(by_n, LIMIT)
        out[LIMIT] = {
            k: v for k, v in vs.items() if k.startswith("es_") and k != CONTROL
        }
    if all("es_ref" in rows and "es_value" in rows for rows in by_n.values()):
        # issue 23: ref mode's extra cost per BatchNorm over value mode's, from the
        # same-round difference (the load both share does not widen its interval)
        # (a line needs two N: with one, there is no slope to report)
        ref_value = stats.fit_many(by_n, "es_value").get("es_ref")
        if ref_value is not None:
            out["ref_value"] = ref_value
        if all(CONTROL in rows for rows in by_n.values()):
            # the same fit for two instances of one variant: what the harness
            # reads for a difference of nothing
            control = stats.fit_many(by_n, "es_value").get(CONTROL)
            if control is not None:
                out["control"] = control
    return out


# ---------------------------------------------------------------------------------
# Reporting


def _growth_row(label: str, f: dict[str, Any] | None, unit: str) -> list[str]:
    stats = _step_overhead().stats
    if f is None:
        return [label, "-", "-", "-"]
    return [
        label,
        " / ".join(f"{y:.1f}" for y in f["diff"]),
        stats.fmt_interval(f["slope"], f["slope_ci"], unit),
        stats.fmt_interval(f["exponent"], f["exponent_ci"], "")
        if f["exponent"] is not None
        else "- (a difference ≤ 0)",
    ]


def markdown(result: dict[str, Any], meta: dict[str, Any]) -> str:
    by_n, fits = result["by_n"], result["fit"]
    ns = sorted(by_n)
    names = list(dict.fromkeys(n for N in ns for n in by_n[N]))
    cols = [f"N = {n}" for n in ns]
    so = _step_overhead()
    fmt = so.stats.fmt_ratio

    def cell(n: int, name: str, prefix: str = "") -> str:
        row = by_n[n].get(name)
        if row is None:
            return "-"
        s = so.stats.ratio_summary(
            row[prefix + "rounds_us"], by_n[n]["pure_jax"][prefix + "rounds_us"]
        )
        return f"{row[prefix + 'median_us']:.0f} ({fmt(s)})"

    growth_header = [
        "variant",
        f"difference per N ({', '.join(map(str, ns))}), µs",
        "slope b of a + b·N [95% CI]",
        "log-log exponent k [95% CI]",
    ]
    lines = [
        "# Many cells: overhead against the number of BatchNorms",
        "",
        f"`{meta['command']}`",
        "",
        f"{meta['environment']}. Model: {meta['model']}; {meta['rounds']} "
        "interleaved rounds per N, each variant timed pipelined and blocking.",
        "",
        "## µs per step (median) and × pure JAX [95% CI], pipelined",
        "",
        *_step_overhead().stats.markdown_table(
            ["variant", *cols], [[n, *(cell(N, n) for N in ns)] for n in names]
        ),
        "",
        "## The same, blocking on every step",
        "",
        *_step_overhead().stats.markdown_table(
            ["variant", *cols],
            [[n, *(cell(N, n, "blocking_") for N in ns)] for n in names],
        ),
        "",
        "## Overhead over pure JAX and its growth (pipelined)",
        "",
        *_step_overhead().stats.markdown_table(
            growth_header,
            [
                _growth_row(
                    "pure_jax (its own step time)" if n == "pure_jax" else n,
                    fits["pure_jax"].get(n),
                    " µs/BN",
                )
                for n in names
            ],
        ),
        "",
        "## Overhead over pure JAX and its growth (blocking)",
        "",
        *_step_overhead().stats.markdown_table(
            growth_header,
            [
                _growth_row(
                    "pure_jax (its own step time)" if n == "pure_jax" else n,
                    fits["blocking"].get(n),
                    " µs/BN",
                )
                for n in names
            ],
        ),
        "",
    ]
    if LIMIT in fits:
        lines += [
            f"## eqx_state against `{LIMIT}` (issue 11: grows no faster)",
            "",
            *_step_overhead().stats.markdown_table(
                growth_header,
                [
                    _growth_row(f"{n} − {LIMIT}", f, " µs/BN")
                    for n, f in fits[LIMIT].items()
                ],
            ),
            "",
        ]
    if "ref_value" in fits:
        value_b = fits["pure_jax"]["es_value"]["slope"]
        limit = (ISSUE23_SLOPE - 1) * value_b
        lines += [
            "## Ref mode against value mode (issue 23: ≤ value's slope + 10 %)",
            "",
            *_step_overhead().stats.markdown_table(
                growth_header,
                [
                    _growth_row("es_ref − es_value", fits["ref_value"], " µs/BN"),
                    *(
                        [
                            _growth_row(
                                f"A/A control: {CONTROL} − es_value",
                                fits["control"],
                                " µs/BN",
                            )
                        ]
                        if "control" in fits
                        else []
                    ),
                ],
            ),
            "",
            f"Limit: {ISSUE23_SLOPE - 1:.2f} × es_value's slope over pure JAX "
            f"({value_b:.2f} µs/BN) = {limit:.2f} µs/BN: "
            + _step_overhead().stats.verdict(fits["ref_value"]["slope_ci"], limit),
            "",
        ]
        if "control" in fits:
            lines += [
                f"The A/A control (`{CONTROL}`: es_value's step, a second instance, "
                "timed as a variant of its own) differs from es_value by nothing "
                "but the harness (the instance, its place in the round): the "
                "interval of its slope is how finely this harness resolves the "
                "slope of a same-round difference.",
                "",
            ]
    lines += [
        "## Compile time (first call, s)",
        "",
        "Wall time of the first call (trace + compile + one call): the median over "
        "fresh instances, and × pure JAX's first calls in the same rounds "
        "[bootstrap 95% interval].",
        "",
        *_step_overhead().stats.markdown_table(
            ["variant", *cols],
            [
                [
                    name,
                    *(_step_overhead().stats.compile_cell(by_n[n], name) for n in ns),
                ]
                for name in names
            ],
        ),
        "",
        "Difference: median over rounds of (variant − reference in the same round). "
        "Both lines are fitted over all N; their slopes' intervals come from "
        "resampling the rounds at every N (bootstrap, 95%). The log-log exponent is "
        "1 for linear growth, 0 for none, and undefined where a median difference "
        "is not positive. Each es.nn.BatchNorm holds 3 state cells. Every variant "
        "was checked against the hand-written reference first.",
        "",
        "## Variants",
        "",
        *so.variants_table(names),
        "",
    ]
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    """Left: step time against N. Right: the overhead over pure JAX (median of
    same-round differences) with, per N, the bootstrap interval of that median."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stats = _step_overhead().stats
    by_n = result["by_n"]
    ns = sorted(by_n)
    names = list(dict.fromkeys(n for N in ns for n in by_n[N]))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for i, name in enumerate(names):
        have = [n for n in ns if name in by_n[n]]
        style = {"marker": "o", "label": name, "color": f"C{i % 10}"}
        if i >= 10:
            style["ls"] = "--"
        ax1.plot(have, [by_n[n][name]["median_us"] for n in have], **style)
        if name == "pure_jax" or len(have) < 2:
            continue
        f = stats.growth(
            {
                n: (by_n[n][name]["rounds_us"], by_n[n]["pure_jax"]["rounds_us"])
                for n in have
            },
            n_boot=1000,
        )
        ax2.plot(have, f["diff"], **style)
    ax1.set(xscale="log", yscale="log", ylabel="µs per step")
    ax1.set_title("step time (median, pipelined)")
    ax2.set(xscale="log", ylabel="µs per step over pure JAX")
    ax2.set_yscale("symlog", linthresh=10)
    ax2.axhline(0, color="k", lw=0.8)
    ax2.set_title("overhead (median of same-round differences)")
    for ax in (ax1, ax2):
        ax.set_xticks(ns, [str(n) for n in ns])
        ax.minorticks_off()
        ax.set_xlabel("BatchNorms N")
    ax1.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; return `{"by_n": {N: {variant: row}}, "fit": ...}` (rows
    as in `step_overhead.py`, fits as in [`fit`][])."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--n", type=int, nargs="+", default=[1, 10, 30, 100])
    parser.add_argument("--width", type=int, default=8)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument(
        "--compile-repeats",
        type=int,
        default=5,
        help="first calls timed per variant and N: the checked one, then fresh "
        "instances in interleaved rounds (a first call's time scatters by ~15%%)",
    )
    parser.add_argument(
        "--steps", type=int, default=None, help="default: max(20, 300 / sqrt(N))"
    )
    parser.add_argument(
        "--variants",
        nargs="+",
        default=None,
        help="pure_jax is always included, as the reference (default: every "
        "available variant of step_overhead.py)",
    )
    parser.add_argument(
        "--tiny", action="store_true", help="N = 1, 3; width 4; 3 rounds of 2 steps"
    )
    parser.add_argument("--out", type=Path, default=_HERE)
    parser.add_argument(
        "--json",
        type=Path,
        default=None,
        help="also save the raw result (every round) to this file, for a report "
        "computed later (`benchmarks/run.py` keeps its own in results.json)",
    )
    args = parser.parse_args(argv)
    if args.tiny:
        args.n, args.width, args.batch = [1, 3], 4, 4
        args.rounds, args.steps = min(args.rounds, 3), args.steps or 2
        args.compile_repeats = 1
    so = _step_overhead()
    if args.variants is not None:
        unknown = set(args.variants) - set(so.available_variants())
        if unknown:
            parser.error(
                f"unknown or unavailable variants {sorted(unknown)}; choose from "
                f"{so.available_variants()}"
            )
        args.variants = ["pure_jax", *(v for v in args.variants if v != "pure_jax")]

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
        names = so.variants_for(size, args.variants)
        by_n[n] = so.run_size(
            size, names, args.rounds, size.steps, args.compile_repeats
        )
    result = {"by_n": by_n, "fit": fit(by_n)}
    meta = {
        "command": "python benchmarks/many_cells.py "
        + " ".join(sys.argv[1:] if argv is None else argv),
        "environment": so.environment(),
        "rounds": args.rounds,
        "model": f"residual MLP, width {args.width}, batch {args.batch}",
    }
    so.write_report(args.out, "many_cells", markdown(result, meta), plot, result)
    if args.json is not None:
        args.json.write_text(
            json.dumps({"meta": meta, "result": result}, indent=1), "utf-8"
        )
    return result


if __name__ == "__main__":
    main()
