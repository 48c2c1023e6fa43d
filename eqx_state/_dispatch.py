"""Dispatch: run a pure function of `(carry, args, kwargs)` as one `jax.jit` call.

This layer changes no result; it only decides how the call reaches XLA:

* **what is traced**, by Equinox's rule (as `eqx.filter_jit`): JAX and NumPy arrays
  are traced, refs are passed as refs, every other leaf is static (part of the
  compilation key, compared by `==`). Everything is read from what the caller passes,
  on every call: a list item replaced or an optimizer hyperparameter changed in place
  takes effect;
* **what is donated**: the arrays of the carry the function replaces (a policy given
  by the caller of this module). The same array object at two positions is passed
  once, and donated only if every position it holds may be donated; each position
  still gets its own output, so this changes memory, never results;
* **what comes back**: every carry position gets the function's output for it. A
  position the function returned unchanged (the very input it was given) and did
  not donate is handed back as the caller's object, without a copy; refs always are.
  Outputs keep the dtype and weak type of their input, so the next call with them
  hits the same compilation.

The cache is keyed by everything a trace depends on (tree structure, leaf types,
static values, which positions alias); it holds no array and records nothing during
tracing: what a trace learns about its outputs travels back through jit's outputs.
Apart from it, `Compiled.call` remembers the carry it last returned (while the
caller holds it: its objects are referenced weakly), so that passing it back is not
flattened again when its structure is immutable (tuples, named tuples, Equinox
modules): the leaves are then exactly those it was built from (see
`Compiled.call`).
"""

from __future__ import annotations

import dataclasses
import gc
import math
import sys
import warnings
import weakref
from collections.abc import Callable, Sequence
from operator import itemgetter
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ._buffer import (
    _is_ref,
    is_consumed,
    is_state,
    leaked_message,
    unbatched_message,
)
from ._checkpoint import _is_python_scalar
from ._compat import (
    Tracer,
    any_committed,
    batched_identity,
    equinox_runtime_error,
    is_batched,
    is_concrete_ref,
    is_deleted_array_error,
    is_incompatible_devices_error,
    only_vmapped,
    private_numpy_copy,
    quiet_equinox_callback_log,
    ref_buffer,
    ref_buffers,
    ref_identity,
    set_ref_buffers,
    under_trace,
)
from ._errors import (
    NeedsFirstCall,
    RecompileWarning,
    StaleModelError,
    StateError,
    StateWriteError,
    StepError,
    stale_message,
    user_stacklevel,
)
from ._modes import (
    _constant_witness,
    call_leaf_names,
    call_path_name,
    model_path,
    named_call_leaves,
    refuse_shared_refs,
)
from ._rebuild import _reads_dict_as_stored, every_node_type, rebuilder
from ._sharding import (
    constrain,
    explain_sharding_error,
    ref_placement_message,
    spans_processes,
)


# An array (traced); a ref passed as a ref (under an outer trace, or an argument); a
# static leaf; a concrete ref of the carry, run as a value-mode cell: its array goes
# in, donated, and the new array is put back into the same ref (see `call_flat`).
_DYN, _REF, _STATIC, _REFBUF = 0, 1, 2, 3
# The shape witness of such a cell: never replaced, so not passed to the compiled
# call at all (one argument less per cell); the trace makes a stand-in of its shape.
_WITNESS = 4


def _kind(x: Any) -> int:
    if is_concrete_ref(x):
        return _REFBUF
    if _is_ref(x):
        return _REF
    if isinstance(x, (jax.Array, np.ndarray, np.generic)):
        return _DYN
    return _STATIC


def _getter(idx: tuple[int, ...]) -> Callable[[list], list]:
    if not idx:
        return lambda xs: []
    if len(idx) == 1:
        i = idx[0]
        return lambda xs: [xs[i]]
    get = itemgetter(*idx)
    return lambda xs: list(get(xs))


@jax.tree_util.register_static
class _Static:
    """A pytree node with no leaves: carries Python values out of a jitted call."""

    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value


class _OutSpec:
    """What one trace learned about its outputs (travels back inside `_Static`)."""

    __slots__ = (
        "ret_pos",
        "static_out",
        "result_static",
        "kept",
        "_gather",
        "_refbufs",
    )

    def __init__(self, ret_pos, static_out, result_static):
        self.ret_pos = ret_pos
        self.static_out = static_out
        self.result_static = result_static
        # the carry positions whose new leaf is the caller's own (set with the
        # gather): a ref-mode cell's ref and witness, an unchanged static leaf
        self.kept: frozenset[int] = frozenset()
        self._gather: Any = None
        self._refbufs: Any = None

    def new_carry(
        self, carry_leaves: Sequence[Any], ret: list, keep: tuple[int, ...]
    ) -> list:
        """The new carry's leaves: `ret[j]` at position `ret_pos[j]`, the caller's
        leaf elsewhere and at the positions `keep` (ref-mode cells: the ref stays,
        its new array is `refbuf_outputs`). One C-level gather per call, built on
        the first (`keep` is the signature's, the same at every call)."""
        gather = self._gather
        if gather is None:
            n = len(carry_leaves)
            src = list(range(n))
            kept = set(keep)
            for j, i in enumerate(self.ret_pos):
                if i not in kept:
                    src[i] = n + j
            gather = self._gather = _getter(tuple(src))
            replaced = {i for i, _ in self.static_out}
            self.kept = frozenset(
                i for i in range(n) if src[i] == i and i not in replaced
            )
            self._refbufs = _getter(tuple(self.ret_pos.index(i) for i in keep))
        out = gather([*carry_leaves, *ret])
        for i, v in self.static_out:
            out[i] = v
        return out

    def refbuf_outputs(self, ret: list) -> list:
        """The new arrays of the ref-mode cells (`new_carry`'s `keep`), in order."""
        return self._refbufs(ret)


class _Signature:
    """How the leaves of `(carry, args, kwargs)` with one structure and one set of
    leaf kinds split into what the jitted function takes."""

    def __init__(
        self,
        carry_td: Any,
        arg_td: Any,
        kinds: list[int],
        carry_leaves: Sequence[Any],
        donate,
        traced: bool = False,
        vmapped: bool = False,
    ):
        n_carry = carry_td.num_leaves
        # a concrete ref outside the carry is passed as a ref: only the carry's
        # outputs come back to be put into refs
        kinds = [
            _REF if k == _REFBUF and i >= n_carry else k for i, k in enumerate(kinds)
        ]
        carry = carry_td.unflatten(carry_leaves)
        roles = _roles(carry)
        for i in range(1, n_carry):
            if (
                roles[i] == "witness"
                and kinds[i - 1] == _REFBUF
                and kinds[i] == _DYN
                and isinstance(carry_leaves[i], jax.Array)
            ):
                kinds[i] = _WITNESS
        self.witness_idx = tuple(i for i, k in enumerate(kinds) if k == _WITNESS)
        self.carry_treedef, self.arg_treedef = carry_td, arg_td
        self.n_leaves = len(kinds)
        self.n_carry = n_carry
        self.dyn_idx = tuple(i for i, k in enumerate(kinds) if k in (_DYN, _REFBUF))
        self.refbuf_idx = tuple(i for i, k in enumerate(kinds) if k == _REFBUF)
        self.refbuf_ks = tuple(self.dyn_idx.index(i) for i in self.refbuf_idx)
        self.n_carry_dyn = sum(i < n_carry for i in self.dyn_idx)
        self.ref_idx = tuple(i for i, k in enumerate(kinds) if k == _REF)
        self.static_idx = tuple(i for i, k in enumerate(kinds) if k == _STATIC)
        self.get_dyn = _getter(self.dyn_idx)
        # the refs of ref-mode cells, and `dyn` gathered from the leaves followed
        # by those refs' arrays (`call_flat`: one C-level gather per call)
        self.get_refbufs = _getter(self.refbuf_idx)
        refbuf_at = {i: self.n_leaves + j for j, i in enumerate(self.refbuf_idx)}
        self.get_dyn_bufs = _getter(tuple(refbuf_at.get(i, i) for i in self.dyn_idx))
        self.get_refs = _getter(self.ref_idx)
        self.get_static = _getter(self.static_idx)
        # one bool per carry leaf: which positions the function replaces; a ref's
        # array is always replaced (and donated, as JAX donates a ref's array).
        # Under an outer transformation other than `vmap` (`traced`) no array is
        # donated: an outer `jit` ignores donation, and an eager `grad` or
        # `linearize` keeps inputs of the call (residuals) that a donation would
        # delete (`_compat.only_vmapped`).
        may_donate = donate(carry) if not traced else [False] * n_carry
        refbufs = set(self.refbuf_idx)
        self.donatable = tuple(
            i < n_carry and (may_donate[i] or i in refbufs) for i in self.dyn_idx
        )
        self.donates = any(self.donatable)
        # an eagerly vmapped call (an ensemble) donates: tied arrays are found
        # through the batch tracers (`_compat.batched_identity`)
        self.vmapped = vmapped
        self.plans: dict[Any, _Plan] = {}
        self.numbers_seen: dict[int, list] = {}  # static numbers, for a warning
        # The positions in `dyn` of NumPy arrays (set by `Compiled._signature`,
        # which knows the leaves' types): each call passes a private copy of them.
        # On the CPU JAX may use a NumPy array's buffer without a copy while the
        # call runs after returning (jax-ml/jax#37830), so changing the array in
        # place after the call (a learning rate set in the optimizer state the
        # step handed back, a batch buffer refilled) could change that call's
        # input. The copy makes the call read the array as it was given. `None`
        # (a signature made under an outer transformation, keyed by kinds, which
        # NumPy and JAX arrays share): found at each call; an eager `vmap` or
        # `grad` runs the call on the device too.
        self.numpy_ks: tuple[int, ...] | None = None if traced or vmapped else ()

    def unflatten(self, leaves: list) -> tuple[tuple, tuple, dict]:
        carry = self.carry_treedef.unflatten(leaves[: self.n_carry])
        args, kwargs = self.arg_treedef.unflatten(leaves[self.n_carry :])
        return carry, args, kwargs


