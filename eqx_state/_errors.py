"""The library's exception types. Each message says what happened and how to fix it."""


class StateError(RuntimeError):
    """Base class of eqx_state's errors about state cells and steps."""


class StateWriteError(StateError):
    """A state write that cannot land: outside a step in value mode, a wrong shape or
    dtype, or a write JAX cannot express (e.g. a vmapped value into an unbatched
    cell)."""


class StaleModelError(StateError):
    """A model (or optimizer state) whose buffers were donated to an earlier step."""


class StepError(StateError):
    """A misuse of `make_step` / `apply` (wrong loss output, changed structure, ...)."""


class RecompileWarning(UserWarning):
    """A compiled step or apply was compiled again for arguments of new shapes or
    dtypes (e.g. a ragged last batch). Filter it with
    `warnings.simplefilter("ignore", es.RecompileWarning)` when that is intended."""
