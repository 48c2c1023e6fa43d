"""`reset`: start every metric in a model over."""

from __future__ import annotations

from typing import Any, TypeVar

import jax

from ._base import Metric


_T = TypeVar("_T")


def _is_metric(x: Any) -> bool:
    return isinstance(x, Metric)


def reset(model: _T) -> _T:
    """Reset every metric in `model` (at any depth, including inside
    [`eqx_state.metrics.Metrics`][] collections) to its fresh state: sums and counts
    0, minima +inf, maxima -inf, last values unset. Other state — BatchNorm
    statistics, counters, caches, RNG keys — and parameters are left alone.

    * Value mode: returns a new model; `model` is unchanged.
    * Ref mode ([`eqx_state.to_refs`][]), or inside [`eqx_state.make_step`][] /
      [`eqx_state.apply`][]: the cells are written in place (so `model` itself is
      reset) and the model is returned too, so `model = reset(model)` works in both.

    **Arguments:**

    - `model`: any pytree holding metrics (a model, a `Metrics` collection, a single
        metric).

    **Returns:**

    The model with fresh metrics.

    **Example:**

    ```python
    import jax.numpy as jnp
    import eqx_state as es

    mean = es.to_refs(es.metrics.Mean())
    mean.update(jnp.array([1.0, 2.0]))
    mean = es.metrics.reset(mean)
    mean.update(jnp.array([5.0]))
    assert float(mean.compute()) == 5.0
    ```
    """
    memo: dict[int, Any] = {}  # tied cells (one array reachable twice) stay tied
    return jax.tree_util.tree_map(
        lambda x: x._reset(memo) if isinstance(x, Metric) else x,
        model,
        is_leaf=_is_metric,
    )
