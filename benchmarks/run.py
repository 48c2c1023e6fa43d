"""Run every benchmark and gather the results in one report, with intervals.

Runs each benchmark in a fresh Python process (so that one benchmark's compiled
functions, caches and memory do not weigh on the next), one after the other, each
importing this checkout's `eqx_state`:

- `step_overhead.py` at every size (small and medium MLP, small CNN): step time and
  compile time of eqx_state against hand-written JAX and against Equinox and Flax
  NNX, each peer in its expert forms and in its default usage;
- `many_cells.py`: the overhead against the number of BatchNorms (1 to 100);
- `kv_cache.py`: KV-cache decoding, per token and in a scan, with memory;
- `scaling.py`: the data-parallel step on 1, 2 and 4 CPU devices, in one process
  and in two (JAX's distributed runtime on localhost);
- `lm.py`: training throughput of a small GPT with eqx_state, hand-written JAX,
  Equinox, Flax NNX and PyTorch, at a dispatch-bound and a compute-bound size.

Each writes its own `results_<name>.md` and PNG into `--out`. This script collects
what their `main()` returned and writes, also into `--out`:

- `results.md`: the environment, the targets of issues 7, 11, 16 and 19 next to the
  measured values, one section per benchmark, and what each variant is;
- `results.json`: the raw rows (every round's time) and the environment;
- `summary.png`: step-time ratios to hand-written JAX per size, with intervals.

With `--docs-root DIR` (by default the repository, for a full run into the default
`--out`), it also regenerates, from the same results, `DIR/docs/performance.md`,
the plots under `DIR/docs/img/bench_*.png`, and the block between the
`<!-- benchmarks:begin -->` / `<!-- benchmarks:end -->` markers of `DIR/README.md`.

Every ratio is recomputed here from the raw rounds (`bench_stats.py`): the median
over rounds of the same-round ratio, a bootstrap 95% interval, and the ratio of
the fastest rounds. A target is ✓ when its interval lies inside it, ✗ when it lies
outside, ? when it straddles the limit.

Usage:

    python benchmarks/run.py                 # everything at default settings
    python benchmarks/run.py --tiny --out /tmp/bench   # smoke run (about a minute)
    python benchmarks/run.py --only step_overhead many_cells
    python benchmarks/run.py --render-only   # rewrite the reports from results.json
    python benchmarks/run.py --only lm --merge   # rerun one, keep the others' results

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
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any


_HERE = Path(__file__).resolve().parent
_ROOT = _HERE.parent


def _sibling(name: str) -> Any:
    """The module `benchmarks/<name>.py`, loaded once."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, _HERE / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up there
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
    return sys.modules[name]


stats = _sibling("bench_stats")


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
        # A tiny run checks every variant in step_overhead (MLP and CNN); here a few
        # of each kind, enough for the growth fits and the targets' rows.
        (
            "--tiny",
            "--variants",
            "es_value",
            "es_ref",
            "es_value_again",
            "eqx_jit",
            "equinox",
            "nnx_jit_partial",
        ),
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
        ("--tiny", "--devices", "1", "2", "--multi", "2x1"),
        ("scaling.png", "results_scaling.md"),
    ),
    "lm": Bench(
        "Language model",
        (),
        # torch.compile takes minutes to compile on 2 cores: the tiny run leaves it
        # out (tests/bench/test_lm_bench.py runs it).
        ("--tiny", "--skip", "torch_compile"),
        ("lm.png", "results_lm.md"),
    ),
}

# ---------------------------------------------------------------------------------
# Targets

SIZES = {
    "small": "small MLP-BN step (width 32, depth 2, batch 16)",
    "medium": "medium MLP-BN step (width 512, depth 4, batch 256)",
    "cnn": "small CNN-BN step (conv 3×3, 2 blocks, 8×8 inputs)",
}
# Which step_overhead size stands for a target's size in a --tiny run.
TINY_SIZES = {"small": "tiny", "cnn": "tiny_cnn"}
ES = ("es_value", "es_ref")
# Issue 11: eqx_state against `jax.jit` on the same Equinox model with the statistics
# threaded by hand, everything donated; (value mode, ref mode) at most.
LIMIT = "eqx_jit"
ISSUE11 = {"small": (1.05, 1.10), "medium": (1.01, 1.02), "cnn": (1.01, 1.02)}
# Issue 19: the plain step within this of the fastest expert form of any peer.
ISSUE19 = 1.05
# Issue 16: step.scan with K = 100, per-step time against single-step pure JAX.
SCAN = "es_scan100"
ISSUE16_SMALL = 0.6
# Issue 7: against hand-written JAX; (value mode, ref mode) at most.
ISSUE7 = {"small": (1.10, 1.25), "medium": (1.02, 1.05), "cnn": (1.10, 1.25)}
COMPILE_TARGET = 1.2
# issue 23: ref mode against value mode (same rounds), its per-BatchNorm slope
# against value mode's, and the compile time at the most BatchNorms
ISSUE23_REF = 1.10
ISSUE23_VALUE = 1.05  # value mode against `eqx_jit`, at every size
# Issue 23's ratios are read from the blocking timings, whose calls are interleaved
# one by one: two programs that differ by 1 % are told apart there, while pipelined
# timings in blocks of steps differ by several % between two instances of one variant
# (step_overhead._time_blocking). Blocking also shows a per-call Python cost in full,
# where pipelining can hide it behind the previous step.
ISSUE23_HOW = (
    "verdict on the blocking timings, calls interleaved one by one; pipelined beside"
)
ISSUE23_SLOPE = 1.10
SUBLINEAR = 1.0  # many cells: the log-log growth exponent's interval below this
PEERS = ("Equinox", "Flax NNX")
EXPERT, DEFAULT = "expert", "default usage"
BEGIN, END = "<!-- benchmarks:begin -->", "<!-- benchmarks:end -->"


# ---------------------------------------------------------------------------------
# Running


def _child(name: str, json_path: str, argv: list[str]) -> None:
    """In the benchmark's own process: run its `main(argv)`, dump what it returns."""
    module = _sibling(name)
    t0 = time.perf_counter()
    result = module.main(argv)
    seconds = time.perf_counter() - t0
    import jax

    import eqx_state

    dev = jax.devices()[0]
    payload = {
        "result": result,
        "seconds": seconds,
        "backend": f"{jax.default_backend()} ({dev.device_kind}), "
        f"{jax.device_count()} device(s)",
        "eqx_state": str(Path(eqx_state.__file__).resolve().parent),
    }
    Path(json_path).write_text(json.dumps(payload, default=_jsonable), "utf-8")