class _Plan:
    """One compiled variant: a signature plus the static values and the aliasing of
    the arrays, and the `jax.jit` function for them."""

    def __init__(self, owner: Compiled, sig: _Signature, statics, alias, dyn, leaves):
        self.sig = sig
        n = len(sig.dyn_idx)
        self.alias = alias  # for each array: the index of its first occurrence
        roots = list(range(n)) if alias is None else list(alias)
        firsts = [k for k in range(n) if roots[k] == k]
        # An array is donated only if every position holding it may be donated, and
        # only a jax array (a NumPy array has no device buffer to give).
        always = set(sig.refbuf_ks)
        ok = {k: owner.donate or k in always for k in firsts}
        for k in range(n):
            ok[roots[k]] = ok[roots[k]] and sig.donatable[k]
        donated = [k for k in firsts if ok[k] and isinstance(dyn[k], jax.Array)]
        self.donated_ks = tuple(donated)
        dset = set(donated)
        self.kept_ks = tuple(
            k for k in firsts if k not in dset and sig.dyn_idx[k] < sig.n_carry
        )
        self.arg_ks = tuple(
            k for k in firsts if k not in dset and sig.dyn_idx[k] >= sig.n_carry
        )
        # carry positions that must come back from the call: those whose input is
        # donated, and the refs' arrays (put back into their refs)
        self.returned_pos = frozenset(
            sig.dyn_idx[k] for k in range(n) if roots[k] in dset
        ) | frozenset(sig.refbuf_idx)
        self.get_donated = _getter(self.donated_ks)
        self.get_kept = _getter(self.kept_ks)
        self.get_args = _getter(self.arg_ks)
        self.statics = statics
        self.owner = owner
        self.arg_types: tuple | None = None  # of the last trace (see `note_trace`)
        # input types whose trace refused the scan (`NeedsFirstCall`): refused
        # again without tracing again, as `jax.jit` keeps a trace for its types
        self.refused: dict[tuple, str] | None = None
        jit_kwargs = dict(owner.jit_kwargs)
        # on a mesh (see `_place_on`)
        self.placement: Any = None
        self.out_placement: Any = None
        self.replicated: Any = None
        self.global_ks: tuple[int, ...] = ()
        if owner.placement is not None:
            self._place_on(owner.placement, leaves, dyn)
            pl = self.placement
            jit_kwargs["in_shardings"] = tuple(
                [pl[k] for k in ks] for ks in (donated, self.kept_ks, self.arg_ks)
            ) + (None,)  # refs: where they are (a ref cannot move)
            # On a mesh the carry comes back as one slot per position (None where
            # nothing is returned), so that each slot's sharding is known before
            # tracing: explicit output shardings let JAX pair donated inputs with
            # their own outputs (XLA, left to choose, may pair one with a ref's).
            outs = [
                self.out_placement.get(i, self.replicated) for i in range(sig.n_carry)
            ]
            jit_kwargs["out_shardings"] = ((outs, self.replicated), None)
        else:
            # Without a placement (`make_apply`, a step without `mesh=`), a carry
            # input laid out on a multi-device mesh gets its output laid out alike:
            # left to XLA, a replicated cell updated from sharded parameters (an
            # EMA, BatchNorm statistics) came back sharded like them, and a ref-mode
            # model no longer fit the mesh step that had laid it out.
            kept = _kept_layout(dyn, sig)
            if kept:
                self.out_placement = kept

        def impl(donated: list, kept: list, argdyn: list, refs: list) -> Any:
            return self._impl(donated, kept, argdyn, refs)

        impl.__name__ = impl.__qualname__ = owner.name  # shown in logs and profiles
        self.fn = jax.jit(impl, donate_argnums=(0,) if donated else (), **jit_kwargs)

    def _place_on(self, placement: Any, leaves: list, dyn: list) -> None:
        """Where each array goes on the mesh (`placement`, one per array), what each
        carry output is constrained to (`out_placement`, by carry position), and
        which arguments must already be global arrays (several processes)."""
        from jax.sharding import NamedSharding, PartitionSpec

        sig = self.sig
        carry = sig.carry_treedef.unflatten(leaves[: sig.n_carry])
        full = placement.carry(carry)
        mesh = placement.mesh
        self.replicated = NamedSharding(mesh, PartitionSpec())
        self.placement = [
            full[i] if i < sig.n_carry else placement.arg(x)
            for i, x in zip(sig.dyn_idx, dyn)
        ]
        self.out_placement = {i: s for i, s in enumerate(full) if s is not None}
        for i in (*sig.ref_idx, *sig.refbuf_idx):  # a ref cannot move
            _check_ref_placed(
                leaves[i], full[i] if i < sig.n_carry else None, sig, leaves, i
            )
        if spans_processes(mesh):
            self.global_ks = tuple(
                k
                for k in self.arg_ks
                if any(e is not None for e in self.placement[k].spec)
            )

    def put(self, dyn: list) -> list:
        """The arrays of a call placed where the compiled step takes them (a no-op
        for the arrays a previous step returned)."""
        for k in self.global_ks:
            x = dyn[k]
            if not isinstance(x, Tracer) and (
                not isinstance(x, jax.Array) or x.is_fully_addressable
            ):
                raise StepError(_local_batch_message(x, self.placement[k]))
        # `device_put` of an array already in place costs ~8 us, a comparison of
        # shardings ~0.1 us: move only what is elsewhere
        placement = self.placement
        todo = [
            k
            for k, (x, want) in enumerate(zip(dyn, placement))
            if isinstance(x, Tracer)
            or not isinstance(x, jax.Array)
            or x.sharding != want
        ]
        if not todo:
            return dyn
        dyn = list(dyn)
        try:
            moved = jax.device_put([dyn[k] for k in todo], [placement[k] for k in todo])
        except ValueError as e:
            for k in todo:
                message = _indivisible_message(dyn[k], placement[k])
                if message is not None:
                    raise StepError(message) from e
            raise
        for k, x in zip(todo, moved):
            dyn[k] = x
        return dyn

    def _impl(self, donated: list, kept: list, argdyn: list, refs: list) -> Any:
        owner, sig = self.owner, self.sig
        owner.trace_count += 1
        owner.note_trace(self, argdyn)
        n = len(sig.dyn_idx)
        dyn: list[Any] = [None] * n
        for ks, xs in (
            (self.donated_ks, donated),
            (self.kept_ks, kept),
            (self.arg_ks, argdyn),
        ):
            for k, x in zip(ks, xs):
                dyn[k] = x
        if self.alias is not None:
            dyn = [dyn[a] for a in self.alias]
        leaves: list[Any] = [None] * sig.n_leaves
        for idx, xs in (
            (sig.dyn_idx, dyn),
            (sig.ref_idx, refs),
            (sig.static_idx, self.statics),
        ):
            for i, x in zip(idx, xs):
                leaves[i] = x
        for i in sig.witness_idx:  # a stand-in: its output is the caller's own
            leaves[i] = _constant_witness((*jnp.shape(leaves[i - 1]), 0))
        new_carry, result = owner.fn(*sig.unflatten(leaves))
        out_leaves, out_treedef = jax.tree_util.tree_flatten(new_carry)
        if out_treedef != sig.carry_treedef:
            raise StepError(
                "The call changed the structure of the model or optimizer state "
                f"(before: {sig.carry_treedef}, after: {out_treedef}). The "
                "optimizer must keep the structure of its state, and the function "
                "must not replace the model's modules or cells."
            )
        ret, ret_pos, static_out = [], [], []
        slots: list[Any] = [None] * sig.n_carry  # on a mesh, see `__init__`
        ref_pos, witnesses = set(sig.ref_idx), set(sig.witness_idx)
        for i, (o, inp) in enumerate(zip(out_leaves, leaves[: sig.n_carry])):
            if i in ref_pos:
                if o is not inp:
                    raise StepError(
                        "The call replaced a ref-mode state cell's ref; a ref-mode "
                        "model keeps its refs (they are written in place)."
                    )
                continue
            if o is inp and i not in self.returned_pos:
                continue  # unchanged: the caller's own leaf is the output
            if i in witnesses:
                continue  # a shape marker (what a scan hands back for it): keep
                # the caller's, of the same shape
            if isinstance(o, jax.Array):
                # Returned as computed, weak type included (as `eqx.filter_jit`):
                # an optimizer that makes a weakly typed parameter strong changes
                # how the next step computes with it, so the next call is traced
                # for the new type.
                if self.out_placement is not None:  # on a mesh: keep the layout
                    target = self.out_placement.get(i, self.replicated)
                    if target is not None:
                        o = constrain(o, target)
                    slots[i] = o
                ret.append(o)
                ret_pos.append(i)
            else:
                static_out.append((i, o))
        result_dyn, result_static = eqx.partition(result, eqx.is_array)
        if self.replicated is not None:  # the loss and aux: replicated on the mesh
            result_dyn = jax.tree.map(
                lambda x: constrain(x, self.replicated), result_dyn
            )
        if not jax.tree_util.tree_leaves(result_static):
            result_static = None  # all arrays (the usual loss and aux): no combine
        spec = _OutSpec(tuple(ret_pos), tuple(static_out), result_static)
        if self.out_placement is not None:
            ret = slots
        return (ret, result_dyn), _Static(spec)

    def returned(self, ret: list, spec: _OutSpec) -> list:
        """The returned carry arrays, in the order of `spec.ret_pos`."""
        if self.out_placement is None:
            return ret
        return [ret[i] for i in spec.ret_pos]


