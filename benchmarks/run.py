"""Run every benchmark and gather the results in one report.

Runs each benchmark in a fresh Python process (so that one benchmark's compiled
functions, caches and memory do not weigh on the next), one after the other:

- `step_overhead.py` at every size (small and medium MLP, small CNN): step time and
  compile time of eqx_state against hand-written JAX, Equinox and Flax NNX;
- `many_cells.py`: the overhead against the number of BatchNorms (1 to 100);
- `kv_cache.py`: KV-cache decoding, per token and in a scan, with memory;
- `scaling.py`: the data-parallel step on 1, 2 and 4 CPU devices.

Each writes its own `results_<name>.md` and PNG into `--out`. This script collects
what their `main()` returned and writes, also into `--out`:

- `results.md`: the environment, the issue-7 targets next to the measured values,
  one combined table per benchmark, and links to the plots;
- `results.json`: the raw rows (every round's time) and the environment;
- `summary.png`: step-time and compile-time ratios to hand-written JAX per size.

Usage:

    python benchmarks/run.py                 # everything at default settings
    python benchmarks/run.py --tiny          # smoke run (about a minute)
    python benchmarks/run.py --only step_overhead many_cells

`--tiny` runs every benchmark at its tiny size, concurrently and with most XLA
optimisations off (`JAX_DISABLE_MOST_OPTIMIZATIONS=1`): the timings of a tiny run
mean nothing; it checks that everything runs, is correct, and is reported. The exit
status is 1 if any benchmark failed (its correctness check, or a crash); the
others still run and `results.md` names the failure.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any


_HERE = Path(__file__).resolve().parent


@dataclasses.dataclass(frozen=True)
class Bench:
    title: str
    args: tuple[str, ...]  # default run
    tiny_args: tuple[str, ...]  # --tiny
    outputs: tuple[str, ...]  # files it writes into --out (plots first)


BENCHES: dict[str, Bench] = {
    "step_overhead": Bench(
        "Training-step overhead",
        ("--sizes", "small", "medium", "cnn"),
        ("--tiny", "--sizes", "tiny", "tiny_cnn", "--steps", "2"),
        ("step_overhead.png", "results_step_overhead.md"),
    ),
    "many_cells": Bench(
        "Many cells",
        (),
        ("--tiny",),
        ("many_cells.png", "results_many_cells.md"),
    ),
    "kv_cache": Bench(
        "KV-cache decoding",
        (),
        ("--tiny",),
        ("kv_cache.png", "results_kv_cache.md"),
    ),
    "scaling": Bench(
        "Data-parallel scaling",
        (),
        ("--tiny", "--devices", "1", "2"),
        ("scaling.png", "results_scaling.md"),
    ),
}

# The issue-7 targets: `× pure JAX` at most this much (value mode, ref mode).
TARGETS = {
    "small": ("small MLP-BN step (width 32, depth 2, batch 16)", 1.10, 1.25),
    "medium": ("medium MLP-BN step (width 512, depth 4, batch 256)", 1.02, 1.05),
    "cnn": ("small CNN-BN step (conv 3×3, 2 blocks, 8×8 inputs)", 1.10, 1.25),
}
COMPILE_TARGET = 1.2
# Many cells: the overhead's growth exponent between the two largest N must be below
# this to count as sub-linear (1 is linear; two noisy medians need a margin).
SUBLINEAR = 0.9
# Which step_overhead size stands for a target's size in a --tiny run.
TINY_SIZES = {"small": "tiny", "cnn": "tiny_cnn"}
ES = ("es_value", "es_ref")
ANCHORS = ("equinox", "nnx_jit", "nnx_split")


# ---------------------------------------------------------------------------------
# Running


def _child(name: str, json_path: str, argv: list[str]) -> None:
    """In the benchmark's own process: run its `main(argv)`, dump what it returns."""
    spec = importlib.util.spec_from_file_location(name, _HERE / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    t0 = time.perf_counter()
    result = module.main(argv)
    seconds = time.perf_counter() - t0
    import jax

    dev = jax.devices()[0]
    payload = {
        "result": result,
        "seconds": seconds,
        "backend": f"{jax.default_backend()} ({dev.device_kind}), "
        f"{jax.device_count()} device(s)",
    }
    Path(json_path).write_text(json.dumps(payload, default=_jsonable), "utf-8")


def _jsonable(x: Any) -> Any:
    if hasattr(x, "tolist"):  # numpy scalars and arrays
        return x.tolist()
    return str(x)


def run_all(
    names: Sequence[str], tiny: bool, out: Path, jobs: int
) -> dict[str, dict[str, Any]]:
    """Run the benchmarks `names`, at most `jobs` at a time; `{name: payload}`, a
    payload being `{"result", "seconds", "backend"}` or `{"error": log tail}`."""
    tmp = Path(tempfile.mkdtemp(prefix="eqx_state_bench_"))
    env = dict(os.environ)
    if tiny:
        # Halves a tiny run's time, most of which is compiling; it still checks
        # every variant's numbers (its timings mean nothing anyway).
        env["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "1"
    pending = list(names)
    running: dict[str, tuple[subprocess.Popen, Path, Any, float]] = {}
    done: dict[str, dict[str, Any]] = {}
    while pending or running:
        while pending and len(running) < jobs:
            name = pending.pop(0)
            bench = BENCHES[name]
            argv = [*(bench.tiny_args if tiny else bench.args), "--out", str(out)]
            cmd = [
                sys.executable,
                __file__,
                "--_child",
                name,
                str(tmp / f"{name}.json"),
            ]
            log = open(tmp / f"{name}.log", "w", encoding="utf-8")  # noqa: SIM115
            print(f"[run] {name}: {' '.join(argv)}", flush=True)
            proc = subprocess.Popen(
                [*cmd, *argv],
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=_HERE.parent,
                env=env,
            )
            running[name] = (proc, tmp / f"{name}.log", log, time.perf_counter())
        for name, (proc, log_path, log, t0) in list(running.items()):
            if proc.poll() is None:
                continue
            log.close()
            del running[name]
            wall = time.perf_counter() - t0
            if proc.returncode == 0:
                done[name] = json.loads((tmp / f"{name}.json").read_text("utf-8"))
                print(f"[run] {name}: done in {wall:.0f} s", flush=True)
            else:
                tail = log_path.read_text("utf-8").strip().splitlines()[-25:]
                done[name] = {"error": "\n".join(tail)}
                print(
                    f"[run] {name}: FAILED (exit {proc.returncode}) after "
                    f"{wall:.0f} s:\n" + "\n".join(tail),
                    flush=True,
                )
        time.sleep(0.2)
    return {name: done[name] for name in names}


def environment() -> dict[str, Any]:
    def version(pkg: str) -> str:
        try:
            return importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            return "-"

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=_HERE,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain"],
            cwd=_HERE,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        commit += " (with uncommitted changes)" if dirty else ""
    except (OSError, subprocess.CalledProcessError):
        commit = "-"
    packages = ("jax", "jaxlib", "equinox", "optax", "flax", "numpy", "eqx_state")
    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "packages": {p: version(p) for p in packages},
        "commit": commit,
    }


# ---------------------------------------------------------------------------------
# Rendering: one function per benchmark, `result -> Markdown lines`


def _fmt_ratio(x: float | None) -> str:
    return "-" if x is None or not math.isfinite(x) else f"{x:.2f}×"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    align = ["---"] + ["---:"] * (len(header) - 1)
    return [
        "| " + " | ".join(header) + " |",
        "|" + "|".join(align) + "|",
        *("| " + " | ".join(r) + " |" for r in rows),
    ]


def _variant_table(
    columns: dict[str, dict[str, dict[str, Any]]], cell: Callable[[dict], str]
) -> list[str]:
    """Variants as rows, one column per key of `columns` (`{column: {variant:
    row}}`), each cell `cell(row)` ("-" where the variant did not run)."""
    names: list[str] = []
    for rows in columns.values():
        names += [n for n in rows if n not in names]
    return _table(
        ["variant", *columns],
        [
            [n, *(cell(rows[n]) if n in rows else "-" for rows in columns.values())]
            for n in names
        ],
    )


def _time_cell(row: dict) -> str:
    return (
        f"{row['median_us']:.1f} ({row['min_us']:.0f}–{row['max_us']:.0f}), "
        f"{_fmt_ratio(row.get('ratio'))}"
    )


def compile_ratio(rows: dict[str, dict[str, Any]], name: str) -> float:
    return rows[name]["compile_s"] / rows["pure_jax"]["compile_s"]


def render_step_overhead(result: dict[str, Any]) -> list[str]:
    lines = [
        "µs per training step: median (min–max over rounds), × pure JAX (median of "
        "same-round ratios). Every variant was checked against the hand-written "
        "reference first. Details: `results_step_overhead.md`.",
        "",
    ]
    lines += _variant_table(result, _time_cell)
    return lines


def render_compile(result: dict[str, Any]) -> list[str]:
    lines = [
        "Wall time of the first call (trace + compile + one step), in seconds: the "
        "median over fresh instances (3 by default, 1 in a tiny run), and its ratio "
        "to pure JAX's at the same size. Expect ±10–20% from run to run on a "
        "loaded machine.",
        "",
    ]

    def cell_for(rows: dict[str, dict[str, Any]]) -> Callable[[dict], str]:
        base = rows["pure_jax"]["compile_s"]
        return lambda row: f"{row['compile_s']:.2f} ({row['compile_s'] / base:.2f}×)"

    names = list(next(iter(result.values())))
    lines += _table(
        ["variant", *result],
        [
            [
                n,
                *(
                    cell_for(rows)(rows[n]) if n in rows else "-"
                    for rows in result.values()
                ),
            ]
            for n in names
        ],
    )
    return lines


def render_many_cells(result: dict[str, Any]) -> list[str]:
    by_n = {int(n): rows for n, rows in result["by_n"].items()}
    ns = sorted(by_n)
    fits = result["fit"]
    lines = [
        "A deep residual MLP with N BatchNorms (3 state cells each). µs per "
        "step (× pure JAX), and the overhead over pure JAX (median of same-round "
        "differences) with its least-squares line a + b·N and growth exponent "
        f"between N = {ns[-2] if len(ns) > 1 else ns[-1]} and N = {ns[-1]} (below 1: "
        "sub-linear). Details: `results_many_cells.md`.",
        "",
    ]
    header = [
        "variant",
        *(f"N = {n}" for n in ns),
        *(f"overhead N = {n} (µs)" for n in ns),
        "b (µs/BN)",
        "exponent",
    ]
    rows = []
    for name in by_n[ns[0]]:
        f = fits[name]
        over = ["-"] * len(ns) if name == "pure_jax" else [f"{y:.1f}" for y in f["us"]]
        per_bn = f"{f['per_cell_us']:.2f}"
        exp = "-" if f["exponent"] is None else f"{f['exponent']:.2f}"
        if name == "pure_jax":
            per_bn += " (step time)"
        rows.append(
            [
                name,
                *(
                    f"{by_n[n][name]['median_us']:.0f} ({_fmt_ratio(by_n[n][name]['ratio'])})"
                    for n in ns
                ),
                *over,
                per_bn,
                exp,
            ]
        )
    return lines + _table(header, rows)


def render_kv_cache(result: dict[str, Any]) -> list[str]:
    lines = [
        "µs per decoded token: median (min–max), × the hand-written loop of the same "
        "kind (per token or scan); XLA extra MB per decode call (a cache copy shows "
        "here); peak MB while decoding. Details: `results_kv_cache.md`.",
        "",
    ]
    rows = []
    for name, row in result.items():
        peak = row.get("peak_mb")
        rows.append(
            [
                name,
                _time_cell(row),
                f"{row['xla_extra_mb']:.2f}" if "xla_extra_mb" in row else "-",
                "-" if peak is None else f"{peak:.1f}",
            ]
        )
    return lines + _table(
        ["variant", "µs/token, × hand-written", "XLA extra MB", "peak MB"], rows
    )


def render_scaling(result: dict[str, Any]) -> list[str]:
    import statistics

    lines = [
        "Medium MLP-BN step on a 1-D mesh of CPU devices sharing this machine's cores "
        "(measures the sharded program's cost, not parallel speed-up): steps/s "
        "(median, min–max), × pure JAX (median of same-round time ratios). Details: "
        "`results_scaling.md`.",
        "",
    ]
    rows = []
    for n, times in sorted(result.items(), key=lambda kv: int(kv[0])):
        base = times["pure_jax"]
        for name, ts in times.items():
            ratio = statistics.median(t / b for t, b in zip(ts, base, strict=True))
            rows.append(
                [
                    f"{n} × {name}",
                    f"{1 / statistics.median(ts):.1f} "
                    f"({1 / max(ts):.1f}–{1 / min(ts):.1f})",
                    _fmt_ratio(ratio),
                ]
            )
    return lines + _table(["devices × variant", "steps/s", "× pure JAX"], rows)


RENDER: dict[str, Callable[[Any], list[str]]] = {
    "step_overhead": render_step_overhead,
    "many_cells": render_many_cells,
    "kv_cache": render_kv_cache,
    "scaling": render_scaling,
}


def _target_size(size: str, tiny: bool) -> str | None:
    return TINY_SIZES.get(size) if tiny else size


def _mark(value: float | None, limit: float) -> str:
    if value is None or not math.isfinite(value):
        return "-"
    return f"{value:.2f}× {'✓' if value <= limit else '✗'}"


def render_targets(payloads: dict[str, dict[str, Any]], tiny: bool) -> list[str]:
    """The issue-7 targets, the measured values, and whether each is met."""
    steps = payloads.get("step_overhead", {}).get("result", {})
    lines = []
    if tiny:
        lines += [
            "**Tiny run:** the sizes below are the tiny stand-ins "
            f"({', '.join(f'{k} → {v}' for k, v in TINY_SIZES.items())}); the "
            "numbers only show that the report is complete.",
            "",
        ]
    rows = []
    for size, (label, v_max, r_max) in TARGETS.items():
        got = steps.get(_target_size(size, tiny) or "", {})

        def ratio(name: str, got=got) -> float | None:
            return got[name].get("ratio") if name in got else None

        rows.append(
            [
                label,
                f"≤ {v_max:.2f}×",
                _mark(ratio("es_value"), v_max),
                f"≤ {r_max:.2f}×",
                _mark(ratio("es_ref"), r_max),
                " / ".join(_fmt_ratio(ratio(a)) for a in ANCHORS),
            ]
        )

    def compile_ratios(name: str) -> dict[str, float]:
        return {
            size: compile_ratio(steps[s], name)
            for size in TARGETS
            if (s := _target_size(size, tiny)) in steps and name in steps[s]
        }

    compile_cells = []
    for mode in ES:
        per_size = compile_ratios(mode)
        detail = ", ".join(f"{k} {v:.2f}" for k, v in per_size.items())
        worst = max(per_size.values(), default=None)
        compile_cells.append(f"{_mark(worst, COMPILE_TARGET)} (worst of: {detail})")
    anchors_compile = [
        _fmt_ratio(max(compile_ratios(a).values(), default=None)) for a in ANCHORS
    ]
    rows.append(
        [
            "compile time (first call), worst size",
            f"≤ {COMPILE_TARGET:.1f}×",
            compile_cells[0],
            f"≤ {COMPILE_TARGET:.1f}×",
            compile_cells[1],
            " / ".join(anchors_compile),
        ]
    )
    cells = payloads.get("many_cells", {}).get("result")
    if cells is not None:
        fits = cells["fit"]

        def growth(name: str) -> str:
            if name not in fits:
                return "-"
            f = fits[name]
            exp = f["exponent"]
            verdict = "-" if exp is None else ("✓" if exp < SUBLINEAR else "✗")
            exp_s = "-" if exp is None else f"{exp:.2f}"
            return f"exponent {exp_s} {verdict}, {f['per_cell_us']:.2f} µs/BN"

        rows.append(
            [
                "many cells (up to "
                f"{max(int(n) for n in cells['by_n'])} BatchNorms): overhead growth",
                f"sub-linear (exponent < {SUBLINEAR})",
                growth("es_value"),
                f"sub-linear (exponent < {SUBLINEAR})",
                growth("es_ref"),
                " / ".join(
                    "-" if a not in fits else f"{fits[a]['per_cell_us']:.1f} µs/BN"
                    for a in ANCHORS
                ),
            ]
        )
    lines += _table(
        [
            "workload",
            "value-mode target",
            "value mode (es_value)",
            "ref-mode target",
            "ref mode (es_ref)",
            "Equinox / NNX jit / NNX split",
        ],
        rows,
    )
    lines += [
        "",
        "Ratios are `× pure JAX` (hand-written JAX, `jax.jit` with donation) measured "
        "in the same rounds; ✓ met, ✗ not met. Many cells: the growth exponent of "
        "the overhead over pure JAX between the two largest N (1 is linear) and the "
        "fitted cost per BatchNorm.",
    ]
    return lines


def markdown(
    payloads: dict[str, dict[str, Any]],
    env: dict[str, Any],
    command: str,
    tiny: bool,
    out: Path,
    seconds: float,
) -> str:
    pk = env["packages"]
    backends = sorted({p["backend"] for p in payloads.values() if "backend" in p})
    lines = [
        "# eqx_state benchmarks",
        "",
        f"`{command}` — {env['date']}, {seconds / 60:.1f} min in all.",
        "",
        "## Environment",
        "",
        f"- CPU: {env['cpu']}, {env['cpu_count']} cores; {env['platform']}",
        f"- JAX backend: {'; '.join(backends) or '-'}",
        "- "
        + ", ".join(f"{k} {v}" for k, v in pk.items())
        + f"; Python {env['python']}",
        f"- eqx_state commit: {env['commit']}",
        f"- load average before / after: {env['load_before']} / {env['load_after']}",
        "",
        "## Targets (issue 7)",
        "",
        *render_targets(payloads, tiny),
        "",
    ]
    steps = payloads.get("step_overhead", {}).get("result")
    for name, payload in payloads.items():
        bench = BENCHES[name]
        lines += [f"## {bench.title}", ""]
        bench_args = bench.tiny_args if tiny else bench.args
        if "error" in payload:
            lines += [
                "**FAILED.** The end of its output:",
                "",
                "```",
                payload["error"],
                "```",
                "",
            ]
            continue
        lines += [
            f"`{' '.join(['python', f'benchmarks/{name}.py', *bench_args])}`, "
            f"{payload['seconds']:.0f} s.",
            "",
            *RENDER[name](payload["result"]),
            "",
        ]
        plots = [p for p in bench.outputs if p.endswith(".png") and (out / p).exists()]
        lines += [f"![{p}]({p})" for p in plots]
        lines += [""] if plots else []
        if name == "step_overhead" and steps is not None:
            lines += ["## Compile time", "", *render_compile(steps), ""]
            if (out / "summary.png").exists():
                lines += ["![summary.png](summary.png)", ""]
    return "\n".join(lines)


def plot_summary(steps: dict[str, dict[str, dict[str, Any]]], path: Path) -> None:
    """Step-time and compile-time ratios to pure JAX, per size and variant."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    sizes = list(steps)
    names = [n for n in next(iter(steps.values())) if n != "pure_jax"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    width = 0.8 / len(names)
    for ax, (title, value) in zip(
        axes,
        [
            ("step time × pure JAX", lambda rows, n: rows[n]["ratio"]),
            ("compile time (first call) × pure JAX", compile_ratio),
        ],
        strict=True,
    ):
        for i, name in enumerate(names):
            ys = [value(steps[s], name) if name in steps[s] else np.nan for s in sizes]
            ax.bar(np.arange(len(sizes)) + i * width, ys, width, label=name)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks(np.arange(len(sizes)) + 0.4 - width / 2, sizes)
        ax.set_yscale("log")
        ax.set_title(title)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> dict[str, dict[str, Any]]:
    given = list(sys.argv[1:] if argv is None else argv)
    if given[:1] == ["--_child"]:
        _child(given[1], given[2], given[3:])
        return {}
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--only", nargs="+", choices=list(BENCHES), default=list(BENCHES)
    )
    parser.add_argument(
        "--tiny",
        action="store_true",
        help="every benchmark at its tiny size, all at once: a smoke run",
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=None,
        help="benchmarks run at once (default 1: timings must not overlap; "
        "--tiny: all)",
    )
    parser.add_argument("--out", type=Path, default=_HERE)
    parser.add_argument(
        "--render-only",
        action="store_true",
        help="run nothing: rewrite results.md and summary.png from --out's "
        "results.json (after changing how results are reported)",
    )
    args = parser.parse_args(given)
    jobs = args.jobs or (len(args.only) if args.tiny else 1)
    args.out.mkdir(parents=True, exist_ok=True)

    if args.render_only:
        saved = json.loads((args.out / "results.json").read_text("utf-8"))
        env, payloads = saved["environment"], saved["benchmarks"]
        given, seconds = saved["argv"], saved["seconds"]
        args.tiny = "--tiny" in given
    else:
        env = environment()
        env["load_before"] = _load()
        t0 = time.perf_counter()
        payloads = run_all(args.only, args.tiny, args.out.resolve(), jobs)
        seconds = time.perf_counter() - t0
        env["load_after"] = _load()

    steps = payloads.get("step_overhead", {}).get("result")
    if steps:
        plot_summary(steps, args.out / "summary.png")
    command = "python benchmarks/run.py " + " ".join(given)
    text = markdown(payloads, env, command.strip(), args.tiny, args.out, seconds)
    (args.out / "results.md").write_text(text, encoding="utf-8")
    (args.out / "results.json").write_text(
        json.dumps(
            {
                "environment": env,
                "argv": given,
                "seconds": seconds,
                "benchmarks": payloads,
            },
            indent=1,
        ),
        "utf-8",
    )
    print(text)
    failed = [n for n, p in payloads.items() if "error" in p]
    if failed:
        print(f"[run] failed: {', '.join(failed)}", file=sys.stderr)
        sys.exit(1)
    return payloads


def _load() -> str:
    try:
        return " ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "-"


if __name__ == "__main__":
    main()
