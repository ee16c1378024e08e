"""Counts XLA compilations, so the engine can prove (and tests can insist) that serving never compiles."""

from __future__ import annotations

import jax

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_compiles = 0


def _count(event: str, duration: float, **kwargs) -> None:
    global _compiles
    if event == BACKEND_COMPILE_EVENT:
        _compiles += 1


jax.monitoring.register_event_duration_secs_listener(_count)  # process-wide; jax offers no unregister


def compile_count() -> int:
    """XLA compilations in this process so far."""
    return _compiles
