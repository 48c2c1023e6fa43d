"""Greedy decoding of a tiny causal transformer with a KV cache kept in the model.

The transformer (token + learned position embeddings, blocks of
`es.nn.CausalSelfAttention` + MLP with pre-LayerNorm, an output head) is an
ordinary Equinox module. `es.nn.with_kv_cache(model, max_len)` gives each attention
layer a `KVCache`; the decoder then feeds the prompt once (prefill) and one token per
step, and every layer writes its keys and values in place — no cache argument is
threaded through the model.

The script decodes in value mode (the whole decode loop is one `jax.lax.scan`
inside `es.apply`, jitted with `eqx.filter_jit`) and in ref mode (`es.to_refs`),
prints the tokens, and checks every step's logits against the uncached full forward
on the decoded sequence. It then decodes a batch of prompts of different lengths
together (one cache row and one cursor per sequence, `jax.vmap` over the rows) and
checks each row against decoding that prompt alone.
"""

import argparse

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

import eqx_state as es


class Block(eqx.Module):
    ln1: eqx.nn.LayerNorm
    attn: es.nn.CausalSelfAttention
    ln2: eqx.nn.LayerNorm
    fc1: eqx.nn.Linear
    fc2: eqx.nn.Linear

    def __init__(self, dim: int, heads: int, *, key: PRNGKeyArray):
        k1, k2, k3 = jax.random.split(key, 3)
        self.ln1 = eqx.nn.LayerNorm(dim)
        self.attn = es.nn.CausalSelfAttention(dim, heads, key=k1)
        self.ln2 = eqx.nn.LayerNorm(dim)
        self.fc1 = eqx.nn.Linear(dim, 4 * dim, key=k2)
        self.fc2 = eqx.nn.Linear(4 * dim, dim, key=k3)

    def __call__(self, x: Float[Array, "seq dim"]) -> Float[Array, "seq dim"]:
        x = x + self.attn(jax.vmap(self.ln1)(x))
        h = jax.vmap(self.ln2)(x)
        return x + jax.vmap(lambda h: self.fc2(jax.nn.gelu(self.fc1(h))))(h)


class TinyTransformer(eqx.Module):
    embed: eqx.nn.Embedding
    pos: Float[Array, "max_pos dim"]
    blocks: list[Block]
    ln_f: eqx.nn.LayerNorm
    head: eqx.nn.Linear

    def __init__(
        self, vocab: int, dim: int, heads: int, layers: int, max_pos: int, *, key
    ):
        ke, kp, kh, *kb = jax.random.split(key, 3 + layers)
        self.embed = eqx.nn.Embedding(vocab, dim, key=ke)
        self.pos = 0.02 * jax.random.normal(kp, (max_pos, dim))
        self.blocks = [Block(dim, heads, key=k) for k in kb]
        self.ln_f = eqx.nn.LayerNorm(dim)
        self.head = eqx.nn.Linear(dim, vocab, key=kh)

    def __call__(self, tokens: Int[Array, " seq"]) -> Float[Array, "seq vocab"]:
        """Logits for `tokens`: the whole sequence without caches, or the next chunk
        with caches (positions continue from the caches' cursor)."""
        start = self.blocks[0].attn.position()
        x = jax.vmap(self.embed)(tokens)
        x = x + jax.lax.dynamic_slice_in_dim(self.pos, start, tokens.shape[0])
        for block in self.blocks:
            x = block(x)
        return jax.vmap(lambda h: self.head(self.ln_f(h)))(x)


def greedy_decode(
    model: TinyTransformer, prompt: Int[Array, " prompt"], steps: int
) -> tuple[Int[Array, " steps"], Float[Array, "prompt+steps-1 vocab"]]:
    """Prefill `prompt`, then generate `steps >= 1` tokens greedily with a
    `lax.scan`.

    `model` must hold caches; this writes them, so run it inside `es.apply` (value
    mode) or on a ref-mode model. Returns the generated tokens and the logits of
    every position that was fed (prompt, then all generated tokens but the last).
    """
    if steps < 1:
        raise ValueError(f"greedy_decode: steps must be at least 1, got {steps}.")
    prompt_logits = model(prompt)
    first = jnp.argmax(prompt_logits[-1]).astype(prompt.dtype)

    def step(token, _):
        logits = model(token[None])[0]
        return jnp.argmax(logits).astype(token.dtype), (token, logits)

    # the scan feeds tokens 1..steps-1; its carry is the last token generated
    last, (fed, logits) = jax.lax.scan(step, first, None, length=steps - 1)
    tokens = jnp.concatenate([fed, last[None]])
    return tokens, jnp.concatenate([prompt_logits, logits])


