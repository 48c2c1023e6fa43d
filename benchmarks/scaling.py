"""Data-parallel scaling: steps/s of a sharded training step on 1, 2 and 4 CPU devices,
in one process and in two (JAX's distributed runtime), and the bytes the step's
collectives move.

For each configuration fresh processes are started with
`XLA_FLAGS=--xla_force_host_platform_device_count=N` (set before JAX is imported):
one process with N devices (rows `1`, `2`, `4`), or P processes on localhost with N
devices each, joined by `jax.distributed.initialize` with gloo CPU collectives (rows
`PxN`: `2x1`, `2x2`), every process feeding its own rows of the batch
(`es.global_batch`). In each, the medium MLP-BatchNorm step (`Linear -> BatchNorm ->
ReLU` x depth, then `Linear(10)`, cross-entropy, Adam) runs three ways on a 1-D mesh
over the batch:

- `pure_jax`: hand-written JAX: parameters and BatchNorm statistics threaded by hand,
  `jax.jit` with `in_shardings` (batch sharded, the rest replicated) and donation;
- `es_value`: `es.make_step(..., mesh=mesh)` over an `eqx.Module` with
  `es.nn.BatchNorm`;
- `es_ref`: the same in ref mode.

They are checked first (same loss trajectory and BatchNorm statistics after a few
steps), then timed in interleaved rounds. Reported: median steps/s (min-max over
rounds), the median per-round ratio of step time to `pure_jax`, and the collective
payload per device per step: the summed result sizes of the all-reduce / all-gather
/ reduce-scatter / all-to-all / collective-permute ops of the compiled program. The
devices are CPU "devices" sharing this machine's cores, so steps/s measures the cost
of the sharded program and its collectives, not real parallel speed-up.

Run: `python benchmarks/scaling.py` (`--tiny` for a smoke run).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def collective_bytes(hlo: str) -> int:
    """The summed result sizes (bytes, per device) of the collectives in a compiled
    program's HLO text."""
    size = {"f64": 8, "s64": 8, "u64": 8, "f32": 4, "s32": 4, "u32": 4, "bf16": 2}
    size.update({"f16": 2, "s16": 2, "u16": 2, "s8": 1, "u8": 1, "pred": 1})
    op = re.compile(
        r"=\s*(\(.*?\)|\S+)\s+(all-reduce|all-gather|reduce-scatter|all-to-all|"
        r"collective-permute)(-start)?\("
    )
    total = 0
    for line in hlo.splitlines():
        m = op.search(line)
        if m is None:
            continue
        for dtype, dims in re.findall(r"([a-z]+\d*)\[([\d,]*)\]", m.group(1)):
            n = 1
            for d in filter(None, dims.split(",")):
                n *= int(d)
            total += n * size.get(dtype, 4)
    return total


