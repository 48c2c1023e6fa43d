"""The step benchmarks: variants run and are reported, the correctness gate rejects
wrong variants, the slots for APIs still to come activate, and the reference matches
PyTorch."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _scripts import load_script

import eqx_state as es


pytest.importorskip("flax")
pytest.importorskip("matplotlib")


def _load(name: str):
    return load_script("benchmarks", name, module_name=f"_bench_{name}")


@pytest.fixture(autouse=True, scope="module")
def _fast_compiles():
    """Most XLA optimisations off, as in `run.py --tiny`: these tests check
    numbers and reports, never timings, and compiling is most of their time."""
    before = jax.config.values["jax_disable_most_optimizations"]
    jax.config.update("jax_disable_most_optimizations", True)
    yield
    jax.config.update("jax_disable_most_optimizations", before)


@pytest.fixture(scope="module")
def so():
    return _load("step_overhead")


# A few variants of each kind: run.py --tiny (tests/test_benchmarks_suite.py) runs
# them all.
SOME = ["es_value", "eqx_jit", "nnx_jit_partial"]


@pytest.mark.slow  # a benchmark script run; the gate tests below stay fast
def test_step_overhead_tiny(so, tmp_path):
    results = so.main(
        ["--tiny", "--steps", "2", "--variants", *SOME, "--out", str(tmp_path)]
    )
    assert list(results) == ["tiny"]
    rows = results["tiny"]
    assert list(rows) == ["pure_jax", *SOME]  # report order, reference first
    for name, row in rows.items():
        cls = so.VARIANTS[name]
        assert row["checked"] is True, name
        assert row["usage"] == cls.usage and row["form"] == cls.form
        assert len(row["check_losses"]) == so.CHECK_STEPS
        for key in ("rounds_us", "blocking_rounds_us"):
            assert len(row[key]) == 3 and min(row[key]) > 0
        assert 0 < row["min_us"] <= row["median_us"] <= row["max_us"]
        assert row["compile_s"] > 0
        # Ratios, intervals and fastest rounds are those of the raw rounds.
        for prefix in ("", "blocking_"):
            s = so.stats.ratio_summary(
                row[prefix + "rounds_us"], rows["pure_jax"][prefix + "rounds_us"]
            )
            assert row[prefix + "ratio"] == pytest.approx(s["median"])
            assert row[prefix + "ratio_ci"] == pytest.approx(s["ci"])
            assert row[prefix + "ratio_fastest"] == pytest.approx(s["fastest"])
            lo, hi = row[prefix + "ratio_ci"]
            assert lo <= row[prefix + "ratio"] <= hi
    assert rows["pure_jax"]["ratio"] == 1.0
    # Same weights and batch: every variant saw the same losses, which decrease.
    ref = rows["pure_jax"]["check_losses"]
    assert ref[-1] < ref[0]
    for row in rows.values():
        np.testing.assert_allclose(row["check_losses"], ref, rtol=1e-4)
    table = (tmp_path / "results_step_overhead.md").read_text(encoding="utf-8")
    for name, row in rows.items():
        assert f"| {name} | {row['usage']} |" in table
        assert f"| `{name}` | {so.VARIANTS[name].family} |" in table  # what it is
        lo, hi = row["ratio_ci"]
        assert f"{row['ratio']:.2f}× [{lo:.2f}–{hi:.2f}]" in table
    png = (tmp_path / "step_overhead.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"


def test_every_variant_is_labelled_and_documented(so):
    """Each variant says what it is, and benchmarks/README.md names each one."""
    from _scripts import ROOT

    readme = (ROOT / "benchmarks" / "README.md").read_text(encoding="utf-8")
    usages = {so.REFERENCE, so.ES, so.EXPERT, so.DEFAULT, so.DIAGNOSTIC}
    for name, cls in so.VARIANTS.items():
        assert cls.name == name
        assert cls.usage in usages, name
        assert cls.form and cls.label and cls.family, name
        if cls.family in ("Equinox", "Flax NNX"):
            assert cls.source != "-", name  # where the peer recommends it
        assert f"`{name}`" in readme, name
    # Each peer has expert forms beside its default usage.
    for family in ("Equinox", "Flax NNX"):
        usages_of = {c.usage for c in so.VARIANTS.values() if c.family == family}
        assert usages_of - {so.DIAGNOSTIC} == {so.EXPERT, so.DEFAULT}, family


def _wrong_variants(so):
    class BiasedEsValue(so.EsValue):
        name = "wrong_convention"
        biased_running_var = True  # checked against the wrong convention

    class UnbiasedNnx(so.NnxJitPartial):
        name = "wrong_convention_nnx"
        biased_running_var = False  # nnx.BatchNorm keeps the biased variance

    class DoubleLr(so.EqxJit):
        name = "wrong_lr"

        def optimizer(self):
            return so.optax.adam(2 * so.LR)

    class FrozenStatsNet(so.EqxJitNet):
        def __call__(self, x, stats):
            logits, _ = super().__call__(x, stats)
            return logits, stats  # forgets the statistics update

    class FrozenStats(so.EqxJit):
        name = "frozen_stats"
        net = FrozenStatsNet

    return {
        "wrong_convention": (BiasedEsValue, "running var of BatchNorm 0 differs"),
        "wrong_convention_nnx": (UnbiasedNnx, "running var of BatchNorm 0 differs"),
        "wrong_lr": (DoubleLr, "loss trajectory differs"),
        "frozen_stats": (FrozenStats, "running mean of BatchNorm 0 differs"),
    }


@pytest.mark.parametrize(
    "wrong", ["wrong_convention", "wrong_convention_nnx", "wrong_lr", "frozen_stats"]
)
@pytest.mark.split
def test_gate_rejects_a_wrong_variant(so, monkeypatch, wrong):
    """The correctness gate is not vacuous: a variant with the wrong running-variance
    convention, a wrong learning rate, or no statistics update is rejected before
    anything is timed, with a message naming it and what differs."""
    cls, message = _wrong_variants(so)[wrong]
    monkeypatch.setitem(so.VARIANTS, wrong, cls)
    with pytest.raises(AssertionError, match=f"{wrong}: {message}"):
        so.build_and_check(so.SIZES["tiny"], ["pure_jax", wrong])


def _fake_scan(self, model, opt_state, *args):
    """`step.scan` as K calls of `step` (its specification in issue 16)."""
    losses = []
    for i in range(args[0].shape[0]):
        model, opt_state, loss = self(model, opt_state, *(a[i] for a in args))
        losses.append(loss)
    return model, opt_state, jnp.stack(losses)


def test_gate_rejects_a_scan_that_skips_a_step(so, monkeypatch):
    def short_scan(self, model, opt_state, *args):
        return _fake_scan(self, model, opt_state, *(a[1:] for a in args))

    monkeypatch.setattr(es._step.Step, "scan", short_scan)
    with pytest.raises(AssertionError, match="es_scan10: loss trajectory differs"):
        so.build_and_check(so.SIZES["tiny"], ["pure_jax", "es_scan10"])


def test_step_overhead_reference_matches_torch(so):
    """The hand-written reference itself: one training step against PyTorch."""
    torch = pytest.importorskip("torch")

    size = so.SIZES["tiny"]
    params = so.init_params(size, jax.random.key(0))
    x, y = so.make_data(size, jax.random.key(1))
    ref = so.PureJax(params, so.init_bn_state(size), (x, y))
    loss = float(ref.step())
    snap = ref.snapshot()

    layers: list = []
    for w, (gamma, beta) in zip(params["layers"], params["norms"], strict=True):
        lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
        bn = torch.nn.BatchNorm1d(w.shape[0], eps=so.EPS, momentum=0.1)
        with torch.no_grad():
            lin.weight.copy_(torch.tensor(np.asarray(w)))
            bn.weight.copy_(torch.tensor(np.asarray(gamma)))
            bn.bias.copy_(torch.tensor(np.asarray(beta)))
        layers += [lin, bn, torch.nn.ReLU()]
    head = torch.nn.Linear(size.widths[-1], so.NUM_CLASSES)
    with torch.no_grad():
        head.weight.copy_(torch.tensor(np.asarray(params["head"][0])))
        head.bias.copy_(torch.tensor(np.asarray(params["head"][1])))
    net = torch.nn.Sequential(*layers, head)
    opt = torch.optim.Adam(net.parameters(), lr=so.LR)
    out = torch.nn.functional.cross_entropy(
        net(torch.tensor(np.asarray(x))), torch.tensor(np.asarray(y), dtype=torch.long)
    )
    opt.zero_grad()
    out.backward()
    opt.step()

    np.testing.assert_allclose(loss, out.item(), rtol=1e-5)
    np.testing.assert_allclose(snap["w0"], layers[0].weight.detach().numpy(), atol=1e-6)
    bn0 = layers[1]
    np.testing.assert_allclose(snap["mean"][0], bn0.running_mean.numpy(), atol=1e-6)
    np.testing.assert_allclose(snap["var"][0], bn0.running_var.numpy(), atol=1e-6)


# ---------------------------------------------------------------------------------
# bench_stats on synthetic data (no timing)


@pytest.fixture(scope="module")
def stats():
    return _load("bench_stats")


def test_ratio_summary_of_known_rounds(stats):
    base = [10.0, 12.0, 11.0, 30.0, 10.5]  # a slow round hits both
    times = [11.0, 13.2, 12.1, 33.0, 11.55]  # exactly 1.1x in every round
    s = stats.ratio_summary(times, base)
    assert s["median"] == pytest.approx(1.1)
    assert s["ci"] == pytest.approx([1.1, 1.1])
    assert s["fastest"] == pytest.approx(11.0 / 10.0)
    assert stats.ratio_summary(times, base) == s  # fixed seed: reproducible
    assert stats.ratio_summary(times[:2], base[:2])["ci"] is None  # too few rounds
    with pytest.raises(ValueError, match="as many rounds"):
        stats.ratio_summary(times, base[:3])


def test_ratio_interval_covers_the_true_ratio(stats):
    """With noisy rounds (log-normal noise, independent per variant) the 95%
    interval of the median ratio covers the true ratio in most simulated runs, and
    its width shrinks with more rounds."""
    rng = np.random.default_rng(0)
    true = 1.07
    covered, widths = 0, {}
    for rounds in (7, 31):
        ws = []
        for _ in range(150):
            drift = rng.lognormal(0, 0.3, rounds)  # machine drift, shared
            base = 60 * drift * rng.lognormal(0, 0.05, rounds)
            times = 60 * true * drift * rng.lognormal(0, 0.05, rounds)
            s = stats.ratio_summary(times, base, n_boot=1000)
            covered += s["ci"][0] <= true <= s["ci"][1] if rounds == 31 else 0
            ws.append(s["ci"][1] - s["ci"][0])
        widths[rounds] = np.median(ws)
    assert covered / 150 >= 0.85
    assert widths[31] < widths[7]


@pytest.mark.parametrize(
    "ci, limit, want",
    [
        ([0.98, 1.04], 1.05, "✓"),
        ([1.06, 1.20], 1.05, "✗"),
        ([1.00, 1.10], 1.05, "?"),
        (None, 1.05, "-"),
    ],
)
def test_verdict(stats, ci, limit, want):
    assert stats.verdict(ci, limit) == want


def test_growth_recovers_a_line_and_an_exponent(stats):
    rng = np.random.default_rng(1)
    ns = [1, 10, 30, 100]
    rounds = 15

    def data(f):
        out = {}
        for n in ns:
            base = 40 + 10 * n + rng.normal(0, 1, rounds)
            out[n] = (base + f(n) + rng.normal(0, 0.5, rounds), base)
        return out

    line = stats.growth(data(lambda n: 7.0 + 0.5 * n))
    assert line["slope"] == pytest.approx(0.5, abs=0.05)
    assert line["slope_ci"][0] <= 0.5 <= line["slope_ci"][1]
    assert line["intercept"] == pytest.approx(7.0, abs=1.0)
    power = stats.growth(data(lambda n: 20.0 * n**0.5))
    assert power["exponent"] == pytest.approx(0.5, abs=0.05)
    assert power["exponent_ci"][0] <= 0.5 <= power["exponent_ci"][1]
    assert stats.verdict(power["exponent_ci"], 1.0) == "✓"  # sub-linear
    flat = stats.growth(data(lambda n: -5.0 + 0 * n))
    assert flat["exponent"] is None  # no log-log line through negative overheads
    assert flat["slope_ci"][0] <= 0 <= flat["slope_ci"][1]
    assert stats.verdict(flat["slope_ci"], 0.0) == "?"


def test_fit_many_pairs_each_variant_with_the_reference(stats):
    a, b = 7.0, 0.5
    by_n = {}
    for n in (1, 10, 30, 100):
        base = [40 + 10 * n + j for j in (0.0, 3.0, -2.0)]
        by_n[n] = {
            "pure_jax": {"rounds_us": base},
            "es_value": {"rounds_us": [t + a + b * n for t in base]},
        }
    fits = stats.fit_many(by_n)
    assert fits["es_value"]["diff"] == pytest.approx([a + b * n for n in by_n])
    assert fits["es_value"]["slope"] == pytest.approx(b)
    assert fits["es_value"]["slope_ci"] == pytest.approx([b, b])
    assert fits["pure_jax"]["slope"] == pytest.approx(10.0)  # its own step time


def test_many_cells_fits_ref_against_value_only_over_two_sizes():
    """Ref mode's extra cost per BatchNorm over value mode (issue 23) is a slope:
    over one N there is none to fit and the report leaves it out (it raised a
    KeyError after the whole run); over two it is the line through the same-round
    differences."""
    mc = _load("many_cells")

    def rows(n):
        base = [40 + 10 * n + j for j in (0.0, 3.0, -2.0)]
        value = [t + 5 + 2.0 * n for t in base]
        ref = [t + 1 + 0.5 * n for t in value]
        return {
            name: {"rounds_us": r, "blocking_rounds_us": r}
            for name, r in (("pure_jax", base), ("es_value", value), ("es_ref", ref))
        }

    assert "ref_value" not in mc.fit({100: rows(100)})
    fits = mc.fit({30: rows(30), 100: rows(100)})
    assert fits["ref_value"]["slope"] == pytest.approx(0.5)
    assert fits["pure_jax"]["es_value"]["slope"] == pytest.approx(2.0)


def test_many_cells_fits_the_control_beside_ref_against_value():
    """The A/A control (`es_value_again`, a second instance of es_value) gets the
    same fit as ref − value, against es_value, and is left out of the growth
    against `eqx_jit` (issue 11's limit is for eqx_state's own variants)."""
    mc = _load("many_cells")

    def rows(n):
        base = [40 + 10 * n + j for j in (0.0, 3.0, -2.0)]
        value = [t + 5 + 2.0 * n for t in base]
        again = [t + 0.25 * n for t in value]
        ref = [t + 1 + 0.5 * n for t in value]
        return {
            name: {"rounds_us": r, "blocking_rounds_us": r}
            for name, r in (
                ("pure_jax", base),
                ("es_value", value),
                ("es_ref", ref),
                (mc.CONTROL, again),
                ("eqx_jit", base),
            )
        }

    fits = mc.fit({n: rows(n) for n in (1, 30, 100)})
    assert fits["control"]["slope"] == pytest.approx(0.25)
    assert fits["ref_value"]["slope"] == pytest.approx(0.5)
    assert mc.CONTROL not in fits[mc.LIMIT]


def test_blocking_timings_interleave_every_call_and_time_each_alone(so, monkeypatch):
    """`time_variants`' blocking way makes each variant's calls one by one between
    the others' (every variant with calls left once per cycle), blocks on each, and
    divides each variant's own time by its steps; a fake clock makes it exact."""
    clock = [0.0]
    log: list[str] = []

    class Fake:
        def __init__(self, name, cost, steps_per_call=1):
            self.name, self.cost, self.steps_per_call = name, cost, steps_per_call

        def step(self):
            log.append(self.name)
            clock[0] += self.cost
            return jnp.zeros(())

    monkeypatch.setattr(so.time, "perf_counter", lambda: clock[0])
    runners = {"a": Fake("a", 3.0), "b": Fake("b", 5.0), "k": Fake("k", 40.0, 10)}
    pipelined, blocking = so.time_variants(runners, rounds=2, steps=20)
    assert blocking == {"a": [3.0, 3.0], "b": [5.0, 5.0], "k": [4.0, 4.0]}
    assert pipelined == blocking  # a call's cost is its own either way
    # round 0: pipelined first (a settle call, then 20 / steps_per_call calls, per
    # variant in turn), then blocking: cycles of one call each, shuffled
    blocking_calls = log[(1 + 20) + (1 + 20) + (1 + 2) :][: 20 + 20 + 2]
    cycles = [blocking_calls[0:3], blocking_calls[3:6]] + [
        blocking_calls[6 + 2 * i : 8 + 2 * i] for i in range(18)
    ]
    assert [sorted(c) for c in cycles] == [["a", "b", "k"]] * 2 + [["a", "b"]] * 18
    assert len({tuple(c) for c in cycles}) > 1  # the order is shuffled
