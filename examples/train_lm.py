"""Train a small GPT-style byte-level language model, resume it bit for bit, and
generate from its EMA weights with a KV cache.

The text ships with the repository: its own documentation (`docs/*.md` and the
README, about 140 kB; nothing is downloaded), read as UTF-8 bytes (a vocabulary of
256). The last 5% is held out.

**The train state** is a `Trainer` module and the optimizer state, and every piece of
state is written where it is computed, inside one compiled `es.make_step`:

* the network: token and learned position embeddings, pre-LayerNorm blocks of
  `es.nn.CausalSelfAttention` and a GELU MLP, the output head tied to the token
  embedding; `es.nn.Dropout` layers with random streams of their own;
  `es.nn.Record` layers keeping per-block activation statistics;
* `es.nn.EMA`: an exponential moving average of the weights (for evaluation and
  generation);
* `es.metrics`: the token loss and the token accuracy of every step since the last
  log (perplexity is `exp` of the mean token loss);
* the optimizer state: AdamW with a warmup-cosine learning rate, clipping by the
  global gradient norm, and a probe that keeps the last gradient norm for logging;
  its step count (`es.step_count`) drives the schedule.

**The data** is a pure function of `(seed, position)`: the batch at position `p`
is drawn from `np.random.default_rng((seed, p))`. The position (the number of
batches consumed) is the only state of the pipeline; it is saved with the model.

**Checkpoints**: an Orbax `CheckpointManager` (asynchronous, every `--save-every`
steps, keeps `--keep`) saves `{"trainer", "opt_state", "position"}` and a
fingerprint of the text (a resume on another text is refused); a run started
on a directory that holds one resumes from the latest. `--check-resume` proves the
resume exact: an uninterrupted run, a run killed mid-interval (`--die-at-step`, an
`os._exit`), a run resumed from it and killed again while an asynchronous save is in
flight, and a run that resumes and finishes, all fresh processes; the final state
must equal the uninterrupted run's bit for bit (exit 1 otherwise).

**Generation**: the EMA weights, in inference mode, with `es.nn.with_kv_cache` (one
cache row and one cursor per sequence) decode a batch of prompts of different
lengths, greedily and by temperature sampling (the keys from an `es.nn.Rng`
stream); every step's logits are checked against the uncached forward pass.

**Logs**: loss, perplexity, accuracy, learning rate and gradient norm, and every
block's activation statistics (`es.recorded`), to TensorBoard (tensorboardX) in
`<dir>/tb`; a tqdm bar with tokens/s; the curves in `<dir>/lm_training.png`.

**Several processes**: `--processes 2` trains data-parallel on 2 local processes
(one CPU device each, `make_step(mesh=...)`, each process feeding its rows with
`es.process_slice` / `es.global_batch`) with the launcher of
`examples/train_multiprocess.py`, and compares with one process.

    python examples/train_lm.py --tiny                 # about 20 s on 2 cores
    python examples/train_lm.py --tiny --check-resume  # about a minute
    python examples/train_lm.py --tiny --processes 2
    python examples/train_lm.py --dir runs/lm          # a larger run; resumable

Needs the `lm` extra: `pip install "eqx_state[lm]"`.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import Array, Float, Int

import eqx_state as es


HERE = Path(__file__).resolve().parent
VOCAB = 256  # bytes


# -- configuration -------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Config:
    """Everything that determines a run's numbers (two runs with equal configs train
    the same model, bit for bit)."""

    steps: int = 2000
    batch: int = 32
    seq_len: int = 128
    dim: int = 128
    heads: int = 4
    layers: int = 4
    dropout: float = 0.1
    lr: float = 3e-3
    warmup: int = 100
    weight_decay: float = 0.1
    clip: float = 1.0
    ema_decay: float = 0.995
    seed: int = 0
    scan: int = 1  # steps per compiled call
    log_every: int = 20
    save_every: int = 200
    keep: int = 2


TINY = dict(
    steps=60,
    batch=16,
    seq_len=64,
    dim=64,
    heads=4,
    layers=2,
    lr=3e-3,
    warmup=10,
    ema_decay=0.9,
    log_every=10,
    save_every=20,
)


# -- the data: a pure function of (seed, position) ------------------------------------


@functools.cache
def corpus() -> np.ndarray:
    """The training text as bytes: the repository's documentation (sorted, so the
    same everywhere), or, where the docs are not at hand (an installed package),
    the source of a few standard-library modules."""
    docs = HERE.parent / "docs"
    paths = sorted(docs.rglob("*.md")) + [HERE.parent / "README.md"]
    if docs.is_dir():
        text = "\n\n".join(p.read_text(encoding="utf-8") for p in paths if p.exists())
    else:  # pragma: no cover - an installed copy without the docs
        import inspect
        import json.decoder
        import textwrap

        text = "\n\n".join(inspect.getsource(m) for m in (textwrap, json.decoder))
    return np.frombuffer(text.encode("utf-8"), np.uint8)


@functools.cache
def corpus_digest() -> int:
    """A fingerprint of the text, saved with every checkpoint: the batch at a
    position depends on the text too, so a resume on another text (the docs were
    edited in between) would not continue the same run."""
    digest = hashlib.sha256(corpus().tobytes()).digest()
    return int.from_bytes(digest[:7], "little")


def split() -> tuple[np.ndarray, np.ndarray]:
    """(train, held-out): the last 5% of the text is held out."""
    data = corpus()
    cut = int(len(data) * 0.95)
    return data[:cut], data[cut:]


def batch_at(cfg: Config, position: int) -> tuple[np.ndarray, np.ndarray]:
    """The global batch at data position `position`: `cfg.batch` windows of
    `cfg.seq_len + 1` bytes at offsets drawn from `default_rng((seed, position))`.
    Inputs and next-byte targets, `int32[batch, seq_len]` each."""
    train, _ = split()
    rng = np.random.default_rng((cfg.seed, position))
    starts = rng.integers(0, len(train) - cfg.seq_len - 1, size=cfg.batch)
    windows = np.stack([train[s : s + cfg.seq_len + 1] for s in starts])
    return windows[:, :-1].astype(np.int32), windows[:, 1:].astype(np.int32)


def batches(cfg: Config, position: int, count: int):
    """`count` consecutive batches from `position`, stacked (`[count, batch, seq]`)."""
    xs, ys = zip(*(batch_at(cfg, position + i) for i in range(count)))
    return np.stack(xs), np.stack(ys)


# -- the model -----------------------------------------------------------------------


def per_token(layer, x):
    """Apply a per-vector layer (`eqx.nn.Linear`, `LayerNorm`) to `[batch, seq, d]`.

    A `Linear` is applied as one matmul, `x @ weight.T + bias`: the same dot
    products as `jax.vmap(jax.vmap(layer))(x)`, without the transposes XLA's CPU
    backend adds around the per-vector form (about 15% of a training step of this
    model, `benchmarks/README.md`, section `lm.py`)."""
    if isinstance(layer, eqx.nn.Linear):
        y = x @ layer.weight.T
        return y if layer.bias is None else y + layer.bias
    return jax.vmap(jax.vmap(layer))(x)


class Block(eqx.Module):
    """Pre-LayerNorm transformer block on a batch `[batch, seq, dim]`."""

    ln1: eqx.nn.LayerNorm
    attn: es.nn.CausalSelfAttention
    drop1: es.nn.Dropout
    ln2: eqx.nn.LayerNorm
    fc1: eqx.nn.Linear
    fc2: eqx.nn.Linear
    drop2: es.nn.Dropout
    act: es.nn.Record  # statistics of the block's output (the residual stream)

    def __init__(self, dim: int, heads: int, p: float, *, key):
        k1, k2, k3, k4, k5 = jax.random.split(key, 5)
        self.ln1 = eqx.nn.LayerNorm(dim)
        # no biases in the projections: a key bias gets an exactly-zero gradient
        # (softmax ignores a shift shared by all keys), and Adam would turn its
        # rounding noise into steps of the learning rate's size
        self.attn = es.nn.CausalSelfAttention(dim, heads, use_bias=False, key=k1)
        self.drop1 = es.nn.Dropout(p, key=k4)  # a random stream of its own
        self.ln2 = eqx.nn.LayerNorm(dim)
        self.fc1 = eqx.nn.Linear(dim, 4 * dim, key=k2)
        self.fc2 = eqx.nn.Linear(4 * dim, dim, key=k3)
        self.drop2 = es.nn.Dropout(p, key=k5)
        self.act = es.nn.Record("std", "max_abs")

    def __call__(self, x: Float[Array, "b s d"]) -> Float[Array, "b s d"]:
        # attention runs per sequence; with caches built for a batch
        # (`with_kv_cache(..., batch_size=B)`) each sequence has its own cache row
        axes = es.nn.kv_cache_axes(self.attn)
        attend = jax.vmap(lambda attn, h: attn(h), in_axes=(axes, 0))
        x = x + self.drop1(attend(self.attn, per_token(self.ln1, x)))
        h = jax.nn.gelu(per_token(self.fc1, per_token(self.ln2, x)))
        x = x + self.drop2(per_token(self.fc2, h))
        return self.act(x)  # records, returns x unchanged


class GPT(eqx.Module):
    """Token + position embeddings, blocks, a final LayerNorm and an output head
    tied to the token embedding (`logits = h @ embed.weight.T`)."""

    embed: eqx.nn.Embedding
    pos: Float[Array, "ctx dim"]
    drop: es.nn.Dropout
    blocks: list[Block]
    ln_f: eqx.nn.LayerNorm

    def __init__(self, cfg: Config, *, key):
        ke, kp, kd, *kb = jax.random.split(key, 3 + cfg.layers)
        self.embed = eqx.nn.Embedding(
            VOCAB, cfg.dim, weight=0.02 * jax.random.normal(ke, (VOCAB, cfg.dim))
        )
        self.pos = 0.02 * jax.random.normal(kp, (cfg.seq_len, cfg.dim))
        self.drop = es.nn.Dropout(cfg.dropout, key=kd)
        self.blocks = [Block(cfg.dim, cfg.heads, cfg.dropout, key=k) for k in kb]
        self.ln_f = eqx.nn.LayerNorm(cfg.dim)

    def __call__(self, tokens: Int[Array, "b s"]) -> Float[Array, "b s vocab"]:
        """Logits for a batch of whole sequences (no caches), or for the next chunk
        of each sequence (with caches: positions continue from each cursor)."""
        start = self.blocks[0].attn.position()  # 0, or the cursors `[batch]`
        positions = start[..., None] + jnp.arange(tokens.shape[-1])
        x = self.drop(self.embed.weight[tokens] + self.pos[positions])
        for block in self.blocks:
            x = block(x)
        return per_token(self.ln_f, x) @ self.embed.weight.T


class Trainer(eqx.Module):
    """The model and everything trained or tracked with it."""

    net: GPT
    ema: es.nn.EMA
    metrics: es.metrics.Metrics

    def __init__(self, cfg: Config):
        self.net = GPT(cfg, key=jax.random.key(cfg.seed))
        self.ema = es.nn.EMA(self.net, cfg.ema_decay, dynamic_decay=True)
        self.metrics = es.metrics.Metrics(
            loss=es.metrics.Mean(), accuracy=es.metrics.Accuracy()
        )


def loss_fn(trainer: Trainer, x, y):
    logits = trainer.net(x)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, y)  # per token
    trainer.ema.update(trainer.net)  # state writes, threaded by make_step
    trainer.metrics.update(loss=losses, accuracy=(logits, y))
    return jnp.mean(losses)


# -- the optimizer ---------------------------------------------------------------------


class GradNormState(NamedTuple):
    norm: jax.Array


def keep_grad_norm() -> optax.GradientTransformation:
    """Keep the global norm of the gradients (before clipping) in the optimizer
    state, for logging; the updates pass through unchanged."""

    def init(params):
        del params
        return GradNormState(jnp.zeros((), jnp.float32))

    def update(updates, state, params=None):
        del state, params
        return updates, GradNormState(optax.tree.norm(updates))

    return optax.GradientTransformation(init, update)


def schedule(cfg: Config) -> optax.Schedule:
    return optax.warmup_cosine_decay_schedule(
        0.0, cfg.lr, cfg.warmup, max(cfg.steps, cfg.warmup + 1), cfg.lr / 10
    )


def optimizer(cfg: Config) -> optax.GradientTransformation:
    # weight decay on the matrices only (not on LayerNorm scales or biases)
    decay_mask = lambda p: jax.tree.map(lambda x: x.ndim >= 2, p)  # noqa: E731
    return optax.chain(
        keep_grad_norm(),
        optax.clip_by_global_norm(cfg.clip),
        optax.adamw(
            schedule(cfg), b2=0.99, weight_decay=cfg.weight_decay, mask=decay_mask
        ),
    )


@functools.cache
def make_train_step(cfg: Config, mesh: jax.sharding.Mesh | None = None) -> es.Step:
    """One compiled step per configuration (and mesh), shared by the runs of a
    process."""
    return es.make_step(loss_fn, optimizer(cfg), return_loss=True, mesh=mesh)


def fresh(cfg: Config):
    """The train state at step 0."""
    trainer = Trainer(cfg)
    return trainer, make_train_step(cfg).init(trainer), np.int64(0)


# -- checkpoints -----------------------------------------------------------------------


def checkpoint_manager(directory: Path, cfg: Config):
    import orbax.checkpoint as ocp

    options = ocp.CheckpointManagerOptions(
        max_to_keep=cfg.keep, save_interval_steps=cfg.save_every
    )  # asynchronous by default
    return ocp.CheckpointManager(
        directory.resolve(),
        options=options,
        item_handlers=ocp.StandardCheckpointHandler(),  # a fresh process reads it
    )


def save(manager, step: int, trainer, opt_state, position: int, *, force=False):
    import orbax.checkpoint as ocp

    item = {
        "trainer": trainer,
        "opt_state": opt_state,
        "position": np.int64(position),
        "corpus": np.int64(corpus_digest()),
    }
    return manager.save(
        step, args=ocp.args.StandardSave(es.to_orbax(item)), force=force
    )


def restore(manager, step: int, cfg: Config, mesh=None):
    """`(trainer, opt_state, position)` saved at `step`, restored into an abstract
    train state (nothing is allocated twice), laid out for `mesh`."""
    import orbax.checkpoint as ocp

    train_step = make_train_step(cfg, mesh)

    def abstract():
        trainer = Trainer(cfg)
        return trainer, train_step.init(trainer)

    trainer, opt_state = eqx.filter_eval_shape(abstract)
    if mesh is not None:
        trainer, opt_state = train_step.place(trainer, opt_state)
    else:  # on this process's first device, wherever the checkpoint was written
        device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        trainer, opt_state = jax.tree.map(
            lambda s: (
                jax.ShapeDtypeStruct(
                    s.shape, s.dtype, sharding=device, weak_type=s.weak_type
                )
                if isinstance(s, jax.ShapeDtypeStruct)
                else s
            ),
            (trainer, opt_state),
        )
    like = {"trainer": trainer, "opt_state": opt_state}
    like.update(position=np.int64(0), corpus=np.int64(0))
    target = es.orbax_target(like, manager.item_metadata(step))  # checks dtypes
    got = es.from_orbax(
        manager.restore(step, args=ocp.args.StandardRestore(target)), like
    )
    if int(got["corpus"]) != corpus_digest():
        raise es.CheckpointError(
            f"The checkpoint of step {step} in {manager.directory} was trained on "
            "another text (the documentation changed since): resuming would not "
            "continue the same run. Start over (`--fresh`, or another `--dir`)."
        )
    return got["trainer"], got["opt_state"], int(got["position"])


# -- training ----------------------------------------------------------------------------


def train(
    cfg: Config,
    run_dir: Path,
    *,
    mesh: jax.sharding.Mesh | None = None,
    die_at: int | None = None,
    stop_at: int | None = None,
    quiet: bool = False,
) -> dict[str, Any]:
    """Train to `cfg.steps`, resuming from the latest checkpoint in
    `run_dir/checkpoints` if there is one.

    `die_at`: `os._exit(3)` right after step `die_at` (after handing its checkpoint
    to the asynchronous writer, if it is a save step: the save is then in flight).
    `stop_at`: stop cleanly after that step (saves finished).
    """
    run_dir = Path(run_dir)
    train_step = make_train_step(cfg, mesh)
    lead = jax.process_index() == 0
    manager = checkpoint_manager(run_dir / "checkpoints", cfg)
    start = manager.latest_step()
    if start is None:
        trainer, opt_state, position = fresh(cfg)
        if mesh is not None:
            trainer, opt_state = train_step.place(trainer, opt_state)
        start = 0
    else:
        trainer, opt_state, position = restore(manager, start, cfg, mesh)
        assert position == start == int(es.step_count(opt_state)), "inconsistent"
        if lead:
            print(f"resumed from step {start} (data position {position})", flush=True)
    writer = None
    if lead:
        from tensorboardX import SummaryWriter

        writer = SummaryWriter(str(run_dir / "tb"))
    from tqdm import tqdm

    rows = slice(None) if mesh is None else es.process_slice(cfg.batch, mesh)
    lr = schedule(cfg)
    k = cfg.scan
    tokens_per_step = cfg.batch * cfg.seq_len
    history: dict[str, list] = {"step": [], "loss": [], "perplexity": [], "lr": []}
    history.update(accuracy=[], grad_norm=[], activations=[], step_losses=[])
    bar = tqdm(total=cfg.steps, initial=start, disable=quiet or not lead, desc="train")
    seconds, trained = 0.0, 0
    step = start
    while step < cfg.steps:
        t = time.perf_counter()
        if k == 1:
            x, y = batch_at(cfg, position)
            x, y = x[rows], y[rows]
            if mesh is not None:
                x, y = es.global_batch((x, y), mesh)
            trainer, opt_state, loss = train_step(trainer, opt_state, x, y)
        else:
            xs, ys = batches(cfg, position, k)
            xs, ys = xs[:, rows], ys[:, rows]
            if mesh is not None:
                xs, ys = es.global_batch((xs, ys), mesh, batch_axis=1)
            trainer, opt_state, loss = train_step.scan(trainer, opt_state, xs, ys)
        step, position = step + k, position + k
        history["step_losses"] += np.atleast_1d(np.asarray(loss)).tolist()
        if step > start + k:  # not the first call (which compiles)
            seconds += time.perf_counter() - t
            trained += k
        bar.update(k)
        if trained:
            bar.set_postfix(
                loss=f"{float(jnp.mean(loss)):.3f}",
                tok_s=f"{trained * tokens_per_step / seconds:,.0f}",
            )
        if step % cfg.log_every == 0:
            trainer = log(trainer, opt_state, step, lr(step - 1), writer, history)
        if step % cfg.save_every == 0 or step == cfg.steps:
            save(manager, step, trainer, opt_state, position, force=step == cfg.steps)
        if die_at is not None and step == die_at:
            in_flight = manager.is_saving_in_progress()
            print(f"dying after step {step}; a save in flight: {in_flight}", flush=True)
            os._exit(3)  # no cleanup: the in-flight save is lost, older ones stay
        if stop_at is not None and step == stop_at:
            break
    bar.close()
    manager.wait_until_finished()
    manager.close()
    if writer is not None:
        writer.close()
    return {
        "trainer": trainer,
        "opt_state": opt_state,
        "position": int(position),
        "start": start,
        "history": history,
        "step": train_step,
        "tokens_per_s": trained * tokens_per_step / seconds if seconds else 0.0,
    }


def log(trainer, opt_state, step: int, lr, writer, history) -> Trainer:
    """Write the scalars and the activation statistics of the steps since the last
    log, then start the metrics and recordings over."""
    metrics = {k: float(v) for k, v in trainer.metrics.compute().items()}
    # the probe's state: the gradient norm of the last step
    scalars = {
        "loss": metrics["loss"],
        "perplexity": float(np.exp(metrics["loss"])),
        "accuracy": metrics["accuracy"],
        "learning_rate": float(lr),
        "grad_norm": float(opt_state[0].norm),
    }
    recorded = {k: float(v) for k, v in es.recorded(trainer.net).items()}
    if writer is not None:
        for name, value in scalars.items():
            writer.add_scalar(f"train/{name}", value, step)
        for name, value in recorded.items():  # "blocks.0.act.std", ...
            writer.add_scalar(f"activations/{name}", value, step)
        writer.flush()
    history["step"].append(step)
    history["lr"].append(scalars["learning_rate"])
    for name in ("loss", "perplexity", "accuracy", "grad_norm"):
        history[name].append(scalars[name])
    history["activations"].append(recorded)
    return es.reset(trainer, (es.MetricState, es.RecordState))


# -- evaluation and generation --------------------------------------------------------


@eqx.filter_jit
def _eval_loss(net: GPT, x, y):
    logits = eqx.nn.inference_mode(net)(x)
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, y))


def heldout_loss(cfg: Config, net: GPT, batches: int = 4) -> float:
    """The mean token loss on fixed windows of the held-out text."""
    _, held = split()
    n = cfg.seq_len + 1
    starts = np.linspace(0, len(held) - n, batches * cfg.batch).astype(int)
    windows = np.stack([held[s : s + n] for s in starts]).astype(np.int32)
    windows = windows.reshape(batches, cfg.batch, n)
    return float(np.mean([_eval_loss(net, w[:, :-1], w[:, 1:]) for w in windows]))


class Sampler(eqx.Module):
    """A network holding KV caches (one row per sequence) and the random stream
    that temperature sampling draws from."""

    net: GPT
    rng: es.nn.Rng


def decode(sampler: Sampler, prompts, lengths, steps: int, temperature):
    """Prefill a batch of prompts (padded to one length), set each sequence's cursor
    to its length, then generate `steps` tokens per sequence in a `lax.scan`:
    greedily (`temperature == 0`) or sampled from `softmax(logits / temperature)`.
    Writes the caches and the stream: run it inside `es.apply`.

    Returns the tokens `[batch, steps]` and the logits each was chosen from
    `[batch, steps, vocab]`."""

    def pick(logits):
        # one program for both: the stream is drawn from either way
        key = sampler.rng()
        sampled = jax.random.categorical(key, logits / jnp.maximum(temperature, 1e-6))
        greedy = jnp.argmax(logits, -1)
        return jnp.where(temperature > 0, sampled, greedy).astype(prompts.dtype)

    prefill = sampler.net(prompts)
    es.nn.truncate_kv_cache(sampler.net, lengths)
    first_logits = prefill[jnp.arange(prompts.shape[0]), lengths - 1]

    def one(token, _):
        logits = sampler.net(token[:, None])[:, 0]
        return pick(logits), (token, logits)

    last, (fed, logits) = jax.lax.scan(one, pick(first_logits), None, length=steps - 1)
    tokens = jnp.concatenate([fed, last[None]]).T
    logits = jnp.concatenate([first_logits[None], logits]).transpose(1, 0, 2)
    return tokens, logits


@eqx.filter_jit
def generate(net: GPT, prompts, lengths, steps: int, temperature, seed):
    """Decode with a fresh batch of caches (value mode, inside `es.apply`)."""
    context = net.pos.shape[0]  # positions past it would index `pos` out of range,
    if prompts.shape[1] + steps > context:  # which JAX clamps to the last row
        raise ValueError(
            f"generate: a prompt of {prompts.shape[1]} tokens and {steps} new ones "
            f"exceed the model's context of {context} positions (--seq-len)"
        )
    cached = es.nn.with_kv_cache(
        net, prompts.shape[1] + steps, batch_size=prompts.shape[0]
    )
    sampler = Sampler(cached, es.nn.Rng(jax.random.key(seed)))
    (tokens, logits), _ = es.apply(
        decode, sampler, prompts, lengths, steps, temperature
    )
    return tokens, logits


@eqx.filter_jit
def _forward(net: GPT, tokens):
    return net(tokens)


def check_generation(cfg: Config, net: GPT, steps: int, quiet=False) -> dict:
    """Generate from a batch of prompts of different lengths, greedily and sampled,
    and check every step's logits against the uncached forward pass on the prompt
    followed by the generated tokens (and the greedy tokens against its argmax)."""
    net = eqx.nn.inference_mode(net)  # no dropout, no recording
    _, held = split()
    lengths = np.array([3, 17, 9])
    longest = int(lengths.max())
    if longest + steps > cfg.seq_len:
        raise SystemExit(f"--generate {steps}: prompt + tokens exceed --seq-len")
    prompts = np.zeros((len(lengths), longest), np.int32)
    for i, n in enumerate(lengths):
        prompts[i, :n] = held[100 * i : 100 * i + n]
    result: dict[str, Any] = {"max_abs_diff": 0.0}
    for name, temperature in (("greedy", 0.0), ("sampled", 0.8)):
        tokens, logits = generate(
            net,
            jnp.asarray(prompts),
            jnp.asarray(lengths),
            steps,
            jnp.float32(temperature),  # traced: one compilation for both
            jnp.int32(0),
        )
        tokens, logits = np.asarray(tokens), np.asarray(logits)
        # the reference: the whole sequence through the uncached forward pass
        full = np.zeros((len(lengths), longest + steps), np.int32)
        for i, n in enumerate(lengths):
            full[i, :n], full[i, n : n + steps] = prompts[i, :n], tokens[i]
        want = np.asarray(_forward(net, jnp.asarray(full)))
        for i, n in enumerate(lengths):
            ref = want[i, n - 1 : n - 1 + steps]
            diff = float(np.max(np.abs(logits[i] - ref)))
            result["max_abs_diff"] = max(result["max_abs_diff"], diff)
            if diff > 1e-4 * max(1.0, float(np.max(np.abs(ref)))):
                raise AssertionError(
                    f"{name} row {i}: cached logits differ from the uncached "
                    f"forward by {diff:.3g}"
                )
            if temperature == 0 and not np.array_equal(tokens[i], ref.argmax(-1)):
                raise AssertionError(f"greedy row {i}: not the uncached argmax")
        result[name] = [
            bytes(prompts[i, :n].astype(np.uint8)).decode("utf-8", "replace")
            + " | "
            + bytes(tokens[i].astype(np.uint8)).decode("utf-8", "replace")
            for i, n in enumerate(lengths)
        ]
        if not quiet:
            for line in result[name]:
                print(f"{name:>8}: {line!r}")
    if not quiet:
        print(
            "cached decoding == uncached forward: max |logit difference| "
            f"{result['max_abs_diff']:.2e}"
        )
    return result


def plot(history: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = history["step"]
    fig, axes = plt.subplots(1, 4, figsize=(15, 3.3))
    axes[0].plot(steps, history["loss"], marker=".")
    axes[0].set_ylabel("training loss (nats/byte)")
    axes[1].plot(steps, history["lr"], label="learning rate")
    axes[1].set_ylabel("learning rate")
    axes[2].plot(steps, history["grad_norm"], marker=".")
    axes[2].set_ylabel("gradient norm (before clipping)")
    names = sorted({n for rec in history["activations"] for n in rec if ".std" in n})
    for n in names:
        axes[3].plot(
            steps, [rec.get(n, np.nan) for rec in history["activations"]], label=n
        )
    axes[3].set_ylabel("activation std per block")
    axes[3].legend(fontsize=7)
    for ax in axes:
        ax.set_xlabel("step")
    fig.suptitle("eqx_state: a byte-level GPT on the repository's docs")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# -- the checks that need several processes --------------------------------------------


def config_args(cfg: Config) -> list[str]:
    """The command-line flags that reproduce `cfg`."""
    out = []
    for field in dataclasses.fields(Config):
        out += [f"--{field.name.replace('_', '-')}", str(getattr(cfg, field.name))]
    return out


def final_state(directory: Path, cfg: Config):
    with checkpoint_manager(directory / "checkpoints", cfg) as manager:
        return restore(manager, cfg.steps, cfg)


def leaves(tree) -> list[tuple[str, np.ndarray]]:
    flat = jax.tree_util.tree_flatten_with_path(es.freeze(tree))[0]
    return [
        (jax.tree_util.keystr(p), np.asarray(v))
        for p, v in flat
        if isinstance(v, jax.Array | np.ndarray | np.generic | int)
        and not isinstance(v, bool)  # flags (`inference`) are configuration
    ]


def compare_exact(got, want) -> list[str]:
    """The leaves whose bits differ."""
    return [
        name
        for (name, g), (_, w) in zip(leaves(got), leaves(want), strict=True)
        if g.dtype != w.dtype or g.shape != w.shape or g.tobytes() != w.tobytes()
    ]


def run_script(args: list[str], log: Path, timeout: float) -> int:
    with open(log, "wb") as f:
        proc = subprocess.run(
            [sys.executable, str(Path(__file__).resolve()), *args],
            stdout=f,
            stderr=subprocess.STDOUT,
            timeout=timeout,
            env=dict(
                os.environ,
                PYTHONPATH=os.pathsep.join(
                    [str(HERE.parent), os.environ.get("PYTHONPATH", "")]
                ),
            ),
        )
    return proc.returncode


def check_resume(cfg: Config, root: Path, timeout: float) -> int:
    """Uninterrupted run vs. killed + resumed runs, all fresh processes."""
    steps, every = cfg.steps, cfg.save_every
    mid = every + every // 2  # between two saves
    mid -= mid % cfg.scan
    in_save = 2 * every  # a save step: the process dies while it is written
    if not (every < mid < in_save < steps):
        raise SystemExit(
            f"--check-resume needs --steps > 2 * --save-every ({steps}, {every})"
        )
    common = config_args(cfg) + ["--quiet", "--generate", "0"]
    t = time.perf_counter()
    # the uninterrupted run, alongside the killed-and-resumed chain
    ref = subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve()), *common, "--dir",
         str(root / "uninterrupted")],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join(
            [str(HERE.parent), os.environ.get("PYTHONPATH", "")])),
    )  # fmt: skip
    chain = root / "resumed"
    chain.mkdir(parents=True, exist_ok=True)
    failures = []
    try:
        for die, what in ((mid, "mid-interval"), (in_save, "during an async save")):
            code = run_script(
                common + ["--dir", str(chain), "--die-at-step", str(die)],
                chain / f"died_at_{die}.log",
                timeout,
            )
            said = (chain / f"died_at_{die}.log").read_text()
            print(f"killed after step {die} ({what}): exit {code}; it said:")
            for line in said.splitlines():
                if line.startswith(("resumed from", "dying")):
                    print(f"    {line}")
            if code != 3:
                failures.append(
                    f"the run to be killed at {die} exited {code}:\n{said[-3000:]}"
                )
        code = run_script(common + ["--dir", str(chain)], chain / "final.log", timeout)
        said = (chain / "final.log").read_text()
        print(f"the last run: exit {code}; it said:")
        for line in said.splitlines():
            if line.startswith(("resumed from", "steps")):
                print(f"    {line}")
        if code != 0:
            failures.append(f"the resumed run exited {code}:\n{said[-3000:]}")
        ref_code = ref.wait(timeout=timeout)
        if ref_code != 0:
            failures.append(f"the uninterrupted run exited {ref_code}")
    finally:
        if ref.poll() is None:
            ref.kill()
            ref.wait()
    print(f"4 processes in {time.perf_counter() - t:.1f} s")
    if not failures:
        got, want = final_state(chain, cfg), final_state(root / "uninterrupted", cfg)
        differ = compare_exact(got, want)
        if differ:
            failures.append(f"{len(differ)} leaves differ, e.g. {differ[:3]}")
        else:
            print(
                f"resumed run == uninterrupted run, bit for bit ({len(leaves(want))} arrays)"
            )
    for f in failures:
        print(f"MISMATCH  {f}", file=sys.stderr)
    return 1 if failures else 0


def worker(a: argparse.Namespace, cfg: Config) -> None:
    """One process of a data-parallel run (`--processes N` starts them)."""
    sys.path.insert(0, str(HERE))
    from train_multiprocess import exit_with_launcher

    exit_with_launcher()
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=a.coordinator,
        num_processes=a.num_processes,
        process_id=a.process_id,
    )
    # Auto axes: XLA decides how the embedding lookup (a gather of the replicated
    # table by batch-sharded tokens) is split; on JAX's default Explicit axes the
    # model's code would have to say it (`.at[...].get(out_sharding=...)`)
    mesh = jax.make_mesh(
        (jax.device_count(),), ("data",), axis_types=(jax.sharding.AxisType.Auto,)
    )
    out = train(cfg, Path(a.dir), mesh=mesh, quiet=True)
    print(
        f"process {jax.process_index()}/{jax.process_count()}: {cfg.steps} steps on "
        f"{jax.device_count()} devices, compiled {out['step'].trace_count}x, "
        f"last logged loss {out['history']['loss'][-1]:.3f}",
        flush=True,
    )
    jax.distributed.shutdown()


# tolerance of the N-process run against one process: the sums over the batch (the
# gradient all-reduce, the metrics, the activation statistics) are added in another
# order. Measured on the tiny run (60 steps): at most 2.4e-7 on any weight.
RTOL, ATOL = 2e-5, 2e-6


def check_processes(cfg: Config, n: int, root: Path, timeout: float) -> int:
    sys.path.insert(0, str(HERE))
    from train_multiprocess import WorkerError, cpu_env, free_port, launch

    address = f"127.0.0.1:{free_port()}"
    script = str(Path(__file__).resolve())
    commands = [
        [sys.executable, script, "--worker", *config_args(cfg), "--dir",
         str(root / "processes"), "--coordinator", address, "--num-processes", str(n),
         "--process-id", str(i)]
        for i in range(n)
    ]  # fmt: skip
    t = time.perf_counter()
    try:
        logs = launch(commands, env=cpu_env(1), timeout=timeout, log_dir=root / "logs")
    except WorkerError as e:
        print(e, file=sys.stderr)
        return 1
    for log_text in logs:
        print(*[ln for ln in log_text.splitlines() if ln.startswith("process ")])
    print(f"{n} processes: {time.perf_counter() - t:.1f} s")
    single = train(cfg, root / "single", quiet=True)
    got = final_state(root / "processes", cfg)
    want = (single["trainer"], single["opt_state"], single["position"])
    worst, bad = 0.0, []
    for (name, g), (_, w) in zip(leaves(got), leaves(want), strict=True):
        if np.issubdtype(g.dtype, np.floating):
            finite = np.isfinite(w)  # a reset maximum is -inf in both
            diff = float(np.max(np.abs(g[finite] - w[finite]), initial=0.0))
            worst = max(worst, diff)
            if not np.allclose(g, w, rtol=RTOL, atol=ATOL):
                bad.append(f"{name} (max difference {diff:.3g})")
        elif not np.array_equal(g, w):  # counts, random keys, the data position
            bad.append(f"{name} (not equal)")
    if bad:
        print(f"MISMATCH  {len(bad)} leaves, e.g. {bad[:3]}", file=sys.stderr)
        return 1
    print(
        f"{n} processes == 1 process: integers equal, floats within rtol={RTOL}, "
        f"atol={ATOL} (largest difference {worst:.2e})"
    )
    return 0


# -- the command line --------------------------------------------------------------------


def parse(argv: list[str] | None) -> tuple[argparse.Namespace, Config]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for field in dataclasses.fields(Config):
        parser.add_argument(
            f"--{field.name.replace('_', '-')}", type=type(field.default), default=None
        )
    parser.add_argument("--tiny", action="store_true", help="a 20-second run")
    parser.add_argument("--dir", help="run directory (checkpoints, logs, plot)")
    parser.add_argument("--fresh", action="store_true", help="start over in --dir")
    parser.add_argument("--generate", type=int, default=None, help="tokens to generate")
    parser.add_argument("--die-at-step", type=int, default=None)
    parser.add_argument("--check-resume", action="store_true")
    parser.add_argument("--processes", type=int, default=None)
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--quiet", action="store_true")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--coordinator", help=argparse.SUPPRESS)
    parser.add_argument("--num-processes", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--process-id", type=int, help=argparse.SUPPRESS)
    a = parser.parse_args(argv)
    values = dict(TINY) if a.tiny else {}
    for field in dataclasses.fields(Config):
        if getattr(a, field.name) is not None:
            values[field.name] = getattr(a, field.name)
    cfg = Config(**values)
    if cfg.log_every % cfg.scan or cfg.save_every % cfg.scan or cfg.steps % cfg.scan:
        parser.error("--scan must divide --steps, --log-every and --save-every")
    if cfg.dim % cfg.heads:
        parser.error("--heads must divide --dim")
    if a.generate is None:
        a.generate = 32 if a.tiny else 64
    return a, cfg


def main(argv: list[str] | None = None) -> dict[str, Any] | int:
    a, cfg = parse(argv)
    if a.worker:
        worker(a, cfg)
        return 0
    if a.check_resume or a.processes:
        root = Path(a.dir or tempfile.mkdtemp(prefix="eqx_state_lm_"))
        try:
            if a.check_resume:
                return check_resume(cfg, root, a.timeout)
            return check_processes(cfg, a.processes, root, a.timeout)
        finally:
            if a.dir is None:
                shutil.rmtree(root, ignore_errors=True)
    run_dir = Path(a.dir or "examples/out/lm")
    if a.fresh:
        shutil.rmtree(run_dir, ignore_errors=True)
    t = time.perf_counter()
    out = train(cfg, run_dir, die_at=a.die_at_step, quiet=a.quiet)
    trainer = out["trainer"]
    ema_net = trainer.ema.averaged(trainer.net)
    out["heldout"] = {
        "weights": heldout_loss(cfg, trainer.net),
        "ema": heldout_loss(cfg, ema_net),
    }
    if out["history"]["step"]:
        plot(out["history"], run_dir / "lm_training.png")
    if a.generate:
        out["generation"] = check_generation(cfg, ema_net, a.generate, a.quiet)
    print(
        f"steps {out['start']}-{cfg.steps}: held-out loss {out['heldout']['weights']:.3f} "
        f"(EMA weights {out['heldout']['ema']:.3f}) nats/byte, "
        f"{out['tokens_per_s']:,.0f} tokens/s, {out['step'].trace_count} compilation(s), "
        f"{time.perf_counter() - t:.1f} s"
    )
    return out


if __name__ == "__main__":
    result = main()
    sys.exit(result if isinstance(result, int) else 0)
