"""benchmarks/run.py runs every benchmark (tiny) and reports each; the CNN and residual
references of the step benchmarks match PyTorch; the many-cells fit is right."""

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from _scripts import load_script


pytest.importorskip("flax")
pytest.importorskip("matplotlib")

_BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
SECTIONS = [
    "## Environment",
    "## Targets",
    "## Training-step overhead",
    "## Compile time",
    "## Many cells",
    "## KV-cache decoding",
    "## Data-parallel scaling",
    "## Language model",
    "## Variants",
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


def _row(section: str, *first_cells: str) -> list[str]:
    """The first table row of `section` whose leading cells are `first_cells`."""
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and cells[: len(first_cells)] == list(first_cells):
            return cells
    raise AssertionError(f"no row {first_cells!r} in:\n{section}")


@pytest.mark.slow
def test_run_tiny_reports_every_benchmark(tmp_path):
    out, root = tmp_path / "out", tmp_path / "root"
    root.mkdir()
    (root / "README.md").write_text(
        "# x\n\n<!-- benchmarks:begin -->\nold\n<!-- benchmarks:end -->\n\ntail\n",
        encoding="utf-8",
    )
    cmd = [sys.executable, str(_BENCH / "run.py"), "--out", str(out)]
    proc = subprocess.run(
        [*cmd, "--tiny", "--docs-root", str(root)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = (out / "results.md").read_text(encoding="utf-8")
    raw = json.loads((out / "results.json").read_text(encoding="utf-8"))
    for title in SECTIONS:
        assert title + "\n" in text, title
    assert "FAILED" not in text
    assert set(raw["benchmarks"]) == {
        "step_overhead",
        "many_cells",
        "kv_cache",
        "scaling",
        "lm",
    }
    assert raw["environment"]["packages"]["jax"] in text
    # The benchmarks imported this checkout's eqx_state.
    here = str(Path(__file__).resolve().parents[2] / "eqx_state")
    for payload in raw["benchmarks"].values():
        assert payload["eqx_state"] == here
    run = _load("run")
    stats = run.stats

    # Step overhead: every available variant at both tiny sizes, checked; its
    # ratios (pipelined, blocking) and intervals are the raw rounds'.
    steps = raw["benchmarks"]["step_overhead"]["result"]
    assert set(steps) == {"tiny", "tiny_cnn"}
    so = run._sibling("step_overhead")
    section = _section(text, "## Training-step overhead")
    for size, rows in steps.items():
        assert list(rows) == so.default_variants(so.SIZES[size])
        assert all(row["checked"] for row in rows.values())
        for row in rows.values():
            for prefix in ("", "blocking_"):
                s = stats.ratio_summary(
                    row[prefix + "rounds_us"], rows["pure_jax"][prefix + "rounds_us"]
                )
                assert row[prefix + "ratio"] == pytest.approx(s["median"])
                assert row[prefix + "ratio_ci"] == pytest.approx(s["ci"])
    want = run.ratio(steps["tiny_cnn"], "es_ref")
    assert _row(section, "`es_ref`")[4] == stats.fmt_ratio(want)
    want = run.ratio(steps["tiny"], "nnx_jit", prefix="blocking_")
    blocking = section[section.index("**Blocking every step**") :]
    assert _row(blocking, "`nnx_jit`")[3] == stats.fmt_ratio(want)

    # Targets: each cell is the interval of the raw rounds and its verdict.
    targets = _section(text, "## Targets")
    small = run.SIZES["small"]
    s = run.ratio(steps["tiny"], "es_value", "eqx_jit")
    row = _row(targets, "11", small)
    assert row[4] == f"{stats.fmt_ratio(s)} {stats.verdict(s['ci'], 1.05)}"
    s = run.ratio(steps["tiny_cnn"], "es_ref")
    row = _row(targets, "7", run.SIZES["cnn"])
    assert row[5] == f"{stats.fmt_ratio(s)} {stats.verdict(s['ci'], 1.25)}"
    best = run.fastest_expert(steps["tiny"])
    assert so.VARIANTS[best].usage == "expert"
    row = _row(
        targets, "19", small, "× the fastest expert form of any peer (same rounds)"
    )
    s = run.ratio(steps["tiny"], "es_value", best)
    assert row[4].startswith(f"{stats.fmt_ratio(s)} {stats.verdict(s['ci'], 1.05)}")
    assert f"(vs `{best}`)" in row[4]
    for mark_cell in (row[4], row[5]):
        assert re.search(r" [✓✗?] ", mark_cell + " "), mark_cell
    if "es_scan100" not in steps["tiny"]:
        assert _row(targets, "16", small)[4] == "not measured"
    assert _row(targets, "7", run.SIZES["medium"])[4] == "not measured"  # not run

    # Many cells: the growth of each variant, recomputed from the raw rounds.
    cells = raw["benchmarks"]["many_cells"]["result"]
    by_n = {int(n): rows for n, rows in cells["by_n"].items()}
    mc = _section(text, "## Many cells")
    for name in by_n[min(by_n)]:
        if name == "pure_jax":
            continue
        f = stats.growth(
            {
                n: (by_n[n][name]["rounds_us"], by_n[n]["pure_jax"]["rounds_us"])
                for n in by_n
            }
        )
        growth = mc[mc.index("**Growth of the overhead**") :]
        row = _row(growth, name)
        assert row[2] == stats.fmt_interval(f["slope"], f["slope_ci"], " µs/BN")
    f = stats.growth(
        {
            n: (by_n[n]["es_value"]["rounds_us"], by_n[n]["eqx_jit"]["rounds_us"])
            for n in by_n
        }
    )
    row = _row(targets, "11", "many cells (1 to 3 BatchNorms)")
    assert row[4] == (
        f"{stats.fmt_interval(f['slope'], f['slope_ci'], ' µs/BN')} "
        f"{stats.verdict(f['slope_ci'], 0.0)}"
    )

    # Issue 23: ref mode against value mode, and the compile time at the most cells.
    # (the verdict reads the blocking timings; the pipelined ratio is shown beside)
    def blocking_cell(name, base, limit):
        b = run.ratio(steps["tiny_cnn"], name, base, prefix="blocking_")
        p = run.ratio(steps["tiny_cnn"], name, base)
        return (
            f"blocking: {stats.fmt_ratio(b)} {stats.verdict(b['ci'], limit)}; "
            f"pipelined: {stats.fmt_ratio(p)}"
        )

    how = "(same rounds; " + run.ISSUE23_HOW + ")"
    row = _row(targets, "23", run.SIZES["cnn"], "ref mode × value mode " + how)
    assert row[3:] == ["≤ 1.10×", "n/a", blocking_cell("es_ref", "es_value", 1.10)]
    # value mode within 1.05x eqx_jit at every size
    row = _row(targets, "23", run.SIZES["cnn"], "value mode × `eqx_jit` " + how)
    assert row[3:] == ["≤ 1.05×", blocking_cell("es_value", "eqx_jit", 1.05), "n/a"]
    # the slope row reads ref − value, and shows the A/A control's beside it
    row = _row(targets, "23", "many cells (1 to 3 BatchNorms)")
    control = stats.growth(
        {
            n: (
                by_n[n]["es_value_again"]["rounds_us"],
                by_n[n]["es_value"]["rounds_us"],
            )
            for n in by_n
        }
    )
    assert row[5].endswith(
        "; A/A control (es_value, a second instance − es_value): "
        + stats.fmt_interval(control["slope"], control["slope_ci"], " µs/BN")
    )
    n_max = max(by_n)
    row = _row(targets, "23", f"compile time at {n_max} BatchNorms")
    for col, name in ((4, "es_value"), (5, "es_ref")):
        s = stats.ratio_summary(
            by_n[n_max][name]["compile_samples_s"],
            by_n[n_max]["pure_jax"]["compile_samples_s"],
        )
        assert row[col] == f"{stats.fmt_ratio(s)} {stats.verdict(s['ci'], 1.2)}"

    # KV cache and scaling: every variant reported with its interval.
    kv = raw["benchmarks"]["kv_cache"]["result"]
    for name, r in kv.items():
        cell = _row(_section(text, "## KV-cache decoding"), name)[1]
        want = stats.ratio_summary(r["rounds_us"], kv[r["baseline"]]["rounds_us"])
        assert cell.endswith(stats.fmt_ratio(want))
    for n, times in raw["benchmarks"]["scaling"]["result"].items():
        for name, ts in times.items():
            cell = _row(_section(text, "## Data-parallel scaling"), f"{n} × {name}")
            want = stats.ratio_summary(ts, times["pure_jax"])
            assert cell[2] == stats.fmt_ratio(want)

    # Language model: lm.py's tables, every ratio that of the raw rounds.
    lm = raw["benchmarks"]["lm"]["result"]["result"]["tiny"]["rows"]
    assert "torch_compile" not in lm and {"es_step", "es_scan", "torch_eager"} <= set(
        lm
    )
    section = _section(text, "## Language model")
    for name, r in lm.items():
        want = stats.ratio_summary(r["rounds_us"], lm["pure_jax"]["rounds_us"])
        assert _row(section, f"`{name}`")[6] == stats.fmt_ratio(want)

    # What each variant is.
    variants = _section(text, "## Variants")
    for name in steps["tiny"]:
        cls = so.VARIANTS[name]
        assert _row(variants, f"`{name}`")[1:3] == [cls.family, cls.usage]

    for png in ("step_overhead.png", "many_cells.png", "kv_cache.png", "summary.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png
        assert f"]({png})" in text

    # The docs page and the README block come from the same results.
    page = (root / "docs" / "performance.md").read_text(encoding="utf-8")
    assert _section(page, "## Targets") == targets
    # the LM's tiny size table and its variants table
    assert _section(page, "## Language model").count("| `es_step` |") == 2
    assert (root / "docs" / "img" / "bench_step_overhead.png").exists()
    readme = (root / "README.md").read_text(encoding="utf-8")
    assert readme.startswith("# x\n\n<!-- benchmarks:begin -->\n")
    assert readme.endswith("<!-- benchmarks:end -->\n\ntail\n")
    assert "old" not in readme
    assert _row(readme, "11", small)[4] == _row(targets, "11", small)[4]

    # The reports are a function of results.json: re-rendering gives them back.
    subprocess.run(
        [*cmd, "--render-only", "--docs-root", str(root)],
        check=True,
        capture_output=True,
        timeout=120,
    )
    assert (out / "results.md").read_text(encoding="utf-8") == text
    assert (root / "docs" / "performance.md").read_text(encoding="utf-8") == page
    assert (root / "README.md").read_text(encoding="utf-8") == readme


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
    small = _row(_section(text, "## Targets"), "11", run.SIZES["small"])
    assert small[4] == small[5] == "not measured"


def test_run_passes_rounds_to_every_benchmark(tmp_path, monkeypatch):
    # `--rounds N` reaches each benchmark's own command line (each takes one);
    # without it, none is added (each keeps its default). The children are faked:
    # only the command lines are checked here.
    run = _load("run")
    seen: dict[str, list[str]] = {}
    scratch: set[Path] = set()  # where the children write (removed after the run)

    class FakeProc:
        returncode = 0

        def __init__(self, cmd, **kwargs):
            name, json_path = cmd[3], cmd[4]
            seen[name] = list(cmd[5:])
            scratch.add(Path(json_path).parent)
            Path(json_path).write_text(json.dumps({"result": name}), "utf-8")

        def poll(self):
            return 0

    monkeypatch.setattr(run.subprocess, "Popen", FakeProc)
    monkeypatch.setattr(run.time, "sleep", lambda s: None)
    names = list(run.BENCHES)
    got = run.run_all(names, False, tmp_path, len(names), rounds=41)
    assert {n: p["result"] for n, p in got.items()} == {n: n for n in names}
    for name in names:
        assert seen[name][-4:-2] == ["--rounds", "41"], (name, seen[name])
        assert got[name]["args"][-2:] == ["--rounds", "41"]  # what the report shows
    assert len(scratch) == 1 and not any(p.exists() for p in scratch)
    seen.clear()
    run.run_all(["many_cells"], False, tmp_path, 1)
    assert "--rounds" not in seen["many_cells"]
    with pytest.raises(SystemExit):  # not a number of rounds
        run.main(["--rounds", "0", "--render-only", "--out", str(tmp_path)])


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
@pytest.mark.split
def test_reference_matches_torch(so, size_name, fast_compiles):
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


@pytest.mark.slow  # the CNN size; the MLP sizes are checked by the fast tests
def test_check_tells_variance_conventions_apart_at_cnn_size(
    so, monkeypatch, fast_compiles
):
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
            "pure_jax": {"rounds_us": base, "blocking_rounds_us": base},
            "es_value": {
                "rounds_us": [t + a + b * n for t in base],
                "blocking_rounds_us": [t + 2 * b * n for t in base],
            },
            "eqx_jit": {
                "rounds_us": [t + a for t in base],
                "blocking_rounds_us": base,
            },
        }

    by_n = {n: rows(n, [0.0, 3.0, -2.0]) for n in (1, 10, 30, 100)}
    fits = mc.fit(by_n)
    f = fits["pure_jax"]["es_value"]
    assert f["diff"] == pytest.approx([a + b * n for n in (1, 10, 30, 100)])
    assert f["slope"] == pytest.approx(b)
    assert f["intercept"] == pytest.approx(a)
    xs, ys = np.log([1, 10, 30, 100]), np.log([a + b * n for n in (1, 10, 30, 100)])
    assert f["exponent"] == pytest.approx(np.polyfit(xs, ys, 1)[0])
    assert fits["blocking"]["es_value"]["slope"] == pytest.approx(2 * b)
    assert fits["pure_jax"]["pure_jax"]["slope"] == pytest.approx(10.0)
    # Against eqx_jit (issue 11): the difference grows by b per BatchNorm.
    assert fits["eqx_jit"]["es_value"]["slope"] == pytest.approx(b)
    assert "eqx_jit" not in fits["eqx_jit"]  # only eqx_state's variants
