"""One process of the multi-process tests (started by tests/test_multiprocess.py,
two processes with two CPU devices each), and the model and data that the test
compares against in a single process.

    python tests/_multiprocess_worker.py --coordinator 127.0.0.1:PORT \\
        --num-processes 2 --process-id I --out DIR

Process 0 writes `DIR/<case>.npz`: every array of `es.freeze((model, opt_state))`
in flattening order (`leaf_<i>`), gathered from all processes, and the metrics
(`metric_<name>`). The checks that need the running processes (shardings of the
outputs, the compiled program's collectives, trace counts, errors) are asserted
here; a failed assertion fails the process, and so the test.
"""

from __future__ import annotations

import argparse
import re
import sys

import numpy as np


FEATURES, HIDDEN, CLASSES, BATCH = 6, 8, 4, 16
LR = 1e-2


def data(steps: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(steps, BATCH, FEATURES)).astype(np.float32)
    y = rng.integers(0, CLASSES, size=(steps, BATCH)).astype(np.int32)
    return x, y


def build():
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import optax

    import eqx_state as es
    from eqx_state import metrics as esm

    class Net(eqx.Module):
        l1: eqx.nn.Linear
        bn: es.nn.BatchNorm
        l2: eqx.nn.Linear
        steps: es.nn.Counter
        metrics: esm.Metrics

        def __init__(self, key):
            k1, k2 = jax.random.split(key)
            self.l1 = eqx.nn.Linear(FEATURES, HIDDEN, use_bias=False, key=k1)
            self.bn = es.nn.BatchNorm(HIDDEN)
            self.l2 = eqx.nn.Linear(HIDDEN, CLASSES, key=k2)
            self.steps = es.nn.Counter()
            self.metrics = esm.Metrics(loss=esm.Mean(), accuracy=esm.Accuracy())

        def __call__(self, x):
            return jax.vmap(self.l2)(jax.nn.relu(self.bn(jax.vmap(self.l1)(x))))

    def loss_fn(model, x, y):
        model.steps.increment()
        logits = model(x)
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, y)
        model.metrics.update(loss=losses, accuracy=(logits, y))
        return jnp.mean(losses)

    return Net, loss_fn, optax.adam(LR)


def tensor_parallel_layout():
    from jax.sharding import PartitionSpec as P

    return [
        (r"l1\.weight$", P("model", None)),
        (r"bn\.(weight|bias|running_mean|running_var)$", P("model")),
        (r"l2\.weight$", P(None, "model")),
    ]


def fsdp_layout(path, x):
    """Fully sharded: every matrix split over `data` on its first axis."""
    from jax.sharding import PartitionSpec as P

    return P("data") if x.ndim == 2 and x.shape[0] % 4 == 0 else None


