"""eqx_state: stateful layers for Equinox, with pure, jit-compiled steps."""

from . import metrics as metrics, nn as nn
from ._buffer import (
    AverageState as AverageState,
    BatchStat as BatchStat,
    Buffer as Buffer,
    Cache as Cache,
    CounterState as CounterState,
    MetricState as MetricState,
    PowerIterationState as PowerIterationState,
    RecordState as RecordState,
    RngState as RngState,
    is_array_or_ref as is_array_or_ref,
    is_state as is_state,
    params as params,
)
from ._checkpoint import CheckpointError as CheckpointError, load as load, save as save
from ._errors import (
    EqxStateError as EqxStateError,
    RecompileWarning as RecompileWarning,
    StaleModelError as StaleModelError,
    StateError as StateError,
    StateWriteError as StateWriteError,
    StepError as StepError,
)
from ._inference import inference_mode as inference_mode
from ._modes import freeze as freeze, to_refs as to_refs
from ._orbax import (
    from_orbax as from_orbax,
    orbax_target as orbax_target,
    to_orbax as to_orbax,
)
from ._recorded import recorded as recorded
from ._reset import reset as reset
from ._serialisation import (
    deserialise_filter_spec as deserialise_filter_spec,
    serialise_filter_spec as serialise_filter_spec,
)
from ._sharding import (
    global_batch as global_batch,
    place as place,
    process_slice as process_slice,
)
from ._state_dict import (
    IncompatibleKeys as IncompatibleKeys,
    load_state_dict as load_state_dict,
    state_dict as state_dict,
)
from ._step import (
    apply as apply,
    make_apply as make_apply,
    make_step as make_step,
)
from ._step_count import step_count as step_count
from ._torch_names import register_torch_names as register_torch_names
from ._vmap import vmap as vmap


__version__ = "0.1.0"


def _deprecated() -> dict[str, tuple[str, object]]:
    from . import _buffer, _step

    return {
        # named like Equinox's `eqx.is_array`, with other semantics (refs count)
        "is_array": ("eqx_state.is_array_or_ref", _buffer.is_array_or_ref),
        # the objects `make_step` / `make_apply` / `Step.own` return: use them
        # through those functions
        "Step": ("the object `eqx_state.make_step` returns", _step.Step),
        "Apply": ("the object `eqx_state.make_apply` returns", _step.Apply),
        "OwnedLoop": ("the object `step.own` returns", _step.OwnedLoop),
    }


def __getattr__(name: str) -> object:
    """Names kept for one release after a rename, with a `DeprecationWarning`."""
    table = _deprecated()
    if name in table:
        from ._errors import warn_deprecated

        new, value = table[name]
        warn_deprecated(f"eqx_state.{name}", new)
        return value
    raise AttributeError(f"module 'eqx_state' has no attribute {name!r}")
