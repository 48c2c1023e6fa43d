"""Shared by the checkpoint tests: an exact comparison of restored trees (type, dtype,
shape, weak type, bits) and a child-process environment that imports this checkout."""

import math
import os
import pathlib

import jax
import numpy as np


ROOT = pathlib.Path(__file__).resolve().parent.parent


def child_env() -> dict[str, str]:
    """The environment of a child Python process that imports `eqx_state` from this
    checkout (not from wherever the package happens to be installed)."""
    path = os.environ.get("PYTHONPATH", "")
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), path])),
    }


def _bits(x: np.ndarray) -> bytes:
    return np.ascontiguousarray(x).tobytes()


def assert_exact(got, want, where="leaf"):
    """`got` is `want`'s exact copy: same Python/NumPy/JAX type, storage mode, dtype,
    shape, weak type and the same bits (so NaN payloads and -0.0 count)."""
    if isinstance(want, jax.Ref):
        assert isinstance(got, jax.Ref), (where, type(got))
        assert got is not want, where
        got, want = jax.freeze(got), jax.freeze(want)
    else:
        assert not isinstance(got, jax.Ref), (where, type(got))
    if type(want) in (bool, int, float, complex):
        assert type(got) is type(want), (where, type(got), type(want))
        if isinstance(want, float) and math.isnan(want):
            assert math.isnan(got), where
        else:
            assert got == want, (where, got, want)
        return
    if isinstance(want, np.generic):
        assert type(got) is type(want), (where, type(got), type(want))
        assert _bits(np.asarray(got)) == _bits(np.asarray(want)), (where, got, want)
        return
    if isinstance(want, np.ndarray):
        assert type(got) is np.ndarray, (where, type(got))
        assert got.dtype == want.dtype and got.shape == want.shape, (where, got, want)
        assert _bits(got) == _bits(want), (where, got, want)
        return
    if isinstance(want, jax.Array):
        assert isinstance(got, jax.Array), (where, type(got))
        assert got.dtype == want.dtype and got.shape == want.shape, (where, got, want)
        if jax.dtypes.issubdtype(want.dtype, jax.dtypes.prng_key):
            assert jax.random.key_impl(got) == jax.random.key_impl(want), where
            got, want = jax.random.key_data(got), jax.random.key_data(want)
        assert got.weak_type == want.weak_type, (where, got.weak_type)
        assert _bits(np.asarray(got)) == _bits(np.asarray(want)), (where, got, want)
        return
    assert got == want, (where, got, want)


def assert_tree_exact(got, want):
    """Leaf by leaf, at the same paths. (Static fields come from `like`, so tree
    definitions are not compared.)"""
    paths_want = jax.tree_util.tree_flatten_with_path(want)[0]
    paths_got = jax.tree_util.tree_flatten_with_path(got)[0]
    assert [p for p, _ in paths_got] == [p for p, _ in paths_want]
    for (path, w), (_, g) in zip(paths_want, paths_got):
        assert_exact(g, w, jax.tree_util.keystr(path))


def consumed_ref_mode_model():
    """A ref-mode model whose buffers a failed jitted call consumed: JAX donates
    ref arguments to a jitted call, even one that then fails."""
    import equinox as eqx
    import jax.numpy as jnp
    import pytest

    import eqx_state as es

    model = es.to_refs(es.Buffer(jnp.ones(2)))

    @jax.jit
    def fails(m):
        v = m.value[...]
        return eqx.error_if(v, v[0] > 0, "boom")

    with pytest.raises(Exception, match="boom"):
        fails(model)
    return model
