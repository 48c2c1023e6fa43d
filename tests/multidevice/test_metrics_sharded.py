"""Metrics with `axis_name` inside `shard_map` on 4 devices, against a single-device
run and float64 numpy: a replicated update (a `pmean`-ed loss, an `all_gather`-ed
batch) is counted once, not once per device; `reduce` twice counts nothing twice; an
`axis_name` that is not bound (inside `make_step(mesh=...)`) raises a clear error; a
user-written metric reduces and merges like the built-ins."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import eqx_state as es
from eqx_state import metrics as esm


class MeanAbsoluteError(esm.Metric):
    total: es.MetricState = esm.statistic("sum")
    count: es.MetricState = esm.statistic("sum")

    def update(self, preds, targets):
        errors = jnp.abs(preds - targets)
        self.accumulate(total=jnp.sum(errors), count=errors.size)

    def compute(self):
        n = self.count[...]
        return jnp.where(n > 0, self.total[...] / jnp.maximum(n, 1.0), 0.0)


class FirstValue(esm.Metric):
    value: es.MetricState = esm.statistic("custom", init=0.0)
    count: es.MetricState = esm.statistic("sum")

    def update(self, values):
        values = jnp.ravel(values)
        self.accumulate(value=values[0], count=values.size)

    def merge_statistics(self, a, b):
        return {
            "value": jnp.where(a["count"] > 0, a["value"], b["value"]),
            "count": a["count"] + b["count"],
        }

    def compute(self):
        return self.value[...]


N = 8  # global batch: 2 per device
X = np.array([0.5, -1.0, 2.0, 3.5, -0.25, 1.0, 4.0, -2.0], np.float32)
Y = np.array([1.0, 0.0, 2.5, 3.0, 0.0, 1.5, 3.0, -1.0], np.float32)


def _sharded(mesh, a):
    return jax.device_put(jnp.asarray(a), NamedSharding(mesh, P("data")))


def _run(mesh, body, metric, *arrays, check_vma=True):
    """`body(metric, *shards) -> metric` under shard_map; the metric replicated."""
    specs = (P(),) + (P("data"),) * len(arrays)
    f = jax.jit(
        jax.shard_map(
            body, mesh=mesh, in_specs=specs, out_specs=P(), check_vma=check_vma
        )
    )
    return f(metric, *(_sharded(mesh, a) for a in arrays))


def _update(kwargs_of):
    def body(metric, x):
        _, metric = es.apply(lambda m: m.update(**kwargs_of(x)), metric)
        return metric

    return body


def test_replicated_update_is_counted_once(mesh):
    loss = float(np.mean(X, dtype=np.float64))  # what every device computes

    def body(metric, x):
        replicated = jax.lax.pmean(jnp.mean(x), "data")  # the global mean loss
        _, metric = es.apply(lambda m: m.update(replicated), metric)
        return metric

    for cls in (esm.Sum, esm.Mean, esm.Max):
        out = _run(mesh, body, cls(axis_name="data"), X)
        np.testing.assert_allclose(out.compute(), loss, rtol=1e-6)
    # the same update on one device, twice (two steps): 2 * loss, not 8 * loss
    total = _run(mesh, body, esm.Sum(axis_name="data"), X)
    total = _run(mesh, body, total, X)
    np.testing.assert_allclose(total.compute(), 2 * loss, rtol=1e-6)


def test_a_replicated_batch_counts_the_global_batch_once(mesh):
    # JAX types `all_gather`'s result as per-device (varying: "Varying -> Varying"),
    # so the library cannot tell it is the global batch. Two documented ways count
    # it once: update with the local shard (the metric's reduction is the gather),
    # or make the gathered batch replicated in JAX's types (`pmax` of equal values
    # is exact) and update with it.
    def gathered(metric, x):
        batch = jax.lax.pmax(jax.lax.all_gather(x, "data", tiled=True), "data")
        _, metric = es.apply(lambda m: m.update(batch), metric)
        return metric

    def local(metric, x):
        _, metric = es.apply(lambda m: m.update(x), metric)
        return metric

    for body in (gathered, local):
        ones = np.ones(N, np.float32)
        for axis_name in ("data", None):
            if body is local and axis_name is None:
                continue  # per-device data into a replicated metric: refused
            count = _run(mesh, body, esm.Sum(axis_name=axis_name), ones)
            assert float(count.compute()) == N
            ms = _run(mesh, body, esm.MeanStd(ddof=1, axis_name=axis_name), X)
            assert float(ms.count[...]) == N
            mean, std = ms.compute()
            np.testing.assert_allclose(mean, X.astype(np.float64).mean(), rtol=1e-6)
            np.testing.assert_allclose(std, X.astype(np.float64).std(ddof=1), rtol=1e-6)


def test_per_device_batch_is_reduced(mesh):
    # the usual case: each device's shard differs, so each update is psum-ed
    for check_vma in (True, False):
        ms = _run(
            mesh,
            _update(lambda x: {"values": x}),
            esm.MeanStd(ddof=1, axis_name="data"),
            X,
            check_vma=check_vma,
        )
        assert float(ms.count[...]) == N
        mean, std = ms.compute()
        np.testing.assert_allclose(mean, X.astype(np.float64).mean(), rtol=1e-6)
        np.testing.assert_allclose(std, X.astype(np.float64).std(ddof=1), rtol=1e-5)


def test_reduce_twice_counts_nothing_twice(mesh):
    def body(metric, x):
        local = jax.tree.map(
            lambda v: jax.lax.pcast(v, "data", to="varying"), es.reset(metric)
        )
        _, local = es.apply(lambda m: m.update(x), local)
        once = local.reduce("data")
        twice = once.reduce("data")  # already replicated: unchanged
        return es.metrics.Metrics(once=once, twice=twice)

    for factory in (esm.Sum, lambda: esm.MeanStd(ddof=1), esm.LastValue):
        out = _run(mesh, body, factory(), X)
        for a, b in zip(jax.tree.leaves(out["once"]), jax.tree.leaves(out["twice"])):
            np.testing.assert_array_equal(a, b)
    out = _run(mesh, body, esm.Sum(), np.ones(N, np.float32))
    assert float(out["twice"].compute()) == N
    out = _run(mesh, body, esm.LastValue(), X)
    assert float(out["twice"].compute()) == X[-1]


@pytest.mark.parametrize("factory", [MeanAbsoluteError, FirstValue])
def test_user_metric_on_four_devices_equals_one_device(mesh, factory):
    if factory is MeanAbsoluteError:
        kwargs_of = lambda x: {"preds": x, "targets": jnp.zeros_like(x)}  # noqa: E731
        want = float(np.abs(X.astype(np.float64)).mean())
    else:
        kwargs_of = lambda x: {"values": x}  # noqa: E731
        want = float(X[0])
    # axis_name: every update reduced
    out = _run(mesh, _update(kwargs_of), factory(axis_name="data"), X)
    np.testing.assert_allclose(out.compute(), want, rtol=1e-6)

    # reduce: per-device state, reduced and merged into the running metric
    def body(metric, x):
        local = jax.tree.map(
            lambda v: jax.lax.pcast(v, "data", to="varying"), es.reset(metric)
        )
        _, local = es.apply(lambda m: m.update(**kwargs_of(x)), local)
        return metric.merge(local.reduce("data"))

    out = _run(mesh, body, factory(), X)
    np.testing.assert_allclose(out.compute(), want, rtol=1e-6)
    assert float(out.count[...]) == N


class Net(eqx.Module):
    w: jax.Array
    mae: MeanAbsoluteError
    loss: esm.Mean


def _net_loss(model, x, y):
    preds = model.w * x
    model.mae.update(preds, y)
    loss = jnp.mean((preds - y) ** 2)
    model.loss.update(loss)
    return loss


def test_user_metric_in_a_mesh_step_equals_one_device(mesh):
    def train(x, y, on_mesh):
        step = es.make_step(
            _net_loss, optax.sgd(0.1), mesh=mesh if on_mesh else None, donate=False
        )
        model = Net(jnp.ones(()), MeanAbsoluteError(), esm.Mean())
        opt_state = step.init(model)
        for _ in range(3):
            model, opt_state = step(model, opt_state, x, y)
        return model, step.trace_count

    one, _ = train(jnp.asarray(X), jnp.asarray(Y), False)
    sharded, traces = train(_sharded(mesh, X), _sharded(mesh, Y), True)
    assert traces == 1
    np.testing.assert_allclose(sharded.mae.compute(), one.mae.compute(), rtol=1e-6)
    np.testing.assert_allclose(sharded.loss.compute(), one.loss.compute(), rtol=1e-6)
    assert float(sharded.mae.count[...]) == 3 * N


@pytest.mark.parametrize("devices", [4, 1])
def test_axis_name_inside_a_mesh_step_says_to_drop_it(mesh, devices):
    sub = jax.make_mesh((devices,), ("data",), devices=jax.devices()[:devices])
    model = Net(jnp.ones(()), MeanAbsoluteError(), esm.Mean(axis_name="data"))
    step = es.make_step(_net_loss, optax.sgd(0.1), mesh=sub)
    opt_state = step.init(model)
    with pytest.raises(ValueError, match="already reduces over the global batch"):
        step(model, opt_state, _sharded(sub, X), _sharded(sub, Y))
    with pytest.raises(ValueError, match=r"axis named 'data'.*without\s+`axis_name`"):
        es.to_refs(esm.Sum(axis_name="data")).update(jnp.ones(3))  # eager, unbound


def test_logits_rule_decides_over_the_global_batch(mesh):
    """Binary scores with one value outside [0, 1], on one device's shard: the
    update (over the global batch, `axis_name`) treats every value as a logit, as
    torchmetrics on the whole batch."""
    from _torchmetrics import classification as tc, torch

    rng = np.random.default_rng(0)
    p = rng.random(N).astype(np.float32)
    p[-1] = 3.0  # a logit, in the last device's shard
    y = rng.integers(0, 2, N)
    tp, ty = torch.tensor(p), torch.tensor(y)
    want = tc.BinaryPrecision(threshold=0.5)(tp, ty).item()
    as_probabilities = tc.BinaryPrecision(threshold=0.5)(tp.clamp(0, 1), ty).item()
    assert want != as_probabilities  # the rule decides this batch
    for check_vma in (True, False):
        out = _run(
            mesh,
            lambda m, p, y: es.apply(lambda m: m.update(p, y), m)[1],
            esm.Precision(threshold=0.5, axis_name="data"),
            p,
            y,
            check_vma=check_vma,
        )
        np.testing.assert_allclose(out.compute(), want, rtol=1e-6)


def test_reset_keeps_a_value_mode_cells_sharding(mesh):
    """`es.reset` in value mode gives each cell a fresh array laid out as the cell
    was: replicated over the mesh (a single-device array there could not be saved
    by Orbax from several processes), or split as the cell was."""
    replicated, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    metrics = esm.Metrics(loss=esm.Mean(), hist=esm.Histogram(8, range=(0.0, 1.0)))
    metrics = jax.tree.map(lambda a: jax.device_put(a, replicated), metrics)
    metrics = eqx.tree_at(
        lambda m: m["hist"].counts.value,
        metrics,
        jax.device_put(jnp.ones(8), split),
    )
    fresh = es.reset(metrics)
    assert float(fresh["loss"].weight[...]) == 0.0
    np.testing.assert_array_equal(fresh["hist"].counts[...], np.zeros(8))
    assert fresh["loss"].total.value.sharding == replicated
    assert fresh["loss"].weight.value.sharding == replicated
    assert fresh["hist"].counts.value.sharding == split