def worker(
    n_devices: int,
    width: int,
    depth: int,
    batch: int,
    rounds: int,
    steps: int,
    coordinator: str | None = None,
    num_processes: int = 1,
    process_id: int = 0,
):
    import jax

    if num_processes > 1:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            coordinator_address=coordinator,
            num_processes=num_processes,
            process_id=process_id,
        )
    import equinox as eqx
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import NamedSharding, PartitionSpec as P

    import eqx_state as es

    assert jax.local_device_count() == n_devices, jax.devices()
    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    rep, shard = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    opt = optax.adam(1e-3)

    class MLP(eqx.Module):
        lins: list
        bns: list
        out: eqx.nn.Linear

        def __init__(self, key):
            keys = jax.random.split(key, depth + 1)
            self.lins = [eqx.nn.Linear(width, width, key=k) for k in keys[:-1]]
            self.bns = [es.nn.BatchNorm(width) for _ in range(depth)]
            self.out = eqx.nn.Linear(width, 10, key=keys[-1])

        def __call__(self, x):
            for lin, bn in zip(self.lins, self.bns):
                x = jax.nn.relu(bn(x @ lin.weight.T + lin.bias))
            return x @ self.out.weight.T + self.out.bias

    def loss_fn(model, x, y):
        return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()

    def pure_step(p, s, o, x, y):
        def loss(p):
            h, new = x, []
            for (w, b), (g, beta), (rm, rv, n) in zip(p["lins"], p["bns"], s):
                h = h @ w.T + b
                mean = h.mean(0)
                var = ((h - mean) ** 2).mean(0)
                new.append(
                    (
                        0.9 * rm + 0.1 * mean,
                        0.9 * rv + 0.1 * var * batch / (batch - 1),
                        n + 1,
                    )
                )
                h = jax.nn.relu((h - mean) * jax.lax.rsqrt(var + 1e-5) * g + beta)
            logits = h @ p["out"][0].T + p["out"][1]
            return optax.softmax_cross_entropy_with_integer_labels(
                logits, y
            ).mean(), new

        (value, new), g = jax.value_and_grad(loss, has_aux=True)(p)
        u, o = opt.update(g, o, p)
        return optax.apply_updates(p, u), new, o, value

    pure = jax.jit(
        pure_step,
        in_shardings=(rep, rep, rep, shard, shard),
        out_shardings=rep,
        donate_argnums=(0, 1, 2),
    )
    key = jax.random.key(0)
    rows = es.process_slice(batch, mesh)  # this process's rows of the batch
    x = np.asarray(jax.random.normal(key, (batch, width)))[rows]
    y = np.asarray(jax.random.randint(key, (batch,), 0, 10))[rows]
    x, y = es.global_batch((x, y), mesh)

    def local(a):  # a replicated global array, read here
        return np.asarray(a.addressable_shards[0].data)

    def fresh_pure():
        m = MLP(key)
        p = {
            "lins": [(jnp.copy(lin.weight), jnp.copy(lin.bias)) for lin in m.lins],
            "bns": [(jnp.copy(bn.weight), jnp.copy(bn.bias)) for bn in m.bns],
            "out": (jnp.copy(m.out.weight), jnp.copy(m.out.bias)),
        }
        s = [
            (jnp.zeros(width), jnp.ones(width), jnp.zeros((), jnp.int32))
            for _ in range(depth)
        ]
        p, s = jax.device_put((p, s), rep)
        return [p, s, jax.device_put(opt.init(p), rep)]

    def fresh_es(ref):
        m = MLP(key)
        m = es.to_refs(m, sharding=rep) if ref else m
        step = es.make_step(loss_fn, opt, mesh=mesh)
        return step, [m, step.init(m)]

    # correctness first
    st = fresh_pure()
    es_steps = {name: fresh_es(name == "es_ref") for name in ("es_value", "es_ref")}
    for _ in range(3):
        st[0], st[1], st[2], _ = pure(*st, x, y)
        for step, s in es_steps.values():
            s[0], s[1] = step(s[0], s[1], x, y)
    for _, s in es_steps.values():
        np.testing.assert_allclose(
            local(s[0].bns[0].running_var[...]),
            local(st[1][0][1]),
            rtol=1e-4,
            atol=1e-5,
        )
        np.testing.assert_allclose(
            local(s[0].out.weight),
            local(st[0]["out"][0]),
            rtol=1e-4,
            atol=1e-5,
        )
    # what the collectives of each compiled step move per device
    moved = {"pure_jax": collective_bytes(pure.lower(*st, x, y).compile().as_text())}
    for name, (step, s) in es_steps.items():
        moved[name] = collective_bytes(step.lower(s[0], s[1], x, y).compile().as_text())

    times: dict[str, list[float]] = {"pure_jax": [], "es_value": [], "es_ref": []}

    def run_pure():
        for _ in range(steps):
            st[0], st[1], st[2], _ = pure(*st, x, y)
        jax.block_until_ready(st[0])

    def run_es(name):
        step, s = es_steps[name]
        for _ in range(steps):
            s[0], s[1] = step(s[0], s[1], x, y)
        jax.block_until_ready(s[1])

    runners = {
        "pure_jax": run_pure,
        "es_value": lambda: run_es("es_value"),
        "es_ref": lambda: run_es("es_ref"),
    }
    order = list(runners)
    for r in range(rounds):
        for name in order[r % 3 :] + order[: r % 3]:
            t = time.perf_counter()
            runners[name]()
            times[name].append((time.perf_counter() - t) / steps)
    if jax.process_index() == 0:
        print(json.dumps({"devices": n_devices, "times": times, "bytes": moved}))
    if num_processes > 1:
        jax.distributed.shutdown()


