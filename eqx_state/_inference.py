"""Train / eval mode for part of a model: `inference_mode(model, where=..., only=...)`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import numpy as np

from ._errors import StateTypeError, StateValueError
from ._modes import check_tree_live


def _has_inference(x: Any) -> bool:
    return isinstance(x, eqx.Module) and hasattr(x, "inference")


def _as_predicate(only: Any) -> Callable[[Any], bool]:
    if only is None:
        return lambda m: True
    if isinstance(only, type) or (
        isinstance(only, tuple) and all(isinstance(t, type) for t in only)
    ):
        return lambda m: isinstance(m, only)
    if isinstance(only, eqx.Module):  # callable, but a layer, not a predicate
        raise StateTypeError(
            "inference_mode: `only` got a layer instance "
            f"({type(only).__name__}(...)), which would be called on every layer "
            f"as a predicate. Pass its type, `only={type(only).__name__}`, or a "
            "predicate `module -> bool`."
        )
    if callable(only):
        return lambda m: bool(only(m))
    raise StateTypeError(
        "inference_mode: `only` must be a layer type (e.g. `es.nn.BatchNorm`), a "
        f"tuple of types, or a predicate `module -> bool`; got {only!r}."
    )


def _inference_paths(tree: Any, keep: Callable[[Any], bool]) -> list[str]:
    """The paths (`jax.tree_util.keystr`) of the `inference` fields of every module
    inside `tree` (at any depth) that `keep` accepts."""
    found: list[str] = []

    def visit(node: Any, prefix: tuple) -> None:
        if _has_inference(node) and keep(node):
            path = prefix + (jax.tree_util.GetAttrKey("inference"),)
            found.append(jax.tree_util.keystr(path))
        items = jax.tree_util.tree_flatten_with_path(
            node, is_leaf=lambda x: x is not node and _has_inference(x)
        )[0]
        for path, x in items:
            if x is not node and _has_inference(x):
                visit(x, prefix + tuple(path))

    visit(tree, ())
    return found


def inference_mode(
    model: Any,
    value: bool | np.bool_ = True,
    *,
    where: Callable[[Any], Any] | None = None,
    only: type | tuple[type, ...] | Callable[[Any], bool] | None = None,
) -> Any:
    """Switch evaluation mode on (or off) for **part** of a model: PyTorch's
    `module.eval()` on a submodule.

    `eqx.nn.inference_mode(model, value)` sets the `inference` field of every layer;
    this sets it only on the layers selected by `where` (which parts of the model)
    and `only` (which kinds of layer). A layer in inference mode writes no state and
    uses its running statistics (BatchNorm), draws no mask (Dropout), and so on;
    the other layers keep training behaviour.

    The fine-tuning recipe, BatchNorm statistics frozen while Dropout stays active:

    ```python
    model = es.inference_mode(model, only=es.nn.BatchNorm)
    ```

    and for a frozen backbone in evaluation mode: `es.inference_mode(model,
    where=lambda m: m.backbone)`. Both are ordinary model edits: pass the returned
    model to `make_step` (a changed mode compiles one new variant of the step).

    **Arguments:**

    - `model`: any model (value or ref mode; cells are untouched).
    - `value`: `True` for evaluation (default), `False` for training (a NumPy
        bool is read as the Python bool; anything else is a `TypeError`).
    - `where`: selects the part(s) of the model to switch, as for `eqx.tree_at`:
        `lambda m: m.backbone`, or a tuple `lambda m: (m.block1, m.block2)`.
        Default: the whole model.
    - `only`: which layers inside the selected parts to switch: a type
        (`es.nn.BatchNorm`, `eqx.nn.Dropout`), a tuple of types, or a predicate
        `module -> bool`. Default: every layer with an `inference` field.

    **Returns:**

    The model with the selected layers' `inference` set to `value`.

    **Raises:**

    `ValueError` if nothing with an `inference` field was selected (a `where` or
    `only` that matches no layer would otherwise do nothing, silently). With
    several parts (`where` returning a tuple), a part without a match is fine as
    long as another part has one.

    **Example:**

    ```python
    import equinox as eqx, jax, jax.numpy as jnp
    import eqx_state as es

    model = eqx.nn.Sequential([
        es.nn.Batched(eqx.nn.Linear(4, 4, key=jax.random.key(0))),
        es.nn.BatchNorm(4),
        eqx.nn.Dropout(0.5),
    ])
    model = es.inference_mode(model, only=es.nn.BatchNorm)
    print(model.layers[1].inference, model.layers[2].inference)  # True False
    # BatchNorm reads its running statistics and writes nothing; Dropout drops.
    y = model(jnp.ones((8, 4)), key=jax.random.key(1))
    ```
    """
    keep = _as_predicate(only)
    if where is not None and not callable(where):
        raise StateTypeError(
            "inference_mode: `where` must be a function that selects the part(s) "
            f"of the model to switch, as for `eqx.tree_at` (`where=lambda m: "
            f"m.backbone`), got {type(where).__name__}."
        )
    if isinstance(value, np.bool_):  # a flag read from a NumPy array of flags
        value = bool(value)
    if not isinstance(value, bool):
        raise StateTypeError(
            f"inference_mode: `value` must be a bool (True: evaluation, False: "
            f"training), got {type(value).__name__}: the flag decides which program "
            "a layer traces, so it is a Python value, never an array."
        )
    check_tree_live(model)  # switching a consumed model's mode would hide it

    # Several parts (`where=lambda m: (m.a, m.b)`) are switched one by one: a part
    # with no match is fine as long as some part has one.
    switched = 0

    def switch(part: Any) -> Any:
        nonlocal switched
        targets = set(_inference_paths(part, keep))
        switched += len(targets)
        done: set[str] = set()

        def one(path: tuple, x: Any) -> Any:
            name = jax.tree_util.keystr(path)
            if name not in targets:
                return x
            done.add(name)
            return value

        new = jax.tree_util.tree_map_with_path(one, part)
        if done != targets:  # an `inference` that is not a leaf (a static field)
            root = "model" if where is None else "part"  # `where`'s part of it
            names = ", ".join(f"`{root}{t}`" for t in sorted(targets - done))
            raise StateValueError(
                "inference_mode: these `inference` fields are static (part of the "
                f"module's structure), so they cannot be switched here: {names}"
                + ("" if where is None else " (`part`: what `where` selects)")
                + ". "
                "Make the field an ordinary (non-static) field, as Equinox's and "
                "eqx_state's layers do."
            )
        return new

    if where is None:
        new = switch(model)
    else:
        new = eqx.tree_at(where, model, replace_fn=switch)
    if not switched:
        raise StateValueError(_nothing_message(where, only))
    return new


def _nothing_message(where: Any, only: Any) -> str:
    what = []
    if where is not None:
        what.append("`where`")
    if only is not None:
        what.append("`only`")
    sel = " and ".join(what) or "the model"
    return (
        f"inference_mode: {sel} selected no layer with an `inference` field, so "
        "nothing would change. Check that `where` returns the submodule(s) (as for "
        "`eqx.tree_at`) and that `only` names the layer type used in the model (e.g. "
        "`es.nn.BatchNorm`, not `eqx.nn.BatchNorm`)."
    )
