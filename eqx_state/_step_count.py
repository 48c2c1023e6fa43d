"""`step_count`: how many optimizer steps an optax state has taken."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ._buffer import check_live
from ._compat import Tracer
from ._errors import StateValueError
from ._modes import model_path


def _is_multi_steps(x: Any) -> bool:
    return isinstance(x, optax.MultiStepsState)


def step_count(opt_state: Any) -> jax.Array:
    """The number of optimizer steps (parameter updates) that `opt_state` has taken,
    read from optax's own counters, whatever the layout of the state.

    * Optimizers with a step counter (Adam, AdamW, any schedule,
      `optax.inject_hyperparams`, ...; inside `optax.chain` or not) keep it in
      fields named `count`; they all agree, and their value is returned. Two
      `count`s that do not count steps are left out: `optax.contrib.reduce_on_plateau`'s
      (losses towards its average) and `optax.apply_every`'s (steps modulo `k`).
    * With `optax.MultiSteps`, the number of updates applied, `gradient_step` (not
      the number of calls, `mini_step`).
    * With `optax.apply_every(k)`, the count of the transformations around it:
      the number of calls, not of parameter updates (`apply_every` passes on
      zeros until its `k`-th call, so the parameters do not move at every call).
      To count the updates of gradient accumulation, use `optax.MultiSteps`.

    **Arguments:**

    - `opt_state`: an optax state, e.g. what `step.init(model)` returned and each
        step returns.

    **Returns:**

    The count, an integer array (a batch of counts for an ensemble of states).

    **Raises:**

    `ValueError` if the optimizer keeps no step counter (plain `optax.sgd` without
    momentum keeps no state at all), or if its counters disagree;
    [`eqx_state.StaleModelError`][] if `opt_state` was consumed by a donating step
    (use the state the step returned).

    **Example:**

    ```python
    import jax.numpy as jnp, optax
    import eqx_state as es

    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
    params = {"w": jnp.ones(3)}
    opt_state = opt.init(params)
    for _ in range(3):
        _, opt_state = opt.update(params, opt_state, params)
    assert int(es.step_count(opt_state)) == 3
    ```
    """
    leaves = jax.tree_util.tree_flatten_with_path(opt_state)[0]
    for path, leaf in leaves:
        check_live(leaf, "optimizer state", f"`{model_path(path, 'opt_state')}`")
    multi = [
        x
        for x in jax.tree_util.tree_leaves(opt_state, is_leaf=_is_multi_steps)
        if _is_multi_steps(x)
    ]
    if multi:
        return multi[0].gradient_step
    # a `count` that is not a step counter: reduce_on_plateau's count of losses
    # towards its average (back to 0 every `accumulation_size` steps) and
    # `apply_every`'s step modulo `k`
    from optax import contrib

    others = (contrib.ReduceLROnPlateauState, optax.ApplyEvery)
    skip = {
        jax.tree_util.keystr(path)
        for path, x in jax.tree_util.tree_flatten_with_path(
            opt_state, is_leaf=lambda x: isinstance(x, others)
        )[0]
        if isinstance(x, others)
    }
    counts = [
        (jax.tree_util.keystr(path), leaf)
        for path, leaf in leaves
        if path
        and isinstance(path[-1], jax.tree_util.GetAttrKey)
        and path[-1].name == "count"
        and jax.tree_util.keystr(path[:-1]) not in skip
        and jnp.issubdtype(jnp.result_type(leaf), jnp.integer)
    ]
    if not counts:
        raise StateValueError(
            "step_count: this optimizer state keeps no step counter (no field named "
            "`count`; plain `optax.sgd` keeps no state at all). Count steps in your "
            "loop, or add one: `optax.chain(optimizer, optax.scale_by_schedule(lambda "
            "n: 1.0))` keeps a `count`."
        )
    first_path, first = counts[0]
    for path, other in counts[1:]:
        if not isinstance(other, Tracer) and not isinstance(first, Tracer):
            if not np.array_equal(np.asarray(other), np.asarray(first)):
                raise StateValueError(
                    f"step_count: the optimizer's counters disagree ({first_path} = "
                    f"{np.asarray(first)}, {path} = {np.asarray(other)}): some of its "
                    "transformations do not count every step. Read the one you mean "
                    "from the state directly."
                )
    return first
