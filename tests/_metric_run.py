"""One metric update in either storage mode (shared by the metrics tests)."""

import equinox as eqx
import jax.numpy as jnp

import eqx_state as es


@eqx.filter_jit
def apply_update(metric, args, kwargs):
    return es.apply(lambda m: m.update(*args, **kwargs), metric)[1]


def run(metric, mode, *args, **kwargs):
    """One update: in value mode through a jitted `es.apply`, in ref mode eagerly."""
    args = tuple(jnp.asarray(a) for a in args)
    kwargs = {k: jnp.asarray(v) for k, v in kwargs.items()}
    if mode == "ref":
        metric = es.to_refs(metric)
        metric.update(*args, **kwargs)
        return metric
    return apply_update(metric, args, kwargs)
