"""benchmarks/run.py runs every benchmark (tiny) and reports each; the CNN and residual
references of the step benchmarks match PyTorch; the many-cells fit is right."""

import json
import math
import re
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from _scripts import load_script


pytest.importorskip("flax")
pytest.importorskip("matplotlib")

_BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
SECTIONS = [
    "## Environment",
    "## Targets (issue 7)",
    "## Training-step overhead",
    "## Compile time",
    "## Many cells",
    "## KV-cache decoding",
    "## Data-parallel scaling",
]


def _load(name: str):
    return load_script("benchmarks", name)


@pytest.fixture(scope="module")
def so():
    return _load("step_overhead")


def _section(text: str, title: str) -> str:
    start = text.index(title + "\n")
    end = text.find("\n## ", start + len(title))
    return text[start : end if end >= 0 else len(text)]


def _row(section: str, first_cell: str) -> list[str]:
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and cells[0] == first_cell:
            return cells
    raise AssertionError(f"no row {first_cell!r} in:\n{section}")


def test_run_tiny_reports_every_benchmark(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(_BENCH / "run.py"), "--tiny", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = (tmp_path / "results.md").read_text(encoding="utf-8")
    raw = json.loads((tmp_path / "results.json").read_text(encoding="utf-8"))
    for title in SECTIONS:
        assert title + "\n" in text, title
    assert "FAILED" not in text
    assert set(raw["benchmarks"]) == {
        "step_overhead",
        "many_cells",
        "kv_cache",
        "scaling",
    }
    assert raw["environment"]["packages"]["jax"] in text

    # Step overhead: every variant at both tiny sizes, checked, with its ratio.
    steps = raw["benchmarks"]["step_overhead"]["result"]
    assert set(steps) == {"tiny", "tiny_cnn"}
    section = _section(text, "## Training-step overhead")
    for rows in steps.values():
        assert set(rows) == {
            "pure_jax",
            "es_value",
            "es_ref",
            "equinox",
            "nnx_jit",
            "nnx_split",
        }
        assert all(row["checked"] for row in rows.values())
        # The same-round ratio, recomputed from the raw rounds.
        for row in rows.values():
            base = rows["pure_jax"]["rounds_us"]
            ratio = statistics.median(
                t / b for t, b in zip(row["rounds_us"], base, strict=True)
            )
            assert row["ratio"] == pytest.approx(ratio)
    cell = _row(section, "es_ref")[2]  # columns: variant, tiny, tiny_cnn
    assert cell.endswith(f"{steps['tiny_cnn']['es_ref']['ratio']:.2f}×")

    # Targets: the measured cells are the step-overhead ratios and compile ratios.
    targets = _section(text, "## Targets (issue 7)")
    small = _row(targets, "small MLP-BN step (width 32, depth 2, batch 16)")
    assert small[2].startswith(f"{steps['tiny']['es_value']['ratio']:.2f}×")
    assert small[4].startswith(f"{steps['tiny']['es_ref']['ratio']:.2f}×")
    cnn = _row(targets, "small CNN-BN step (conv 3×3, 2 blocks, 8×8 inputs)")
    assert cnn[2].startswith(f"{steps['tiny_cnn']['es_value']['ratio']:.2f}×")
    compile_row = _row(targets, "compile time (first call), worst size")
    worst = max(
        steps[s]["es_value"]["compile_s"] / steps[s]["pure_jax"]["compile_s"]
        for s in ("tiny", "tiny_cnn")
    )
    assert compile_row[2].startswith(f"{worst:.2f}×")
    assert "✓" in compile_row[2] or "✗" in compile_row[2]

    # Many cells: the growth exponent, recomputed from the raw rounds.
    cells = raw["benchmarks"]["many_cells"]["result"]
    by_n = {int(n): rows for n, rows in cells["by_n"].items()}
    ns = sorted(by_n)

    def overhead(n, name):
        pairs = zip(
            by_n[n][name]["rounds_us"], by_n[n]["pure_jax"]["rounds_us"], strict=True
        )
        return statistics.median(t - p for t, p in pairs)

    for name in by_n[ns[0]]:
        if name == "pure_jax":
            continue
        o = [overhead(n, name) for n in ns]
        assert cells["fit"][name]["us"] == pytest.approx(o)
        exp_cell = _row(_section(text, "## Many cells"), name)[-1]
        if o[-2] > 0 and o[-1] > 0:
            exp = math.log(o[-1] / o[-2]) / math.log(ns[-1] / ns[-2])
            assert exp_cell == f"{exp:.2f}"
        else:
            assert exp_cell == "-"

    # KV cache and scaling: every variant reported.
    for name in raw["benchmarks"]["kv_cache"]["result"]:
        _row(_section(text, "## KV-cache decoding"), name)
    for n, times in raw["benchmarks"]["scaling"]["result"].items():
        for name in times:
            _row(_section(text, "## Data-parallel scaling"), f"{n} × {name}")

    for png in ("step_overhead.png", "many_cells.png", "kv_cache.png", "summary.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png
        assert f"]({png})" in text

    # The report is a function of results.json: re-rendering gives it back.
    subprocess.run(
        [
            sys.executable,
            str(_BENCH / "run.py"),
            "--render-only",
            "--out",
            str(tmp_path),
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    assert (tmp_path / "results.md").read_text(encoding="utf-8") == text


def test_run_reports_a_failed_benchmark():
    run = _load("run")
    env = {
        "date": "-",
        "python": "-",
        "platform": "-",
        "cpu": "-",
        "cpu_count": 2,
        "packages": {"jax": "-"},
        "commit": "-",
        "load_before": "-",
        "load_after": "-",
    }
    text = run.markdown(
        {"scaling": {"error": "AssertionError: es_ref differs"}},
        env,
        "python benchmarks/run.py --only scaling",
        False,
        Path("/nonexistent"),
        1.0,
    )
    section = _section(text, "## Data-parallel scaling")
    assert "**FAILED.**" in section and "es_ref differs" in section
    # No step-overhead results: the targets are reported as not measured.
    small = _row(_section(text, "## Targets (issue 7)"), run.TARGETS["small"][0])
    assert small[2] == small[4] == "-"


def _torch_step(size, params, x, y, lr):
    """One training step of `size`'s model in PyTorch: (loss, net)."""
    torch = pytest.importorskip("torch")
    nn = torch.nn

    def t(a):
        return torch.tensor(np.asarray(a))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            conv = len(size.in_shape) == 3
            self.layers, self.norms = nn.ModuleList(), nn.ModuleList()
            for w, (gamma, beta) in zip(params["layers"], params["norms"], strict=True):
                if conv:
                    lay = nn.Conv2d(w.shape[1], w.shape[0], 3, padding=1, bias=False)
                    bn = nn.BatchNorm2d(w.shape[0], eps=1e-5, momentum=0.1)
                else:
                    lay = nn.Linear(w.shape[1], w.shape[0], bias=False)
                    bn = nn.BatchNorm1d(w.shape[0], eps=1e-5, momentum=0.1)
                with torch.no_grad():
                    lay.weight.copy_(t(w))
                    bn.weight.copy_(t(gamma))
                    bn.bias.copy_(t(beta))
                self.layers.append(lay)
                self.norms.append(bn)
            self.head = nn.Linear(size.widths[-1], 10)
            with torch.no_grad():
                self.head.weight.copy_(t(params["head"][0]))
                self.head.bias.copy_(t(params["head"][1]))

        def forward(self, h):
            for lay, bn in zip(self.layers, self.norms, strict=True):
                out = torch.relu(bn(lay(h)))
                h = h + out if size.residual else out
            if h.ndim == 4:
                h = h.mean(dim=(2, 3))
            return self.head(h)

    net = Net()
    opt = torch.optim.Adam(net.parameters(), lr=lr)
    loss = nn.functional.cross_entropy(net(t(x)), t(y).long())
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.item(), net


@pytest.mark.parametrize("size_name", ["tiny_cnn", "cnn", "residual"])
def test_reference_matches_torch(so, size_name):
    """The hand-written reference of the CNN sizes and of the residual blocks (the
    many-cells model), one training step against PyTorch."""
    import jax

    if size_name == "residual":
        size = so.Size("residual", (6,) * 3, (6,), batch=5, steps=1, residual=True)
    else:
        size = so.SIZES[size_name]
    params = so.init_params(size, jax.random.key(0))
    x, y = so.make_data(size, jax.random.key(1))
    ref = so.PureJax(params, so.init_bn_state(size), (x, y), residual=size.residual)
    loss = float(ref.step())
    snap = ref.snapshot()
    want_loss, net = _torch_step(size, params, x, y, so.LR)

    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    np.testing.assert_allclose(
        snap["w0"], net.layers[0].weight.detach().numpy(), atol=1e-6
    )
    for i, bn in enumerate(net.norms):
        np.testing.assert_allclose(snap["mean"][i], bn.running_mean.numpy(), atol=1e-6)
        np.testing.assert_allclose(snap["var"][i], bn.running_var.numpy(), rtol=1e-5)


def test_check_tells_variance_conventions_apart_at_cnn_size(so, monkeypatch):
    """At the CNN size (2048 values per channel) the biased and unbiased running
    variances differ by ~3e-5 only; the check's tolerance follows, so a variant
    with the wrong convention is still rejected."""
    monkeypatch.setattr(so.EsValue, "biased_running_var", True)
    with pytest.raises(AssertionError, match=r"es_value: running var of BatchNorm \d"):
        so.build_and_check(so.SIZES["cnn"], ["pure_jax", "es_value"])


def test_many_cells_fit_recovers_a_line():
    mc = _load("many_cells")
    a, b = 7.0, 0.5  # overhead = a + b N (µs); pure JAX = 40 + 10 N

    def rows(n, jitter):
        base = [40 + 10 * n + j for j in jitter]
        return {
            "pure_jax": {"median_us": statistics.median(base), "rounds_us": base},
            "es_value": {"rounds_us": [t + a + b * n for t in base]},
        }

    by_n = {n: rows(n, [0.0, 3.0, -2.0]) for n in (1, 10, 30, 100)}
    fit = mc.fit(by_n)["es_value"]
    assert fit["us"] == pytest.approx([a + b * n for n in (1, 10, 30, 100)])
    assert fit["per_cell_us"] == pytest.approx(b)
    assert fit["intercept_us"] == pytest.approx(a)
    want = math.log((a + 100 * b) / (a + 30 * b)) / math.log(100 / 30)
    assert fit["exponent"] == pytest.approx(want)
    assert re.fullmatch(r"0\.\d+", f"{fit['exponent']:.2f}")  # sub-linear here
    assert mc.fit(by_n)["pure_jax"]["per_cell_us"] == pytest.approx(10.0)
