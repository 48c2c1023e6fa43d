"""Multi-process training on JAX's distributed runtime: two processes on localhost,
two CPU devices each, joined by `jax.distributed.initialize` (gloo collectives).

The workers (tests/_multiprocess_worker.py) train with a global mesh, each process
feeding its own half of every batch; here, in one process on one device, the same
training runs on the whole batch — with `es.make_step` and as a hand-threaded pure
JAX loop (parameters, BatchNorm statistics, counter and metrics threaded by hand) —
and the results must agree. The processes are started by the launcher of
examples/train_multiprocess.py: free ports, a time limit, and a failing worker stops
the others at once and fails the test with its log.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _scripts import ROOT, load_script

import eqx_state as es


example = load_script("examples", "train_multiprocess", module_name="mp_example")
worker = load_script("tests", "_multiprocess_worker", module_name="mp_worker")

TIMEOUT = 240.0  # seconds; a healthy run takes ~10 s on two loaded cores


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Run the worker in two processes once; the `.npz` results by case."""
    out = tmp_path_factory.mktemp("multiprocess")
    address = f"127.0.0.1:{example.free_port()}"
    script = str(ROOT / "tests" / "_multiprocess_worker.py")
    commands = [
        [sys.executable, script, "--coordinator", address, "--num-processes", "2"]
        + ["--process-id", str(i), "--out", str(out)]
        for i in range(2)
    ]
    logs = example.launch(
        commands, env=example.cpu_env(2), timeout=TIMEOUT, log_dir=out / "logs"
    )
    for i, log in enumerate(logs):
        assert f"process {i}: all checks passed" in log, log[-3000:]
    return {p.stem: dict(np.load(p)) for p in out.glob("*.npz")}


def _single_device(steps: list, mode: str = "value"):
    """The same training on one device with the whole batch (`es.make_step`)."""
    Net, loss_fn, optimizer = worker.build()
    x, y = worker.data(5)
    step = es.make_step(loss_fn, optimizer)
    model = Net(jax.random.key(0))
    if mode == "ref":
        model = es.to_refs(model)
    opt_state = step.init(model)
    for i in steps:
        model, opt_state = step(model, opt_state, x[i], y[i])
    return model, opt_state


def _pure_jax(steps: list):
    """The same training, threaded by hand in pure JAX (no eqx_state): parameters,
    Adam, BatchNorm running statistics (PyTorch's rule: momentum 0.1, unbiased
    running variance), the step counter and the metrics' sums."""
    Net, _, _ = worker.build()
    x, y = worker.data(5)
    net = Net(jax.random.key(0))
    params = {
        "w1": net.l1.weight,
        "g": net.bn.weight,
        "b": net.bn.bias,
        "w2": net.l2.weight,
        "b2": net.l2.bias,
    }
    opt = optax.adam(worker.LR)
    opt_state = opt.init(params)
    mean, var = jnp.zeros(worker.HIDDEN), jnp.ones(worker.HIDDEN)
    loss_sum, correct, seen = 0.0, 0.0, 0

    def loss(p, x, y):
        h = x @ p["w1"].T
        mu, v = h.mean(0), h.var(0)
        h = (h - mu) / jnp.sqrt(v + 1e-5) * p["g"] + p["b"]
        logits = jax.nn.relu(h) @ p["w2"].T + p["b2"]
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, y)
        return losses.mean(), (mu, v, losses, logits)

    n = worker.BATCH
    for i in steps:
        (_, (mu, v, losses, logits)), g = jax.value_and_grad(loss, has_aux=True)(
            params, x[i], y[i]
        )
        updates, opt_state = opt.update(g, opt_state, params)
        params = optax.apply_updates(params, updates)
        mean = 0.9 * mean + 0.1 * mu
        var = 0.9 * var + 0.1 * v * n / (n - 1)
        loss_sum += float(losses.sum())
        correct += float((jnp.argmax(logits, -1) == y[i]).sum())
        seen += n
    return params, mean, var, len(steps), loss_sum / seen, correct / seen


def _leaves(model, opt_state) -> list[np.ndarray]:
    return [
        np.asarray(v)
        for v in jax.tree.leaves(es.freeze((model, opt_state)))
        if isinstance(v, jax.Array)
    ]


def _check(got: dict, model, opt_state, rtol=1e-4, atol=1e-5):
    want = _leaves(model, opt_state)
    assert len([k for k in got if k.startswith("leaf_")]) == len(want)
    for i, w in enumerate(want):
        np.testing.assert_allclose(
            got[f"leaf_{i}"], w, rtol=rtol, atol=atol, err_msg=f"leaf {i}"
        )
    metrics = model.metrics.compute()
    for k, v in metrics.items():
        np.testing.assert_allclose(got[f"metric_{k}"], np.asarray(v), rtol=rtol)