class Compiled:
    """A pure function `fn(carry, args, kwargs) -> (new_carry, result)` compiled
    with `jax.jit` (see the module docstring). Every runner (a step, its scan, the
    owned loop, an apply) calls it through `call_flat`: one path, so each check
    holds for all of them.

    **Arguments:**

    - `fn`: the pure function. `carry` is a tuple of pytrees whose new values `fn`
        returns (`(model, opt_state)` for a step, `(model,)` for an apply).
    - `donate`: whether to donate at all (`False` keeps every input valid).
    - `donate_policy`: `donate_policy(carry) -> list[bool]`, one bool per leaf of the
        carry: which positions `fn` replaces and may therefore consume.
    - `jit_kwargs`: passed to `jax.jit`.
    - `name`: the name of the compiled function in JAX's logs and profiles.
    - `placement`: where arrays go on a mesh (`_sharding.Placement`), or None.
    - `scanned`: the function runs a scan over the leading axis of every array
        argument: a new length `K` compiles again by design, so the warning of a
        recompile (`note_trace`) compares the arguments' shapes without that axis.
    """

    def __init__(
        self,
        fn: Callable[[tuple, tuple, dict], tuple[tuple, Any]],
        *,
        donate: bool,
        donate_policy: Callable[[tuple], list[bool]],
        jit_kwargs: dict[str, Any],
        name: str = "eqx_state_call",
        placement: Any = None,
        scanned: bool = False,
    ):
        self.fn = fn
        self.name = name
        self.donate = donate
        self.donate_policy = donate_policy
        self.jit_kwargs = jit_kwargs
        self.placement = placement
        self.mesh: Any = None if placement is None else placement.mesh
        self.trace_count = 0
        self._warned = False
        self._warned_numbers = False
        self.scanned = scanned
        self._signatures: dict[Any, Any] = {}
        self._last_signature: tuple | None = None  # (key, signature) of the last call
        # the carry the last call returned, for the next (see `call`): (its
        # skeleton, its leaves, its structure, the weak references of the
        # skeleton, that structure's rebuild or the loop's calls), or None; and which
        # structures are immutable
        self._last: tuple | None = None
        self._frozen: dict[Any, bool] = {}
        self._forget = _forgetter(weakref.ref(self))
        # whether this process has several devices (read at the first call: JAX's
        # backend may not be up when the step is built): a call without a
        # placement then keys its plans by the layout of a carry on a mesh too
        self._several_devices: bool | None = None

    def note_trace(self, plan: _Plan, argdyn: list) -> None:
        """At trace time: warn once when a plan is traced again because its array
        arguments changed shape or dtype (a ragged last batch, typically)."""
        lead = 1 if self.scanned else 0  # a scan's length K: not a ragged batch
        types = tuple(
            (
                tuple(x.shape[lead:]),
                # JAX keys its programs on weak typing too (a Python number's)
                f"{x.dtype} (weak)" if getattr(x, "weak_type", False) else str(x.dtype),
            )
            for x in argdyn
        )
        before, plan.arg_types = plan.arg_types, types
        if before is None or before == types or self._warned:
            return
        self._warned = True
        pairs = [(a, b) for a, b in zip(before, types) if a != b]
        changed = [f"{a} -> {b}" for a, b in pairs]
        advice = []
        weak = [
            a[1].removesuffix(" (weak)") == b[1].removesuffix(" (weak)")
            for a, b in pairs
        ]
        if any(a[1] != b[1] and w for (a, b), w in zip(pairs, weak)):  # weak typing
            advice.append(
                "a weakly typed value (a Python number, or `jnp.asarray` of one) and "
                "an array of a set dtype compile separately: pass one kind every "
                "time, e.g. `jnp.asarray(x, jnp.float32)`"
            )
        if any(a[1] != b[1] and not w for (a, b), w in zip(pairs, weak)):  # a dtype
            advice.append(
                "a new dtype compiles it again: pass each argument in one dtype, "
                "e.g. `jnp.asarray(x, jnp.float32)`"
            )
        if any(len(a[0]) != len(b[0]) for a, b in pairs):  # a rank
            advice.append(
                "a new number of axes compiles it again: give each argument one shape"
            )
        elif any(a[0] != b[0] for a, b in pairs):  # the same rank, other lengths
            advice.append(
                "each new shape compiles it again; a short last batch is the usual "
                "cause: drop it (`drop_last`), or pad it to the batch size and mask "
                "the padding out of the loss and metrics (BatchNorm takes `mask=`)"
            )
        warnings.warn(
            f"`{self.name}` is compiled again because its array arguments changed "
            f"({', '.join(changed)}): {'; '.join(advice)}. This warning is shown once "
            "per step (`eqx_state.RecompileWarning`).",
            RecompileWarning,
            stacklevel=user_stacklevel(),
        )

    def _signature(
        self, carry_leaves: Sequence[Any], carry_td: Any, leaves: list, arg_td
    ):
        types = tuple(map(type, leaves))
        key = (carry_td, arg_td, types)
        last = self._last_signature
        try:
            again = last is not None and last[0] == key
            found = None if again else self._signatures.get(key)
        except (TypeError, ValueError) as e:  # JAX compares static fields with ==
            message = _static_fields_message(carry_leaves, carry_td, leaves, arg_td)
            if message is None:
                raise
            raise StepError(message) from e
        if again:
            # the previous call's key again (a loop): its signature, without
            # hashing the key (which walks every node of the carry's structure)
            sig: Any = last[1]  # type: ignore[index]
        else:
            sig = found
            if sig is None:
                # A new structure: refuse a static field that JAX cannot compare
                # (a NumPy array) now, not at some later call or in one of JAX's
                # caches (each compares structures with `==`)
                message = _static_fields_message(carry_leaves, carry_td, leaves, arg_td)
                if message is not None:
                    raise StepError(message)
                if any(issubclass(t, Tracer) for t in types):
                    sig = self._signatures[key] = _AMBIGUOUS
                else:
                    sig = self._signatures[key] = _Signature(
                        carry_td,
                        arg_td,
                        list(map(_kind, leaves)),
                        carry_leaves,
                        self.donate_policy,
                    )
                    sig.numpy_ks = tuple(
                        k
                        for k, i in enumerate(sig.dyn_idx)
                        if issubclass(types[i], np.ndarray)
                    )
            self._last_signature = (key, sig)
        if sig is _AMBIGUOUS or ((sig.refbuf_idx or sig.donates) and under_trace()):
            if sig is _AMBIGUOUS and not under_trace():
                _refuse_escaped(carry_leaves, carry_td, leaves, arg_td)
            # Under an outer transformation leaves are tracers, and a tracer may be
            # an array or a ref: classify each one (and donate only under `vmap`s
            # over an eager evaluation: `traced`, also when every leaf is concrete,
            # closed over by a differentiated function). A concrete ref closed over by
            # the outer trace (also when no leaf is a tracer: a model and a batch
            # closed over by an outer `jax.jit` or a loop body) is passed as a ref:
            # the trace reads and writes it. Reading its array instead would put
            # the value it held at trace time into the program as a constant.
            kinds = [_REF if k == _REFBUF else k for k in map(_kind, leaves)]
            traced = not only_vmapped()
            key = (carry_td, arg_td, tuple(kinds), traced)
            sig = self._signatures.get(key)
            if sig is None:
                sig = self._signatures[key] = _Signature(
                    carry_td,
                    arg_td,
                    kinds,
                    carry_leaves,
                    self.donate_policy,
                    traced,
                    vmapped=not traced,
                )
        return sig

    def lower(self, carry: tuple, args: tuple, kwargs: dict) -> Any:
        """`jax.jit(...).lower` for the call `call(carry, args, kwargs)` would make:
        the compiled program, for inspection (`.as_text()`,
        `.compile().memory_analysis()`). Runs nothing and donates nothing."""
        with GcPaused():
            leaves, treedef = jax.tree_util.tree_flatten(carry)
            return self.call_flat(leaves, treedef, args, kwargs, lower=True)

    def call(self, carry: tuple, args: tuple, kwargs: dict) -> tuple[tuple, Any]:
        """`fn(carry, args, kwargs)`, compiled: `(new_carry, result)`.

        A carry that is the very objects the previous call returned (`model,
        opt_state = step(model, opt_state, ...)` in a loop) is not flattened again:
        its leaves are the ones that call built it from. This is exact, not a
        guess: it is done only when every node of the carry's structure is
        immutable (`_frozen_structure`: tuples, named tuples, `None` and Equinox
        modules, which refuse attribute assignment), so the objects returned then
        still hold exactly those leaves (the same objects, which flattening would
        give). A list, a dict (`inject_hyperparams`' `hyperparams`) or any other
        node type anywhere in the carry is flattened on every call, so a change
        made in place between calls is read.

        Once such a loop has made `_REBUILD_AFTER` calls, the new carry is built
        by one function generated for the remembered structure
        (`_rebuild.rebuilder`: the objects `treedef.unflatten` builds, the same
        static values), made before the call runs (it never raises). Making it
        costs some tens of unflattens, which a short loop would not win back.
        A module of the carry whose leaves the call returns as they were given
        (`_OutSpec.kept`: a ref-mode cell's ref and witness) is the given
        carry's own module (see `rebuilder`'s `kept`): the object a rebuild would
        make, without making it."""
        with GcPaused():
            last = self._last
            known = last is not None and _same(carry, last[0])
            build: Any = 0  # the rebuild, or how many calls the loop has made
            kept: Any = None
            if known:
                leaves, treedef, build, kept = last[1], last[2], last[4], last[5]  # type: ignore[index]
                if build == _REBUILD_AFTER:
                    build = rebuilder(treedef, kept) or _unflatten(treedef)
            else:
                leaves, treedef = jax.tree_util.tree_flatten(carry)
            new_leaves, result, now_kept = self.call_flat(
                leaves, treedef, args, kwargs, known=known
            )
            if type(build) is int:
                new, build = treedef.unflatten(new_leaves), build + 1
            elif now_kept is kept or now_kept == kept:
                new = build(new_leaves, carry)
            else:  # another plan's outputs (other statics): count again for them
                new, build = treedef.unflatten(new_leaves), 1
            self._remember(
                new, new_leaves, treedef, True if known else None, build, now_kept
            )
            return new, result

    def _remember(
        self,
        new: tuple,
        leaves: list,
        treedef: Any,
        frozen: bool | None,
        build: Any,
        kept: frozenset[int],
    ) -> None:
        """Keep `new` (the carry a call returned) with its leaves for the next
        call (see `call`), when its structure is immutable and no outer
        transformation traced the call (its tracers must not outlive the trace).
        The carry's objects are held weakly (`_skeleton`) and the leaves only
        while all of them live: once the caller drops the model or the optimizer
        state (a module or an array of it), the remembered leaves are let go.
        `frozen`: already known for `treedef` (the remembered one: it was frozen),
        or `None` (looked up here; hashing a structure walks all its nodes).
        `build`: the rebuild of this very `treedef` (its static values), or the
        number of calls the loop has made (see `call`); `kept`: the positions
        whose leaf the call returned as given (`_OutSpec.kept`)."""
        self._last = None
        if frozen is None:
            frozen = self._frozen.get(treedef)
        if frozen is None:
            frozen = self._frozen[treedef] = _frozen_structure(treedef)
        if frozen and not under_trace():
            refs: list = []
            skeleton = _skeleton(new, self._forget, refs)
            self._last = (skeleton, tuple(leaves), treedef, refs, build, kept)

    def call_flat(
        self,
        carry_leaves: Sequence[Any],
        carry_td: Any,
        args: tuple,
        kwargs: dict,
        lower: bool = False,
        known: bool = False,
    ) -> Any:
        """The call on a flattened carry: returns the new carry's leaves, the
        result, and the positions whose new leaf is the given one
        (`_OutSpec.kept`). The one path of every runner (see the module
        docstring). `known`:
        `carry_leaves` are the very leaves the previous call returned (a loop's
        carry), whose refs that call checked."""
        arg_leaves, arg_td = jax.tree_util.tree_flatten((args, kwargs))
        leaves = [*carry_leaves, *arg_leaves]
        sig = self._signature(carry_leaves, carry_td, leaves, arg_td)
        refs = sig.get_refs(leaves)
        if sig.refbuf_ks:  # a ref-mode cell runs as a value-mode one: its array
            cells = sig.get_refbufs(leaves)
            n_refs = len(refs) + len(cells)
            # Two cells sharing one ref would each write it: refused. A carry the
            # previous call returned (`known`) holds the refs that call checked.
            if (
                n_refs > 1
                and (refs or not known)
                and len(set(map(ref_identity, (*cells, *refs)))) != n_refs
            ):
                _refuse_shared_refs(sig, leaves)
            bufs = ref_buffers(cells)
            dyn = sig.get_dyn_bufs([*leaves, *bufs])
        else:
            cells = bufs = ()
            if len(refs) > 1 and len(set(map(ref_identity, refs))) != len(refs):
                _refuse_shared_refs(sig, leaves)
            dyn = sig.get_dyn(leaves)
        numpy_ks = sig.numpy_ks
        if numpy_ks is None:  # a traced signature: NumPy and JAX arrays share it
            numpy_ks = [k for k, x in enumerate(dyn) if isinstance(x, np.ndarray)]
        for k in numpy_ks:  # read as given (see `_Signature.numpy_ks`)
            dyn[k] = private_numpy_copy(dyn[k])
        statics = tuple(sig.get_static(leaves)) if sig.static_idx else ()
        # Aliasing, for donation only (the same buffer cannot be donated twice):
        # results never depend on it.
        alias = None
        ident = batched_identity if sig.vmapped else id
        if len(set(map(ident, dyn))) != len(dyn):
            first: dict[Any, int] = {}
            alias = tuple(first.setdefault(ident(x), k) for k, x in enumerate(dyn))
        if self.mesh is not None:
            pkey: tuple = (statics, alias, _where(dyn, sig))
        else:
            pkey = (statics, alias)
            several = self._several_devices
            if several is None:
                several = self._several_devices = jax.device_count() > 1
            if several:  # `_Plan.__init__`: outputs keep a mesh input's layout
                layout = _layout_key(dyn, sig)
                if layout is not None:
                    pkey = (statics, alias, layout)
        try:
            plan = sig.plans.get(pkey)
        except TypeError as e:  # an unhashable static leaf
            raise StepError(_unhashable_message(*sig.unflatten(leaves))) from e
        if plan is None:
            if sig.plans and statics:
                self._note_numbers(sig, statics, leaves)
            plan = sig.plans[pkey] = _Plan(self, sig, statics, alias, dyn, leaves)
        if plan.placement is not None:
            # On a mesh a consumed input is refused before the call: XLA crashes
            # the process on a deleted sharded buffer (off a mesh, JAX's error
            # is translated after the call, `_reraise`)
            deleted = _deleted(dyn, sig)
            if deleted:
                raise _consumed_error(deleted, sig, leaves)
            for k in sig.refbuf_ks:  # as a new plan checks it (`_place_on`)
                _check_ref_placed(
                    dyn[k], plan.placement[k], sig, leaves, sig.dyn_idx[k]
                )
        if plan.refused is not None:
            why = plan.refused.get(_input_types(dyn, refs))
            if why is not None:
                raise NeedsFirstCall(why)
        given = dyn  # (the types a refusal is kept under: before any placement)
        try:
            if plan.placement is not None:
                dyn = plan.put(dyn)  # on the mesh: where the compiled step takes them
            elif refs or (sig.refbuf_ks and any_committed(bufs)):
                # A call that takes refs commits its outputs (JAX counts a ref as
                # committed), as does an eager ref read or write JAX runs: commit
                # the whole carry once, so that it stays one compilation. A
                # ref-mode carry otherwise stays uncommitted, as a value-mode one.
                dyn = _committed(dyn, sig.n_carry_dyn)
            inputs = (
                plan.get_donated(dyn),
                plan.get_kept(dyn),
                plan.get_args(dyn),
                refs,
            )
            if lower:
                return plan.fn.lower(*inputs)
            (ret, result_dyn), spec = plan.fn(*inputs)
        except Exception as e:
            if isinstance(e, NeedsFirstCall):
                # decided by the inputs' types (and the plan's statics): the same
                # types are refused alike, without tracing the scan again
                if plan.refused is None:
                    plan.refused = {}
                plan.refused[_input_types(given, refs)] = str(e)
                raise
            if (
                type(e) is Exception
                and (refs or sig.refbuf_idx)
                and any(map(is_batched, leaves))
            ):
                # JAX's bare refusal of a write into a ref an enclosing `vmap` does
                # not map (as eager writes say it: `_buffer.unbatched_message`);
                # only under a `vmap` that maps some input of this call
                cells = sorted((*sig.ref_idx, *sig.refbuf_idx))
                what = f"ref-mode state cell (one of {_named(sig, leaves, cells)})"
                raise StateWriteError(unbatched_message(what, e)) from e
            _reraise(e, dyn, sig, leaves)
            if (refs or sig.refbuf_idx) and is_incompatible_devices_error(e):
                _refuse_refs_elsewhere(e, sig, leaves, dyn)
            if self.mesh is not None:
                explain_sharding_error(e, self.mesh)
                _check_refs_on_mesh(
                    e, [*refs, *(leaves[i] for i in sig.refbuf_idx)], self.mesh
                )
            raise
        spec = spec.value
        ret = plan.returned(ret, spec)
        # a ref-mode cell's position keeps its ref, which takes the new array
        out = spec.new_carry(carry_leaves, ret, sig.refbuf_idx)
        if sig.refbuf_idx:
            news = spec.refbuf_outputs(ret)
            if isinstance(news[0], Tracer):  # staged into an outer trace
                for ref, new in zip(cells, news):
                    ref[...] = new
            else:
                set_ref_buffers(cells, news)
        if spec.result_static is None:
            return out, result_dyn, spec.kept
        return out, eqx.combine(result_dyn, spec.result_static), spec.kept

    def _note_numbers(self, sig: _Signature, statics: tuple, leaves: list) -> None:
        """A new plan for a signature that has one: warn (once) when a static
        Python number keeps changing (a float learning rate set between steps
        compiles the step at every change)."""
        changing = []
        for pos, (j, v) in enumerate(zip(sig.static_idx, statics)):
            if isinstance(v, bool) or not isinstance(v, (int, float, complex)):
                continue
            seen = sig.numbers_seen.get(j)
            if seen is None:  # the values of the plans compiled before: the first
                # value counts as a value seen (the warning comes at the third)
                seen = sig.numbers_seen[j] = []
                for key in sig.plans:
                    if key[0][pos] not in seen:
                        seen.append(key[0][pos])
            if v not in seen:
                seen.append(v)
            if len(seen) >= 3:
                changing.append(j)
        if not changing or self._warned_numbers:
            return
        self._warned_numbers = True
        names = call_leaf_names(sig.unflatten(leaves), changing)
        # The fix depends on where the number is: an array in the optimizer state
        # or an argument is a value; in the model, a bare array would be a
        # parameter, which the optimizer trains.
        fixes = {
            "`opt_state": "in the optimizer state, make it an array, e.g. "
            "`opt_state.hyperparams['learning_rate'] = jnp.asarray(lr, jnp.float32)` "
            "(the state's dtype; a bare `jnp.asarray(lr)` is weakly typed) with "
            "`optax.inject_hyperparams`",
            "`model": "in the model, hold it in a state cell, "
            "`es.Buffer(jnp.asarray(v, jnp.float32))` (read with `cell[...]`; "
            "replace the cell between calls with `eqx.tree_at`), which the optimizer "
            "does not train (a bare array field would be a trainable parameter)",
            "`args": "an argument: pass an array, `jnp.asarray(v, jnp.float32)`",
            "`kwargs": "an argument: pass an array, `jnp.asarray(v, jnp.float32)`",
        }
        advice = dict.fromkeys(
            fix for root, fix in fixes.items() for n in names if n.startswith(root)
        )
        warnings.warn(
            f"`{self.name}` is compiled again at every change of "
            f"{', '.join(names)}: a Python number is static (part of the "
            "compilation key, as in `eqx.filter_jit`), so each new value compiles "
            f"the step again. To change it without compiling: {'; '.join(advice)}. "
            "This warning is shown once per step (`eqx_state.RecompileWarning`).",
            RecompileWarning,
            stacklevel=user_stacklevel(),
        )


