"""When each launched step finishes on the device, as seen by a waiter thread: the device's busy time, and
its idle gaps between back-to-back steps (the host overhead the device actually felt).

The host only learns a step has finished when it fetches the samples, which with async scheduling is
long after; so a daemon thread blocks on each step's output in launch order and timestamps it. The
thread exits after a second without steps and is started again by the next launch, and is stopped at
interpreter exit (see _stop_all).
"""

from __future__ import annotations

import atexit
import queue
import threading
import time
import weakref

import jax

from jserve.engine.stats import EngineStats

IDLE_EXIT_S = 1.0
_STOP = object()
_live: weakref.WeakSet[DeviceTimeline] = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    """Python ends a daemon thread at exit when it next takes the GIL; inside jax's block_until_ready that
    happens in a C++ destructor, which aborts the process ("FATAL: exception not rethrown"). So waiters
    finish before that, once their last step is done."""
    for timeline in list(_live):
        timeline.stop()


class DeviceTimeline:
    def __init__(self, stats: EngineStats):
        self.stats = stats
        self._steps: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._last_done: float | None = None
        _live.add(self)

    def launched(self, dispatched: float, result, back_to_back: bool) -> None:
        """A step was dispatched at `dispatched` (perf_counter); `back_to_back`: work was already waiting
        when the previous step finished, so any gap before this one is overhead, not an empty queue."""
        with self._lock:
            self._steps.put((dispatched, result, back_to_back))
            if self._thread is None:
                self._thread = threading.Thread(target=self._watch, name="jserve-device-timeline", daemon=True)
                self._thread.start()

    def drain(self) -> None:
        """Wait until every launched step is accounted for (before reading the stats)."""
        done = threading.Event()
        self.launched(0.0, done, False)
        done.wait()

    def stop(self) -> None:
        with self._lock:
            thread = self._thread
            if thread is not None:
                self._steps.put((0.0, _STOP, False))
        if thread is not None:
            thread.join()

    def _watch(self) -> None:
        stats = self.stats
        while True:
            try:
                dispatched, result, back_to_back = self._steps.get(timeout=IDLE_EXIT_S)
            except queue.Empty:
                with self._lock:
                    if self._steps.empty():
                        self._thread = None
                        return
                continue
            if result is _STOP:
                with self._lock:
                    self._thread = None
                return
            if isinstance(result, threading.Event):
                result.set()
                continue
            jax.block_until_ready(result)
            done = time.perf_counter()
            start = dispatched if self._last_done is None else max(dispatched, self._last_done)
            if back_to_back and self._last_done is not None:
                stats.device_idle_s += max(0.0, dispatched - self._last_done)
            stats.device_busy_s += done - start
            self._last_done = done