# Two real processes for every case (one fixture, ~25 s of CPU): with the slow cases
# (also in CI); the 4-device step on one process runs by default
# (tests/distributed/test_multidevice.py).
@pytest.mark.slow
@pytest.mark.parametrize(
    "case, steps, mode",
    [
        ("data_parallel_value", [0, 1, 2, 3], "value"),
        ("data_parallel_ref", [0, 1, 2], "ref"),
        ("scan", [0, 1], "value"),
        ("tensor_parallel", [0, 1, 2], "value"),
        ("fsdp", [0, 1, 2], "value"),
    ],
)
def test_two_processes_equal_one_device(results, case, steps, mode):
    """Parameters, Adam state, BatchNorm statistics, counter and metrics of the
    2-process run (each process feeding half of every batch) equal one device on
    the whole batch, with `es.make_step` ..."""
    model, opt_state = _single_device(steps, mode)
    _check(results[case], model, opt_state)
    assert int(es.freeze(model).steps.count[...]) == len(steps)


@pytest.mark.slow
@pytest.mark.parametrize("case, steps", [("data_parallel_value", 4), ("fsdp", 3)])
def test_two_processes_equal_pure_jax(results, case, steps):
    """... and a hand-threaded pure-JAX loop (independent of eqx_state)."""
    params, mean, var, count, mean_loss, accuracy = _pure_jax(list(range(steps)))
    got = results[case]
    model, opt_state = _single_device(list(range(steps)))
    # locate the leaves by position in the single-device model's flattening
    arrays = [
        (p, v)
        for p, v in jax.tree_util.tree_flatten_with_path(es.freeze(model))[0]
        if isinstance(v, jax.Array)
    ]
    by_name = {
        jax.tree_util.keystr(p): got[f"leaf_{i}"] for i, (p, _) in enumerate(arrays)
    }
    close = dict(rtol=2e-4, atol=2e-5)
    np.testing.assert_allclose(by_name[".l1.weight"], params["w1"], **close)
    np.testing.assert_allclose(by_name[".l2.weight"], params["w2"], **close)
    np.testing.assert_allclose(by_name[".bn.weight"], params["g"], **close)
    np.testing.assert_allclose(by_name[".bn.running_mean.value"], mean, **close)
    np.testing.assert_allclose(by_name[".bn.running_var.value"], var, **close)
    assert int(by_name[".bn.num_batches_tracked.value"]) == count
    assert int(by_name[".steps.count.value"]) == count
    np.testing.assert_allclose(got["metric_loss"], mean_loss, rtol=1e-5)
    np.testing.assert_allclose(got["metric_accuracy"], accuracy, rtol=1e-6)


@pytest.fixture(scope="module")
def example_run(tmp_path_factory):
    """`examples/train_multiprocess.py --processes 2 --mode ref`, once."""
    import subprocess

    pytest.importorskip("orbax.checkpoint")  # the `orbax` extra

    directory = tmp_path_factory.mktemp("example")
    args = ["--steps", "4", "--resume-at", "2", "--batch", "16"]
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "train_multiprocess.py")]
        + ["--processes", "2", "--mode", "ref", *args]
        + ["--dir", str(directory), "--timeout", str(TIMEOUT)],
        env=example.cpu_env(1),
        capture_output=True,
        text=True,
        timeout=3 * TIMEOUT,
    )
    return directory, args, result


@pytest.mark.slow
def test_example_trains_checkpoints_resumes_and_checks_itself(example_run):
    """`examples/train_multiprocess.py --processes 2`: tensor parallel + fully
    sharded on 2 x 2 devices over two processes, an Orbax checkpoint written by
    both processes (each its own shards), a bit-exact resume in new processes,
    restores on a 1 x 4 mesh and one device, and the check against one device."""
    directory, _, result = example_run
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-5000:]
    for line in [
        "resumed run == uninterrupted run (bit for bit)",
        "2 processes == 1 device, whole batch",
        "restored on a 1x4 mesh == restored on 1 device (bit for bit)",
        "resumed on a 1x4 mesh == 1 device, whole batch",
    ]:
        assert f"ok  {line}" in out, out[-5000:]
    # each process wrote its own shards of the checkpoint (the first weight is
    # split over the data axis, i.e. over the processes)
    saved = directory / "train" / "2" / "default"
    for i in range(2):
        data = list((saved / f"ocdbt.process_{i}" / "d").iterdir())
        assert data and all(f.stat().st_size > 0 for f in data), i


@pytest.mark.slow
def test_example_check_fails_on_a_mismatch(example_run, monkeypatch, capsys):
    """The example's check is not vacuous: run here (one device) on the same
    checkpoints it passes, and with a reference trained on other labels it fails."""
    directory, args, _ = example_run
    a = argparse.Namespace(steps=4, resume_at=2, batch=16, processes=2)
    assert example.check(a, directory) == []
    make_data = example.make_data

    def other_labels(steps, batch, seed=0):
        x, y = make_data(steps, batch, seed)
        return x, (y + 1) % example.CLASSES

    monkeypatch.setattr(example, "make_data", other_labels)
    failures = example.check(a, directory)
    assert failures and "2 processes == 1 device" in failures[0], failures


def _launch(tmp_path, codes: list[str], timeout: float):
    commands = [[sys.executable, "-c", c] for c in codes]
    return example.launch(
        commands,
        env=dict(os.environ),
        timeout=timeout,
        log_dir=tmp_path / "logs",
        cwd=str(tmp_path),
    )