def greedy_decode_batch(
    model: TinyTransformer,
    prompts: Int[Array, "batch prompt"],
    lengths: Int[Array, " batch"],
    steps: int,
) -> tuple[Int[Array, "batch steps"], Float[Array, "batch prompt vocab"]]:
    """Greedy decoding of a batch of prompts of different lengths, together.

    `model` holds caches built with `with_kv_cache(..., batch_size=B)`: one row and
    one cursor per sequence. `prompts` holds the prompts padded (with any token) to
    one length, `lengths` their true lengths. The padded batch is prefilled in one
    call (a padded position only writes its own key and value, which no real
    position attends to), then each cursor is set back to its prompt's length, so
    every sequence continues from its own last token. Returns the generated tokens
    and the prefill logits (rows past each length are padding).
    """
    if steps < 1:
        raise ValueError(f"greedy_decode_batch: steps must be at least 1, got {steps}.")
    rows = jax.vmap(lambda m, t: m(t), in_axes=(es.nn.kv_cache_axes(model), 0))
    prompt_logits = rows(model, prompts)
    es.nn.truncate_kv_cache(model, lengths)
    last_real = prompt_logits[jnp.arange(prompts.shape[0]), lengths - 1]
    first = jnp.argmax(last_real, -1).astype(prompts.dtype)

    def step(tokens, _):
        logits = rows(model, tokens[:, None])[:, 0]
        return jnp.argmax(logits, -1).astype(tokens.dtype), tokens

    last, fed = jax.lax.scan(step, first, None, length=steps - 1)
    tokens = jnp.concatenate([fed, last[None]]).T  # [batch, steps]
    return tokens, prompt_logits


@eqx.filter_jit
def decode_batch(model, max_len, prompts, lengths, steps):
    """Value mode: a fresh batch of caches, decoded inside `es.apply`, jitted."""
    cached = es.nn.with_kv_cache(model, max_len, batch_size=prompts.shape[0])
    out, _ = es.apply(greedy_decode_batch, cached, prompts, lengths, steps)
    return out


@eqx.filter_jit
def _full_forward(model, tokens):
    return model(tokens)


def uncached_greedy(model, padded_prompt, length, steps):
    """Greedy decoding without a cache: the full causal forward on the sequence so
    far (kept padded to a fixed length, so that it compiles once), `steps` times.
    Returns the tokens and the first forward's logits."""
    seq = jnp.concatenate([padded_prompt, jnp.zeros(steps, padded_prompt.dtype)])
    first_logits = None
    tokens = []
    for k in range(steps):
        logits = _full_forward(model, seq)
        if first_logits is None:
            first_logits = logits
        token = jnp.argmax(logits[length + k - 1]).astype(seq.dtype)
        seq = seq.at[length + k].set(token)
        tokens.append(int(token))
    return tokens, first_logits


def max_abs_diff(got: Array, want: Array, what: str) -> float:
    """The largest |got - want|; refuses to compare nothing (an empty comparison
    would pass any check) or arrays of different shapes."""
    if got.shape != want.shape or got.size == 0:
        raise AssertionError(
            f"{what}: nothing to compare (shapes {got.shape} and {want.shape})."
        )
    return float(jnp.max(jnp.abs(got - want)))


def decode_value_mode(cached, prompt, steps):
    """Value mode: `es.apply` around the scan, jitted, with the caches donated.

    Only the state cells are donated (updated in place, no second copy): the
    parameters are shared with the uncached model and stay valid. The old `cached`
    model's caches are consumed; use the returned model.
    """
    state, rest = eqx.partition(cached, es.is_state, is_leaf=es.is_state)
    out, state = _decode_state((rest, prompt), state, steps)
    return out, eqx.combine(state, rest, is_leaf=es.is_state)


