"""`make_step` (one jit-compiled training step) and `apply` (any state-writing call)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax._src import core as _jax_core

from ._buffer import _is_param, _refreeze, _stale_message, _thaw, is_state, params
from ._errors import StaleModelError, StepError


try:  # keeps weakly-typed leaves weakly typed, so the second call does not retrace
    from jax._src.lax.lax import _convert_element_type as _convert
except ImportError:  # pragma: no cover - depends on the JAX version
    _convert = None

_Ref = jax.Ref
_Tracer = _jax_core.Tracer
_Array = jax.Array
_STATIC = -1


def _fast_ref_swap_ok(r: Any) -> bool:
    # A concrete ref at top level stores its array in `_refs._buf`; JAX's own
    # dispatch of ref arguments reads and replaces exactly that (pxla's
    # `_shard_mutable_array`). We do the same outside the compiled call so that the
    # call stays on jit's C++ fast path (a ref argument costs ~30-50 us per call).
    impl = getattr(r, "_refs", None)
    return type(r) is _Ref and hasattr(impl, "_buf")


def _split(leaves: list[Any], allow_fast_refs: bool) -> tuple[Any, ...]:
    """Split flattened leaves into what the jitted function takes.

    `spec[i]` is the index into the unique dynamic arrays for leaf `i`, `_STATIC` for
    a Python value (kept in `statics`, part of the compilation key), or `-2 - k` for
    the `k`-th ref passed as a ref (only under an outer transformation, where the
    refs may be tracers). Arrays reachable twice are passed (and donated) once.
    """
    spec: list[int] = []
    statics: list[Any] = []
    dyn: list[Any] = []
    refs: list[Any] = []
    ref_pos: list[int] = []
    seen: dict[int, int] = {}
    seen_refs: dict[int, int] = {}
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, _Array) or isinstance(leaf, (np.ndarray, np.generic)):
            k = seen.get(id(leaf))
            if k is None:
                k = seen[id(leaf)] = len(dyn)
                dyn.append(leaf)
            spec.append(k)
        elif isinstance(leaf, _Ref):
            if allow_fast_refs and _fast_ref_swap_ok(leaf):
                k = seen.get(id(leaf))
                if k is None:
                    k = seen[id(leaf)] = len(dyn)
                    dyn.append(leaf._refs._buf)
                spec.append(k)
                ref_pos.append(i)
            else:
                k = seen_refs.get(id(leaf))
                if k is None:
                    k = seen_refs[id(leaf)] = len(refs)
                    refs.append(leaf)
                spec.append(-2 - k)
        else:
            spec.append(_STATIC)
            statics.append(leaf)
    return tuple(spec), tuple(statics), dyn, refs, tuple(ref_pos)


def _join(spec: tuple[int, ...], statics: tuple[Any, ...], dyn: Any, refs: Any) -> list:
    out = []
    it = iter(statics)
    for s in spec:
        if s >= 0:
            out.append(dyn[s])
        elif s == _STATIC:
            out.append(next(it))
        else:
            out.append(refs[-2 - s])
    return out


def _match_weak(out: Any, like: Any) -> Any:
    """Give `out` the dtype and weak type of `like` (an input of the same leaf)."""
    like_aval = jax.typeof(like)
    out_aval = jax.typeof(out)
    if out_aval.dtype == like_aval.dtype and out_aval.weak_type == like_aval.weak_type:
        return out
    if _convert is not None:
        return _convert(out, like_aval.dtype, weak_type=like_aval.weak_type)
    return out.astype(like_aval.dtype)  # pragma: no cover


def _reraise_stale(e: Exception, trees: Any) -> None:
    msg = str(e)
    if "deleted" in msg or "donated" in msg:
        for leaf in jax.tree_util.tree_leaves(trees):
            if isinstance(leaf, _Array) and not isinstance(leaf, _Tracer):
                if leaf.is_deleted():
                    raise StaleModelError(_stale_message("model")) from e


class _Plan:
    """One compiled variant of a call: how the flattened carry (`(model, opt_state)`
    for a step, `(model,)` for an apply) maps onto the jitted function, and the
    jitted function itself."""

    __slots__ = (
        "treedef",
        "spec",
        "statics",
        "fn",
        "ref_slots",
        "gather",
        "donated_ks",
        "kept_ks",
        "out_ks",
        "all_out",
    )

    def __init__(self, treedef, spec, statics, ref_pos, n_dyn, donated_ks, out_ks):
        self.treedef = treedef
        self.spec = spec
        self.statics = statics
        self.fn: Any = None
        # For each leaf: the index of its new array, or -1 (kept: Python values and
        # ref-mode cells, whose refs stay in the model).
        self.gather = tuple(
            k if k >= 0 and i not in ref_pos else -1 for i, k in enumerate(spec)
        )
        # Ref-mode cells passed by value: (index of their array, first position).
        first: dict[int, int] = {}
        for i in ref_pos:
            first.setdefault(spec[i], i)
        self.ref_slots = tuple((k, i) for k, i in first.items())
        self.donated_ks = tuple(donated_ks)
        donated = set(donated_ks)
        self.kept_ks = tuple(k for k in range(n_dyn) if k not in donated)
        self.out_ks = tuple(out_ks)
        self.all_out = self.out_ks == tuple(range(n_dyn))

    def split(self, dyn: list) -> tuple[list, list]:
        if not self.kept_ks:
            return dyn, []
        if not self.donated_ks:
            return [], dyn
        return [dyn[k] for k in self.donated_ks], [dyn[k] for k in self.kept_ks]

    def merge(self, donated: list, kept: list) -> list:
        dyn: list[Any] = [None] * (len(donated) + len(kept))
        for k, x in zip(self.donated_ks, donated):
            dyn[k] = x
        for k, x in zip(self.kept_ks, kept):
            dyn[k] = x
        return dyn


class _Compiled:
    """The machinery shared by [`eqx_state.Step`][] and [`eqx_state.Apply`][]: split
    the carried trees into arrays and Python values once, compile once per split,
    donate what is replaced, keep tied cells tied, and skip all of it when called on
    what the previous call returned."""

    def __init__(self, donate: bool, jit_kwargs: dict[str, Any]):
        self.donate = donate
        self._jit_kwargs = jit_kwargs
        self._plans: dict[Any, _Plan] = {}
        self.mesh: jax.sharding.Mesh | None = None
        self._replicated: Any = None
        # What the last call returned, with what is known of it: calling again on
        # it skips flattening and splitting.
        self._last: tuple[tuple, _Plan, list, list] | None = None
        self.trace_count = 0

    # -- what subclasses define -------------------------------------------------
    def _compute(self, carry: tuple, args: tuple, kwargs: dict) -> tuple[tuple, Any]:
        raise NotImplementedError

    def _choose(self, leaves: list, spec: tuple, carry: tuple) -> tuple[list, list]:
        """The indices of the arrays to donate and of the arrays that are outputs."""
        raise NotImplementedError

    # -- the shared machinery ---------------------------------------------------
    def _impl(self, plan: _Plan, donated, kept, refs, args, kwargs):
        self.trace_count += 1
        dyn = plan.merge(donated, kept)
        carry = jax.tree_util.tree_unflatten(
            plan.treedef, _join(plan.spec, plan.statics, dyn, refs)
        )
        carry, result = self._compute(carry, args, kwargs)
        new_leaves, new_treedef = jax.tree_util.tree_flatten(carry)
        if new_treedef != plan.treedef:
            raise StepError(
                "The call changed the structure of the model or optimizer state "
                f"(before: {plan.treedef}, after: {new_treedef}). The optimizer must "
                "keep the structure of its state; the function must not replace "
                "modules."
            )
        # One output per distinct input array (tied cells share one ref, so all their
        # positions hold the same frozen value).
        first: dict[int, Any] = {}
        for new, k in zip(new_leaves, plan.spec):
            if k >= 0 and k not in first:
                first[k] = new
        outs = [_match_weak(first[k], dyn[k]) for k in plan.out_ks]
        return outs, result

    def _plan(
        self, leaves: list, treedef: Any, carry: tuple
    ) -> tuple[_Plan, list, list]:
        spec, statics, dyn, refs, ref_pos = _split(
            leaves, allow_fast_refs=_jax_core.trace_state_clean()
        )
        key = (treedef, spec, statics, ref_pos)
        plan = self._plans.get(key)
        if plan is None:
            donated_ks, out_ks = self._choose(leaves, spec, carry)
            plan = _Plan(
                treedef,
                spec,
                statics,
                frozenset(ref_pos),
                len(dyn),
                donated_ks if self.donate else (),
                out_ks,
            )
            plan.fn = jax.jit(
                functools.partial(self._impl, plan),
                donate_argnums=(0,) if plan.donated_ks else (),
                **self._jit_kwargs,
            )
            self._plans[key] = plan
        return plan, dyn, refs

    def _place(self, dyn: list) -> list:
        """Place the arrays of a model seen for the first time as the call's outputs
        will be placed, so that the next call sees the same input types."""
        if self.mesh is not None:  # replicated on the mesh
            return jax.device_put(dyn, self._replicated, donate=self.donate)
        if not _jax_core.trace_state_clean():
            return dyn
        # Committed to their device. jit caches on committedness, and arrays get
        # committed behind our back (an eager read of a ref-mode cell does it), which
        # would otherwise cost a recompilation.
        return [
            x if getattr(x, "committed", True) else jax.device_put(x, x.sharding)
            for x in dyn
        ]

    def _run(self, carry: tuple, args: tuple, kwargs: dict) -> tuple[tuple, Any]:
        last = self._last
        if (
            last is not None
            and all(a is b for a, b in zip(last[0], carry))
            and (not last[1].ref_slots or _jax_core.trace_state_clean())
        ):
            # Fast path: called on what the last call returned, so the plan and the
            # arrays are known: no flattening, no splitting.
            _, plan, leaves, dyn = last
            for k, i in plan.ref_slots:
                buf = leaves[i]._refs._buf  # may have been replaced by an eager write
                dyn[k] = buf if buf.committed else jax.device_put(buf, buf.sharding)
            refs: list = []
        else:
            leaves, treedef = jax.tree_util.tree_flatten(carry)
            plan, dyn, refs = self._plan(leaves, treedef, carry)
        try:
            if last is None or dyn is not last[3]:
                dyn = self._place(dyn)
            donated, kept = plan.split(dyn)
            outs, result = plan.fn(donated, kept, refs, args, kwargs)
        except (ValueError, RuntimeError) as e:
            _reraise_stale(e, carry)
            raise
        if plan.all_out:
            new = outs
        else:
            new = list(dyn)
            for j, k in enumerate(plan.out_ks):
                new[k] = outs[j]
        leaves = [new[k] if k >= 0 else old for k, old in zip(plan.gather, leaves)]
        for k, i in plan.ref_slots:
            # A ref-mode cell: put the new value into the ref in place (as JAX does
            # after a call with ref arguments); the model keeps the same ref.
            leaves[i]._refs._buf = new[k]
        carry = plan.treedef.unflatten(leaves)
        self._last = (carry, plan, leaves, new)
        return carry, result


def _state_ks(spec: tuple, carry: tuple) -> list[int]:
    """The indices of the arrays that sit in state cells."""
    in_cell: list[bool] = []
    for node in jax.tree_util.tree_leaves(carry, is_leaf=is_state):
        if is_state(node):
            in_cell.extend([True] * len(jax.tree_util.tree_leaves(node)))
        else:
            in_cell.append(False)
    return sorted({k for k, cell in zip(spec, in_cell) if k >= 0 and cell})


class Step(_Compiled):
    """A compiled training step; build it with [`eqx_state.make_step`][].

    Call it as `model, opt_state = step(model, opt_state, *args, **kwargs)` (with
    `aux` appended when `has_aux=True`). `step.init(model)` returns the optimizer
    state. `step.trace_count` counts how often the step was traced (compiled).
    """

    def __init__(
        self,
        loss_fn: Callable[..., Any],
        optimizer: optax.GradientTransformation,
        *,
        has_aux: bool,
        donate: bool,
        mesh: jax.sharding.Mesh | None = None,
        data_axis: str = "data",
        microbatches: int | None = None,
        jit_kwargs: dict[str, Any],
    ):
        if microbatches is not None and microbatches < 1:
            raise ValueError(
                f"make_step: microbatches must be >= 1, got {microbatches}."
            )
        if mesh is not None and data_axis not in mesh.axis_names:
            raise ValueError(
                f"make_step: the mesh has axes {mesh.axis_names}, not {data_axis!r}. "
                "Pass `data_axis=` naming the axis that shards the batch."
            )
        if mesh is not None:
            from jax.sharding import NamedSharding, PartitionSpec

            replicated = NamedSharding(mesh, PartitionSpec())
            batch = NamedSharding(mesh, PartitionSpec(data_axis))
            # model and optimizer state replicated, every argument sharded on its
            # leading (batch) axis; the outputs stay replicated.
            jit_kwargs = {
                "in_shardings": (replicated, replicated, None, batch, batch),
                "out_shardings": replicated,
                **jit_kwargs,
            }
        super().__init__(donate, jit_kwargs)
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self.has_aux = has_aux
        self.mesh = mesh
        self.data_axis = data_axis
        self.microbatches = microbatches
        if mesh is not None:
            self._replicated = replicated

    def init(self, model: Any) -> optax.OptState:
        """The optimizer state for `model`'s parameters ([`eqx_state.params`][]).

        **Arguments:**

        - `model`: the model, in either mode.

        **Returns:**

        `optimizer.init(es.params(model))`.
        """
        return self.optimizer.init(params(model))

    def _choose(self, leaves, spec, carry):
        n = 1 + max((k for k in spec if k >= 0), default=-1)
        return list(range(n)), list(range(n))  # a step replaces everything

    def _compute(self, carry, args, kwargs):
        model, opt_state = carry
        model, made = _thaw(model)
        diff, rest = eqx.partition(model, _is_param, is_leaf=is_state)
        diff_leaves = jax.tree_util.tree_leaves(diff)
        if len({id(x) for x in diff_leaves}) != len(diff_leaves):
            raise StepError(
                "The model holds the same parameter array at two places. make_step "
                "cannot tell whether they should be trained as one (tied) or two "
                "parameters. Tie parameters with `eqx.nn.Shared`, or copy the array "
                "if they are meant to be independent."
            )

        def loss(d, args=args, kwargs=kwargs):
            out = self.loss_fn(eqx.combine(d, rest, is_leaf=is_state), *args, **kwargs)
            if self.has_aux:
                if not (isinstance(out, tuple) and len(out) == 2):
                    raise StepError(
                        "make_step(..., has_aux=True) expects `loss_fn` to return a "
                        f"pair `(loss, aux)`, got {type(out).__name__}."
                    )
                value = out[0]
            else:
                value = out
            if jnp.shape(value) != ():
                raise StepError(
                    "`loss_fn` must return a scalar loss"
                    + (
                        " (as the first element of `(loss, aux)`)"
                        if self.has_aux
                        else ""
                    )
                    + f", got shape {jnp.shape(value)}. Reduce it (e.g. `jnp.mean`), or "
                    "pass `has_aux=True` if it returns `(loss, aux)`."
                )
            return out

        grad_fn = jax.value_and_grad(loss, has_aux=self.has_aux)
        if self.microbatches is None:
            out, grads = grad_fn(diff)
        else:
            out, grads = self._accumulate(grad_fn, diff, args, kwargs)
        updates, opt_state = self.optimizer.update(grads, opt_state, diff)
        diff = optax.apply_updates(diff, updates)
        model = eqx.combine(diff, rest, is_leaf=is_state)
        model = _refreeze(model, made)
        return (model, opt_state), (out[1] if self.has_aux else None)

    def _accumulate(self, grad_fn, diff, args, kwargs):
        """Gradients averaged over `microbatches` slices of the batch, accumulated in
        the carry of a `lax.scan` (in place); state writes land once per slice."""
        k = self.microbatches
        assert k is not None

        def split(x):
            if jnp.ndim(x) == 0 or x.shape[0] % k:
                raise StepError(
                    f"make_step(..., microbatches={k}): every argument must be a batch "
                    f"whose leading axis divides by {k}; got shape {jnp.shape(x)}. Pass "
                    "non-batch values through a closure."
                )
            return x.reshape(k, x.shape[0] // k, *x.shape[1:])

        batches = jax.tree.map(split, (args, kwargs))
        zeros = jax.tree.map(jnp.zeros_like, diff)

        def body(acc, batch):
            out, g = grad_fn(diff, *batch)
            value = out[0] if self.has_aux else out
            acc = jax.tree.map(jnp.add, acc, g)
            return acc, (value, out[1] if self.has_aux else None)

        grads, (values, aux) = jax.lax.scan(body, zeros, batches)
        grads = jax.tree.map(lambda g: g / k, grads)
        loss = jnp.mean(values)
        return ((loss, aux) if self.has_aux else loss), grads

    def __call__(self, model: Any, opt_state: Any, *args: Any, **kwargs: Any) -> Any:
        (new_model, new_opt_state), aux = self._run((model, opt_state), args, kwargs)
        if self.has_aux:
            return new_model, new_opt_state, aux
        return new_model, new_opt_state


class Apply(_Compiled):
    """A compiled state-writing call; build it with [`eqx_state.make_apply`][].

    Call it as `out, model = apply_fn(model, *args, **kwargs)`.
    `apply_fn.trace_count` counts how often it was traced (compiled).
    """

    def __init__(self, fn: Callable[..., Any], *, donate: bool, jit_kwargs: dict):
        super().__init__(donate, jit_kwargs)
        self.fn = fn

    def _choose(self, leaves, spec, carry):
        state = _state_ks(spec, carry)
        return state, state  # only state is replaced (and donated)

    def _compute(self, carry, args, kwargs):
        (model,) = carry
        out, model = apply(self.fn, model, *args, **kwargs)
        return (model,), out

    def __call__(self, model: Any, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        (new_model,), out = self._run((model,), args, kwargs)
        return out, new_model


def make_step(
    loss_fn: Callable[..., Any],
    optimizer: optax.GradientTransformation,
    *,
    has_aux: bool = False,
    donate: bool = True,
    mesh: jax.sharding.Mesh | None = None,
    data_axis: str = "data",
    microbatches: int | None = None,
    **jit_kwargs: Any,
) -> Step:
    """Build one jit-compiled training step.

    The step differentiates `loss_fn` with respect to the parameters of the model
    ([`eqx_state.params`][]: inexact arrays outside state cells) only, applies
    `optimizer`, and threads every state write made during the loss (BatchNorm
    statistics, counters, metrics, ...). It is a pure function of its inputs: inside
    it the state cells become refs created in the trace, layers write them in place,
    and they are frozen before the step returns.

    **Arguments:**

    - `loss_fn`: `loss_fn(model, *args, **kwargs) -> loss` (a scalar), or
        `-> (loss, aux)` with `has_aux=True`.
    - `optimizer`: an `optax.GradientTransformation`.
    - `has_aux`: whether `loss_fn` returns `(loss, aux)`; the step then returns
        `(model, opt_state, aux)`.
    - `donate`: donate the buffers the step replaces (parameters, optimizer state,
        value-mode state), as hand-written JAX does with `donate_argnums`. The model
        and optimizer state passed in are then consumed; pass `donate=False` to keep
        them valid (e.g. to differentiate through a step).
    - `mesh`: a `jax.sharding.Mesh` for data parallelism: every argument is
        sharded over `data_axis` on its leading (batch) axis, the model and the
        optimizer state are replicated, and the step is compiled once for the mesh.
        Reductions over the batch (BatchNorm statistics, metrics, the mean loss) are
        then over the **global** batch: the step equals the same step on one device.
    - `data_axis`: the mesh axis that shards the batch.
    - `microbatches`: accumulate gradients over this many equal slices of the batch
        (in a `lax.scan`, in place) and apply the optimizer once: with a mean loss
        this equals one step on the full batch. The loss runs once per slice, so
        state written in it is written once per slice: BatchNorm statistics are
        per-slice batch statistics, updated `microbatches` times, as in PyTorch's
        gradient accumulation. With `has_aux=True`, `aux` is stacked per slice.
    - `**jit_kwargs`: passed to `jax.jit`.

    **Returns:**

    A [`eqx_state.Step`][]: call it as `model, opt_state = step(model, opt_state,
    *args, **kwargs)`; `step.init(model)` makes the optimizer state. In ref mode
    ([`eqx_state.to_refs`][]) the returned model holds the same refs, updated in
    place.

    **Example:**

    ```python
    import equinox as eqx, jax, jax.numpy as jnp, optax
    import eqx_state as es

    model = eqx.nn.Sequential([eqx.nn.Linear(2, 4, key=jax.random.key(0)),
                               es.nn.BatchNorm(4), eqx.nn.Lambda(jax.nn.relu),
                               eqx.nn.Linear(4, 1, key=jax.random.key(1))])

    def loss_fn(model, x, y):
        return jnp.mean((model(x)[:, 0] - y) ** 2)

    step = es.make_step(loss_fn, optax.adam(1e-2))
    opt_state = step.init(model)
    x, y = jnp.ones((8, 2)), jnp.zeros(8)
    model, opt_state = step(model, opt_state, x, y)
    ```
    """
    return Step(
        loss_fn,
        optimizer,
        has_aux=has_aux,
        donate=donate,
        mesh=mesh,
        data_axis=data_axis,
        microbatches=microbatches,
        jit_kwargs=jit_kwargs,
    )


def apply(
    fn: Callable[..., Any], model: Any, *args: Any, **kwargs: Any
) -> tuple[Any, Any]:
    """Run `fn(model, *args, **kwargs)`, letting it write state, and return
    `(out, new_model)`.

    In value mode the cells become refs for the duration of the call and are frozen
    afterwards, so `apply` is a pure function (wrap it, or the code around it, in
    `eqx.filter_jit`). In ref mode the cells are written in place and the returned
    model is `model` itself. Use it for forward-only work that writes state:
    evaluation loops that update metrics, BatchNorm recalibration, decoding with a
    cache.

    **Arguments:**

    - `fn`: any function of the model.
    - `model`: the model, in either mode.
    - `*args`, `**kwargs`: passed to `fn`.

    **Returns:**

    `(out, model)`: what `fn` returned and the model with the new state.

    **Example:**

    ```python
    import jax.numpy as jnp
    import eqx_state as es

    bn = es.nn.BatchNorm(3)
    y, bn = es.apply(lambda m, x: m(x), bn, jnp.ones((4, 3)))
    assert int(bn.num_batches_tracked[...]) == 1
    ```
    """
    thawed, made = _thaw(model)
    out = fn(thawed, *args, **kwargs)
    if any(
        isinstance(x, _Ref) and id(x) in made for x in jax.tree_util.tree_leaves(out)
    ):
        raise StepError(
            "`apply(fn, model, ...)`: `fn` returned a state cell's ref. Return "
            "values (`buf[...]`), not cells; the new model is returned by `apply`."
        )
    return out, _refreeze(thawed, made)


def make_apply(
    fn: Callable[..., Any], *, donate: bool = True, **jit_kwargs: Any
) -> Apply:
    """Build a jit-compiled [`eqx_state.apply`][]: `out, model = apply_fn(model,
    *args)` runs `fn(model, *args)`, letting it write state, in one compiled call.

    It is what `eqx.filter_jit(lambda m, *a: es.apply(fn, m, *a))` computes, with the
    guarantees of [`eqx_state.make_step`][]: tied cells stay one state (under
    `eqx.filter_jit` every leaf becomes its own tracer and a tie is lost), the state
    cells it replaces are donated (parameters are not: they are returned as they
    came), ref-mode models stay on jit's fast dispatch path, and a model this call
    returned is passed back without flattening it again. Use it for evaluation loops
    that update metrics, BatchNorm recalibration, or decoding with a KV cache.

    **Arguments:**

    - `fn`: `fn(model, *args, **kwargs)`, any function of the model.
    - `donate`: donate the state cells the call replaces; the model passed in is then
        consumed (its parameters stay valid). `donate=False` keeps it valid.
    - `**jit_kwargs`: passed to `jax.jit`.

    **Returns:**

    An [`eqx_state.Apply`][].

    **Example:**

    ```python
    import jax.numpy as jnp
    import eqx_state as es

    count = es.make_apply(lambda c: c.increment())
    counter = es.nn.Counter()
    for _ in range(3):
        n, counter = count(counter)
    assert int(n) == 3
    ```
    """
    return Apply(fn, donate=donate, jit_kwargs=jit_kwargs)