def _launcher():
    """examples/train_multiprocess.py (its launcher part imports no JAX)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "examples" / "train_multiprocess.py"
    spec = importlib.util.spec_from_file_location("_mp_launcher", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--coordinator", required=True)
    p.add_argument("--num-processes", type=int, required=True)
    p.add_argument("--process-id", type=int, required=True)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    _launcher().exit_with_launcher()  # the test died: stop, do not wait for peers

    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=a.coordinator,
        num_processes=a.num_processes,
        process_id=a.process_id,
    )
    import pytest
    from jax.experimental import multihost_utils
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

    import eqx_state as es

    assert jax.process_count() == 2 and jax.device_count() == 4, jax.devices()
    Net, loss_fn, optimizer = build()
    x, y = data(5)

    def save(case, model, opt_state):
        arrays = [
            v
            for v in jax.tree.leaves(es.freeze((model, opt_state)))
            if isinstance(v, jax.Array)
        ]
        metrics = model.metrics.compute()
        gathered = multihost_utils.process_allgather((arrays, metrics), tiled=True)
        if jax.process_index() == 0:
            out = {f"leaf_{i}": np.asarray(v) for i, v in enumerate(gathered[0])}
            out.update({f"metric_{k}": np.asarray(v) for k, v in gathered[1].items()})
            np.savez(f"{a.out}/{case}.npz", **out)

    def batch(mesh, i, stop=None):
        rows = es.process_slice(BATCH, mesh)
        if stop is None:  # one step
            return es.global_batch((x[i, rows], y[i, rows]), mesh)
        return es.global_batch((x[i:stop, rows], y[i:stop, rows]), mesh, batch_axis=1)

    # -- data parallel, JAX's default (Explicit) mesh axes, both modes ------------
    mesh = jax.make_mesh((4,), ("data",))
    replicated = NamedSharding(mesh, P())
    for mode in ("value", "ref"):
        step = es.make_step(loss_fn, optimizer, mesh=mesh)
        model = Net(jax.random.key(0))
        if mode == "ref":
            model = es.to_refs(model, sharding=replicated)
        opt_state = step.init(model)
        for i in range(3):
            model, opt_state = step(model, opt_state, *batch(mesh, i))
        if mode == "value":
            loop = step.own(model, opt_state)  # the owned loop: same program
            loop(*batch(mesh, 3))
            model, opt_state = loop.release()
            # a process-local batch is refused, naming the helper
            rows = es.process_slice(BATCH, mesh)
            with pytest.raises(es.StepError, match=r"es\.global_batch"):
                step(model, opt_state, x[4, rows], y[4, rows])
        assert step.trace_count == 1, step.trace_count
        save(f"data_parallel_{mode}", model, opt_state)

    # `step.scan`: two steps in one call
    step = es.make_step(loss_fn, optimizer, mesh=mesh)
    model = Net(jax.random.key(0))
    opt_state = step.init(model)
    model, opt_state = step.scan(model, opt_state, *batch(mesh, 0, 2))
    save("scan", model, opt_state)

    # -- tensor parallel on a 2 x 2 mesh (Auto axes): data over processes -------
    mesh2 = jax.make_mesh((2, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    layout = tensor_parallel_layout()
    step = es.make_step(loss_fn, optimizer, mesh=mesh2, layout=layout)
    model = es.place(Net(jax.random.key(0)), mesh2, layout)
    opt_state = step.init(model)
    # the compiled program: no all-gather (no device assembles a sharded weight),
    # and each device's arguments are its shards
    compiled = step.lower(model, opt_state, *batch(mesh2, 0)).compile()
    hlo = compiled.as_text()
    assert not re.search(r"all-gather|all-to-all", hlo), "a weight is gathered"
    inputs = [
        v
        for v in jax.tree.leaves((model, opt_state, batch(mesh2, 0)))
        if isinstance(v, jax.Array) and v.size
    ]
    per_device = sum(v.addressable_shards[0].data.nbytes for v in inputs)
    full = sum(v.nbytes for v in inputs)
    got = compiled.memory_analysis().argument_size_in_bytes
    assert got == per_device < full, (got, per_device, full)
    for i in range(3):
        model, opt_state = step(model, opt_state, *batch(mesh2, i))
    assert step.trace_count == 1, step.trace_count
    # the outputs keep the layout, the optimizer state follows its parameters
    want = {
        "l1.weight": P("model", None),
        "bn.weight": P("model"),
        "bn.bias": P("model"),
        "bn.running_mean": P("model"),
        "bn.running_var": P("model"),
        "l2.weight": P(None, "model"),
    }
    for name, spec in want.items():
        leaf = model
        for part in name.split("."):
            leaf = getattr(leaf, part)
        leaf = leaf.value if es.is_state(leaf) else leaf
        assert leaf.sharding.spec == spec, (name, leaf.sharding)
        if not name.startswith("bn.running"):
            for moment in (opt_state[0].mu, opt_state[0].nu):
                m = moment
                for part in name.split("."):
                    m = getattr(m, part)
                assert m.sharding.spec == spec, (name, m.sharding)
    assert model.l1.weight.addressable_shards[0].data.shape == (HIDDEN // 2, FEATURES)
    assert model.l2.bias.sharding.is_fully_replicated
    assert opt_state[0].count.sharding.is_fully_replicated
    save("tensor_parallel", model, opt_state)

    # -- fully sharded data parallel: matrices split over the 4 devices ---------
    mesh_auto = jax.make_mesh((4,), ("data",), axis_types=(AxisType.Auto,))
    step = es.make_step(loss_fn, optimizer, mesh=mesh_auto, layout=fsdp_layout)
    model = es.place(Net(jax.random.key(0)), mesh_auto, fsdp_layout)
    opt_state = step.init(model)
    for i in range(3):
        model, opt_state = step(model, opt_state, *batch(mesh_auto, i))
    assert step.trace_count == 1
    for w in (model.l1.weight, opt_state[0].mu.l1.weight, opt_state[0].nu.l1.weight):
        assert w.addressable_shards[0].data.shape == (HIDDEN // 4, FEATURES), w.sharding
    save("fsdp", model, opt_state)
    print(f"process {jax.process_index()}: all checks passed", flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv[1:])
