"""Train on several processes with JAX's distributed runtime; checkpoint, resume and
check the result against one process.

Every process runs the same program (`worker` below): it joins the others with
`jax.distributed.initialize`, builds one global mesh over all processes' devices and
runs `es.make_step(..., mesh=mesh, layout=LAYOUT)`. Each process loads only its own
rows of every batch (`es.process_slice`) and turns them into a global array
(`es.global_batch`). The model (`Linear -> BatchNorm -> ReLU -> Linear`, with a
running-loss and an accuracy metric kept as state) is split over the mesh's two axes:
the batch over `data`, the hidden layer over `model` (tensor parallel: the first
weight by rows, the second by columns, BatchNorm's parameters and running statistics
with their channel), and the first weight also over `data` (fully sharded). The
optimizer state follows its parameters. Orbax writes each process's shards.

`--processes N` runs the whole check on this machine: it starts N processes on
localhost (each with `--devices` CPU devices, joined through a free local port), and

1. trains `--steps` steps, saving a checkpoint after `--resume-at` steps and at the end;
2. starts N new processes that restore the middle checkpoint, train to the end and
   save: the result must equal the uninterrupted run bit for bit;
3. restores the checkpoints here, in one process, on a single device and on a
   `1 x 4` mesh (another layout of the same arrays): the values must be the saved ones
   bit for bit, and training on from the middle checkpoint on the `1 x 4` mesh must
   match;
4. trains the same model on one device with the whole batch: parameters, optimizer
   state, BatchNorm statistics and metrics must match the N-process run (to float
   tolerance: the sums over the batch are split differently).

It exits non-zero when a check fails, a process fails, or `--timeout` passes (every
process it started is stopped).

    python examples/train_multiprocess.py --processes 2

On a cluster, run one process per host with `--worker` (see docs/scaling.md):

    srun --nodes=2 --ntasks-per-node=1 python examples/train_multiprocess.py --worker --dir /shared/run
    python examples/train_multiprocess.py --worker --dir /shared/run \\
        --coordinator host0:1234 --num-processes 2 --process-id 0   # on host0; 1 on host1

Needs the `orbax` extra: `pip install eqx_state[orbax]`.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path


FEATURES, HIDDEN, CLASSES = 8, 16, 4


# -- starting processes on this machine (no JAX here) ----------------------------


class WorkerError(RuntimeError):
    """A process failed or the run timed out; the message holds its log."""


def free_port() -> int:
    """A TCP port that is free on localhost now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: Path, n: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:  # pragma: no cover
        return "<no log>"


def exit_with_launcher() -> None:
    """In a process started by `launch`: exit as soon as the launcher is gone (killed
    by a time limit, say), instead of waiting for peers that will never come."""
    launcher = os.environ.get("EQX_STATE_LAUNCHER_PID")
    if launcher is None:
        return

    def watch() -> None:
        while os.getppid() == int(launcher):
            time.sleep(0.2)
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


def launch(
    commands: list[list[str]],
    *,
    env: dict[str, str],
    timeout: float,
    log_dir: Path,
    cwd: str | None = None,
) -> list[str]:
    """Run `commands` (one per process) at once and wait for all of them.

    Each process writes its output to a log file in `log_dir`. If one exits with an
    error, the others are stopped at once and `WorkerError` shows its log (a process
    blocked waiting for a dead peer never hangs the launch); if `timeout` seconds
    pass, every process is stopped and `WorkerError` shows all logs. Every process
    started here is stopped before this returns or raises.

    **Returns:** the logs, in the order of `commands`.
    """
    log_dir.mkdir(parents=True, exist_ok=True)
    logs = [log_dir / f"process_{i}.log" for i in range(len(commands))]
    env = dict(env, EQX_STATE_LAUNCHER_PID=str(os.getpid()))
    procs: list[subprocess.Popen] = []
    try:
        for cmd, log in zip(commands, logs):
            with open(log, "wb") as f:
                # its own process group: stopping it stops what it started
                procs.append(
                    subprocess.Popen(
                        cmd,
                        env=env,
                        cwd=cwd,
                        stdout=f,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )
        deadline = time.monotonic() + timeout
        while True:
            codes = [p.poll() for p in procs]
            for i, code in enumerate(codes):
                if code not in (None, 0):
                    raise WorkerError(
                        f"process {i} exited with code {code}; its log:\n"
                        + _tail(logs[i])
                    )
            if all(code == 0 for code in codes):
                return [_tail(log, 1 << 20) for log in logs]
            if time.monotonic() > deadline:
                raise WorkerError(
                    f"timed out after {timeout:.0f} s; the logs:\n"
                    + "\n".join(
                        f"--- process {i}\n{_tail(p)}" for i, p in enumerate(logs)
                    )
                )
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:  # pragma: no cover - already gone
                    pass
                p.wait()


def cpu_env(devices: int) -> dict[str, str]:
    """The environment of a local process with `devices` CPU devices, importing this
    checkout's eqx_state."""
    root = str(Path(__file__).resolve().parent.parent)
    return dict(
        os.environ,
        XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
        JAX_PLATFORMS="cpu",
        PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]),
    )


