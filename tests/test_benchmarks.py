"""The benchmark scripts run, check their variants, and report every variant."""

import numpy as np
import pytest
from _scripts import load_script


pytest.importorskip("flax")
pytest.importorskip("matplotlib")


def _load(name: str):
    return load_script("benchmarks", name, module_name=f"_bench_{name}")


@pytest.fixture(scope="module")
def step_overhead():
    return _load("step_overhead")


def test_step_overhead_tiny(step_overhead, tmp_path):
    results = step_overhead.main(["--tiny", "--steps", "2", "--out", str(tmp_path)])
    assert list(results) == ["tiny"]
    rows = results["tiny"]
    assert set(rows) == set(step_overhead.VARIANTS)
    for name, row in rows.items():
        assert row["checked"] is True, name
        assert len(row["check_losses"]) == step_overhead.CHECK_STEPS
        assert len(row["rounds_us"]) == 2
        assert 0 < row["min_us"] <= row["median_us"] <= row["max_us"]
        assert row["compile_s"] > 0
        assert row["ratio"] > 0
    assert rows["pure_jax"]["ratio"] == 1.0
    # Same weights and batch: every variant saw the same losses, which decrease.
    ref = rows["pure_jax"]["check_losses"]
    assert ref[-1] < ref[0]
    for row in rows.values():
        np.testing.assert_allclose(row["check_losses"], ref, rtol=1e-4)
    table = (tmp_path / "results_step_overhead.md").read_text(encoding="utf-8")
    for name in rows:
        assert f"| {name}:" in table
    png = (tmp_path / "step_overhead.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"


def test_step_overhead_check_catches_a_wrong_variant(step_overhead, monkeypatch):
    """The correctness check is not vacuous: a variant whose BatchNorm keeps the
    wrong running-variance convention is rejected before any timing."""
    monkeypatch.setattr(step_overhead.EsValue, "biased_running_var", True)
    size = step_overhead.SIZES["tiny"]
    with pytest.raises(
        AssertionError, match="es_value: running var of BatchNorm 0 differs"
    ):
        step_overhead.build_and_check(size, ["pure_jax", "es_value"])


def test_step_overhead_reference_matches_torch(step_overhead):
    """The hand-written reference itself: one training step against PyTorch."""
    torch = pytest.importorskip("torch")
    import jax

    size = step_overhead.SIZES["tiny"]
    params = step_overhead.init_params(size, jax.random.key(0))
    x, y = step_overhead.make_data(size, jax.random.key(1))
    ref = step_overhead.PureJax(params, step_overhead.init_bn_state(size), (x, y))
    loss = float(ref.step())
    snap = ref.snapshot()

    layers: list = []
    for w, (gamma, beta) in zip(params["layers"], params["norms"], strict=True):
        lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
        bn = torch.nn.BatchNorm1d(w.shape[0], eps=step_overhead.EPS, momentum=0.1)
        with torch.no_grad():
            lin.weight.copy_(torch.tensor(np.asarray(w)))
            bn.weight.copy_(torch.tensor(np.asarray(gamma)))
            bn.bias.copy_(torch.tensor(np.asarray(beta)))
        layers += [lin, bn, torch.nn.ReLU()]
    head = torch.nn.Linear(size.widths[-1], step_overhead.NUM_CLASSES)
    with torch.no_grad():
        head.weight.copy_(torch.tensor(np.asarray(params["head"][0])))
        head.bias.copy_(torch.tensor(np.asarray(params["head"][1])))
    net = torch.nn.Sequential(*layers, head)
    opt = torch.optim.Adam(net.parameters(), lr=step_overhead.LR)
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