SLEEPER = "import os, time; open('pid', 'w').write(str(os.getpid())); time.sleep(600)"


def test_a_dying_worker_fails_fast_with_its_log(tmp_path):
    """One process dies while the other would wait forever (as a process blocked in
    `jax.distributed.initialize` waits for a dead peer): the launch fails at once
    with the dead process's log, and the waiting process is stopped."""
    t = time.monotonic()
    with pytest.raises(example.WorkerError, match=r"(?s)process 1 exited.*boom"):
        _launch(
            tmp_path,
            [SLEEPER, "import sys, time; time.sleep(2); print('boom'); sys.exit(3)"],
            timeout=120,
        )
    assert time.monotonic() - t < 60
    _assert_stopped(tmp_path)


@pytest.mark.slow
def test_a_hanging_run_times_out(tmp_path):
    with pytest.raises(example.WorkerError, match="timed out"):
        _launch(tmp_path, [SLEEPER, "import time; time.sleep(1)"], timeout=3)
    _assert_stopped(tmp_path)


def _assert_stopped(tmp_path: Path) -> None:
    pid = int((tmp_path / "pid").read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_free_ports_differ():
    assert len({example.free_port() for _ in range(5)}) > 1


def test_process_local_helpers_in_one_process():
    """In one process, `process_slice` is the whole batch and `global_batch` a
    `device_put` with the batch sharded over the data axis."""
    mesh = jax.make_mesh((1,), ("data",))
    assert es.process_slice(8, mesh) == slice(0, 8)
    x = np.arange(16.0, dtype=np.float32).reshape(8, 2)
    g = es.global_batch({"x": x, "n": np.float32(3.0)}, mesh)
    np.testing.assert_array_equal(np.asarray(g["x"]), x)
    assert g["x"].sharding.spec == jax.P("data")
    assert g["n"].sharding.spec == jax.P()
    s = es.global_batch(np.zeros((3, 8, 2), np.float32), mesh, batch_axis=1)
    assert s.sharding.spec == jax.P(None, "data")
    with pytest.raises(ValueError, match="not 'batch'"):
        es.global_batch(x, mesh, data_axis="batch")


def test_layout_errors_name_the_path():
    mesh = jax.make_mesh((1,), ("model",))
    lin = eqx.nn.Linear(3, 4, key=jax.random.key(0))
    with pytest.raises(
        es.StepError, match=r"`weight` \(shape \(4, 3\)\).*more entries"
    ):
        es.place(lin, mesh, [(r"weight", jax.P("model", None, None))])
    with pytest.raises(es.StepError, match=r"no axis 'data'"):
        es.place(lin, mesh, [(r"bias", jax.P("data"))])
    with pytest.raises(TypeError, match=r"\(regex, PartitionSpec\)"):
        es.place(lin, mesh, [("weight",)])
    with pytest.raises(TypeError, match="PartitionSpec"):
        es.place(lin, mesh, lambda path, x: "model")
    with pytest.raises(ValueError, match="pass the mesh"):
        es.make_step(lambda m, x: 0.0, optax.sgd(0.1), layout=[])


@pytest.mark.parametrize("obj", [es.place, es.global_batch, es._step.Step.place])
def test_docstring_examples_run(obj):
    import inspect
    import re

    blocks = re.findall(r"```python\n(.*?)```", inspect.getdoc(obj) or "", re.S)
    assert blocks
    for block in blocks:
        exec(compile(block, f"<{obj.__qualname__}>", "exec"), {"__name__": "doc"})


@pytest.mark.slow
def test_workers_exit_when_the_launcher_is_killed(tmp_path):
    """A launcher killed from outside (a time limit) leaves no worker behind: each
    worker watches its launcher and exits when it is gone."""
    import signal
    import subprocess

    path = ROOT / "examples" / "train_multiprocess.py"
    load = (
        "import importlib.util as u; s = u.spec_from_file_location('m', "
        f"{str(path)!r}); m = u.module_from_spec(s); s.loader.exec_module(m)"
    )
    sleeper = (
        f"{load}; m.exit_with_launcher(); import os, time; "
        "open('pid', 'w').write(str(os.getpid())); time.sleep(600)"
    )
    launcher = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"{load}; from pathlib import Path; import os, sys; "
            f"m.launch([[sys.executable, '-c', {sleeper!r}]], env=dict(os.environ), "
            "timeout=600, log_dir=Path('logs'))",
        ],
        cwd=tmp_path,
    )
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "pid").exists():
            assert time.monotonic() < deadline and launcher.poll() is None
            time.sleep(0.05)
        time.sleep(0.1)
        pid = int((tmp_path / "pid").read_text())
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        deadline = time.monotonic() + 20
        while _alive(pid):
            assert time.monotonic() < deadline, "the worker outlived its launcher"
            time.sleep(0.1)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, exited but not yet reaped, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    except OSError:  # pragma: no cover - no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
    return stat.rsplit(")", 1)[1].split()[0] != "Z"
