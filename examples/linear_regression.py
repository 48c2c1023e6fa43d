"""The seed tutorial's linear regression, trained with `eqx_state.make_step`.

Fits `y = 2x + 1` on x = [1, 2, 3], y = [3, 5, 7] for 100 steps of SGD with learning
rate 0.1 and momentum 0.9 (the optimizer state is the momentum), exactly the update
the tutorial threads by hand. A `Counter` inside the model counts the steps as state.
Prints `{'b': 1.0, 'w': 2.0}`.
"""

import argparse

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

import eqx_state as es


class Line(eqx.Module):
    w: jax.Array
    b: jax.Array
    steps: es.nn.Counter

    def __init__(self):
        self.w = jnp.float32(1.0)
        self.b = jnp.float32(0.0)
        self.steps = es.nn.Counter()

    def __call__(self, x):
        return self.w * x + self.b


def loss_fn(model: Line, x, y):
    model.steps.increment()  # a state write, threaded by make_step
    return jnp.mean((model(x) - y) ** 2)


def train(steps: int = 100, *, ref_mode: bool = False) -> Line:
    model = Line()
    if ref_mode:
        model = es.to_refs(model)
    step = es.make_step(loss_fn, optax.sgd(0.1, momentum=0.9))
    opt_state = step.init(model)
    x, y = jnp.array([1.0, 2.0, 3.0]), jnp.array([3.0, 5.0, 7.0])
    for _ in range(steps):
        model, opt_state = step(model, opt_state, x, y)
    return model


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--ref-mode", action="store_true")
    args = parser.parse_args(argv)
    model = train(args.steps, ref_mode=args.ref_mode)
    params = {"b": model.b, "w": model.w}
    print(jax.tree.map(lambda x: round(float(x), 2), params))  # fits y = 2x + 1
    print("steps taken:", int(model.steps.value))


if __name__ == "__main__":
    main()