@eqx.filter_jit(donate="all-except-first")
def _decode_state(rest_and_prompt, state, steps):
    rest, prompt = rest_and_prompt
    cached = eqx.combine(state, rest, is_leaf=es.is_state)
    out, cached = es.apply(greedy_decode, cached, prompt, steps)
    return out, eqx.filter(cached, es.is_state, is_leaf=es.is_state)


@eqx.filter_jit
def decode_ref_mode(cached_refs, prompt, steps):
    """Ref mode: the caches are refs, written in place by the jitted scan."""
    return greedy_decode(cached_refs, prompt, steps)


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--vocab", type=int, default=32)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--prompt-len", type=int, default=5)
    parser.add_argument("--steps", type=int, default=11)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.steps < 1 or args.prompt_len < 1:
        parser.error(
            "--steps and --prompt-len must be at least 1 (decoding needs a prompt "
            "to prefill and generates at least one token)."
        )
    max_len = args.prompt_len + args.steps
    key_model, key_prompt = jax.random.split(jax.random.key(args.seed))
    model = TinyTransformer(
        args.vocab, args.dim, args.heads, args.layers, max_len, key=key_model
    )
    prompt = jax.random.randint(key_prompt, (args.prompt_len,), 0, args.vocab)

    cached = es.nn.with_kv_cache(model, max_len)
    (tokens, logits), cached = decode_value_mode(cached, prompt, args.steps)
    print("prompt:          ", prompt.tolist())
    print("value mode tokens:", tokens.tolist())

    cached_refs = es.to_refs(es.nn.with_kv_cache(model, max_len))
    tokens_r, logits_r = decode_ref_mode(cached_refs, prompt, args.steps)
    print("ref mode tokens:  ", tokens_r.tolist())

    # The reference: the uncached full forward on prompt + generated tokens.
    sequence = jnp.concatenate([prompt, tokens[:-1]])
    full = model(sequence)
    diff = max_abs_diff(logits, full, "value mode logits")
    diff_r = max_abs_diff(logits_r, full, "ref mode logits")
    same = len(tokens) == args.steps and tokens.tolist() == tokens_r.tolist()
    print(f"cursor after decoding: {int(cached.blocks[0].attn.position())} / {max_len}")
    print(
        f"max |cached - uncached| logits: value mode {diff:.2e}, ref mode {diff_r:.2e}"
    )
    print(f"value and ref modes decode the same tokens: {same}")

    # A batch: the prompt and two shorter ones, padded, decoded together; each row
    # must decode what its prompt decodes alone.
    lengths = jnp.array([args.prompt_len, max(1, args.prompt_len - 2), 1])
    prompts = jnp.stack(
        [
            jnp.where(jnp.arange(args.prompt_len) < n, jnp.roll(prompt, i), 0)
            for i, n in enumerate(lengths.tolist())
        ]
    )
    batch_tokens, batch_logits = decode_batch(
        model, max_len, prompts, lengths, args.steps
    )
    # the reference for every row: uncached greedy decoding (one fixed-length
    # causal forward per step: position j only sees tokens 0..j, so the padding
    # after the sequence does not matter)
    batch_diff = 0.0
    for i, n in enumerate(lengths.tolist()):
        want_tokens, want_logits = uncached_greedy(model, prompts[i], n, args.steps)
        if batch_tokens[i].tolist() != want_tokens:
            raise AssertionError(f"batch row {i} decoded other tokens than alone")
        batch_diff = max(
            batch_diff,
            max_abs_diff(batch_logits[i, :n], want_logits[:n], f"row {i} logits"),
        )
    print("batch tokens:     ", batch_tokens.tolist())
    print(f"batch rows decode as alone: True (prefill max diff {batch_diff:.2e})")
    if not same:
        raise AssertionError("value and ref modes decoded different tokens")
    return max(diff, diff_r, batch_diff)


if __name__ == "__main__":
    main()
