"""`make_step` (one jit-compiled training step), `apply` and `make_apply` (any
state-writing call): the public objects around the pure functions of `_pure.py`,
compiled by `_dispatch.py`."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, ClassVar

import equinox as eqx
import jax
import numpy as np
import optax

from ._buffer import is_state
from ._compat import Tracer, jit_body
from ._dispatch import (
    Compiled,
    Owned,
    all_but_witnesses,
    cells_only,
    check_carry_live,
)
from ._errors import (
    ReadOnlyError,
    StateTypeError,
    StateValueError,
    check_bool,
    check_int,
    is_whole,
)
from ._modes import check_tree_live
from ._pure import apply_call, run_scan, scan_calls, train_step, trainable_mask
from ._sharding import (
    Layout,
    Placement,
    check_mesh,
    layout_rule,
    place,
    place_carry,
)


class _Runner:
    """What the compiled runners (`Step`, `Apply`) share: read-only after
    construction (one message, `_read_only_message`)."""

    _var: ClassVar[str]  # how the docs call an instance: `step`, `apply_fn`
    _builder: ClassVar[str]  # the function that builds one: `make_step`, ...
    _compiled: Compiled
    _scan: Compiled

    def __setattr__(self, name: str, value: Any) -> None:
        raise ReadOnlyError(_read_only_message(self, name))

    def __delattr__(self, name: str) -> None:
        raise ReadOnlyError(_read_only_message(self, name))


def _own_buffers(make: Callable[[], Any]) -> Any:
    """The tree `make()` returns (an optimizer state), every concrete array in a
    buffer of its own. optax's `init` puts arrays it was given into the state as
    they are (a typed learning rate given to `optax.inject_hyperparams`, the
    parameters themselves for `optax.lookahead`), and the first step donates the
    state: it would delete them from under their owner (the optimizer, for its next
    `init`). Each array is copied, and the original let go before the next copy, so
    the state is held about once (plus one array), not twice."""
    leaves, treedef = jax.tree_util.tree_flatten(make())
    for i, x in enumerate(leaves):
        if isinstance(x, jax.Array) and not isinstance(x, Tracer):
            leaves[i] = x.copy()  # (keeps the dtype, weak type and sharding)
    return treedef.unflatten(leaves)


class Step(_Runner):
    """A compiled training step; build it with [`eqx_state.make_step`][].

    Call it as `model, opt_state = step(model, opt_state, *args, **kwargs)` (with
    the loss appended when `return_loss=True`, then `aux` when `has_aux=True`).
    `step.init(model)` returns the optimizer state. `step.trace_count` counts how
    often the step was traced (compiled). Its configuration (`step.optimizer`,
    `step.loss_fn`, ...) is read-only: the compiled step was built from it.
    """

    loss_fn: Callable[..., Any]
    optimizer: Any
    has_aux: bool
    return_loss: bool
    trainable: Any
    mesh: jax.sharding.Mesh | None
    data_axis: str
    layout: Layout
    microbatches: int | None
    _var, _builder = "step", "make_step"

    @property
    def trace_count(self) -> int:
        """How often the step (and its `scan`) was traced (compiled)."""
        return self._compiled.trace_count + self._scan.trace_count

    def __init__(
        self,
        loss_fn: Callable[..., Any],
        optimizer: Any,
        *,
        has_aux: bool = False,
        return_loss: bool = False,
        trainable: Any = None,
        donate: bool = True,
        mesh: jax.sharding.Mesh | None = None,
        data_axis: str = "data",
        layout: Layout = None,
        microbatches: int | None = None,
        scan_unroll: int | bool = 1,
        jit_kwargs: dict[str, Any] | None = None,
    ):
        check_options(
            "make_step",
            loss_fn,
            jit_kwargs,
            scan_unroll,
            has_aux=has_aux,
            return_loss=return_loss,
            donate=donate,
        )
        if not (
            callable(getattr(optimizer, "init", None))
            and callable(getattr(optimizer, "update", None))
        ):
            raise StateTypeError(
                "make_step: `optimizer` must be an optax optimizer (an object with "
                "`init` and `update`, e.g. `optax.adam(1e-3)`), got "
                f"{type(optimizer).__name__}."
            )
        if microbatches is not None:
            microbatches = check_int(
                "make_step",
                "microbatches",
                microbatches,
                1,
                hint="None (the default) runs each batch in one piece.",
            )
        if mesh is not None:
            check_mesh("make_step", mesh)
        if mesh is not None and data_axis not in mesh.axis_names:
            raise StateValueError(
                f"make_step: the mesh has axes {mesh.axis_names}, not {data_axis!r}. "
                "Pass `data_axis=` naming the axis that shards the batch."
            )
        if layout is not None and mesh is None:
            raise StateValueError(
                "make_step: `layout=` says how the model is split over a mesh; pass "
                "the mesh too (`mesh=`)."
            )
        layout_rule(layout)  # a malformed layout fails here, not at the first step
        config = dict(
            loss_fn=loss_fn,
            optimizer=optimizer,
            has_aux=has_aux,
            return_loss=return_loss,
            trainable=trainable,
            mesh=mesh,
            data_axis=data_axis,
            layout=layout,
            microbatches=microbatches,
        )
        for name, value in config.items():
            object.__setattr__(self, name, value)
        fn = functools.partial(
            train_step,
            loss_fn=jit_body(loss_fn),  # compiled: an `eqx.filter_jit`'s body
            optimizer=optimizer,
            has_aux=has_aux,
            trainable=trainable,
            microbatches=microbatches,
        )

        def scan_fn(carry: tuple, args: tuple, kwargs: dict) -> tuple[tuple, Any]:
            return scan_calls(fn, carry, args, kwargs, unroll=scan_unroll)

        compiled, scan = (
            Compiled(
                f,
                donate=donate,
                donate_policy=all_but_witnesses,
                jit_kwargs=dict(jit_kwargs or {}),
                name=name,
                placement=None
                if mesh is None
                else Placement(mesh, layout, data_axis, batch_axis),
                scanned=batch_axis == 1,  # the scan's: a new K compiles, by design
            )
            for f, name, batch_axis in (
                (fn, "eqx_state_step", 0),
                (scan_fn, "eqx_state_step_scan", 1),
            )
        )
        object.__setattr__(self, "_compiled", compiled)
        object.__setattr__(self, "_scan", scan)

    def init(self, model: Any) -> optax.OptState:
        """The optimizer state for `model`'s trainable parameters.

        **Arguments:**

        - `model`: the model, in either mode.

        **Returns:**

        `optimizer.init(es.params(model))`, restricted to the parameters selected
        by `trainable` when the step has one. With a mesh, it is laid out as the
        step takes it: every copy of a parameter (Adam's moments, a momentum) like
        that parameter, the rest replicated.
        """
        check_tree_live(model)  # consumed: named as every runner names it
        params = trainable_params(model, self.trainable)
        if self.mesh is None:
            return _own_buffers(lambda: self.optimizer.init(params))
        # the parameters where the step puts them, so that the state built from
        # them (`zeros_like`, copies) is laid out alike from the start
        params = place(params, self.mesh, self.layout)
        opt_state = _own_buffers(lambda: self.optimizer.init(params))
        _, opt_state = place_carry(params, opt_state, self.mesh, self.layout)
        return opt_state

    def place(self, model: Any, opt_state: Any) -> tuple[Any, Any]:
        """`(model, opt_state)` laid out on the step's mesh as the step takes them
        (see `layout` in [`eqx_state.make_step`][]): the arrays are
        `jax.device_put` there, `jax.ShapeDtypeStruct` leaves (an abstract model,
        from `eqx.filter_eval_shape`) get the sharding — the target of a sharded
        checkpoint restore —, ref-mode cells are checked to be there already.
        Without a mesh, they are returned as they are.

        **Example:**

        ```python
        import equinox as eqx, jax, jax.numpy as jnp, optax
        from jax.sharding import PartitionSpec as P
        import eqx_state as es

        mesh = jax.make_mesh((1,), ("data",))
        step = es.make_step(lambda m, x: jnp.mean(jax.vmap(m)(x) ** 2),
                            optax.adam(1e-3), mesh=mesh,
                            layout=[(r"weight$", P("data", None))])

        def make():
            model = eqx.nn.Linear(2, 4, key=jax.random.key(0))
            return model, step.init(model)

        model, opt_state = step.place(*eqx.filter_eval_shape(make))  # abstract
        assert opt_state[0].mu.weight.sharding.spec == P("data", None)
        ```
        """
        if self.mesh is None:
            return model, opt_state
        return place_carry(model, opt_state, self.mesh, self.layout)

    def lower(self, model: Any, opt_state: Any, *args: Any, **kwargs: Any) -> Any:
        """The compiled program that `step(model, opt_state, *args, **kwargs)` runs,
        as a `jax.stages.Lowered` (`.as_text()`, `.compile()`); runs nothing."""
        return self._compiled.lower((model, opt_state), args, kwargs)

    def __call__(self, model: Any, opt_state: Any, *args: Any, **kwargs: Any) -> Any:
        (model, opt_state), (loss, aux) = self._compiled.call(
            (model, opt_state), args, kwargs
        )
        return self._outputs(model, opt_state, loss, aux)

    def scan(self, model: Any, opt_state: Any, *args: Any, **kwargs: Any) -> Any:
        """`K` training steps in one compiled call.

        Every array argument has a leading axis of length `K`: step `i` gets slice
        `i` of each (other arguments are passed to every step as they are). The
        result is what `K` calls of the step would give — every state write lands
        once per step, in both modes — in one `jax.jit` call that runs the steps in
        a `lax.scan`, carrying the model and the optimizer state in place. It
        compiles once per `K` and donates like a step. For dense models in
        float32 and float64 (and `scan_unroll=1`, the default) the numbers are
        those of `K` calls, bit for bit. XLA may compile a loop body differently
        from a separate call, as it does a hand-written `lax.scan` (whose numbers
        the scan gives): convolutions, any bfloat16 or float16 arithmetic, and an
        unrolled loop (`scan_unroll` above 1, or `True`: XLA fuses across steps) can then
        round differently, so results can differ in their last bits (which Adam magnifies on a parameter whose
        gradient is nearly zero, e.g. the bias of a convolution before BatchNorm).

        **Arguments:**

        - `model`, `opt_state`: as for a step.
        - `*args`, `**kwargs`: the steps' arguments, stacked: `xs[i]` is step `i`'s
            batch (shape `[K, batch, ...]`).

        **Returns:**

        `(model, opt_state)` after the `K` steps, then the `K` losses (with
        `return_loss=True`) and the `K` auxiliary outputs stacked (with
        `has_aux=True`), as a step returns them.

        **Example:**

        ```python
        import equinox as eqx, jax, jax.numpy as jnp, optax
        import eqx_state as es

        model = eqx.nn.Sequential([es.nn.Batched(eqx.nn.Linear(2, 3, key=jax.random.key(0))),
                                   es.nn.BatchNorm(3)])
        step = es.make_step(lambda m, x: jnp.mean(m(x) ** 2), optax.sgd(0.1),
                            return_loss=True)
        opt_state = step.init(model)
        xs = jax.random.normal(jax.random.key(1), (10, 8, 2))  # 10 steps of 8 examples
        model, opt_state, losses = step.scan(model, opt_state, xs)
        assert losses.shape == (10,)
        assert int(model[1].num_batches_tracked[...]) == 10
        ```
        """
        (model, opt_state), (loss, aux) = run_scan(
            self._scan, self._compiled, (model, opt_state), args, kwargs
        )
        return self._outputs(model, opt_state, loss, aux)

    def own(self, model: Any, opt_state: Any) -> OwnedLoop:
        """Hand the model and the optimizer state over to a training loop that keeps
        them as flat arrays between steps: the fastest way to call this step one
        batch at a time (no flattening or rebuilding of the model per step).

        `loop = step.own(model, opt_state)` takes them over; `loop(*args)` runs one
        step on them (it returns what the step returns after `(model, opt_state)`:
        the loss with `return_loss=True`, `aux` with `has_aux=True`, both as a pair,
        or `None`); `model, opt_state = loop.release()` hands them back. The step is
        the same compiled program as `step(...)`, with the same results.

        While the loop owns them, the model and the optimizer state given to `own`
        must not be used (their arrays are donated by the first step, so using them
        raises `StaleModelError`). A number their lists and dicts hold may be set
        in place, as between step calls: an optimizer hyperparameter
        (`opt_state.hyperparams['learning_rate'] = ...` with
        `optax.inject_hyperparams`) is read by the next step, as a step call reads
        it. An entry added to or removed from a list or dict that holds a number
        raises at the next step. Other changes are not read (a layer or an array
        replaced, an entry of a container that holds no number): to change the
        model, `release()`, change, and `own` again.

        **Example:**

        ```python
        import equinox as eqx, jax, jax.numpy as jnp, optax
        import eqx_state as es

        step = es.make_step(lambda m, x: jnp.mean(m(x) ** 2), optax.sgd(0.1),
                            return_loss=True)
        bn = es.nn.BatchNorm(3)
        loop = step.own(bn, step.init(bn))
        for x in jax.random.normal(jax.random.key(0), (5, 8, 3)):
            loss = loop(x)
        bn, opt_state = loop.release()
        assert int(bn.num_batches_tracked[...]) == 5
        ```
        """
        check_carry_live((model, opt_state))  # as a step call would say it
        return OwnedLoop(self, Owned(self._compiled, (model, opt_state)))

    def _extras(self, loss: Any, aux: Any) -> Any:
        if self.return_loss and self.has_aux:
            return loss, aux
        if self.return_loss:
            return loss
        if self.has_aux:
            return aux
        return None

    def _outputs(self, model: Any, opt_state: Any, loss: Any, aux: Any) -> Any:
        out: tuple = (model, opt_state)
        if self.return_loss:
            out += (loss,)
        if self.has_aux:
            out += (aux,)
        return out


class OwnedLoop:
    """A training loop that owns a model and its optimizer state; made by
    [`Step.own`][eqx_state._step.Step.own]."""

    def __init__(self, step: Step, owned: Owned):
        self._extras = step._extras
        self._owned = owned

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """One training step on the owned model; returns the step's extras."""
        loss, aux = self._owned.call(args, kwargs)
        return self._extras(loss, aux)

    def release(self) -> tuple[Any, Any]:
        """`(model, opt_state)` after the last step; the loop is then done."""
        model, opt_state = self._owned.release()
        return model, opt_state


# `jax.jit` options a runner sets itself (`donate=` is its own option).
_RESERVED_JIT = {
    "donate_argnums": "use `donate=`",
    "donate_argnames": "use `donate=`",
    "static_argnums": "none is needed: Python values in the arguments are static "
    "already (as in `eqx.filter_jit`)",
    "static_argnames": "none is needed: Python values in the arguments are static "
    "already (as in `eqx.filter_jit`)",
}


def check_options(
    where: str, fn: Any, jit_kwargs: Any, scan_unroll: Any, **flags: Any
) -> None:
    """The one check of the options every runner's builder takes (`make_step`,
    `make_apply`; `es.apply` checks its function here at each call): a callable
    function, boolean flags, a valid `scan_unroll`, and
    `jax.jit` options that `jax.jit` takes and the runner does not set itself."""
    if not callable(fn):
        raise StateTypeError(
            f"{where}: the function must be callable, got {type(fn).__name__}."
        )
    for name, value in flags.items():
        check_bool(where, f"`{name}`", value)
    if not isinstance(scan_unroll, bool | np.bool_) and not (
        is_whole(scan_unroll) and scan_unroll >= 1
    ):
        raise StateValueError(
            f"{where}: `scan_unroll` must be a whole number >= 1 or a bool (as "
            f"`lax.scan`'s `unroll`), got {scan_unroll!r}."
        )
    if not jit_kwargs:
        return  # (`es.apply` checks its function at each call: keep that cheap)
    accepted = set(inspect.signature(jax.jit).parameters) - {"fun"}
    for name in jit_kwargs:
        if name in _RESERVED_JIT:
            raise StateValueError(
                f"{where}: `{name}` is set by the runner itself; {_RESERVED_JIT[name]}."
            )
        if name not in accepted:
            raise StateTypeError(
                f"{where} got an unexpected keyword argument `{name}`. Its own "
                "options are in its signature; other keywords go to `jax.jit`, "
                f"which takes {', '.join(sorted(accepted - set(_RESERVED_JIT)))}."
            )


def trainable_params(model: Any, trainable: Any = None) -> Any:
    """[`eqx_state.params`][] restricted to a filter spec (see `make_step`)."""
    mask = trainable_mask(model, trainable)
    return eqx.filter(model, mask, is_leaf=is_state)


def _read_only_message(runner: _Runner, name: str) -> str:
    """The one refusal of a change to a compiled runner (`Step`, `Apply`): what it
    compiled was built from what its builder was given, so a new value would be
    shown but not used. Its options are its public annotated fields."""
    var, builder = runner._var, runner._builder
    options = [n for n in type(runner).__annotations__ if not n.startswith("_")]
    text = (
        f"`{var}.{name}` cannot be changed: the compiled call was built from what "
        f"`es.{builder}` was given, and would keep using it. Build a new one"
    )
    if name not in options:
        return text + f" with `es.{builder}(...)`."
    text += (
        f" with `es.{builder}(new_fn, ...)`"
        if name == "fn"
        else f" with `es.{builder}(..., {name}=...)`"
    )
    if builder != "make_step":
        return text + "."
    return text + (
        " (an optimizer state made by the old step's `init` fits the new one when "
        "the optimizer's state has the same structure). To change a hyperparameter "
        "between steps, use `optax.inject_hyperparams` and set it in the optimizer "
        "state."
    )


class Apply(_Runner):
    """A compiled state-writing call; build it with [`eqx_state.make_apply`][].

    Call it as `out, model = apply_fn(model, *args, **kwargs)`.
    `apply_fn.trace_count` counts how often it was traced (compiled).
    """

    _var, _builder = "apply_fn", "make_apply"

    @property
    def trace_count(self) -> int:
        """How often the call (and its `scan`) was traced (compiled)."""
        return self._compiled.trace_count + self._scan.trace_count

    fn: Callable[..., Any]

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        donate: bool,
        jit_kwargs: dict,
        scan_unroll: int | bool = 1,
    ):
        check_options("make_apply", fn, jit_kwargs, scan_unroll, donate=donate)
        object.__setattr__(self, "fn", fn)

        body = jit_body(fn)  # compiled: an `eqx.filter_jit`'s body

        def pure(carry: tuple, args: tuple, kwargs: dict) -> tuple[tuple, Any]:
            out, model = apply_call(body, carry[0], args, kwargs)
            return (model,), out

        def scan_fn(carry: tuple, args: tuple, kwargs: dict) -> tuple[tuple, Any]:
            return scan_calls(pure, carry, args, kwargs, unroll=scan_unroll)

        # Only the state cells are replaced, so only they are donated; parameters
        # come back as the caller's own arrays.
        compiled = Compiled(
            pure,
            donate=donate,
            donate_policy=cells_only,
            jit_kwargs=jit_kwargs,
            name="eqx_state_apply",
        )
        scan = Compiled(
            scan_fn,
            donate=donate,
            donate_policy=cells_only,
            jit_kwargs=jit_kwargs,
            name="eqx_state_apply_scan",
            scanned=True,
        )
        object.__setattr__(self, "_compiled", compiled)
        object.__setattr__(self, "_scan", scan)

    def lower(self, model: Any, *args: Any, **kwargs: Any) -> Any:
        """The compiled program that `apply_fn(model, *args, **kwargs)` runs, as a
        `jax.stages.Lowered` (`.as_text()`, `.compile()`); runs nothing."""
        return self._compiled.lower((model,), args, kwargs)

    def __call__(self, model: Any, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        (model,), out = self._compiled.call((model,), args, kwargs)
        return out, model

    def scan(self, model: Any, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        """`K` calls in one compiled call (an evaluation loop over `K` batches):
        every array argument has a leading axis of length `K`, call `i` gets slice
        `i`. State writes (metrics, BatchNorm statistics) land once per call.

        **Returns:**

        `(outs, model)`: the `K` outputs stacked, and the model after the `K` calls.

        **Example:**

        ```python
        import jax.numpy as jnp
        import eqx_state as es

        evaluate = es.make_apply(lambda m, x: m.update(x))
        mean = es.metrics.Mean()
        _, mean = evaluate.scan(mean, jnp.arange(12.0).reshape(4, 3))  # 4 batches
        assert float(mean.compute()) == 5.5
        ```
        """
        (model,), out = run_scan(self._scan, self._compiled, (model,), args, kwargs)
        return out, model


def make_step(
    loss_fn: Callable[..., Any],
    optimizer: Any,
    *,
    has_aux: bool = False,
    return_loss: bool = False,
    trainable: Any = None,
    donate: bool = True,
    mesh: jax.sharding.Mesh | None = None,
    data_axis: str = "data",
    layout: Layout = None,
    microbatches: int | None = None,
    scan_unroll: int | bool = 1,
    **jit_kwargs: Any,
) -> Step:
    """Build one jit-compiled training step.

    The step differentiates `loss_fn` with respect to the parameters of the model
    ([`eqx_state.params`][]: inexact arrays outside state cells) only, applies
    `optimizer`, and threads every state write made during the loss (BatchNorm
    statistics, counters, metrics, ...). It is a pure function of its inputs: inside
    it the state cells become refs created in the trace, layers write them in place,
    and they are frozen before the step returns.

    Each call reads what it is given, with Equinox's rule (as `eqx.filter_jit`):
    arrays (in the model, the optimizer state and the arguments) are traced, every
    other leaf — Python numbers, bools, strings, functions — is static, so a change
    to it compiles the step again. In-place changes between calls (a list item of
    the model replaced, `opt_state.hyperparams["learning_rate"] = ...` with
    `optax.inject_hyperparams`) take effect.

    **Arguments:**

    - `loss_fn`: `loss_fn(model, *args, **kwargs) -> loss` (a scalar), or
        `-> (loss, aux)` with `has_aux=True`.
    - `optimizer`: an optax optimizer (an `optax.GradientTransformation`, or
        anything with its `init` / `update`, such as `optax.MultiSteps`).
    - `has_aux`: whether `loss_fn` returns `(loss, aux)`; the step then returns
        `aux` last.
    - `return_loss`: also return the loss (after the optimizer state).
    - `trainable`: train only part of the model: a predicate called on each
        parameter (`param -> bool`), or an Equinox filter spec (a pytree prefix of
        the model of bools and callables, as for `eqx.filter`). The other parameters get no gradient, no optimizer state
        and no update (not from weight decay, not from momentum). `step.init` builds
        the optimizer state for the selected parameters only.
    - `donate`: donate the buffers the step replaces (parameters, optimizer state,
        value-mode state), as hand-written JAX does with `donate_argnums`, except
        the optimizer state's scalars: `optax.inject_hyperparams` keeps a typed
        hyperparameter it was given (`jnp.float32(1e-3)`) in the state as that
        same array, so a state made by hand, `optimizer.init(es.params(model))`,
        would lose it from under the optimizer. The model
        and optimizer state passed in are then consumed — also when the compiled
        program fails at run time (an `eqx.error_if` check): keep a checkpoint, or
        pass `donate=False` to keep them valid (e.g. while debugging). A step
        called inside a traced function (`jax.jit`, `jax.grad`, or a `vmap` under
        either: to differentiate through a step) donates nothing: JAX keeps its
        inputs. Called by an eager `vmap` (an ensemble: `eqx.filter_vmap(step)`
        outside any `jit`), it donates the arrays the batch holds, as a plain call
        does: the old ensemble is consumed.
    - `mesh`: a `jax.sharding.Mesh` for data parallelism: every array argument is
        sharded over `data_axis` on its leading (batch) axis, the model is laid out
        by `layout` (replicated by default), the optimizer state like its
        parameters, and the step is compiled once for the mesh; its outputs keep
        those layouts. Reductions over the batch (BatchNorm statistics, metrics,
        the mean loss) are then over the **global** batch: the step equals the same
        step on one device. The mesh may span several processes
        (`jax.distributed.initialize`): every process runs the same step, and its
        array arguments are then global arrays built from each process's part of
        the batch with [`eqx_state.global_batch`][].
    - `data_axis`: the mesh axis that shards the batch.
    - `layout`: how the model's arrays are split over the mesh (fully-sharded data
        parallel, tensor parallel): a function `(path, x) -> PartitionSpec | None`
        or a sequence of `(regex, PartitionSpec)` pairs, as for
        [`eqx_state.place`][]. Unnamed arrays and state cells are replicated; the
        optimizer state follows its parameters. A layout that splits
        contractions (tensor parallel) needs the mesh's axes to be
        `jax.sharding.AxisType.Auto` (JAX's default `Explicit` axes ask the model
        code to say how each sharded matmul is split). See the scaling guide.
    - `microbatches`: accumulate gradients over this many equal slices of the batch
        (in a `lax.scan`, in place) and apply the optimizer once: with a mean loss
        this equals one step on the full batch. The loss runs once per slice, so
        state written in it is written once per slice: BatchNorm statistics are
        per-slice batch statistics, updated `microbatches` times, as in PyTorch's
        gradient accumulation, and an `EMA.update` in the loss advances once per
        slice. With `has_aux=True`, `aux` is stacked per slice.
    - `scan_unroll`: `lax.scan`'s `unroll` for [`Step.scan`][eqx_state._step.Step.scan] (how many
        steps each iteration of the compiled loop runs; `True`: all of them). On
        CPU, XLA runs convolutions inside a loop several times slower than outside
        one (measured: a small CNN 17x slower per step); unrolling avoids the loop,
        at a compile time that grows with `K`. Dense models are fastest rolled.
        Unrolled, XLA fuses arithmetic across steps, so results can differ from
        `K` separate calls in their last bits, as a hand-written `lax.scan(...,
        unroll=...)`'s do.
    - `**jit_kwargs`: passed to `jax.jit`.

    **Returns:**

    A [`Step`][eqx_state._step.Step]: call it as `model, opt_state = step(model, opt_state,
    *args, **kwargs)`; `step.init(model)` makes the optimizer state. In ref mode
    ([`eqx_state.to_refs`][]) the returned model holds the same refs, updated in
    place.

    **Example:**

    ```python
    import equinox as eqx, jax, jax.numpy as jnp, optax
    import eqx_state as es

    k1, k2 = jax.random.split(jax.random.key(0))
    model = eqx.nn.Sequential([es.nn.Batched(eqx.nn.Linear(2, 4, key=k1)),
                               es.nn.BatchNorm(4), eqx.nn.Lambda(jax.nn.relu),
                               es.nn.Batched(eqx.nn.Linear(4, 1, key=k2))])

    def loss_fn(model, x, y):  # x: [batch, 2]
        return jnp.mean((model(x)[:, 0] - y) ** 2)

    step = es.make_step(loss_fn, optax.adam(1e-2), return_loss=True)
    opt_state = step.init(model)
    x, y = jax.random.normal(jax.random.key(1), (8, 2)), jnp.zeros(8)
    model, opt_state, loss = step(model, opt_state, x, y)
    assert int(model[1].num_batches_tracked[...]) == 1
    assert int(es.step_count(opt_state)) == 1
    ```
    """
    return Step(
        loss_fn,
        optimizer,
        has_aux=has_aux,
        return_loss=return_loss,
        trainable=trainable,
        donate=donate,
        mesh=mesh,
        data_axis=data_axis,
        layout=layout,
        microbatches=microbatches,
        scan_unroll=scan_unroll,
        jit_kwargs=jit_kwargs,
    )


def apply(
    fn: Callable[..., Any], model: Any, *args: Any, **kwargs: Any
) -> tuple[Any, Any]:
    """Run `fn(model, *args, **kwargs)`, letting it write state, and return
    `(out, new_model)`.

    In value mode the cells become refs for the duration of the call and are frozen
    afterwards, so `apply` is a pure function (wrap it, or the code around it, in
    `eqx.filter_jit`, or use [`eqx_state.make_apply`][]). In ref mode the cells are
    written in place and the returned model holds the same refs. Use it for
    forward-only work that writes state: evaluation loops that update metrics,
    BatchNorm recalibration, decoding with a cache.

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
    check_options("eqx_state.apply", fn, None, 1)  # as `make_apply` checks it
    return apply_call(fn, model, args, kwargs)


def make_apply(
    fn: Callable[..., Any],
    *,
    donate: bool = True,
    scan_unroll: int | bool = 1,
    **jit_kwargs: Any,
) -> Apply:
    """Build a jit-compiled [`eqx_state.apply`][]: `out, model = apply_fn(model,
    *args)` runs `fn(model, *args)`, letting it write state, in one compiled call.

    It computes what `eqx.filter_jit(lambda m, *a: es.apply(fn, m, *a))` computes,
    with the state cells it replaces donated (parameters are not: they are returned
    as they came, without a copy). Use it for evaluation loops that update metrics,
    BatchNorm recalibration, or decoding with a KV cache.

    **Arguments:**

    - `fn`: `fn(model, *args, **kwargs)`, any function of the model.
    - `donate`: donate the state cells the call replaces; the model passed in is then
        consumed (its parameters stay valid). `donate=False` keeps it valid. Inside
        a traced function nothing is donated; an eager `vmap` donates as a plain
        call does (see [`eqx_state.make_step`][]).
    - `scan_unroll`: `lax.scan`'s `unroll` for [`Apply.scan`][eqx_state._step.Apply.scan] (see
        [`eqx_state.make_step`][]).
    - `**jit_kwargs`: passed to `jax.jit`.

    **Returns:**

    An [`Apply`][eqx_state._step.Apply].

    **Example:**

    ```python
    import eqx_state as es

    count = es.make_apply(lambda c: c.increment())
    counter = es.nn.Counter()
    for _ in range(3):
        n, counter = count(counter)
    assert int(n) == 3
    ```
    """
    return Apply(fn, donate=donate, jit_kwargs=jit_kwargs, scan_unroll=scan_unroll)
