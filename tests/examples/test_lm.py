"""examples/train_lm.py: the language model trains, resumes bit for bit, logs to
TensorBoard, decodes with its KV cache as the uncached forward does, and runs on two
processes as on one."""

import math
import struct

import jax.numpy as jnp
import numpy as np
import pytest
from _scripts import cached_script


def lm():
    return cached_script("examples", "train_lm", "train_lm_example")


# a smaller model than --tiny: the default suite runs it in a few seconds
SMALL = ["--tiny", "--steps", "30", "--dim", "32", "--layers", "1"]
SMALL += ["--seq-len", "48", "--lr", "1e-2"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    directory = tmp_path_factory.mktemp("lm")
    out = lm().main([*SMALL, "--dir", str(directory), "--generate", "12", "--quiet"])
    return out, directory


def read_scalars(directory):
    """`{tag: [(step, value), ...]}` from the TensorBoard event files under
    `directory`, read with the record framing of TensorFlow's TFRecord format
    (length, masked CRC-32C of the length, the `Event` protobuf, masked CRC-32C of
    it) and tensorboardX's `Event` message."""
    from tensorboardX.crc32c import crc32c
    from tensorboardX.proto.event_pb2 import Event

    def masked(data: bytes) -> int:
        crc = crc32c(data)
        return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF

    scalars: dict[str, list] = {}
    files = sorted(directory.rglob("events.out.tfevents.*"))
    assert files, f"no event file under {directory}"
    for path in files:
        data, i = path.read_bytes(), 0
        while i < len(data):
            header = data[i : i + 8]
            (n,) = struct.unpack("<Q", header)
            assert struct.unpack("<I", data[i + 8 : i + 12])[0] == masked(header)
            body = data[i + 12 : i + 12 + n]
            assert struct.unpack("<I", data[i + 12 + n : i + 16 + n])[0] == masked(body)
            i += 16 + n
            event = Event.FromString(body)
            for value in event.summary.value:
                scalars.setdefault(value.tag, []).append(
                    (event.step, value.simple_value)
                )
    return scalars


def test_loss_decreases_and_the_metrics_are_the_steps_losses(run):
    out, _ = run
    history = out["history"]
    assert history["step"] == [10, 20, 30]
    # the first steps predict bytes about uniformly (ln 256 nats), then learn
    assert abs(history["step_losses"][0] - math.log(256)) < 0.2
    assert history["loss"][-1] < history["loss"][0] - 1.0
    assert out["heldout"]["ema"] < math.log(256) - 1.5
    # the loss metric, updated inside the step, is the mean of the losses the
    # steps returned since the last log (every step has as many tokens)
    losses = np.asarray(history["step_losses"]).reshape(3, 10).mean(1)
    np.testing.assert_allclose(history["loss"], losses, rtol=1e-5)
    np.testing.assert_allclose(history["perplexity"], np.exp(losses), rtol=1e-5)
    # the learning rate: warmup (10 steps, linear from 0) then cosine to lr / 10,
    # written out by hand
    lr, warmup, total = 1e-2, 10, 30

    def by_hand(t):
        if t < warmup:
            return lr * t / warmup
        frac = (t - warmup) / (total - warmup)
        return lr / 10 + (lr - lr / 10) * 0.5 * (1 + math.cos(math.pi * frac))

    np.testing.assert_allclose(
        history["lr"], [by_hand(s - 1) for s in history["step"]], rtol=1e-5
    )
    assert out["step"].trace_count == 1


def test_tensorboard_holds_the_logged_scalars(run):
    out, directory = run
    history = out["history"]
    scalars = read_scalars(directory / "tb")
    for name, key in [
        ("loss", "loss"),
        ("perplexity", "perplexity"),
        ("accuracy", "accuracy"),
        ("learning_rate", "lr"),
        ("grad_norm", "grad_norm"),
    ]:
        steps, values = zip(*scalars[f"train/{name}"])
        assert list(steps) == history["step"]
        np.testing.assert_allclose(values, history[key], rtol=1e-6)
    assert all(g > 0 for g in history["grad_norm"])
    # per-block activation statistics, from es.nn.Record via es.recorded
    for tag in ("std", "max_abs"):
        steps, values = zip(*scalars[f"activations/blocks.0.act.{tag}"])
        assert list(steps) == history["step"]
        np.testing.assert_allclose(
            values, [a[f"blocks.0.act.{tag}"] for a in history["activations"]]
        )
    std = [a["blocks.0.act.std"] for a in history["activations"]]
    top = [a["blocks.0.act.max_abs"] for a in history["activations"]]
    assert all(0 < s < m for s, m in zip(std, top))
    assert (directory / "lm_training.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cached_generation_equals_uncached_greedy_decoding(run):
    """The example's greedy decoding with KV caches (a batch of prompts of
    different lengths) against greedy decoding written here without any cache: the
    full forward pass on the sequence so far, one token at a time."""
    import equinox as eqx

    out, _ = run
    example = lm()
    assert out["generation"]["max_abs_diff"] < 1e-4
    trainer = out["trainer"]
    net = eqx.nn.inference_mode(trainer.ema.averaged(trainer.net))
    steps, lengths = 12, np.array([5, 17, 1])  # the shapes the example compiled
    rng = np.random.default_rng(0)
    prompts = rng.integers(32, 127, (3, 17)).astype(np.int32)

    def generate(temperature, seed):
        tokens, _ = example.generate(
            net,
            jnp.asarray(prompts),
            jnp.asarray(lengths),
            steps,
            jnp.float32(temperature),
            jnp.int32(seed),
        )
        return np.asarray(tokens)

    tokens = generate(0.0, 0)
    for i, n in enumerate(lengths):
        seq = np.zeros(17 + steps, np.int32)  # padding after the sequence: causal
        seq[:n] = prompts[i, :n]
        for k in range(steps):
            logits = example._forward(net, jnp.asarray(np.stack([seq] * 3)))[0]
            seq[n + k] = int(jnp.argmax(logits[n + k - 1]))
        assert tokens[i].tolist() == seq[n : n + steps].tolist()
    # sampling draws from the stream: two seeds give different continuations
    assert not np.array_equal(generate(1.5, 0), generate(1.5, 1))


def test_the_data_is_a_function_of_seed_and_position():
    example = lm()
    _, cfg = example.parse(["--tiny"])
    x1, y1 = example.batch_at(cfg, 7)
    x2, y2 = example.batch_at(cfg, 7)
    np.testing.assert_array_equal(x1, x2)
    np.testing.assert_array_equal(x1[:, 1:], y1[:, :-1])  # next-byte targets
    assert not np.array_equal(x1, example.batch_at(cfg, 8)[0])
    text = example.corpus()
    start = bytes(x1[0].astype(np.uint8))
    assert text.tobytes().find(start) >= 0  # a window of the text


def test_resume_in_process_is_bit_exact(run, tmp_path, monkeypatch):
    """Stopped between two checkpoints and resumed from the last one: the final
    state equals the uninterrupted run's (the fixture's) bit for bit."""
    out, _ = run
    example = lm()
    _, cfg = example.parse(SMALL)  # the fixture's configuration: its compiled step
    stopped = example.train(cfg, tmp_path, stop_at=25, quiet=True)
    assert stopped["position"] == 25
    resumed = example.train(cfg, tmp_path, quiet=True)
    assert resumed["start"] == 20  # the last checkpoint before the stop
    assert resumed["history"]["step"] == [30]
    got = (resumed["trainer"], resumed["opt_state"], resumed["position"])
    want = (out["trainer"], out["opt_state"], out["position"])
    assert len(example.leaves(want)) > 50
    assert example.compare_exact(got, want) == []
    # the checkpoint written at the end holds that state
    assert example.compare_exact(example.final_state(tmp_path, cfg), want) == []
    assert out["step"].trace_count == 1  # no second compilation
    # the batches depend on the text too: a checkpoint of another text is refused
    import eqx_state as es

    monkeypatch.setattr(example, "corpus_digest", lambda: 12345)
    with pytest.raises(es.CheckpointError, match="trained on another text"):
        example.train(cfg, tmp_path, quiet=True)


@pytest.mark.slow
def test_check_resume_kills_processes_mid_run_and_during_a_save(tmp_path, capsys):
    example = lm()
    args = ["--tiny", "--scan", "2", "--check-resume", "--dir", str(tmp_path)]
    assert example.main(args) == 0  # K = 2 steps per compiled call
    out = capsys.readouterr().out
    assert "dying after step 30; a save in flight: False" in out
    assert "dying after step 40; a save in flight: True" in out
    # the save of step 40 was lost: the last run resumed from step 20
    assert "    resumed from step 20 (data position 20)" in out.split("last run")[1]
    assert "resumed run == uninterrupted run, bit for bit" in out


@pytest.mark.slow
def test_two_processes_equal_one(tmp_path, capsys):
    example = lm()
    assert example.main(["--tiny", "--processes", "2", "--dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "2 processes == 1 process" in out
    assert out.count("compiled 1x") == 2