_AMBIGUOUS = object()
# the calls a loop makes before its carry is rebuilt by a generated function
# (`Compiled.call`)
_REBUILD_AFTER = 4


_STRONG, _TUPLE = object(), object()


def _forgetter(owner: Any) -> Callable[[Any], None]:
    """The weakref callback that clears `owner()`'s remembered carry once the
    caller drops one of its objects (`Compiled._remember`); it holds the owner
    weakly, so the remembered carry does not keep the step alive."""

    def forget(ref: Any) -> None:
        o = owner()
        if o is not None and o._last is not None and any(r is ref for r in o._last[3]):
            o._last = None

    return forget


def _skeleton(x: Any, forget: Callable[[Any], None], refs: list) -> Any:
    """How `_same` recognises `x` later without keeping it alive: a weak
    reference to it (appended to `refs`, calling `forget` when it dies); for a
    tuple (which cannot have one), its type and its items' skeletons; for an
    object that cannot be weakly referenced (a Python scalar, `None`), the object
    itself."""
    # Only a weakly referenceable type is asked (tuples, named tuples, None and
    # numbers are not: asking them raises, ~1 us each)
    if getattr(type(x), "__weakrefoffset__", 1):
        try:
            ref = weakref.ref(x, forget)
        except TypeError:  # pragma: no cover - a type that refuses anyway
            pass
        else:
            refs.append(ref)
            return ref
    if isinstance(x, tuple):
        items = tuple(_skeleton(item, forget, refs) for item in x)
        return (_TUPLE, type(x), items)
    return (_STRONG, x)


