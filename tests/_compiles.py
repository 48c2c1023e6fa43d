"""Count XLA compilations (JAX's monitoring events), for "compiles once" tests."""

import contextlib

import jax


_EVENT = "/jax/core/compile/backend_compile_duration"


@contextlib.contextmanager
def count_compiles(prefix="jit(eqx_state"):
    """Yields a list that gets one entry per XLA compilation inside the block, of
    the functions whose name starts with `prefix` (eqx_state's steps and applies by
    default: eager operations compile too)."""
    seen: list[str] = []

    def listener(event, duration, **kwargs):
        name = kwargs.get("fun_name", "?")
        if event == _EVENT and name.startswith(prefix):
            seen.append(name)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield seen
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