def _jsonable(x: Any) -> Any:
    if hasattr(x, "tolist"):  # numpy scalars and arrays
        return x.tolist()
    return str(x)


def _positive(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text}")
    return n


def run_all(
    names: Sequence[str], tiny: bool, out: Path, jobs: int, rounds: int | None = None
) -> dict[str, dict[str, Any]]:
    """Run the benchmarks `names`, at most `jobs` at a time; `{name: payload}`, a
    payload being `{"result", "seconds", "backend", "eqx_state"}` or `{"error": log
    tail}`. `rounds`: passed to every benchmark as its `--rounds` (each takes
    one), or `None` for each one's default."""
    tmp = Path(tempfile.mkdtemp(prefix="eqx_state_bench_"))
    try:
        # The benchmarks measure this checkout's eqx_state, whatever else is installed.
        env = dict(
            os.environ,
            PYTHONPATH=os.pathsep.join(
                [str(_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
            ),
        )
        if tiny:
            # Halves a tiny run's time, most of which is compiling; it still checks
            # every variant's numbers (its timings mean nothing anyway).
            env["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "1"
        pending = list(names)
        running: dict[str, tuple[subprocess.Popen, Path, Any, float]] = {}
        done: dict[str, dict[str, Any]] = {}
        args_of: dict[str, list[str]] = {}
        while pending or running:
            while pending and len(running) < jobs:
                name = pending.pop(0)
                bench = BENCHES[name]
                shown = [*(bench.tiny_args if tiny else bench.args)]
                if rounds is not None:
                    shown += ["--rounds", str(rounds)]
                argv = [*shown, "--out", str(out)]
                args_of[name] = shown
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
                    cwd=_ROOT,
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
                    done[name]["args"] = args_of[name]  # the command line it ran with
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
    finally:  # the children's results and logs were read (a failure's tail kept)
        shutil.rmtree(tmp, ignore_errors=True)
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


def _load() -> str:
    try:
        return " ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "-"


# ---------------------------------------------------------------------------------
# Analysis: pure functions of the raw results (every round's time), so that the
# reports of `--render-only` are those of the run.


def variant_meta(row: dict[str, Any], name: str) -> dict[str, Any]:
    """What a variant is (`label`, `family`, `usage`, `form`, `source`): from its
    row, or for results written before rows carried it, from step_overhead.py."""
    keys = ("label", "family", "usage", "form", "source")
    if all(k in row for k in keys):
        return {k: row[k] for k in keys}
    try:
        cls = _sibling("step_overhead").VARIANTS[name]
        return {k: getattr(cls, k) for k in keys}
    except (KeyError, ImportError):
        return dict.fromkeys(keys, "-") | {"label": name}


def ratio(
    rows: dict[str, dict[str, Any]] | None,
    name: str,
    base: str = "pure_jax",
    prefix: str = "",
) -> dict[str, Any] | None:
    """`bench_stats.ratio_summary` of `name` against `base` from the same rounds
    (`prefix`: "" pipelined, "blocking_"), or None where either did not run."""
    key = prefix + "rounds_us"
    if not rows or name not in rows or base not in rows or key not in rows[name]:
        return None
    return stats.ratio_summary(rows[name][key], rows[base][key])


def fastest_expert(rows: dict[str, dict[str, Any]] | None) -> str | None:
    """The peer variant (Equinox or Flax NNX) in an expert form with the lowest
    median same-round ratio to pure JAX (pipelined), or None if none ran."""
    best, best_ratio = None, float("inf")
    for name in rows or {}:
        m = variant_meta(rows[name], name)  # type: ignore[index]
        if m["family"] in PEERS and m["usage"] == EXPERT:
            r = ratio(rows, name)
            if r is not None and r["median"] < best_ratio:
                best, best_ratio = name, r["median"]
    return best


def missing_experts(rows: dict[str, dict[str, Any]] | None) -> list[str]:
    """The peers' expert variants that step_overhead.py defines but that did not
    run here (an older run, or `--variants`)."""
    try:
        variants = _sibling("step_overhead").VARIANTS
    except ImportError:  # pragma: no cover - the script is next to this one
        return []
    return [
        n
        for n, cls in variants.items()
        if cls.family in PEERS and cls.usage == EXPERT and n not in (rows or {})
    ]


def _vs_fastest_cell(rows, name: str, limit: float) -> str:
    """`name` × the fastest expert peer form; when some expert forms did not run,
    ✓ becomes ? (a faster one might be missing; ✗ stands)."""
    best = fastest_expert(rows)
    if best is None:
        return "not measured"
    cell = _ratio_cell(ratio(rows, name, best), limit, f" (vs `{best}`)")
    missing = missing_experts(rows)
    if missing and " ✓ " in cell + " ":
        cell = cell.replace(" ✓", " ?", 1)
    if missing and not cell.startswith("not"):
        cell += f"; {len(missing)} expert form(s) not run"
    return cell


def step_rows(
    payloads: dict[str, dict[str, Any]], size: str, tiny: bool
) -> dict[str, dict[str, Any]] | None:
    """The step-overhead rows of a target size (its tiny stand-in in a tiny run)."""
    result = payloads.get("step_overhead", {}).get("result") or {}
    key = TINY_SIZES.get(size) if tiny else size
    return result.get(key) if key else None


def many_cells_rows(
    payloads: dict[str, dict[str, Any]],
) -> dict[int, dict[str, dict[str, Any]]] | None:
    result = payloads.get("many_cells", {}).get("result")
    if not result:
        return None
    return {int(n): rows for n, rows in result["by_n"].items()}


def _ratio_cell(s: dict[str, Any] | None, limit: float, note: str = "") -> str:
    if s is None:
        return "not measured"
    return f"{stats.fmt_ratio(s)} {stats.verdict(s['ci'], limit)}{note}"


def _blocking_cell(rows, name: str, base: str, limit: float) -> str:
    """`name` × `base` blocking (the verdict's) and pipelined (shown beside)."""
    blocking = ratio(rows, name, base, prefix="blocking_")
    if blocking is None:
        return "not measured"
    pipelined = ratio(rows, name, base)
    return (
        f"blocking: {_ratio_cell(blocking, limit)}; pipelined: "
        f"{stats.fmt_ratio(pipelined)}"
    )


def _slope_cell(f: dict[str, Any] | None, limit: float) -> str:
    if f is None:
        return "not measured"
    return (
        f"{stats.fmt_interval(f['slope'], f['slope_ci'], ' µs/BN')} "
        f"{stats.verdict(f['slope_ci'], limit)}"
    )


def _exponent_text(f: dict[str, Any]) -> str:
    if f["exponent"] is None:
        return "- (overhead ≤ 0 at some N)"
    return stats.fmt_interval(f["exponent"], f["exponent_ci"], "")


def _exponent_cell(f: dict[str, Any] | None, limit: float) -> str:
    if f is None:
        return "not measured"
    if f["exponent"] is None:
        return _exponent_text(f)
    return f"k = {_exponent_text(f)} {stats.verdict(f['exponent_ci'], limit)}"


def _growth(by_n, name: str, base: str) -> dict[str, Any] | None:
    """The growth of `name - base` over the N where both ran (None if < 2 N)."""
    if by_n is None:
        return None
    have = [n for n in sorted(by_n) if name in by_n[n] and base in by_n[n]]
    if len(have) < 2:
        return None
    return stats.growth(
        {n: (by_n[n][name]["rounds_us"], by_n[n][base]["rounds_us"]) for n in have}
    )


def targets(payloads: dict[str, dict[str, Any]], tiny: bool) -> list[list[str]]:
    """Rows `[issue, workload, measure, target, value mode, ref mode]`."""
    rows: list[list[str]] = []
    by_n = many_cells_rows(payloads)
    n_max = max(by_n) if by_n else None
    cells_label = f"many cells (1 to {n_max} BatchNorms)" if by_n else "many cells"

    for size, label in SIZES.items():
        got = step_rows(payloads, size, tiny)
        v_max, r_max = ISSUE11[size]
        rows.append(
            [
                "11",
                label,
                f"× `{LIMIT}` (jax.jit on the same Equinox model, statistics by "
                "hand, donated)",
                f"≤ {v_max:.2f}× / ≤ {r_max:.2f}×",
                _ratio_cell(ratio(got, "es_value", LIMIT), v_max),
                _ratio_cell(ratio(got, "es_ref", LIMIT), r_max),
            ]
        )
    rows.append(
        [
            "11",
            cells_label,
            f"growth of the overhead over `{LIMIT}`: slope b of (eqx_state − "
            f"{LIMIT}) against N",
            "b ≤ 0 µs/BN (grows no faster)",
            *(_slope_cell(_growth(by_n, es, LIMIT), 0.0) for es in ES),
        ]
    )
    for size, label in SIZES.items():
        got = step_rows(payloads, size, tiny)
        rows.append(
            [
                "19",
                label,
                "× the fastest expert form of any peer (same rounds)",
                f"≤ {ISSUE19:.2f}×",
                *(_vs_fastest_cell(got, es, ISSUE19) for es in ES),
            ]
        )
    got = step_rows(payloads, "small", tiny)
    rows.append(
        [
            "19",
            SIZES["small"],
            "`step.scan`, K = 100, per step × the fastest expert form of any peer",
            "< 1.00× (ahead)",
            _vs_fastest_cell(got, SCAN, 1.0) if got and SCAN in got else "not measured",
            "n/a",
        ]
    )
    rows.append(
        [
            "16",
            SIZES["small"],
            "`step.scan`, K = 100, per step × single-step pure JAX",
            f"≤ {ISSUE16_SMALL:.2f}×",
            _ratio_cell(ratio(got, SCAN), ISSUE16_SMALL),
            "n/a",
        ]
    )
    rows.append(
        [
            "16",
            cells_label,
            "`step.scan`, K = 100: slope b of (per-step time − single-step pure "
            "JAX) against N",
            "b ≤ 0 µs/BN (stops growing)",
            _slope_cell(_growth(by_n, SCAN, "pure_jax"), 0.0),
            "n/a",
        ]
    )
    for size, label in SIZES.items():
        got = step_rows(payloads, size, tiny)
        v_max, r_max = ISSUE7[size]
        rows.append(
            [
                "7",
                label,
                "× pure JAX (hand-written, jax.jit, donated)",
                f"≤ {v_max:.2f}× / ≤ {r_max:.2f}×",
                _ratio_cell(ratio(got, "es_value"), v_max),
                _ratio_cell(ratio(got, "es_ref"), r_max),
            ]
        )
    rows.append(
        [
            "7",
            "compile time (first call), every size",
            "× pure JAX's first call (same rounds)",
            f"≤ {COMPILE_TARGET:.1f}×",
            *(_compile_cell(payloads, es, tiny) for es in ES),
        ]
    )
    rows.append(
        [
            "7",
            cells_label,
            "growth exponent k of the overhead over pure JAX (log-log, all N)",
            f"k < {SUBLINEAR:.0f} (sub-linear)",
            *(_exponent_cell(_growth(by_n, es, "pure_jax"), SUBLINEAR) for es in ES),
        ]
    )
    # (a ratio, its limit, and which column it fills: value mode's or ref mode's)
    for what, name, base, limit, column in (
        ("ref mode × value mode", "es_ref", "es_value", ISSUE23_REF, 5),
        (f"value mode × `{LIMIT}`", "es_value", LIMIT, ISSUE23_VALUE, 4),
    ):
        for size, label in SIZES.items():
            cells = ["n/a", "n/a"]
            got = step_rows(payloads, size, tiny)
            cells[column - 4] = _blocking_cell(got, name, base, limit)
            rows.append(
                [
                    "23",
                    label,
                    f"{what} (same rounds; {ISSUE23_HOW})",
                    f"≤ {limit:.2f}×",
                    *cells,
                ]
            )
    value_b = _growth(by_n, "es_value", "pure_jax")
    rows.append(
        [
            "23",
            cells_label,
            "slope b of the overhead over pure JAX against N; for ref mode, also "
            "the slope of its same-round difference to value mode (paired, as "
            "every ratio here), which the verdict reads",
            f"ref's b ≤ {ISSUE23_SLOPE:.2f} × value's",
            "not measured"
            if value_b is None
            else stats.fmt_interval(value_b["slope"], value_b["slope_ci"], " µs/BN"),
            "not measured"
            if value_b is None
            else _ref_slope_cell(by_n, value_b["slope"]),
        ]
    )
    rows.append(
        [
            "23",
            f"compile time at {n_max} BatchNorms" if by_n else "compile time",
            "× pure JAX's first call (same rounds)",
            f"≤ {COMPILE_TARGET:.1f}×",
            *(_cells_compile_cell(by_n, n_max, es) for es in ES),
        ]
    )
    return rows


def _ref_slope_cell(by_n, value_slope: float) -> str:
    """Ref mode's slope over pure JAX, and the verdict on `b_ref ≤ ISSUE23_SLOPE ×
    b_value` read from the slope of the same-round difference ref − value (its
    interval is that of the paired difference, which the round-to-round load both
    share does not widen), against `(ISSUE23_SLOPE - 1) × b_value`."""
    ref_b = _growth(by_n, "es_ref", "pure_jax")
    diff = _growth(by_n, "es_ref", "es_value")
    if ref_b is None or diff is None:
        return "not measured"
    limit = (ISSUE23_SLOPE - 1) * value_slope
    control = _growth(by_n, "es_value_again", "es_value")
    return (
        f"{stats.fmt_interval(ref_b['slope'], ref_b['slope_ci'], ' µs/BN')}; "
        f"ref − value: {stats.fmt_interval(diff['slope'], diff['slope_ci'], ' µs/BN')}"
        f" (limit {limit:.2f}) {stats.verdict(diff['slope_ci'], limit)}"
        + (
            ""
            if control is None
            else "; A/A control (es_value, a second instance − es_value): "
            + stats.fmt_interval(control["slope"], control["slope_ci"], " µs/BN")
        )
    )


def _cells_compile_cell(by_n, n: int | None, name: str) -> str:
    """The many-cells benchmark's first-call ratio to pure JAX at `n` BatchNorms
    (fresh instances, paired by round)."""
    rows = None if by_n is None or n is None else by_n[n]
    if not rows or name not in rows or "compile_samples_s" not in rows[name]:
        return "not measured"
    return _ratio_cell(stats.compile_ratio(rows, name), COMPILE_TARGET)


def _compile_cell(payloads: dict[str, dict[str, Any]], name: str, tiny: bool) -> str:
    """The compile-time ratio at every size (first calls of fresh instances,
    paired by round), the worst one shown; ✓ only if every size's interval is
    inside the target."""
    per_size = {}
    for size in SIZES:
        got = step_rows(payloads, size, tiny)
        if got and name in got and "compile_samples_s" in got[name]:
            per_size[size] = stats.compile_ratio(got, name)
    if not per_size:
        return "not measured"
    marks = [stats.verdict(s["ci"], COMPILE_TARGET) for s in per_size.values()]
    mark = "✗" if "✗" in marks else "?" if "?" in marks or "-" in marks else "✓"
    worst = max(per_size, key=lambda k: per_size[k]["median"])
    others = ", ".join(
        f"{k} {s['median']:.2f}×" for k, s in per_size.items() if k != worst
    )
    return f"{worst} {stats.fmt_ratio(per_size[worst])} {mark}" + (
        f" ({others})" if others else ""
    )


# ---------------------------------------------------------------------------------
# Rendering


TARGETS_LEGEND = (
    "Each ratio is the median over rounds of the same-round ratio, with its "
    "bootstrap 95% interval in brackets. ✓: the interval lies inside the target; ✗: "
    "it lies outside; ?: it straddles the limit, or too few rounds gave no interval "
    "(the run cannot tell); not "
    "measured: the variant did not run (a `step.scan` row until `es.Step` has "
    "`scan`). Slopes b: least-squares line of the overhead against the number of "
    "BatchNorms N over all N, with a bootstrap interval (rounds resampled at every "
    "N); k: the log-log line's slope."
)


def render_targets(payloads: dict[str, dict[str, Any]], tiny: bool) -> list[str]:
    lines = []
    if tiny:
        lines += [
            "**Tiny run:** the sizes below are the tiny stand-ins "
            f"({', '.join(f'{k} → {v}' for k, v in TINY_SIZES.items())}); the "
            "numbers only show that the report is complete.",
            "",
        ]
    lines += stats.markdown_table(
        [
            "issue",
            "workload",
            "measure",
            "target (value / ref)",
            "value mode (es_value)",
            "ref mode (es_ref)",
        ],
        targets(payloads, tiny),
        left=4,
    )
    return lines + ["", TARGETS_LEGEND]


def _order(rows: dict[str, dict[str, Any]]) -> list[str]:
    """The reference, eqx_state, then each peer's expert forms before its default
    usage (the order of the rows, grouped)."""
    rank = {"reference": 0, "eqx_state": 1}

    def key(name: str) -> tuple:
        m = variant_meta(rows[name], name)
        fam = rank.get(
            m["usage"], 2 + (PEERS.index(m["family"]) if m["family"] in PEERS else 9)
        )
        return (fam, m["usage"] == DEFAULT)

    return sorted(rows, key=key)


def peers_table(
    step: dict[str, dict[str, dict[str, Any]]], prefix: str, *, only_with_expert: bool
) -> list[str]:
    """Every variant × pure JAX [95% CI] per size. With `only_with_expert`, a peer
    family's default usage is shown only at sizes where one of its expert forms ran
    too (no ratio against a peer's slow form without its fast form beside it)."""
    sizes = list(step)
    names: list[str] = []
    for rows in step.values():
        names += [n for n in _order(rows) if n not in names]
    out = []
    for name in names:
        cells = []
        for size in sizes:
            rows = step[size]
            if name not in rows:
                cells.append("-")
                continue
            m = variant_meta(rows[name], name)
            if only_with_expert and m["usage"] == DEFAULT:
                experts = [
                    n
                    for n in rows
                    if variant_meta(rows[n], n)["family"] == m["family"]
                    and variant_meta(rows[n], n)["usage"] == EXPERT
                ]
                if not experts:
                    cells.append("(no expert form measured)")
                    continue
            cells.append(stats.fmt_ratio(ratio(rows, name, prefix=prefix)))
        m = variant_meta(step[next(s for s in sizes if name in step[s])][name], name)
        out.append([f"`{name}`", m["family"], m["usage"], *cells])
    return stats.markdown_table(["variant", "family", "usage", *sizes], out, left=3)


def render_step_overhead(result: dict[str, Any]) -> list[str]:
    lines = [
        "Per training step, × pure JAX: the median over rounds of the same-round "
        "ratio [bootstrap 95% interval]. *Pipelined*: consecutive calls, one "
        "`block_until_ready` at the end (Python overlaps the previous step's "
        "execution); *blocking*: waiting for every step. Every variant was checked "
        "against the hand-written reference first. Per-size tables with µs, the "
        "fastest-round ratios and compile times: `results_step_overhead.md`.",
        "",
        "**Pipelined**",
        "",
        *peers_table(result, "", only_with_expert=False),
        "",
    ]
    if any(
        "blocking_rounds_us" in row for rows in result.values() for row in rows.values()
    ):
        lines += [
            "**Blocking every step**",
            "",
            *peers_table(result, "blocking_", only_with_expert=False),
            "",
        ]
    lines += [
        "**µs per step** (pipelined median; fastest round; blocking median)",
        "",
    ]
    names: list[str] = []
    for rows in result.values():
        names += [n for n in _order(rows) if n not in names]

    def cell(rows: dict[str, dict[str, Any]], n: str) -> str:
        if n not in rows:
            return "-"
        r = rows[n]
        blocking = r.get("blocking_median_us")
        return f"{r['median_us']:.1f}; {r['min_us']:.1f}; " + (
            "-" if blocking is None else f"{blocking:.1f}"
        )

    lines += stats.markdown_table(
        ["variant", *result],
        [[n, *(cell(rows, n) for rows in result.values())] for n in names],
    )
    return lines


def render_compile(result: dict[str, Any]) -> list[str]:
    lines = [
        "Wall time of the first call (trace + compile + one call), in seconds: the "
        "median over fresh instances (3 by default, 1 in a tiny run), and × pure "
        "JAX's first calls in the same rounds [bootstrap 95% interval].",
        "",
    ]
    names: list[str] = []
    for rows in result.values():
        names += [n for n in _order(rows) if n not in names]

    return lines + stats.markdown_table(
        ["variant", *result],
        [
            [n, *(stats.compile_cell(rows, n) for rows in result.values())]
            for n in names
        ],
    )


def render_many_cells(
    result: dict[str, Any], *, only_with_expert: bool = False
) -> list[str]:
    """With `only_with_expert`, a peer family's default usage is left out when none
    of its expert forms ran."""
    by_n = {int(n): rows for n, rows in result["by_n"].items()}
    ns = sorted(by_n)
    names: list[str] = []
    for n in ns:
        names += [v for v in _order(by_n[n]) if v not in names]
    if only_with_expert:
        meta = {
            v: variant_meta(next(by_n[n][v] for n in ns if v in by_n[n]), v)
            for v in names
        }
        with_expert = {m["family"] for m in meta.values() if m["usage"] == EXPERT}
        names = [
            v
            for v in names
            if meta[v]["usage"] != DEFAULT or meta[v]["family"] in with_expert
        ]
    lines = [
        "A deep residual MLP with N BatchNorms (3 state cells each). µs per step "
        "(pipelined median) and × pure JAX [bootstrap 95% interval]; then the "
        "overhead over pure JAX (median of same-round differences) per N, its "
        "least-squares slope b over all N and its log-log growth exponent k over "
        "all N, each with a bootstrap 95% interval. Details (blocking timings, "
        "compile times): `results_many_cells.md`.",
        "",
    ]

    def cell(n: int, name: str) -> str:
        rows = by_n[n]
        if name not in rows:
            return "-"
        return f"{rows[name]['median_us']:.0f} ({stats.fmt_ratio(ratio(rows, name))})"

    lines += stats.markdown_table(
        ["variant", *(f"N = {n}" for n in ns)],
        [[name, *(cell(n, name) for n in ns)] for name in names],
    )
    lines += ["", f"**Growth of the overhead** (N = {', '.join(map(str, ns))})", ""]
    growth_rows = []
    for name in names:
        base = "pure_jax"
        if name == "pure_jax":
            have = [n for n in ns if name in by_n[n]]
            f = stats.growth(
                {
                    n: (
                        by_n[n][name]["rounds_us"],
                        [0.0] * len(by_n[n][name]["rounds_us"]),
                    )
                    for n in have
                }
            )
            label = "pure_jax (its own step time)"
        else:
            f = _growth(by_n, name, base)
            label = name
        if f is None:
            growth_rows.append([label, "-", "-", "-"])
            continue
        growth_rows.append(
            [
                label,
                " / ".join(f"{y:.1f}" for y in f["diff"]),
                stats.fmt_interval(f["slope"], f["slope_ci"], " µs/BN"),
                _exponent_text(f),
            ]
        )
    for name in ES:
        f = _growth(by_n, name, LIMIT)
        if f is not None:
            growth_rows.append(
                [
                    f"{name} − {LIMIT}",
                    " / ".join(f"{y:.1f}" for y in f["diff"]),
                    stats.fmt_interval(f["slope"], f["slope_ci"], " µs/BN"),
                    _exponent_text(f),
                ]
            )
    lines += stats.markdown_table(
        ["variant", "overhead per N (µs)", "slope b [95% CI]", "exponent k [95% CI]"],
        growth_rows,
    )
    return lines


def _kv_base(name: str, row: dict[str, Any]) -> str:
    return row.get("baseline") or ("pure_jax_scan" if "scan" in name else "pure_jax")


def render_kv_cache(result: dict[str, Any]) -> list[str]:
    lines = [
        "µs per decoded token: median (min–max), × the hand-written loop of the same "
        "kind (per token or scan) [bootstrap 95% interval]; XLA extra MB per decode "
        "call (a cache copy shows here); peak MB while decoding. Details: "
        "`results_kv_cache.md`.",
        "",
    ]
    rows = []
    for name, row in result.items():
        peak = row.get("peak_mb")
        r = ratio(result, name, _kv_base(name, row))
        rows.append(
            [
                name,
                f"{row['median_us']:.1f} ({row['min_us']:.0f}–{row['max_us']:.0f}), "
                f"{stats.fmt_ratio(r)}",
                f"{row['xla_extra_mb']:.2f}" if "xla_extra_mb" in row else "-",
                "-" if peak is None else f"{peak:.1f}",
            ]
        )
    return lines + stats.markdown_table(
        ["variant", "µs/token, × hand-written", "XLA extra MB", "peak MB"], rows
    )


def render_scaling(result: dict[str, Any]) -> list[str]:
    import statistics

    lines = [
        "Medium MLP-BN step on a 1-D mesh of CPU devices sharing this machine's cores "
        "(measures the sharded program's cost, not parallel speed-up), in one process "
        "with N devices (`N`) or in P processes with N devices each (`PxN`, JAX's "
        "distributed runtime on localhost): steps/s (median, min–max), × pure JAX "
        "(median of same-round time ratios [bootstrap 95% interval]). Details and "
        "the bytes each step's collectives move: `results_scaling.md`.",
        "",
    ]
    rows = []

    def order(label: str) -> tuple:  # `N` rows first, then `PxN`
        return (label.count("x"), [int(v) for v in label.split("x")])

    for n, times in sorted(result.items(), key=lambda kv: order(kv[0])):
        base = times["pure_jax"]
        for name, ts in times.items():
            rows.append(
                [
                    f"{n} × {name}",
                    f"{1 / statistics.median(ts):.1f} "
                    f"({1 / max(ts):.1f}–{1 / min(ts):.1f})",
                    stats.fmt_ratio(stats.ratio_summary(ts, base)),
                ]
            )
    return lines + stats.markdown_table(
        ["devices × variant", "steps/s", "× pure JAX"], rows
    )


def render_lm(result: dict[str, Any], level: int = 3) -> list[str]:
    """lm.py's own tables (its `render`), from what its `main` returned."""
    return _sibling("lm").render(result, level=level)


RENDER: dict[str, Callable[[Any], list[str]]] = {
    "step_overhead": render_step_overhead,
    "many_cells": render_many_cells,
    "kv_cache": render_kv_cache,
    "scaling": render_scaling,
    "lm": render_lm,
}


def _all_variant_rows(payloads: dict[str, dict[str, Any]]) -> dict[str, dict]:
    """One row per step variant that ran anywhere (for what it is)."""
    found: dict[str, dict] = {}
    for rows in (payloads.get("step_overhead", {}).get("result") or {}).values():
        for n, r in rows.items():
            found.setdefault(n, r)
    for rows in (many_cells_rows(payloads) or {}).values():
        for n, r in rows.items():
            found.setdefault(n, r)
    return {n: found[n] for n in _order(found)}


def render_variants(payloads: dict[str, dict[str, Any]]) -> list[str]:
    rows = []
    for name, row in _all_variant_rows(payloads).items():
        m = variant_meta(row, name)
        rows.append(
            [f"`{name}`", m["family"], m["usage"], f"`{m['form']}`", m["source"]]
        )
    if not rows:
        return []
    return [
        "What each training-step variant is: the exact code form, and where its "
        "family's docs recommend it. *Expert*: the fastest form the family's docs "
        "recommend; *default usage*: the form their docs start from and most users "
        "write.",
        "",
        *stats.markdown_table(
            ["variant", "family", "usage", "exact form", "where recommended"], rows
        ),
    ]


def _provenance(env: dict[str, Any], payloads: dict[str, dict[str, Any]]) -> list[str]:
    pk = env["packages"]
    backends = sorted({p["backend"] for p in payloads.values() if "backend" in p})
    sources = sorted({p["eqx_state"] for p in payloads.values() if "eqx_state" in p})
    return [
        f"- CPU: {env['cpu']}, {env['cpu_count']} cores; {env['platform']}",
        f"- JAX backend: {'; '.join(backends) or '-'}",
        "- "
        + ", ".join(f"{k} {v}" for k, v in pk.items())
        + f"; Python {env['python']}",
        f"- eqx_state commit: {env['commit']}"
        + (f" (imported from {', '.join(sources)})" if sources else ""),
        f"- load average before / after: {env['load_before']} / {env['load_after']}",
        *(f"- merged later: {m}" for m in env.get("merged", [])),
    ]


def markdown(
    payloads: dict[str, dict[str, Any]],
    env: dict[str, Any],
    command: str,
    tiny: bool,
    out: Path,
    seconds: float,
) -> str:
    lines = [
        "# eqx_state benchmarks",
        "",
        f"`{command}` — {env['date']}, {seconds / 60:.1f} min in all.",
        "",
        "## Environment",
        "",
        *_provenance(env, payloads),
        "",
        "## Targets",
        "",
        *render_targets(payloads, tiny),
        "",
    ]
    steps = payloads.get("step_overhead", {}).get("result")
    for name, payload in payloads.items():
        bench = BENCHES[name]
        lines += [f"## {bench.title}", ""]
        bench_args = payload.get("args", bench.tiny_args if tiny else bench.args)
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
    variants = render_variants(payloads)
    if variants:
        lines += ["## Variants", "", *variants, ""]
    return "\n".join(lines)


def _missing_experts(payloads: dict[str, dict[str, Any]]) -> list[str]:
    """The peer families that ran at some size without any expert form."""
    missing = []
    for rows in (payloads.get("step_overhead", {}).get("result") or {}).values():
        for fam in PEERS:
            usages = {
                variant_meta(r, n)["usage"]
                for n, r in rows.items()
                if variant_meta(r, n)["family"] == fam
            }
            if usages and EXPERT not in usages and fam not in missing:
                missing.append(fam)
    return missing


def _caveats(payloads: dict[str, dict[str, Any]], env: dict[str, Any]) -> list[str]:
    notes = [env["note"]] if env.get("note") else []
    missing = _missing_experts(payloads)
    if missing:
        notes.append(
            f"This run predates the expert forms of {', '.join(missing)} (issue 19): "
            "their default usage is not shown here as a comparison; see "
            "`benchmarks/results.md` for every row."
        )
    load = env.get("load_before", "-")
    try:
        busy = max(float(x) for x in str(load).split()) > 0.5 * env["cpu_count"]
    except (ValueError, TypeError):
        busy = False
    if busy:
        notes.append(
            f"The machine was not quiet (load average {load} on {env['cpu_count']} "
            "cores): expect wide intervals, and trust the ✓/✗ marks over the "
            "medians."
        )
    return notes


def performance_page(
    payloads: dict[str, dict[str, Any]],
    env: dict[str, Any],
    command: str,
    tiny: bool,
    images: dict[str, str],
) -> str:
    """docs/performance.md, generated from the same results as results.md."""
    steps = payloads.get("step_overhead", {}).get("result") or {}
    lines = [
        "# Performance",
        "",
        "<!-- Generated by benchmarks/run.py from benchmarks/results.json: do not "
        "edit by hand; rerun `python benchmarks/run.py --render-only`. -->",
        "",
        "eqx_state's training step is measured side by side with hand-written JAX "
        "(`jax.jit` with donation on dicts and tuples: ratio 1.0) and with each peer "
        "written two ways: its **expert forms** (the fastest forms its own docs "
        "recommend, e.g. Equinox's low-overhead loop, Flax NNX's tree-mode "
        "`nnx.jit_partial` and functional loop) and its **default usage** (the form "
        "its docs start from). Every variant is first checked against the "
        "hand-written reference (losses, weights, running statistics); variants are "
        "timed in interleaved rounds, and every ratio is the median of same-round "
        "ratios with a bootstrap 95% interval. A target is ✓ only when its interval "
        "lies inside it.",
        "",
        f"From `{command}` on {env['date']}: {env['cpu']}, {env['cpu_count']} cores, "
        f"JAX {env['packages'].get('jax', '-')}; eqx_state commit {env['commit']}; "
        f"load average {env['load_before']} / {env['load_after']} (before / "
        "after). `benchmarks/results.md` has every table, `benchmarks/README.md` "
        "how to read and reproduce them.",
        "",
    ]
    merged = env.get("merged", [])
    if merged:  # a rerun benchmark's numbers are its own run's, not the date above
        lines += ["Rerun since, their tables replaced:", ""]
        lines += [f"- {m}" for m in merged] + [""]
    for note in _caveats(payloads, env):
        lines += ["!!! warning", "", f"    {note}", ""]
    if tiny:
        lines += [
            "!!! warning",
            "",
            "    A tiny smoke run: these numbers mean nothing.",
            "",
        ]
    lines += ["## Targets", "", *render_targets(payloads, tiny), ""]
    if steps:
        lines += [
            "## Against each peer, expert forms beside default usage",
            "",
            "Per training step, × pure JAX [95% interval], pipelined (consecutive "
            "calls, as a training loop runs). A peer's default usage appears only "
            "where one of its expert forms was measured too.",
            "",
            *peers_table(steps, "", only_with_expert=True),
            "",
        ]
        if "step_overhead" in images:
            lines += [f"![step overhead]({images['step_overhead']})", ""]
    by_n = many_cells_rows(payloads)
    if by_n:
        lines += [
            "## Many cells",
            "",
            "How the overhead over pure JAX grows with the number of BatchNorms N "
            "(a deep residual MLP, width 8): its least-squares slope b (µs per "
            "BatchNorm) and log-log exponent k over all N, with bootstrap 95% "
            "intervals.",
            "",
            *render_many_cells(payloads["many_cells"]["result"], only_with_expert=True)[
                2:
            ],
            "",
        ]
        if "many_cells" in images:
            lines += [f"![many cells]({images['many_cells']})", ""]
    for name, title in (
        ("kv_cache", "KV-cache decoding"),
        ("scaling", "Data-parallel scaling"),
    ):
        if name in images:
            lines += [f"## {title}", "", f"![{name}]({images[name]})", ""]
    lm = payloads.get("lm", {}).get("result")
    if lm:
        lines += [
            "## Language model",
            "",
            "Training throughput of one small GPT written in each library (the "
            "targets: `step` within 1.05× of hand-written JAX and ahead of every "
            "peer's fastest form at both sizes; `step.scan` ahead of everything at "
            "the dispatch-bound size). Its own run, from `benchmarks/lm.py`; where "
            "eqx_state's time goes (its call path, the Equinox model's pytree, the "
            "compiled program), measured: `benchmarks/README.md`, section `lm.py`.",
            "",
            *render_lm(lm),
            "",
        ]
        if "lm" in images:
            lines += [f"![language model]({images['lm']})", ""]
    variants = render_variants(payloads)
    if variants:
        lines += ["## What each variant is", "", *variants, ""]
    lines += [
        "## Reproduce",
        "",
        "```bash",
        'pip install -e ".[bench]"',
        "python benchmarks/run.py          # ~15 min on 2 cores; rewrites this page",
        "python benchmarks/run.py --tiny --out /tmp/bench   # smoke run",
        "```",
        "",
    ]
    return "\n".join(lines)


def readme_block(
    payloads: dict[str, dict[str, Any]], env: dict[str, Any], tiny: bool
) -> str:
    """The README's performance block: the targets, and where the rest is."""
    lines = [
        BEGIN,
        "<!-- Generated by benchmarks/run.py; do not edit by hand. -->",
        "",
        f"Measured by `python benchmarks/run.py` ({env['date'][:10]}, "
        f"{env['cpu']}, {env['cpu_count']} cores, commit {env['commit']}). Ratios: "
        "median of same-round ratios [bootstrap 95% interval]; ✓ only when the "
        "interval is inside the target, ? when the run cannot tell.",
        "",
        *stats.markdown_table(
            ["issue", "workload", "measure", "target", "value mode", "ref mode"],
            targets(payloads, tiny),
            left=4,
        ),
        "",
    ]
    for note in _caveats(payloads, env):
        lines += [f"> {note}", ""]
    lines += [
        "Every peer is measured in its expert forms beside its default usage: see "
        "[docs/performance.md](docs/performance.md) and `benchmarks/results.md`.",
        END,
    ]
    return "\n".join(lines)


def write_docs(
    root: Path,
    payloads: dict[str, dict[str, Any]],
    env: dict[str, Any],
    command: str,
    tiny: bool,
    out: Path,
) -> None:
    """Regenerate `root/docs/performance.md`, its plots under `root/docs/img/`, and
    the README's block between BEGIN and END (left alone if the README has no such
    block)."""
    img = root / "docs" / "img"
    img.mkdir(parents=True, exist_ok=True)
    images = {}
    for name in (
        "step_overhead",
        "many_cells",
        "kv_cache",
        "scaling",
        "lm",
        "summary",
    ):
        src = out / f"{name}.png"
        if src.exists() and (
            name == "summary" or "error" not in payloads.get(name, {})
        ):
            dst = img / f"bench_{name}.png"
            if src.resolve() != dst.resolve():
                shutil.copyfile(src, dst)
            images[name] = f"img/bench_{name}.png"
    if _missing_experts(payloads):
        # Those plots show every row, a peer's default usage without its expert forms
        # among them: left out until a run has both.
        images.pop("step_overhead", None)
        images.pop("many_cells", None)
    page = performance_page(payloads, env, command, tiny, images)
    (root / "docs" / "performance.md").write_text(page, encoding="utf-8")
    readme = root / "README.md"
    if readme.exists():
        text = readme.read_text(encoding="utf-8")
        pattern = re.compile(re.escape(BEGIN) + r".*?" + re.escape(END), re.S)
        if pattern.search(text):
            block = readme_block(payloads, env, tiny)
            readme.write_text(pattern.sub(lambda _: block, text), encoding="utf-8")


def plot_summary(steps: dict[str, dict[str, dict[str, Any]]], path: Path) -> None:
    """Per size: each variant's step time × pure JAX (median of same-round ratios)
    with its bootstrap 95% interval, pipelined; log scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    sizes = list(steps)
    names: list[str] = []
    for rows in steps.values():
        names += [n for n in _order(rows) if n not in names and n != "pure_jax"]
    fig, ax = plt.subplots(figsize=(max(8, 1.2 * len(names)), 4.5))
    width = 0.8 / len(sizes)
    for i, size in enumerate(sizes):
        mids, errs = [], []
        for n in names:
            r = ratio(steps[size], n)
            if r is None:
                mids.append(np.nan)
                errs.append((0.0, 0.0))
            else:
                lo, hi = r["ci"] or (r["median"], r["median"])
                mids.append(r["median"])
                errs.append((r["median"] - lo, hi - r["median"]))
        x = np.arange(len(names)) + i * width
        ax.bar(x, mids, width, yerr=np.array(errs).T, capsize=2, label=size)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(
        np.arange(len(names)) + 0.4 - width / 2, names, rotation=40, ha="right"
    )
    ax.set_yscale("log")
    ax.set_ylabel("step time × pure JAX (95% CI)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> dict[str, dict[str, Any]]:
    if str(_ROOT) not in sys.path:
        # Reports may load step_overhead.py (what older results' variants are),
        # which imports eqx_state: this checkout's, as the benchmarks themselves do.
        sys.path.insert(0, str(_ROOT))
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
    parser.add_argument(
        "--rounds",
        type=_positive,
        default=None,
        help="interleaved rounds of every benchmark run (default: each one's own; "
        "more rounds narrow the intervals of the targets that straddle a limit)",
    )
    parser.add_argument("--out", type=Path, default=_HERE)
    parser.add_argument(
        "--render-only",
        action="store_true",
        help="run nothing: rewrite the reports from --out's results.json (after "
        "changing how results are reported)",
    )
    parser.add_argument(
        "--docs-root",
        type=Path,
        default=None,
        help="also regenerate DIR/docs/performance.md, DIR/docs/img/bench_*.png and "
        "the README block of DIR (default: this repository when --out is the "
        "default folder and the run is not --tiny; else none)",
    )
    parser.add_argument(
        "--no-docs", action="store_true", help="never touch docs/ or the README"
    )
    parser.add_argument(
        "--merge",
        action="store_true",
        help="run only the --only benchmarks and put their results into --out's "
        "results.json in place of the old ones, keeping the others' (the "
        "environment and date stay the full run's; each merged benchmark is named "
        "in the environment section)",
    )
    parser.add_argument(
        "--note",
        default=None,
        help="a caveat printed at the top of docs/performance.md and in the README "
        "block (e.g. that the run predates a change of the core)",
    )
    args = parser.parse_args(given)
    jobs = args.jobs or (len(args.only) if args.tiny else 1)
    args.out.mkdir(parents=True, exist_ok=True)

    if args.render_only:
        saved = json.loads((args.out / "results.json").read_text("utf-8"))
        env, payloads = saved["environment"], saved["benchmarks"]
        run_argv, seconds = saved["argv"], saved["seconds"]
        args.tiny = "--tiny" in run_argv
    else:
        run_argv = given
        env = environment()
        env["load_before"] = _load()
        t0 = time.perf_counter()
        payloads = run_all(args.only, args.tiny, args.out.resolve(), jobs, args.rounds)
        seconds = time.perf_counter() - t0
        env["load_after"] = _load()
        if args.merge:
            saved = json.loads((args.out / "results.json").read_text("utf-8"))
            merged = [
                f"{name}: `python benchmarks/run.py {' '.join(given)}` on "
                f"{env['date']}, load average {env['load_before']} / "
                f"{env['load_after']}"
                for name in payloads
            ]
            payloads = {**saved["benchmarks"], **payloads}
            env = dict(saved["environment"])
            env["merged"] = [
                m for m in env.get("merged", []) if m.split(":", 1)[0] not in args.only
            ] + merged
            run_argv, seconds = saved["argv"], saved["seconds"]
            # The report is the saved run's (a merged benchmark names its own run).
            args.tiny = "--tiny" in run_argv

    steps = payloads.get("step_overhead", {}).get("result")
    if steps:
        plot_summary(steps, args.out / "summary.png")
    command = ("python benchmarks/run.py " + " ".join(run_argv)).strip()
    text = markdown(payloads, env, command, args.tiny, args.out, seconds)
    (args.out / "results.md").write_text(text, encoding="utf-8")
    if not args.render_only:
        (args.out / "results.json").write_text(
            json.dumps(
                {
                    "environment": env,
                    "argv": run_argv,
                    "seconds": seconds,
                    "benchmarks": payloads,
                },
                indent=1,
            ),
            "utf-8",
        )
    if args.note:
        env = dict(env, note=args.note)
    docs_root = args.docs_root
    if docs_root is None and not args.tiny and args.out.resolve() == _HERE:
        docs_root = _ROOT
    if docs_root is not None and not args.no_docs:
        write_docs(docs_root, payloads, env, command, args.tiny, args.out)
    print(text)
    failed = [n for n, p in payloads.items() if "error" in p]
    if failed:
        print(f"[run] failed: {', '.join(failed)}", file=sys.stderr)
        sys.exit(1)
    return payloads


if __name__ == "__main__":
    main()