def _same(x: Any, skeleton: Any) -> bool:
    """Whether `x` is, object for object, what `skeleton` was made from."""
    if type(skeleton) is weakref.ref:
        return x is skeleton()
    if skeleton[0] is _TUPLE:
        items = skeleton[2]
        return (
            type(x) is skeleton[1]
            and len(x) == len(items)
            and all(map(_same, x, items))
        )
    return x is skeleton[1]


def _unflatten(treedef: Any) -> Callable[[Sequence[Any], Any], Any]:
    """`treedef.unflatten`, called as a rebuild is (`Compiled.call`)."""
    return lambda leaves, _: treedef.unflatten(leaves)


def _frozen_structure(treedef: Any) -> bool:
    """Whether every node of `treedef` is of a type whose instances cannot change
    what they hold: tuples (named tuples too: optax's states), `None`, and Equinox
    modules whose `__dict__` is read as stored (Equinox's flatten reads it; a
    module refuses attribute assignment). Lists, dicts and other node types are
    mutable or unknown."""
    return every_node_type(treedef, _immutable_node_type)


def _immutable_node_type(kind: type) -> bool:
    if issubclass(kind, tuple):
        # a named tuple without an instance `__dict__`: only its items, which
        # cannot change, are there to flatten
        return hasattr(kind, "_fields") and kind.__dictoffset__ == 0  # type: ignore[attr-defined]
    return issubclass(kind, eqx.Module) and _reads_dict_as_stored(kind)


