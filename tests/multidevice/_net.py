"""The small model of the multi-device step tests: Linear -> BatchNorm -> ReLU ->
Linear, with a counter of the loss calls."""

import equinox as eqx
import jax
import jax.numpy as jnp

import eqx_state as es


class Net(eqx.Module):
    l1: eqx.nn.Linear
    bn: es.nn.BatchNorm
    l2: eqx.nn.Linear
    steps: es.nn.Counter

    def __init__(self, key, in_features: int = 6):
        k1, k2 = jax.random.split(key)
        self.l1 = eqx.nn.Linear(in_features, 8, use_bias=False, key=k1)
        self.bn = es.nn.BatchNorm(8)
        self.l2 = eqx.nn.Linear(8, 3, key=k2)
        self.steps = es.nn.Counter()

    def __call__(self, x):
        return jax.vmap(self.l2)(jax.nn.relu(self.bn(jax.vmap(self.l1)(x))))


def loss_fn(model, x, y):
    model.steps.increment()
    return jnp.mean((model(x) - y) ** 2)
