"""Recorders on a 4-device mesh: a data-parallel step (`make_step(mesh=...)`)
records the statistics of the global batch — equal to the same steps on one device
and to float64 NumPy — in both modes; per-device recording inside `shard_map`
merges across the devices (`axis_name`, `Record.reduce`); a capture holds the global
batch; and with recording off the sharded step is the recorder-free program."""

import pathlib
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P


sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "nn"))

from test_record_program import _program  # noqa: E402

import eqx_state as es  # noqa: E402


STATS = ("mean", "std", "rms", "max_abs", "zero_fraction", "dead_fraction")
BATCH = 16


class Net(eqx.Module):
    l1: eqx.nn.Linear
    l2: eqx.nn.Linear
    rec: es.nn.Record
    cap: es.nn.Capture

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.l1 = eqx.nn.Linear(5, 8, key=k1)
        self.l2 = eqx.nn.Linear(8, 1, key=k2)
        self.rec = es.nn.Record(*STATS, hist=es.metrics.Histogram(6, range=(0, 3)))
        self.cap = es.nn.Capture((BATCH, 8))

    def hidden(self, x):
        return jax.nn.relu(jax.vmap(self.l1)(x))

    def __call__(self, x):
        return jax.vmap(self.l2)(self.cap(self.rec(self.hidden(x))))


def loss_fn(model, x, y):
    return jnp.mean((model(x)[:, 0] - y) ** 2)


def _data(n=3):
    kx, ky = jax.random.split(jax.random.key(1))
    return (
        jax.random.normal(kx, (n, BATCH, 5)),
        jax.random.normal(ky, (n, BATCH)),
    )


@pytest.mark.parametrize("mode", ["value", "ref"])
def test_data_parallel_step_records_the_global_batch(mesh, mode):
    xs, ys = _data()
    single_dev = jax.devices()[0]
    hidden = []

    def run(step, on_mesh):
        model = Net(jax.random.key(0))
        if mode == "ref":
            rep = NamedSharding(mesh, P())
            model = es.to_refs(model, sharding=rep if on_mesh else None)
        opt_state = step.init(model)
        for x, y in zip(xs, ys):
            if not on_mesh:
                hidden.append(np.asarray(es.freeze(model).hidden(x), np.float64))
                x, y = jax.device_put(x, single_dev), jax.device_put(y, single_dev)
            model, opt_state = step(model, opt_state, x, y)
        return model

    sharded = run(es.make_step(loss_fn, optax.sgd(0.1), mesh=mesh), True)
    single = run(es.make_step(loss_fn, optax.sgd(0.1)), False)
    got, want = es.recorded(sharded), es.recorded(single)
    assert list(got) == list(want)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6, err_msg=k)
    # and against numpy over the activations of the global batches
    flat = np.concatenate([h.ravel() for h in hidden])
    ref = {
        "rec.mean": flat.mean(),
        "rec.std": flat.std(),
        "rec.rms": np.sqrt(np.mean(flat**2)),
        "rec.max_abs": np.abs(flat).max(),
        "rec.zero_fraction": np.mean(flat == 0),
        "rec.dead_fraction": np.mean([np.mean(np.all(h <= 0, 0)) for h in hidden]),
        "rec.hist": np.histogram(flat, bins=6, range=(0, 3))[0],
    }
    for k, v in ref.items():
        np.testing.assert_allclose(got[k], v, rtol=1e-5, atol=1e-6, err_msg=k)
    np.testing.assert_allclose(got["cap"], hidden[-1], rtol=1e-6, atol=1e-6)
    cell = sharded.rec.metrics["std"].m2.value
    cell = cell[...] if isinstance(cell, jax.Ref) else cell
    assert len(cell.sharding.device_set) == 4 and cell.sharding.is_fully_replicated


def _sharded(mesh, a):
    return jax.device_put(jnp.asarray(a), NamedSharding(mesh, P("data")))