def _inside_a_call() -> bool:
    """Whether this thread is running a compiled call of ours (`Compiled.call_flat`
    is on its stack): asked only when a callback failed (see below)."""
    code = Compiled.call_flat.__code__
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is code:
            return True
        frame = frame.f_back
    return False


# An `eqx.error_if` that fires inside a step: the step raises Equinox's error for it
# (`_reraise`), without JAX's log of the failed callback before it (Equinox's banner
# telling the user to use `eqx.filter_jit`, as `eqx.filter_jit` itself hides it).
quiet_equinox_callback_log(_inside_a_call)


class GcPaused:
    """Python's cyclic garbage collector paused for a call, then restored as it
    was (left off if it was off). Every runner's call runs under it: `Compiled.call`,
    `Compiled.lower` and `Owned.call`, around flattening, the compiled call and
    rebuilding.

    A call allocates one new object per module and cell of the model (the rebuilt
    model and optimizer state) and frees as many when the caller drops the old
    ones; a collection triggered in between scans every object of the process and
    finds next to nothing to free (about ten cycles after a trace at 100
    BatchNorms). With the collector on, such collections took 40% of a step's time
    at 100 BatchNorms (11.6 ms against 6.9 ms paused) and 0.4-0.6 s of a 7 s first
    call (tracing). Results do not depend on when the collector runs; garbage made
    meanwhile, by this call or another thread, is collected at its next collection.
    """

    __slots__ = ("_was",)

    def __enter__(self) -> None:
        self._was = gc.isenabled()
        if self._was:
            gc.disable()

    def __exit__(self, *exc: object) -> None:
        if self._was:
            gc.enable()


class Owned:
    """A carry handed over to a `Compiled` for a run of calls: it is flattened once,
    kept as flat arrays between calls, and rebuilt only on `release()`. Each call
    goes through `Compiled.call_flat`, as every other call does, and reads its
    arguments.

    What the caller can still change in the carry it handed over are the numbers
    its lists and dicts hold (`_settings`: the `hyperparams` of an
    `optax.inject_hyperparams` state, a float in a list of the model). Each call
    reads those, as a step call reads its whole carry: a number set in place since
    the last call is taken into the owned leaves. Everything else was handed over
    (the donated arrays are consumed by the first call, so a stale use raises);
    only the containers that hold numbers are kept, so that nothing else of the
    given carry stays alive (with `donate=False` its arrays are not consumed)."""

    def __init__(self, compiled: Compiled, carry: tuple):
        self._compiled = compiled
        self._leaves, self._treedef = jax.tree_util.tree_flatten(carry)
        self._known = False
        self._released = False
        self._settings = _settings(carry)
        self._names = (
            call_leaf_names((carry, (), {}), [s[3] for s in self._settings])
            if self._settings
            else []
        )

    def _read_settings(self, releasing: bool = False) -> None:
        """Take each number set in place since the last read. A slot that no longer
        holds one leaf (removed, or given a subtree) cannot be taken into the flat
        carry: a `StepError` before a call; on `release()`, a warning (the loop's
        own values are returned, without that change)."""
        for n, (node, key, was, i, size) in enumerate(self._settings):
            try:
                now = node[key]
            except (KeyError, IndexError):
                now = _GONE
            if now is was and len(node) == size:
                continue
            if now is _GONE or len(node) != size or not _is_one_leaf(now):
                what = (
                    "removed"
                    if now is _GONE
                    else f"set to a {type(now).__name__}"
                    if now is not was
                    else f"left in a {type(node).__name__} whose entries were "
                    "added or removed"
                )
                message = (
                    f"{self._names[n]} of the carry `step.own` took over was {what} "
                    "while the loop owns it: the loop takes a number set in place "
                    "(a hyperparameter), not a change of structure."
                )
                if releasing:
                    warnings.warn(
                        message + " `release()` returns the model and optimizer state "
                        "as the loop holds them, without that change.",
                        stacklevel=user_stacklevel(),
                    )
                    continue
                raise StepError(
                    message + " Undo it, or `release()` the loop (which returns "
                    "the model and optimizer state as it holds them), change what it "
                    "returns, and `own` that."
                )
            self._leaves[i] = now
            self._settings[n] = (node, key, now, i, size)
            self._known = False  # no longer only what the last call returned

    def call(self, args: tuple, kwargs: dict) -> Any:
        if self._released:
            raise StepError(
                "This loop was released: it no longer holds the model. Call "
                "`step.own(model, opt_state)` again with what `release()` returned."
            )
        if self._settings:
            self._read_settings()
        with GcPaused():
            self._leaves, result, _ = self._compiled.call_flat(
                self._leaves, self._treedef, args, kwargs, known=self._known
            )
        self._known = True  # the leaves the call returned (see `call_flat`)
        return result

    def release(self) -> tuple:
        """The carry, rebuilt from the arrays the last call returned (with the
        numbers set in place since)."""
        if self._settings:
            self._read_settings(releasing=True)
        self._released = True
        self._settings = []
        return jax.tree_util.tree_unflatten(self._treedef, self._leaves)


def _is_number(x: Any) -> bool:
    """A Python number or a concrete 0-d array: a setting (a hyperparameter)."""
    if _is_python_scalar(x):
        return True
    return (
        isinstance(x, jax.Array | np.ndarray | np.generic)
        and not isinstance(x, Tracer)
        and np.ndim(x) == 0
    )


def _is_one_leaf(x: Any) -> bool:
    treedef = jax.tree_util.tree_structure(x)
    return treedef.num_nodes == 1 and treedef.num_leaves == 1


def _settings(tree: Any) -> list[tuple[Any, Any, Any, int, int]]:
    """The numbers the dicts and lists of `tree` hold, each as `(container, key,
    value, index of the leaf in tree_leaves(tree), len(container))`."""
    out: list[tuple[Any, Any, Any, int, int]] = []

    def visit(x: Any, start: int) -> int:  # -> the number of leaves of `x`
        children = jax.tree_util.tree_flatten_with_path(
            x, is_leaf=lambda y: y is not x
        )[0]
        if len(children) == 1 and children[0][1] is x:
            return 1  # a leaf
        n = 0
        for path, child in children:
            if isinstance(x, dict | list) and _is_number(child):
                key = getattr(path[0], "key", getattr(path[0], "idx", None))
                out.append((x, key, child, start + n, len(x)))
            n += visit(child, start + n)
        return n

    visit(tree, 0)
    return out


_GONE = object()


def _input_types(dyn: Sequence[Any], refs: Sequence[Any]) -> tuple:
    """What a trace of a plan sees of its inputs: each one's shape, dtype and weak
    type (`jax.typeof`)."""
    return (*map(jax.typeof, dyn), *map(jax.typeof, refs))


def _is_committed(x: Any) -> bool:
    return not isinstance(x, jax.Array) or isinstance(x, Tracer) or x.committed


def _committed(dyn: list, n: int) -> list:
    """The carry's arrays (the first `n` of `dyn`) committed to their device. A
    call that takes refs commits its outputs (JAX counts a ref as committed), and
    `jax.jit` compiles separately for committed and uncommitted inputs:
    committing the whole carry up front keeps such calls at one compilation. The
    arguments are left as they come (a fresh batch each call, uncommitted every
    time: no new compilation, and no copy)."""
    # After a call every array it returned is committed: when the model's first
    # array and the optimizer state's last are, the carry is one a call returned
    # (a cheap test; a carry it misjudges costs one compilation, never a result)
    if n == 0 or (_is_committed(dyn[0]) and _is_committed(dyn[n - 1])):
        return dyn
    return [
        x
        if k >= n
        or not isinstance(x, jax.Array)
        or isinstance(x, Tracer)
        or x.committed
        else jax.device_put(x, x.sharding)
        for k, x in enumerate(dyn)
    ]


