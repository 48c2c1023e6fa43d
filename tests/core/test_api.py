"""The public API: one name per job, renamed names kept one release with a
`DeprecationWarning` that names the replacement."""

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

import eqx_state as es
from eqx_state import _buffer, _step


TOP = {
    # steps and calls that write state
    "make_step", "make_apply", "apply", "step_count", "vmap",
    # modes, filters, resets, evaluation
    "to_refs", "freeze", "params", "is_state", "is_array_or_ref", "reset",
    "inference_mode", "recorded",
    # checkpoints and PyTorch
    "save", "load", "to_orbax", "from_orbax", "orbax_target", "state_dict",
    "load_state_dict", "IncompatibleKeys", "register_torch_names",
    "serialise_filter_spec",
    "deserialise_filter_spec",
    # several devices and processes
    "place", "global_batch", "process_slice",
    # cell kinds
    "Buffer", "BatchStat", "MetricState", "CounterState", "AverageState",
    "RngState", "Cache", "PowerIterationState", "RecordState",
    # errors and warnings
    "EqxStateError", "StateError", "StateWriteError", "StaleModelError",
    "StepError", "CheckpointError", "RecompileWarning",
    # namespaces
    "nn", "metrics",
}  # fmt: skip


def test_the_public_names_are_the_documented_ones():
    # (`jaxtyping`: the test run's import hook, see pyproject's addopts)
    public = {n for n in dir(es) if not n.startswith("_")} - {"jaxtyping"}
    assert public == TOP


@pytest.mark.parametrize(
    "old, new, value",
    [
        ("is_array", "is_array_or_ref", _buffer.is_array_or_ref),
        ("Step", "make_step", _step.Step),
        ("Apply", "make_apply", _step.Apply),
        ("OwnedLoop", "step.own", _step.OwnedLoop),
    ],
)
def test_deprecated_names_work_for_one_release(old, new, value):
    with pytest.warns(DeprecationWarning, match=rf"eqx_state\.{old}.*{new}"):
        assert getattr(es, old) is value
    assert not hasattr(es, "no_such_name")


@pytest.mark.parametrize(
    "statement",
    ["from eqx_state import is_array", "from eqx_state.metrics import reset"],
)
def test_a_deprecated_name_imported_by_name_warns_once(statement):
    """`from eqx_state import old` asks `hasattr` before reading: one warning (it
    gave two)."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exec(compile(statement, "user_script.py", "exec"), {})
    found = [w for w in caught if w.category is DeprecationWarning]
    assert len(found) == 1, [str(w.message) for w in found]


def test_a_wrong_cell_write_is_also_a_value_error_as_for_a_jax_ref():
    """JAX raises `ValueError` for a write of the wrong shape or dtype into a
    `jax.Ref`; a cell's `StateWriteError` is one too, in both modes."""
    ref = jax.new_ref(jnp.zeros(3))
    for bad in (jnp.zeros(4), jnp.zeros(3, jnp.complex64)):
        with pytest.raises(ValueError):
            ref[...] = bad
        for cell in (
            es.to_refs(es.nn.BatchNorm(3)).running_mean,
            es.nn.BatchNorm(3).running_mean,
        ):
            with pytest.raises(ValueError) as info:
                es.apply(lambda c, v: c.__setitem__(Ellipsis, v), cell, bad)
            assert isinstance(info.value, es.StateWriteError)


def test_is_array_or_ref_differs_from_eqx_is_array_on_refs_only():
    ref = es.to_refs(es.nn.Counter()).count.value
    assert es.is_array_or_ref(ref) and not eqx.is_array(ref)
    for x in (jnp.ones(2), 1.0, "a", jax.numpy.int32(1)):
        assert es.is_array_or_ref(x) == eqx.is_array(x)


def test_every_error_of_the_library_derives_from_its_base_class():
    import eqx_state._errors as errors

    for name in dir(errors):
        cls = getattr(errors, name)
        if (
            isinstance(cls, type)
            and issubclass(cls, Exception)
            and not issubclass(cls, Warning)
        ):
            assert issubclass(cls, es.EqxStateError), name
    assert issubclass(es.CheckpointError, es.EqxStateError)
    assert issubclass(errors.StateValueError, ValueError)
    assert issubclass(errors.StateTypeError, TypeError)
