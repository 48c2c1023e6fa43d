"""A user-defined stateful layer, written only against eqx_state's public API.

`RunningMax` remembers the largest value it has seen per feature. It is an ordinary
`eqx.Module` with an `es.Buffer` field: the same code works in value mode (through
`es.apply` / `es.make_step`) and in ref mode (`es.to_refs`).
"""

import argparse

import equinox as eqx
import jax
import jax.numpy as jnp

import eqx_state as es


class RunningMax(eqx.Module):
    peak: es.Buffer
    inference: bool

    def __init__(self, features: int, inference: bool = False):
        self.peak = es.Buffer(jnp.full((features,), -jnp.inf))
        self.inference = inference

    def __call__(self, x):  # x: [batch, features]
        if not self.inference:
            self.peak[...] = jnp.maximum(self.peak[...], jnp.max(x, axis=0))
        return x


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batches", type=int, default=4)
    args = parser.parse_args(argv)
    key = jax.random.key(0)
    batches = jax.random.normal(key, (args.batches, 8, 3))

    layer = RunningMax(3)  # value mode: purely, through es.apply
    run = eqx.filter_jit(lambda m, x: es.apply(lambda m, x: m(x), m, x))
    for x in batches:
        _, layer = run(layer, x)
    print("value mode:", layer.peak[...])

    layer_r = es.to_refs(RunningMax(3))  # ref mode: in place
    for x in batches:
        layer_r(x)
    print("ref mode:  ", layer_r.peak[...])
    print("numpy:     ", jnp.max(batches.reshape(-1, 3), axis=0))


if __name__ == "__main__":
    main()
