"""Keeping Python's cyclic garbage collector off what start-up built.

A full collection scans every object the collector tracks. Once an engine is up that is the model, the
engine and the libraries' objects (about 320,000 with the default model), and a full collection in the
middle of serving stalls the engine loop for 100-200 ms: at 256 running sequences one came every few
hundred steps. Frozen objects are left out of every collection; what the loop allocates is still collected,
in scans of just that.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

_lock = threading.Lock()
_holders = 0  # frozen_heap calls in progress (any thread)
_for_good = False  # freeze_startup_objects ran: this process never unfreezes


def freeze_startup_objects() -> int:
    """For a process that runs one engine for its life (`jserve serve`): collect once, then freeze what is
    left for good, since none of it is dropped before the process ends. Returns how many objects."""
    global _for_good
    with _lock:
        gc.collect()
        gc.freeze()
        _for_good = True
    return gc.get_freeze_count()


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """While generating inside someone else's process (`LLM`): freeze what exists now, and hand it back to
    the collector when the last such call ends, so whatever the caller drops meanwhile is collected then.
    Nothing is collected first (a full collection is the pause this avoids)."""
    global _holders
    with _lock:
        if _holders == 0:
            gc.freeze()
        _holders += 1
    try:
        yield
    finally:
        with _lock:
            _holders -= 1
            if _holders == 0 and not _for_good:
                gc.unfreeze()
