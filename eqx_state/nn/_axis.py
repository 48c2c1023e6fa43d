"""The size of a named axis that a layer reduces over, with a clear error when the
axis is not bound."""

from __future__ import annotations

from collections.abc import Hashable

import jax

from .._errors import AxisNameError


def axis_size(axis_name: Hashable, layer: str) -> int:
    """The size of the named axis `axis_name` (of an enclosing `jax.vmap`,
    `eqx_state.vmap`, `jax.shard_map` or `jax.pmap`). Raises a `NameError` that says
    what to do when no such axis is bound (e.g. inside `make_step(mesh=...)`, which
    already computes statistics over the global batch)."""
    try:
        return jax.lax.axis_size(axis_name)
    except NameError as e:
        raise AxisNameError(
            f"{layer}(axis_name={axis_name!r}) was called where no axis named "
            f"{axis_name!r} is bound, so it cannot reduce its statistics over that "
            "axis. `axis_name` is for per-example or per-device code: calls mapped "
            f"with `eqx_state.vmap(model, axis_name={axis_name!r})` or run inside "
            f"`jax.shard_map` / `jax.pmap` with that axis name. If the model is "
            "called on a whole batch, including inside "
            "`eqx_state.make_step(..., mesh=...)` (where the batch is sharded but "
            "the step is written for the global batch and JAX reduces over the "
            f"devices itself), build the layer without `axis_name`: `{layer}(...)` "
            "then computes its statistics over the whole (global) batch."
        ) from e
