"""The public extension API: metrics written by a user with `es.metrics.statistic`,
`update` / `accumulate` and `compute` — a perplexity (against torchmetrics and
float64 numpy) through `make_step`, `merge`, `reduce` and `reset`; statistics with a
function merge and a `"custom"` merge; the errors that guide a metric's author.
(The same metrics on 4 devices: tests/multidevice/test_metrics_sharded.py.)"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _torchmetrics import torch
from torchmetrics.text import Perplexity as TorchPerplexity

import eqx_state as es
from eqx_state import metrics as esm


class Perplexity(esm.Metric):
    """exp of the mean negative log-likelihood per (unignored) token."""

    nll: es.MetricState = esm.statistic("sum")
    tokens: es.MetricState = esm.statistic("sum")
    ignore_index: int = eqx.field(static=True, default=-100)

    def update(self, logits, targets):
        keep = targets != self.ignore_index
        safe = jnp.where(keep, targets, 0)
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        nll = -jnp.take_along_axis(logp, safe[..., None], axis=-1)[..., 0]
        self.accumulate(nll=jnp.sum(jnp.where(keep, nll, 0.0)), tokens=jnp.sum(keep))

    def compute(self):
        n = self.tokens[...]
        return jnp.exp(jnp.where(n > 0, self.nll[...] / jnp.maximum(n, 1.0), 0.0))


def first_seen(a, b):  # module level: two metrics built alike compare equal
    return a


class LogSumExp(esm.Metric):
    """log(sum(exp(x))) over everything seen: a statistic merged by a function."""

    lse: es.MetricState = esm.statistic(jnp.logaddexp, init=-np.inf)

    def update(self, values):
        self.accumulate(lse=jax.nn.logsumexp(values))

    def compute(self):
        return self.lse[...]


class FirstValue(esm.Metric):
    """The first value seen: statistics that merge together (`"custom"`)."""

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


def ref_perplexity(logits, targets, ignore_index=-100):
    """float64 numpy."""
    logits = np.asarray(logits, np.float64)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    keep = targets != ignore_index
    nll = -np.take_along_axis(logp, np.where(keep, targets, 0)[..., None], -1)[..., 0]
    return float(np.exp(nll[keep].mean()))


def torch_perplexity(logits, targets):
    metric = TorchPerplexity(ignore_index=-100)
    return metric(torch.tensor(np.asarray(logits)), torch.tensor(targets)).item()


B, T, V = 3, 5, 7


def lm_data(seed, n_batches=3):
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(n_batches, B, T, V)).astype(np.float32) * 2
    targets = rng.integers(0, V, (n_batches, B, T))
    targets[0, 0, :2] = -100  # ignored (padding) tokens
    return logits, targets


def close(a, b, rtol=1e-5):
    np.testing.assert_allclose(np.asarray(a, np.float64), b, rtol=rtol)


@pytest.mark.parametrize("mode", ["value", "ref"])
def test_user_metric_matches_torchmetrics_in_both_modes(mode):
    logits, targets = lm_data(0)
    metric = Perplexity()
    if mode == "ref":
        metric = es.to_refs(metric)
    for lg, tg in zip(logits, targets):
        if mode == "ref":
            metric.update(jnp.asarray(lg), jnp.asarray(tg))
        else:
            _, metric = eqx.filter_jit(es.apply)(
                lambda m, a, b: m.update(a, b), metric, jnp.asarray(lg), tg
            )
    flat_l, flat_t = logits.reshape(-1, T, V), targets.reshape(-1, T)
    close(metric.compute(), ref_perplexity(flat_l, flat_t))
    close(metric.compute(), torch_perplexity(flat_l, flat_t), rtol=1e-4)
    # a metric with default-field statistics gets a dataclass __init__
    assert Perplexity(axis_name="d").axis_name == "d"
    assert Perplexity().nll.value is not Perplexity().nll.value  # fresh arrays


class LM(eqx.Module):
    emb: jax.Array
    ppl: Perplexity

    def __call__(self, x):
        return x @ self.emb  # [B, T, V]


def lm_loss(model, x, y):
    logits = model(x)
    logp = jax.nn.log_softmax(logits, -1)
    loss = -jnp.mean(jnp.take_along_axis(logp, y[..., None], -1))
    model.ppl.update(logits, y)
    return loss


@pytest.mark.parametrize("mode", ["value", "ref"])
def test_user_metric_through_make_step(mode):
    rng = np.random.default_rng(1)
    xs = jnp.asarray(rng.normal(size=(3, B, T, 4)).astype(np.float32))
    ys = jnp.asarray(rng.integers(0, V, (3, B, T)))
    emb = jnp.asarray(rng.normal(size=(4, V)).astype(np.float32))
    opt = optax.sgd(0.5)

    # the reference: the same training written by hand, collecting the logits
    def ref_loss(emb, x, y):
        logp = jax.nn.log_softmax(x @ emb, -1)
        return -jnp.mean(jnp.take_along_axis(logp, y[..., None], -1)), x @ emb

    ref_emb, ref_state, seen = emb, opt.init(emb), []
    for x, y in zip(xs, ys):
        (_, lg), g = jax.value_and_grad(ref_loss, has_aux=True)(ref_emb, x, y)
        updates, ref_state = opt.update(g, ref_state)
        ref_emb = optax.apply_updates(ref_emb, updates)
        seen.append(np.asarray(lg))

    model = LM(emb, Perplexity())
    if mode == "ref":
        model = es.to_refs(model)
    step = es.make_step(lm_loss, opt)
    opt_state = step.init(model)
    for x, y in zip(xs, ys):
        model, opt_state = step(model, opt_state, x, y)
    assert step.trace_count == 1
    all_logits, all_targets = np.concatenate(seen), np.asarray(ys).reshape(-1, T)
    close(model.ppl.compute(), ref_perplexity(all_logits, all_targets), rtol=1e-4)
    close(model.emb, np.asarray(ref_emb), rtol=1e-5)
    # reset starts the metric over (and only it)
    model = es.reset(model)
    assert float(model.ppl.tokens[...]) == 0.0 and float(model.ppl.compute()) == 1.0
    close(model.emb, np.asarray(ref_emb), rtol=1e-5)


def _per_batch(factory, batches):
    out = []
    for args in batches:
        _, m = es.apply(lambda m, a: m.update(*a), factory(), args)
        out.append(m)
    return out


def test_user_metrics_merge_in_any_grouping():
    logits, targets = lm_data(2, n_batches=4)
    per = _per_batch(Perplexity, [(jnp.asarray(a), b) for a, b in zip(logits, targets)])
    want = ref_perplexity(logits.reshape(-1, T, V), targets.reshape(-1, T))
    for merged in (
        per[0].merge(per[1]).merge(per[2].merge(per[3])),
        per[0].merge(per[1].merge(per[2])).merge(per[3]),
    ):
        close(merged.compute(), want)

    rng = np.random.default_rng(3)
    x = rng.normal(size=(4, 6)).astype(np.float32) * 10
    per = _per_batch(LogSumExp, [(jnp.asarray(b),) for b in x])
    want = np.logaddexp.reduce(x.astype(np.float64).ravel())
    close(per[0].merge(per[1].merge(per[2])).merge(per[3]).compute(), want)
    empty = FirstValue()
    per = [empty] + _per_batch(FirstValue, [(jnp.asarray(b),) for b in x[1:]])
    close(per[0].merge(per[1]).merge(per[2].merge(per[3])).compute(), x[1, 0])


CASES = [
    ("Perplexity", Perplexity, lambda r: lm_data(4, n_batches=4)),
    ("LogSumExp", LogSumExp, lambda r: (r.normal(size=(4, 6)).astype(np.float32),)),
    ("FirstValue", FirstValue, lambda r: (r.normal(size=(4, 6)).astype(np.float32),)),
]


def reference(name, data):
    if name == "Perplexity":
        logits, targets = data
        return ref_perplexity(logits.reshape(-1, T, V), targets.reshape(-1, T))
    (x,) = data
    if name == "LogSumExp":
        return np.logaddexp.reduce(x.astype(np.float64).ravel())
    return x[0, 0]


@pytest.mark.parametrize("name,factory,make", CASES, ids=[c[0] for c in CASES])
@pytest.mark.split
def test_user_metrics_reduce_under_vmap(name, factory, make):
    data = make(np.random.default_rng(5))
    want = reference(name, data)
    args = tuple(jnp.asarray(d) for d in data)

    def reduce_path(metric, *shard):
        _, metric = es.apply(lambda m: m.update(*shard), metric)
        return metric.reduce("shards").compute()

    def axis_name_path(metric, *shard):
        _, metric = es.apply(lambda m: m.update(*shard), metric)
        return metric.compute()

    for fn, metric in [
        (reduce_path, factory()),
        (axis_name_path, factory(axis_name="shards")),
    ]:
        out = jax.vmap(fn, in_axes=(None,) + (0,) * len(args), axis_name="shards")(
            metric, *args
        )
        for member in np.asarray(out):  # the same on every member
            close(member, want, rtol=1e-5)


def test_user_metric_under_debug_nans():
    with jax.debug_nans(True):
        assert float(Perplexity().compute()) == 1.0
        m = es.to_refs(Perplexity())
        m.update(jnp.zeros((1, 2, V)), jnp.array([[-100, -100]]))  # all ignored
        assert float(m.compute()) == 1.0


def test_authoring_errors_are_clear():
    class Plain(esm.Metric):
        total: es.MetricState

        def __init__(self):
            self.total = es.MetricState(jnp.zeros(()))

    with pytest.raises(TypeError, match=r"Plain\.total .*statistic\("):
        Plain()

    with pytest.raises(TypeError, match=r"needs one value for each statistic"):
        es.to_refs(Perplexity()).accumulate(nll=1.0)

    class Custom(esm.Metric):
        x: es.MetricState = esm.statistic("custom", init=0.0)

        def update(self, v):
            self.accumulate(x=v)

    with pytest.raises(NotImplementedError, match="override `merge_statistics"):
        es.to_refs(Custom()).update(1.0)
    with pytest.raises(ValueError, match="pass `init=`"):
        esm.statistic(jnp.logaddexp)
    with pytest.raises(ValueError, match="merge must be one of"):
        esm.statistic("mean")
    with pytest.raises(ValueError, match=r"statistic 'nll' has shape \(\)"):
        es.to_refs(Perplexity()).accumulate(nll=jnp.ones(3), tokens=1.0)
    with pytest.raises(NotImplementedError, match="does not define `compute`"):

        class NoCompute(esm.Metric):
            x: es.MetricState = esm.statistic("sum")

        NoCompute().compute()


def test_statistic_defaults():
    assert esm.statistic("sum").init == 0
    assert esm.statistic("min").init == np.inf
    assert esm.statistic("max", dtype=jnp.int32).init == np.iinfo(np.int32).min
    cell = esm.statistic("max", shape=(2, 3), dtype=jnp.bfloat16)
    assert cell.shape == (2, 3) and cell.dtype == jnp.bfloat16
    assert np.all(np.asarray(cell.value, np.float32) == -np.inf)
    assert isinstance(cell, es.MetricState)


class Tally(esm.Metric):
    """A user metric with an integer statistic (and a bfloat16 one)."""

    total: es.MetricState = esm.statistic("sum", dtype=jnp.int32)
    small: es.MetricState = esm.statistic("sum", dtype=jnp.bfloat16)

    def update(self, total, small=0.0):
        self.accumulate(total=total, small=small)

    def compute(self):
        return self.total[...]


def _tally(mode, *args):
    if mode == "ref":
        metric = es.to_refs(Tally())
        metric.update(*args)
        return metric
    return es.apply(lambda m, *a: m.update(*a), Tally(), *args)[1]


@pytest.mark.parametrize("mode", ["value", "ref"])
def test_accumulate_refuses_a_narrowing_cast(mode):
    """`accumulate` refuses by dtype what a state write refuses: a float into an
    integer statistic (1.75 would be stored as 1; an integral 2.0 too, as the
    cells' write rule), a wider float into a narrower one."""
    fix = r"statistic\(\.\.\., dtype=jnp\.float32\)|astype\(jnp\.int32\)"
    for bad in (1.75, 2.0, jnp.float32(2.0), jnp.array([3.0]).sum()):
        with pytest.raises(es.StateWriteError, match=r"Tally\.accumulate.*'total'"):
            _tally(mode, bad)
    with pytest.raises(es.StateWriteError, match=fix):
        _tally(mode, jnp.float32(1.75))
    with pytest.raises(es.StateWriteError, match=r"'small' has dtype bfloat16"):
        _tally(mode, 1, jnp.float32(0.5))
    # widening and same-dtype values are accumulated exactly (reference: Python)
    got = _tally(mode, jnp.int16(3), jnp.bfloat16(0.5))
    assert int(got.total[...]) == 3 and float(got.small[...]) == 0.5
    got = _tally(mode, 7, 0.25)  # Python scalars (weakly typed) of the same kind
    assert int(got.total[...]) == 7 and float(got.small[...]) == 0.25
    got = _tally(mode, jnp.bool_(True))
    assert int(got.total[...]) == 1


def test_a_statistic_init_its_dtype_does_not_hold_is_refused():
    """`statistic(dtype=int32, init=0.5)` started (and reset) at 0 while its `init`
    said 0.5; `dtype=uint32, init=-1` at 4294967295; a float16 init of 1e6 at inf.
    Each is refused by name; inits the dtype holds are kept exactly (NumPy's cast
    is the reference)."""
    import warnings

    for dtype, init in ((jnp.int32, 0.5), (jnp.uint32, -1), (jnp.float16, 1e6)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # NumPy's overflow
            with pytest.raises(ValueError, match=rf"init={init!r} is not a value"):
                es.metrics.statistic(dtype=dtype, init=init)
    for dtype, init in ((jnp.int32, 3), (jnp.float32, 0.1), (jnp.bool_, True)):
        cell = es.metrics.statistic(dtype=dtype, init=init)
        assert cell.value.item() == np.asarray(init, dtype).item()
    # the check runs on the host: metrics can be built inside a trace (an abstract
    # model for a checkpoint restore), where reading a device value raised
    abstract = eqx.filter_eval_shape(lambda: esm.Metrics(a=esm.Accuracy(), s=esm.Sum()))
    assert jax.tree.leaves(abstract)[0].shape == ()
