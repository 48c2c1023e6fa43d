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
on the decoded sequence.
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
    """Prefill `prompt`, then generate `steps` tokens greedily with a `lax.scan`.

    `model` must hold caches; this writes them, so run it inside `es.apply` (value
    mode) or on a ref-mode model. Returns the generated tokens and the logits of
    every position that was fed (prompt, then all generated tokens but the last).
    """
    prompt_logits = model(prompt)
    first = jnp.argmax(prompt_logits[-1]).astype(prompt.dtype)

    def step(token, _):
        logits = model(token[None])[0]
        return jnp.argmax(logits).astype(token.dtype), (token, logits)

    _, (tokens, logits) = jax.lax.scan(step, first, None, length=steps - 1)
    tokens = jnp.concatenate([tokens, jnp.argmax(logits[-1:], -1).astype(tokens.dtype)])
    return tokens, jnp.concatenate([prompt_logits, logits])


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
    diff = float(jnp.max(jnp.abs(logits - full)))
    diff_r = float(jnp.max(jnp.abs(logits_r - full)))
    same = bool(jnp.all(tokens == tokens_r))
    print(f"cursor after decoding: {int(cached.blocks[0].attn.position())} / {max_len}")
    print(
        f"max |cached - uncached| logits: value mode {diff:.2e}, ref mode {diff_r:.2e}"
    )
    print(f"value and ref modes decode the same tokens: {same}")
    return max(diff, diff_r)


if __name__ == "__main__":
    main()