def _indivisible_message(x: Any, sharding: Any) -> str | None:
    """Why `x` cannot be split as `sharding` says (an axis whose length the mesh
    axes it is split over do not divide, typically a short last batch), or None."""
    spec = tuple(getattr(sharding, "spec", ()))
    for axis, (n, entry) in enumerate(zip(jnp.shape(x), spec)):
        names = () if entry is None else entry if isinstance(entry, tuple) else (entry,)
        devices = math.prod(sharding.mesh.shape[a] for a in names)
        if n % devices:
            return (
                f"make_step(mesh=...): an array argument of shape "
                f"{tuple(jnp.shape(x))} has {n} examples on its batch axis {axis}, "
                f"which the mesh axes {names} of {devices} devices do not divide. "
                "Drop the short last batch (`drop_last`), or pad it to a multiple of "
                f"{devices} and mask the padding out of the loss and metrics "
                "(BatchNorm takes `mask=`). Every array argument with that axis is "
                "split as a batch: pass other arrays through a closure."
            )
    return None


def _mesh_shardings(dyn: list, sig: _Signature) -> list[tuple[int, Any]]:
    """Each carry position with its input's sharding when that input is laid out
    on a multi-device mesh, else None: the one reading of the carry's layout for
    `_kept_layout` and `_layout_key`."""
    from jax.sharding import NamedSharding

    out = []
    for i, x in zip(sig.dyn_idx, dyn):
        if i >= sig.n_carry:
            break
        s = getattr(x, "sharding", None) if not isinstance(x, Tracer) else None
        on_mesh = isinstance(s, NamedSharding) and s.mesh.size > 1
        out.append((i, s if on_mesh else None))
    return out


def _kept_layout(dyn: list, sig: _Signature) -> dict[int, Any]:
    """The carry positions whose input is laid out on a multi-device mesh, with
    that layout (`_Plan.__init__` lays their outputs out alike)."""
    return {i: s for i, s in _mesh_shardings(dyn, sig) if s is not None}


def _layout_key(dyn: list, sig: _Signature) -> tuple | None:
    """The layout of the carry's arrays on a multi-device mesh, for the plan key
    (see `_kept_layout`), or None when none is: by mesh and partition, trailing
    unsplit dimensions left out (JAX hands back `P()` of an input as
    `P(None, None)`, the same layout). Read on every call of a process with
    several devices, so that a plan compiled for one layout (or for one device)
    is not reused for another."""
    key: list = []
    for _, s in _mesh_shardings(dyn, sig):
        if s is None:
            key.append(None)
            continue
        spec = list(s.spec)
        while spec and spec[-1] is None:
            spec.pop()
        key.append((s.mesh, tuple(spec), s.memory_kind))
    return tuple(key) if any(k is not None for k in key) else None


def _where(dyn: list, layout: _Signature) -> tuple:
    """What decides where the arrays go on a mesh: the shapes of the carry's (a
    layout rule may look at them), the number of dimensions of the arguments'."""
    n = layout.n_carry
    return tuple(
        np.shape(x) if i < n else np.ndim(x) for i, x in zip(layout.dyn_idx, dyn)
    )


def _leaf_path(carry: tuple, i: int) -> str:
    """The path of a cell's leaf in the model (the first item of the carry)."""
    path = model_path(jax.tree_util.tree_flatten_with_path(carry)[0][i][0][1:])
    return path.removesuffix(".value")


def _comparable(value: Any) -> bool:
    """Whether JAX can compare a static value with `==` whatever it meets there:
    no array in it (a NumPy or JAX array, of any size: `==` with another value
    broadcasts to an array; tuples, lists, dicts and sets are looked into, since
    their `==` skips an item that is the same object on both sides), and its own
    `==` gives True or False."""
    if isinstance(value, np.ndarray | jax.Array):
        return False
    if isinstance(value, tuple | list | set | frozenset):
        if not all(map(_comparable, value)):
            return False
    elif isinstance(value, dict):
        if not all(map(_comparable, value.values())):
            return False
    try:
        bool(value == value)  # as JAX compares structures
    except Exception:
        return False
    return True


def _static_fields_message(
    carry_leaves: Sequence[Any], carry_td: Any, leaves: list, arg_td: Any
) -> str | None:
    """The static fields of the modules in a call's `(carry, args, kwargs)` whose
    values JAX cannot compare (a NumPy array: JAX compares a structure with the
    ones it has seen, and `==` of two arrays is no True/False), named by path;
    None when there is none. What JAX takes (a list, a tuple, a function) passes."""
    tree = (
        carry_td.unflatten(carry_leaves),
        *arg_td.unflatten(leaves[len(carry_leaves) :]),
    )
    bad: list[str] = []
    todo: list[tuple[tuple, Any]] = [((), tree)]
    while todo and len(bad) < 5:
        path, x = todo.pop()
        if isinstance(x, eqx.Module):
            for f in dataclasses.fields(x):
                if not f.metadata.get("static", False):
                    continue
                value = x.__dict__.get(f.name)
                if not _comparable(value):
                    where = (*path, jax.tree_util.GetAttrKey(f.name))
                    bad.append(
                        f"{call_path_name(tree, where)} ({type(value).__name__})"
                    )
        inner = jax.tree_util.tree_flatten_with_path(
            x, is_leaf=lambda y, x=x: y is not x and isinstance(y, eqx.Module)
        )[0]
        todo.extend((path + p, y) for p, y in reversed(inner) if y is not x)
    if not bad:
        return None
    return (
        "A static field (`eqx.field(static=True)`) is part of the compiled "
        "program's structure (as in `eqx.filter_jit`), which JAX compares with `==`; "
        f"these hold values whose `==` is no True/False: {', '.join(bad)}. Hold an "
        "array in a normal field (a leaf; a state cell, `es.Buffer(...)`, if the "
        "optimizer must not train it), or a tuple of numbers in the static field."
    )


def _named(sig: _Signature, leaves: list, positions: list[int], shown: int = 3) -> str:
    """`named_call_leaves` of a call's leaves at `positions`."""
    return named_call_leaves(sig.unflatten(leaves), positions, shown)


def _local_batch_message(x: Any, sharding: Any) -> str:
    what = (
        "a process-local jax.Array"
        if isinstance(x, jax.Array)
        else f"a {type(x).__name__}"
    )
    return (
        f"The step's mesh spans {jax.process_count()} processes, and an array "
        f"argument of shape {np.shape(x)} is {what}. In a multi-process step every "
        "array argument sharded over the batch must be a global array "
        f"(sharded as {sharding.spec}): build it from this process's rows with "
        "`es.global_batch(local_batch, mesh)` (`jax.make_array_from_process_local_data`"
        "); `es.process_slice(batch_size, mesh)` says which rows are this process's."
    )


def _refuse_escaped(
    carry_leaves: Sequence[Any], carry_td: Any, leaves: list, arg_td
) -> None:
    """Tracers given to a call that no transformation is tracing escaped the one
    that made them (a model returned by `eqx.filter_vmap` of a ref-mode step, or by
    a jitted function that called `es.to_refs`): name the first and the fix, before
    JAX's bare `UnexpectedTracerError` deep in the call."""
    n = len(carry_leaves)
    tree = (carry_td.unflatten(leaves[:n]), *arg_td.unflatten(leaves[n:]))
    escaped = [i for i, x in enumerate(leaves) if isinstance(x, Tracer)]
    what = f"leaf {named_call_leaves(tree, escaped[:1])}" + (
        f" (one of {len(escaped)} such leaves)" if len(escaped) > 1 else ""
    )
    first = leaves[escaped[0]]
    if _is_ref(first):
        raise StateError(leaked_message(what, first))
    raise StateError(
        f"The {what} is a tracer that escaped the transformation that made it (a "
        "value saved from inside `jax.jit`, `vmap` or `grad`, or returned through "
        "a static field). Pass concrete arrays; return values from the transformed "
        "function instead of keeping its intermediates."
    )


def _refuse_shared_refs(sig: _Signature, leaves: list) -> None:
    """One ref at two places of `(carry, args, kwargs)` (see `refuse_shared_refs`)."""
    n_model = sig.carry_treedef.children()[0].num_leaves
    refs = (*sig.ref_idx, *sig.refbuf_idx)
    refuse_shared_refs(sig.unflatten(leaves), leaves, refs, n_model, sig.n_carry)


