"""Counts JAX traces and XLA compilations, so the engine can prove (and tests insist) serving never compiles.

Traces are counted as well as backend compiles: a jit specialisation served from the persistent
compilation cache skips the backend compile but is still traced, and still costs time mid-serving.

JAX reports these events on the thread that traces or compiles, so each thread has its own count: an
engine stepping on one thread is not blamed for another engine (or a user's code) compiling on another.
"""

from __future__ import annotations

import logging
import threading

import jax

COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/backend_compile_duration")
_counts = threading.local()
log = logging.getLogger("jserve")


def _on_event(event: str, duration: float, **kwargs) -> None:
    if event in COMPILE_EVENTS:
        _counts.value = getattr(_counts, "value", 0) + 1


jax.monitoring.register_event_duration_secs_listener(_on_event)  # once per process; jax offers no unregister


def compile_count() -> int:
    """Traces plus XLA compilations on the calling thread so far."""
    return getattr(_counts, "value", 0)


def check_no_compiles(before: int, what: str, strict: bool) -> None:
    """After serving work begun at compile_count() == `before`: any trace or compilation since is an error
    under `strict` (debug checks), else a warning."""
    if (count := compile_count() - before) == 0:
        return
    message = f"{what} traced or compiled {count} time(s) after warm-up"
    if strict:
        raise RuntimeError(message)
    log.warning(message)