def _per_device(mesh, body, rec, x):
    """`body(rec, x_shard) -> rec` under `shard_map`, the recorder replicated (its
    Python fields kept out of the trace, as `eqx.filter_jit` does)."""
    arrays, static = eqx.partition(rec, eqx.is_array)

    def inner(arrays, x):
        out = body(eqx.combine(arrays, static), x)
        return eqx.partition(out, eqx.is_array)[0]

    f = jax.jit(
        jax.shard_map(inner, mesh=mesh, in_specs=(P(), P("data")), out_specs=P())
    )
    return eqx.combine(f(arrays, _sharded(mesh, x)), static)


def test_shard_map_with_axis_name_equals_one_device(mesh):
    x = jax.random.normal(jax.random.key(0), (BATCH, 6)) - 0.2
    whole = es.to_refs(es.nn.Record(*STATS))
    whole(x)

    def body(rec, x):
        _, rec = es.apply(lambda r, x: r(x), rec, x)
        return rec

    per_device = _per_device(mesh, body, es.nn.Record(*STATS, axis_name="data"), x)
    got, want = es.recorded(per_device), es.recorded(whole)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, err_msg=k)


def test_reduce_merges_per_device_recorders(mesh):
    x = jax.random.normal(jax.random.key(0), (BATCH, 6))
    whole = es.to_refs(es.nn.Record("mean", "std", "max"))
    whole(x)

    def body(rec, x):
        local = jax.tree.map(
            lambda v: jax.lax.pcast(v, "data", to="varying") if eqx.is_array(v) else v,
            rec,
        )
        _, local = es.apply(lambda r, x: r(x), local, x)
        return local.reduce("data")

    reduced = _per_device(mesh, body, es.nn.Record("mean", "std", "max"), x)
    got, want = es.recorded(reduced), es.recorded(whole)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, err_msg=k)


def test_recording_off_on_the_mesh_is_the_recorder_free_program(mesh):
    class Plain(eqx.Module):
        l1: eqx.nn.Linear
        l2: eqx.nn.Linear

        def __call__(self, x):
            return jax.vmap(self.l2)(jax.nn.relu(jax.vmap(self.l1)(x)))

    net = Net(jax.random.key(0))
    plain = Plain(net.l1, net.l2)
    off = es.inference_mode(net, only=es.nn.Recorder)
    step = es.make_step(loss_fn, optax.sgd(0.1), mesh=mesh)
    x, y = (a[0] for a in _data(1))
    p_plain, through_plain = _program(step.lower(plain, step.init(plain), x, y))
    p_off, through_off = _program(step.lower(off, step.init(off), x, y))
    assert through_plain == [] and p_off == p_plain
    leaves = jax.tree.leaves((net.rec, net.cap), is_leaf=es.is_state)
    cells = [c for c in leaves if es.is_state(c)]
    assert len(through_off) == len(cells) == 18  # the recorders' cells only
    assert "sharding" in p_plain  # the program really is the sharded one


@pytest.mark.parametrize("mode", ["value", "ref"])
def test_capture_of_a_sharded_batch_stays_replicated(mesh, mode):
    # plain `jax.jit` over a batch sharded in its type (an explicit mesh): the
    # capture holds the global batch and keeps its (replicated) layout
    x = jax.random.normal(jax.random.key(0), (BATCH, 8))
    rep = NamedSharding(mesh, P())
    cap = jax.tree.map(
        lambda a: jax.device_put(a, rep) if eqx.is_array(a) else a,
        es.nn.Capture((BATCH, 8)),
    )
    if mode == "ref":
        cap = es.to_refs(cap)
        f = eqx.filter_jit(lambda c, x: c(2 * x))
        f(cap, _sharded(mesh, x))
    else:
        f = eqx.filter_jit(lambda c, x: es.apply(lambda c, x: c(2 * x), c, x))
        _, cap = f(cap, _sharded(mesh, x))
    value = cap.value[...]
    np.testing.assert_array_equal(value, 2 * x)
    assert value.sharding.is_fully_replicated