def _reraise(e: Exception, dyn: list, sig: _Signature, leaves: list) -> None:
    """Say what went wrong in a failed compiled call: a check in the program that
    fired (`eqx.error_if`), an input consumed by an earlier call (a stale model or
    optimizer state, or a deleted argument: named by its path), or else the error
    itself, with a note when this call consumed its inputs."""
    eqx_error = equinox_runtime_error(e)
    deleted = _deleted(dyn, sig)
    if eqx_error is not None:  # a check in the program fired: say which
        if deleted:
            eqx_error.add_note(_CONSUMED_NOTE)
        raise eqx_error from None
    if deleted and is_deleted_array_error(e):  # consumed before this call
        raise _consumed_error(deleted, sig, leaves) from e
    if deleted:  # the program failed after its inputs were donated to it
        e.add_note(_CONSUMED_NOTE)


def _deleted(dyn: list, sig: _Signature) -> list[int]:
    """The leaf positions of the call's arrays that an earlier call consumed."""
    return [i for i, x in zip(sig.dyn_idx, dyn) if is_consumed(x)]


def _check_ref_placed(x: Any, want: Any, sig: _Signature, leaves: list, i: int):
    """The one check that the ref-mode cell at leaf `i` (its ref, or the array it
    holds) is where the step takes it (`want`; None: anywhere): a ref cannot move.
    Run when a plan is made (`_place_on`) and, for the carry's cells, on every
    call on a mesh (a later call may bring another model)."""
    if want is None or isinstance(x, Tracer) or x.sharding == want:
        return
    if not x.sharding.is_equivalent_to(want, len(x.shape)):
        carry = sig.carry_treedef.unflatten(leaves[: sig.n_carry])
        raise StepError(ref_placement_message(_leaf_path(carry, i), x.sharding, want))


def _consumed_error(deleted: list[int], sig: _Signature, leaves: list) -> Exception:
    """The one error for inputs an earlier call consumed: the stale model or
    optimizer state (`_stale_carry`), or a deleted argument, named by path."""
    where = _named(sig, leaves, deleted)
    if all(i >= sig.n_carry for i in deleted):
        return StaleModelError(
            f"The argument {where} holds an array that was consumed (its buffer "
            "donated and deleted) by an earlier call; the model and optimizer "
            "state are intact. Pass an array that is still alive: one donated to "
            "another jitted call (`donate_argnums`) or deleted (`.delete()`) "
            "cannot be read again."
        )
    n_model = sig.carry_treedef.children()[0].num_leaves
    owners = {i < n_model for i in deleted if i < sig.n_carry}
    return _stale_carry(where, owners)


def _stale_carry(where: str, owners: set[bool]) -> StaleModelError:
    """The one error for a carry (model: True, optimizer state: False, in
    `owners`) that an earlier call consumed, naming the consumed leaves (`where`)."""
    what = " and ".join(
        w for w, own in (("model", True), ("optimizer state", False)) if own in owners
    )
    return StaleModelError(stale_message(what, where))


def check_carry_live(carry: tuple) -> None:
    """Before a loop takes over `(model, opt_state)` (`step.own`): the error a
    compiled call gives for a consumed carry, rather than one at the loop's first
    call and a dead carry back from `release()`."""
    leaves = jax.tree_util.tree_leaves(carry)
    deleted = [i for i, x in enumerate(leaves) if is_consumed(x)]
    if deleted:
        n_model = len(jax.tree_util.tree_leaves(carry[0]))
        where = named_call_leaves((carry, (), {}), deleted)
        raise _stale_carry(where, {i < n_model for i in deleted})


_CONSUMED_NOTE = (
    "eqx_state: this call donated the model's (and optimizer state's) buffers to "
    "the compiled program, which failed, so they are consumed. Restore them from a "
    "checkpoint, or build the step with `donate=False` to keep them valid while "
    "debugging."
)


def _refuse_refs_elsewhere(e: Exception, sig: _Signature, leaves: list, dyn: list):
    """JAX refused a call whose inputs live on different devices: if ref-mode
    cells live on devices none of the model's other arrays live on (a ref made on
    the default device beside a model on a mesh), say so and how to make them
    there (JAX cannot move a ref); otherwise JAX's error stands."""
    refs = set(sig.ref_idx) | set(sig.refbuf_idx)
    others = {  # the model's own arrays (an argument elsewhere is JAX's error)
        frozenset(x.sharding.device_set)
        for i, x in zip(sig.dyn_idx, dyn)
        if i < sig.n_carry
        and i not in refs
        and isinstance(x, jax.Array)
        and not isinstance(x, Tracer)
        and x.committed  # an uncommitted array goes where the call runs
    }
    bad = [
        i
        for i in sorted(refs)
        if not isinstance(leaves[i], Tracer)
        and frozenset(ref_buffer(leaves[i]).sharding.device_set) not in others
    ]
    if others and bad:
        raise StepError(
            f"The ref-mode state cells {_named(sig, leaves, bad)} live on other "
            "devices than the call's other arrays, and JAX cannot move a ref. Make "
            "the refs where the model is: `es.to_refs(es.place(model, mesh, "
            "layout))` for a model on a mesh (after `es.nn.with_kv_cache` too, whose "
            "new caches start on the default device), or `es.to_refs(model)` of the "
            "placed value-mode model."
        ) from e


def _check_refs_on_mesh(e: Exception, refs: list, mesh: Any) -> None:
    devices = set(mesh.devices.flat)
    for r in refs:
        if set(r[...].sharding.device_set) != devices:
            raise StepError(
                "A ref-mode state cell lives on other devices than the step's mesh: "
                "JAX cannot move a ref, and a data-parallel step needs its state "
                "replicated on the mesh. Make the ref-mode model on the mesh: "
                "`es.to_refs(model, sharding=NamedSharding(mesh, PartitionSpec()))` "
                "(from a value-mode model, e.g. `es.freeze(model)`)."
            ) from e


def _unhashable_message(carry: Any, args: Any, kwargs: Any) -> str:
    tree = (carry, args, kwargs)
    leaves = jax.tree_util.tree_leaves(tree)
    bad = []
    for j, leaf in enumerate(leaves):
        if _kind(leaf) == _STATIC:
            try:
                hash(leaf)
            except TypeError:
                bad.append(j)
    names = call_leaf_names(tree, bad[:5])  # by path, as every message names leaves
    listed = [f"{n} ({type(leaves[j]).__name__})" for n, j in zip(names, bad)]
    return (
        "Leaves that are not arrays are static (part of the compilation key, as in "
        "`eqx.filter_jit`) and must be hashable; these are not: "
        + ", ".join(listed)
        + ". Make them arrays (`jnp.asarray`), or mark the field "
        "`eqx.field(static=True)` with a hashable value."
    )


def _roles(carry: tuple) -> list[str]:
    """One role per leaf of `carry`: "cell" (a state cell's value), "witness" (a
    ref-mode cell's shape witness, never donated: it is never replaced) or "other"."""
    roles: list[str] = []
    for node in jax.tree_util.tree_leaves(carry, is_leaf=is_state):
        if is_state(node):
            n = len(jax.tree_util.tree_leaves(node))
            roles.extend(["cell"] + ["witness"] * (n - 1))
        else:
            roles.append("other")
    return roles


def all_but_witnesses(carry: tuple) -> list[bool]:
    """Donation policy of a step (carry `(model, opt_state)`): it replaces every
    leaf but cells' witnesses, and donates them all except the optimizer state's
    scalars. `optax.inject_hyperparams` keeps a typed hyperparameter it is given
    (`learning_rate=jnp.asarray(0.1, jnp.float32)`) in the state as that same
    array, and in its closure: donated by the first step, it was deleted under
    the optimizer, and every later `optimizer.init` failed. A scalar kept costs
    one scalar output buffer per step."""
    n_model = len(jax.tree_util.tree_leaves(carry[:1]))
    rest = jax.tree_util.tree_leaves(carry[1:])
    scalar = [False] * n_model + [getattr(x, "ndim", None) == 0 for x in rest]
    return [
        r != "witness" and not s for r, s in zip(_roles(carry), scalar, strict=True)
    ]


def cells_only(carry: tuple) -> list[bool]:
    """Donation policy of an apply: it replaces the state cells' values only."""
    return [r == "cell" for r in _roles(carry)]
