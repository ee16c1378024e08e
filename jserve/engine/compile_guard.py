"""Counts JAX traces and XLA compilations, so the engine can prove (and tests insist) serving never compiles.

Traces are counted as well as backend compiles: a jit specialisation served from the persistent
compilation cache skips the backend compile but is still traced, and still costs time mid-serving.
"""

from __future__ import annotations

import jax

COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/backend_compile_duration")
_count = 0


def _on_event(event: str, duration: float, **kwargs) -> None:
    global _count
    if event in COMPILE_EVENTS:
        _count += 1


jax.monitoring.register_event_duration_secs_listener(_on_event)  # process-wide; jax offers no unregister


def compile_count() -> int:
    """Traces plus XLA compilations in this process so far."""
    return _count