def _launcher():
    """`launch` and `free_port` of examples/train_multiprocess.py (stdlib only)."""
    import importlib.util

    path = Path(__file__).resolve().parent.parent / "examples" / "train_multiprocess.py"
    spec = importlib.util.spec_from_file_location("_mp_launcher", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_config(label: str, a: argparse.Namespace) -> dict:
    """One row group: `"N"` (one process, N devices) or `"PxN"` (P processes on
    localhost, N devices each). Returns the worker's JSON (process 0's)."""
    processes, devices = (
        (int(v) for v in label.split("x"))
        if "x" in label
        else (
            1,
            int(label),
        )
    )
    # The workers import this checkout's eqx_state (not another installed copy).
    root = str(Path(__file__).resolve().parent.parent)
    env = dict(
        os.environ,
        XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
        JAX_PLATFORMS="cpu",
        PYTHONPATH=os.pathsep.join([root, *sys.path]),
    )
    cmd = [sys.executable, __file__, "--worker", str(devices)]
    cmd += ["--width", str(a.width), "--depth", str(a.depth), "--batch", str(a.batch)]
    cmd += ["--rounds", str(a.rounds), "--steps", str(a.steps)]
    if processes == 1:
        out = subprocess.run(
            cmd, env=env, check=True, capture_output=True, text=True
        ).stdout
    else:
        mp = _launcher()
        address = f"127.0.0.1:{mp.free_port()}"
        commands = [
            cmd
            + ["--coordinator", address, "--num-processes", str(processes)]
            + ["--process-id", str(i)]
            for i in range(processes)
        ]
        with tempfile.TemporaryDirectory() as logs:
            out = mp.launch(commands, env=env, timeout=a.timeout, log_dir=Path(logs))[0]
    return json.loads([ln for ln in out.strip().splitlines() if ln.startswith("{")][-1])


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--devices", type=int, nargs="+", default=[1, 2, 4], help="one process"
    )
    parser.add_argument(
        "--multi",
        nargs="*",
        default=["2x1", "2x2"],
        help="PxN: P processes on localhost with N devices each",
    )
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--timeout", type=float, default=1200.0)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent)
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--coordinator", help=argparse.SUPPRESS)
    parser.add_argument("--num-processes", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--process-id", type=int, default=0, help=argparse.SUPPRESS)
    a = parser.parse_args(argv)
    if a.tiny:
        a.width, a.depth, a.batch, a.rounds, a.steps = 16, 1, 16, 2, 3
    if a.worker:
        worker(
            a.worker,
            a.width,
            a.depth,
            a.batch,
            a.rounds,
            a.steps,
            a.coordinator,
            a.num_processes,
            a.process_id,
        )
        return {}
    results, moved = {}, {}
    for label in [str(n) for n in a.devices] + list(a.multi):
        got = run_config(label, a)
        results[label], moved[label] = got["times"], got["bytes"]
    params = 4 * (a.depth * (a.width * a.width + 3 * a.width) + 10 * a.width + 10)
    lines = [
        f"Scaling: width {a.width}, depth {a.depth}, global batch {a.batch}; "
        f"{a.rounds} rounds x {a.steps} steps (CPU devices share the machine's cores). "
        "Rows `N`: one process with N devices; `PxN`: P processes (JAX's distributed "
        "runtime on localhost, gloo collectives) with N devices each.",
        "",
        "| processes x devices | variant | steps/s (median) | min-max | ratio to pure JAX "
        "| collective bytes / step / device |",
        "|---|---|---|---|---|---|",
    ]
    for label, times in results.items():
        for name, ts in times.items():
            ratios = [t / p for t, p in zip(ts, times["pure_jax"])]
            lines.append(
                f"| {label} | {name} | {1 / statistics.median(ts):.1f} | "
                f"{1 / max(ts):.1f}-{1 / min(ts):.1f} | {statistics.median(ratios):.3f} "
                f"| {moved[label][name]:,} |"
            )
    lines += [
        "",
        f"Parameters: {params:,} bytes. The data-parallel step all-reduces its "
        "gradients (one parameter-sized payload), the BatchNorm batch statistics "
        "(2 x width per layer, forward and backward) and the loss; with a ring "
        "all-reduce each device sends and receives about 2(n-1)/n times that payload "
        "per step, so per-device traffic stays flat as hosts are added while the "
        "number of sequential hops grows with n. The payload is the same with one or "
        "two processes: the program is the same, only the transport differs (shared "
        "memory within a process, gloo over TCP between them).",
    ]
    table = "\n".join(lines)
    print(table)
    if not a.tiny:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "results_scaling.md").write_text(table + "\n")
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt

            fig, ax = plt.subplots(figsize=(6, 3.5))
            for name in ("pure_jax", "es_value", "es_ref"):
                ax.plot(
                    list(results),
                    [1 / statistics.median(results[n][name]) for n in results],
                    marker="o",
                    label=name,
                )
            ax.set_xlabel("CPU devices (N) / processes x devices each (PxN)")
            ax.set_ylabel("steps/s (median)")
            ax.legend()
            fig.tight_layout()
            fig.savefig(a.out / "scaling.png", dpi=120)
        except ImportError:
            pass
    return results


if __name__ == "__main__":
    main()