# -- the model, the data and the training loop (the same in every process) --------


def build():
    """The model, the loss, the mesh-independent parts of the run."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import optax
    from jax.sharding import PartitionSpec as P

    import eqx_state as es
    from eqx_state import metrics as esm

    class Net(eqx.Module):
        l1: eqx.nn.Linear
        bn: es.nn.BatchNorm
        l2: eqx.nn.Linear
        metrics: esm.Metrics

        def __init__(self, key):
            k1, k2 = jax.random.split(key)
            self.l1 = eqx.nn.Linear(FEATURES, HIDDEN, use_bias=False, key=k1)
            self.bn = es.nn.BatchNorm(HIDDEN)
            self.l2 = eqx.nn.Linear(HIDDEN, CLASSES, key=k2)
            self.metrics = esm.Metrics(loss=esm.Mean(), accuracy=esm.Accuracy())

        def __call__(self, x):  # x: [batch, FEATURES]
            h = jax.nn.relu(self.bn(jax.vmap(self.l1)(x)))
            return jax.vmap(self.l2)(h)

    def loss_fn(model, x, y):
        logits = model(x)
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, y)
        # reduced over the global batch, whatever the number of processes
        model.metrics.update(loss=losses, accuracy=(logits, y))
        return jnp.mean(losses)

    # How the arrays are split over the mesh; everything else is replicated, and the
    # optimizer state follows its parameters.
    layout = [
        (r"l1\.weight$", P("model", "data")),  # tensor parallel + fully sharded
        (r"bn\.(weight|bias|running_mean|running_var)$", P("model")),  # per channel
        (r"l2\.weight$", P(None, "model")),  # tensor parallel (by columns)
    ]
    optimizer = optax.adam(1e-2)
    return Net, loss_fn, layout, optimizer


def make_data(steps: int, batch: int, seed: int = 0):
    """`steps` batches of a synthetic classification task (the same everywhere)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    x = rng.normal(size=(steps, batch, FEATURES)).astype(np.float32)
    teacher = rng.normal(size=(FEATURES, CLASSES)).astype(np.float32)
    y = np.argmax(x @ teacher + 0.5 * rng.normal(size=(steps, batch, CLASSES)), -1)
    return x, y.astype(np.int32)


def make_mesh(shape: tuple[int, int], devices=None):
    import jax
    from jax.sharding import AxisType

    # Auto axes: XLA places the collectives of the tensor-parallel matmuls
    auto = (AxisType.Auto,) * 2
    return jax.make_mesh(shape, ("data", "model"), axis_types=auto, devices=devices)


def train(step, model, opt_state, mesh, x, y, start, stop, manager=None, save_at=()):
    """Steps `start` to `stop` (exclusive), each process feeding its own rows; an
    Orbax checkpoint after the steps in `save_at`, written by every process (each
    its own shards)."""
    import orbax.checkpoint as ocp

    import eqx_state as es

    rows = es.process_slice(x.shape[1], mesh)
    for i in range(start, stop):
        batch = es.global_batch((x[i, rows], y[i, rows]), mesh)
        model, opt_state = step(model, opt_state, *batch)
        if i + 1 in save_at:
            state = es.to_orbax((model, opt_state))
            manager.save(i + 1, args=ocp.args.StandardSave(state))
    return model, opt_state


