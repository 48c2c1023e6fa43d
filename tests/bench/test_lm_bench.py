"""benchmarks/lm.py: every variant of the GPT training step passes the correctness
gate at the tiny size (eqx_state and every peer against hand-written JAX, and PyTorch
as an independent reference for all of them), the gate rejects a wrong optimizer,
and a full tiny run reports every variant."""

import json

import numpy as np
import optax
import pytest
from _scripts import load_script


pytest.importorskip("flax")
torch = pytest.importorskip("torch")

lm = load_script("benchmarks", "lm")
TINY = lm.SIZES["tiny"]
# The fast part: eqx_state's step and scan, and PyTorch (independent of JAX), each
# gated against the hand-written reference. The Equinox and Flax forms run in the
# slow full tiny run below.
FAST = ["es_step", "es_scan", "torch_eager"]


@pytest.mark.slow
def test_every_fast_variant_passes_the_gate(fast_compiles):
    torch.set_num_threads(1)
    runners, info, failed = lm.build_and_check(TINY, FAST)
    assert failed == {}
    assert list(runners) == FAST
    ref = info["es_step"]["check_losses"]
    assert len(ref) == lm.CHECK_STEPS
    # The tiny model learns its one batch: the loss falls from about log(vocab).
    assert abs(ref[0] - np.log(TINY.vocab)) < 0.1 and ref[-1] < ref[0] - 1e-3
    # PyTorch's losses (its own autograd and AdamW) match eqx_state's.
    np.testing.assert_allclose(info["torch_eager"]["check_losses"], ref, rtol=1e-4)
    # A scan call is K steps: whole calls, their losses those of as many steps.
    k_losses = info["es_scan"]["check_losses"]
    assert len(k_losses) == -(-lm.CHECK_STEPS // TINY.k) * TINY.k > len(ref)
    np.testing.assert_allclose(k_losses[: len(ref)], ref, rtol=1e-4)


class _NoWeightDecay(lm.PureJax):
    name = "no_weight_decay"

    def __init__(self, size, params, data):
        real = lm.optimizer
        lm.optimizer = lambda: optax.adamw(  # the same AdamW without weight decay
            lm.LR, b1=lm.BETAS[0], b2=lm.BETAS[1], eps=lm.ADAM_EPS, weight_decay=0.0
        )
        try:
            super().__init__(size, params, data)
        finally:
            lm.optimizer = real


class _DoubleLr(lm.EsStep):
    name = "double_lr"

    def __init__(self, size, params, data):
        super().__init__(size, params, data)
        self._step = lm.es.make_step(
            lm.gpt_loss,
            optax.adamw(
                2 * lm.LR,
                b1=lm.BETAS[0],
                b2=lm.BETAS[1],
                eps=lm.ADAM_EPS,
                weight_decay=lm.WEIGHT_DECAY,
            ),
            return_loss=True,
        )


@pytest.mark.slow
def test_gate_rejects_a_wrong_variant(fast_compiles, monkeypatch):
    """No weight decay (eqx_state's step otherwise right), or twice the learning
    rate: each is rejected, named, and not timed."""
    for wrong in (_NoWeightDecay, _DoubleLr):
        monkeypatch.setitem(lm.VARIANTS, wrong.name, wrong)
    runners, info, failed = lm.build_and_check(
        TINY, ["pure_jax", "no_weight_decay", "double_lr"]
    )
    assert list(runners) == ["pure_jax"] and set(failed) == {
        "no_weight_decay",
        "double_lr",
    }
    for why in failed.values():
        assert why.startswith("failed the correctness gate: "), why
        assert "differ from" in why, why
    # The reference itself is measured against eqx_state's step: rounding only.
    assert info["pure_jax"]["gate_errors"]["loss"] < lm.LOSS_RTOL / 10


@pytest.mark.slow
def test_tiny_run_reports_every_variant(tmp_path):
    """`lm.py --tiny`: every variant is gated and timed (torch.compile where it
    works here; if it cannot run, the report says why), the report and JSON agree."""
    out = lm.main(["--tiny", "--out", str(tmp_path)])
    res = out["result"]["tiny"]
    rows, failed = res["rows"], res["failed"]
    assert not {n: w for n, w in failed.items() if "correctness gate" in w}
    assert set(rows) | set(failed) == set(lm.VARIANTS)
    assert set(failed) <= {"torch_compile"}  # the only one allowed not to run
    for name, row in rows.items():
        assert row["checked"] and len(row["rounds_us"]) == 3, name
        assert row["tokens_per_s"] == pytest.approx(
            TINY.tokens / (row["median_us"] * 1e-6)
        )
    saved = json.loads((tmp_path / "results_lm.json").read_text("utf-8"))
    assert (
        saved["result"]["tiny"]["rows"]["es_step"]["rounds_us"]
        == (rows["es_step"]["rounds_us"])
    )
    text = (tmp_path / "results_lm.md").read_text("utf-8")
    for name in rows:
        assert f"| `{name}` |" in text
    assert "`es_step` × `pure_jax`" in text