def restore(manager, at: int, like):
    import orbax.checkpoint as ocp

    import eqx_state as es

    target = es.orbax_target(like, manager.item_metadata(at))
    return es.from_orbax(
        manager.restore(at, args=ocp.args.StandardRestore(target)), like
    )


def manager_for(directory: Path):
    import orbax.checkpoint as ocp

    return ocp.CheckpointManager(
        directory.resolve(), item_handlers=ocp.StandardCheckpointHandler()
    )


def worker(a: argparse.Namespace) -> None:
    """One process of the run: the code a cluster runs on every host."""
    exit_with_launcher()  # started by `--processes`: stop if the launcher dies
    import jax

    # CPU collectives between processes (GPUs and TPUs have their own)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if a.coordinator:
        jax.distributed.initialize(
            coordinator_address=a.coordinator,
            num_processes=a.num_processes,
            process_id=a.process_id,
        )
    else:  # SLURM, Open MPI, Cloud TPU: found from the environment
        jax.distributed.initialize()

    import equinox as eqx

    import eqx_state as es

    Net, loss_fn, layout, optimizer = build()
    n = jax.device_count()
    model_axis = 2 if n % 2 == 0 else 1
    mesh = make_mesh((n // model_axis, model_axis))
    step = es.make_step(loss_fn, optimizer, mesh=mesh, layout=layout)
    x, y = make_data(a.steps, a.batch)
    root = Path(a.dir)

    def fresh():
        model = Net(jax.random.key(0))  # the same in every process
        return model, step.init(model)

    if a.phase == "train":
        model, opt_state = step.place(*fresh())
        start, manager = 0, manager_for(root / "train")
        save_at = (a.resume_at, a.steps)
    else:  # resume from the middle checkpoint of the first run
        like = step.place(*eqx.filter_eval_shape(fresh))  # abstract, with shardings
        with manager_for(root / "train") as saved:
            model, opt_state = restore(saved, a.resume_at, like)
        start, manager = a.resume_at, manager_for(root / "resume")
        save_at = (a.steps,)
    if a.mode == "ref":
        model = es.to_refs(model)  # the refs are made where the layout puts them
    with manager:
        model, opt_state = train(
            step, model, opt_state, mesh, x, y, start, a.steps, manager, save_at
        )
        manager.wait_until_finished()
    metrics = model.metrics.compute()
    print(
        f"process {jax.process_index()}/{jax.process_count()}: {a.phase} "
        f"steps {start}-{a.steps} on mesh {dict(mesh.shape)}, compiled "
        f"{step.trace_count}x; loss {float(metrics['loss']):.4f}, "
        f"accuracy {float(metrics['accuracy']):.3f}",
        flush=True,
    )
    jax.distributed.shutdown()


# -- the checks, in this process ---------------------------------------------------


def check(a: argparse.Namespace, root: Path) -> list[str]:
    """Compare the runs; returns the failures (empty: all good)."""
    import equinox as eqx
    import jax
    import numpy as np

    import eqx_state as es

    Net, loss_fn, layout, optimizer = build()
    x, y = make_data(a.steps, a.batch)
    failures: list[str] = []

    def leaves(tree):
        return [
            np.asarray(v)
            for v in jax.tree.leaves(es.freeze(tree))
            if isinstance(v, jax.Array)
        ]

    def compare(name, got, want, exact):
        for g, w in zip(leaves(got), leaves(want), strict=True):
            same = (
                np.array_equal(g, w)
                if exact
                else np.allclose(g, w, rtol=2e-4, atol=2e-5)
            )
            if not same:
                failures.append(f"{name}: max difference {np.max(np.abs(g - w)):.3g}")
                return
        print(f"ok  {name}")

    # one device, the whole batch: the reference
    single = es.make_step(loss_fn, optimizer)
    model = Net(jax.random.key(0))
    opt_state = single.init(model)
    for i in range(a.steps):
        model, opt_state = single(model, opt_state, x[i], y[i])
    reference = (model, opt_state)

    def fresh_on(step):  # an abstract model and optimizer state for `step`'s mesh
        def fresh():
            m = Net(jax.random.key(0))
            return m, step.init(m)

        return step.place(*eqx.filter_eval_shape(fresh))

    one_mesh = make_mesh((1, 1), jax.devices()[:1])  # one device
    like_one = fresh_on(es.make_step(loss_fn, optimizer, mesh=one_mesh, layout=layout))
    with (
        manager_for(root / "train") as train_m,
        manager_for(root / "resume") as resume_m,
    ):
        final = restore(train_m, a.steps, like_one)
        compare(
            "resumed run == uninterrupted run (bit for bit)",
            restore(resume_m, a.steps, like_one),
            final,
            True,
        )
        compare(
            f"{a.processes} processes == 1 device, whole batch", final, reference, False
        )
        middle = restore(train_m, a.resume_at, like_one)
        if jax.device_count() >= 4:
            mesh = make_mesh((1, 4))
            step = es.make_step(loss_fn, optimizer, mesh=mesh, layout=layout)
            model, opt_state = restore(train_m, a.resume_at, fresh_on(step))
            assert model.l1.weight.addressable_shards[0].data.shape == (4, FEATURES)
            compare(
                "restored on a 1x4 mesh == restored on 1 device (bit for bit)",
                (model, opt_state),
                middle,
                True,
            )
            model, opt_state = train(
                step, model, opt_state, mesh, x, y, a.resume_at, a.steps
            )
            compare(
                "resumed on a 1x4 mesh == 1 device, whole batch",
                (model, opt_state),
                reference,
                False,
            )
        else:
            print("(restores on a 1x4 mesh skipped: this process has 1 device)")
    return failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=2, help="local processes")
    parser.add_argument("--devices", type=int, default=2, help="CPU devices each")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--resume-at", type=int, default=3)
    parser.add_argument("--batch", type=int, default=16, help="global batch size")
    parser.add_argument("--mode", choices=["value", "ref"], default="value")
    parser.add_argument("--dir", help="checkpoint directory (shared by all hosts)")
    parser.add_argument(
        "--timeout", type=float, default=300.0, help="seconds per phase"
    )
    parser.add_argument("--worker", action="store_true", help="run one process")
    parser.add_argument("--phase", choices=["train", "resume"], default="train")
    parser.add_argument("--coordinator", help="host:port of process 0")
    parser.add_argument("--num-processes", type=int)
    parser.add_argument("--process-id", type=int)
    a = parser.parse_args(argv)
    if not 0 < a.resume_at < a.steps:
        parser.error("need 0 < --resume-at < --steps")
    if a.worker:
        if a.dir is None:
            parser.error("--worker needs --dir (a directory every host can reach)")
        worker(a)
        return 0

    # This process runs the checks with 4 CPU devices (for the 1 x 4 mesh); set
    # before JAX is imported.
    os.environ.update({k: cpu_env(4)[k] for k in ("XLA_FLAGS", "JAX_PLATFORMS")})
    directory = Path(a.dir or tempfile.mkdtemp(prefix="eqx_state_mp_"))
    script = str(Path(__file__).resolve())
    common = [
        "--worker",
        "--dir", str(directory),
        "--steps", str(a.steps),
        "--resume-at", str(a.resume_at),
        "--batch", str(a.batch),
        "--mode", a.mode,
        "--num-processes", str(a.processes),
    ]  # fmt: skip
    try:
        for phase in ("train", "resume"):
            address = f"127.0.0.1:{free_port()}"
            commands = [
                [sys.executable, script, *common, "--phase", phase]
                + ["--coordinator", address, "--process-id", str(i)]
                for i in range(a.processes)
            ]
            t = time.perf_counter()
            logs = launch(
                commands,
                env=cpu_env(a.devices),
                timeout=a.timeout,
                log_dir=directory / "logs" / phase,
            )
            for log in logs:
                print(*[ln for ln in log.splitlines() if ln.startswith("process ")])
            print(f"{phase}: {a.processes} processes, {time.perf_counter() - t:.1f} s")
        failures = check(a, directory)
    except WorkerError as e:
        print(e, file=sys.stderr)
        return 1
    finally:
        if a.dir is None:
            shutil.rmtree(directory, ignore_errors=True)
    for f in failures:
        print(f"MISMATCH  {f}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
