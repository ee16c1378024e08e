"""The device timeline's waiter thread: it accounts for every launched step, and never outlives Python."""

import subprocess
import sys
import textwrap
from types import SimpleNamespace

import jax.numpy as jnp

from jserve.engine import device_timeline
from jserve.engine.device_timeline import DeviceTimeline
from jserve.engine.stats import EngineStats


def test_drain_accounts_for_every_launched_step(monkeypatch):
    """Busy time runs from a step's start (its dispatch, or the previous step's finish if it queued behind
    it) to its finish; idle time is a gap before a step dispatched while work was waiting, and only that."""
    # (dispatched, back_to_back, finished), in seconds on a scripted clock read by the waiter thread alone
    steps = [
        (10.0, False, 11.0),  # busy 1
        (11.5, True, 12.5),  # dispatched 0.5 s after the device went quiet, with work waiting: idle 0.5, busy 1
        (12.0, True, 13.0),  # queued behind the one before: busy from 12.5 only, no idle
        (20.0, False, 21.0),  # nothing was waiting before it: its gap is not overhead; busy 1
    ]
    finish_times = iter([finished for *_, finished in steps])
    monkeypatch.setattr(device_timeline, "time", SimpleNamespace(perf_counter=lambda: next(finish_times)))
    stats = EngineStats()
    timeline = DeviceTimeline(stats)
    x = jnp.ones((256, 256))
    for dispatched, back_to_back, _ in steps:
        timeline.launched(dispatched, jnp.tanh(x @ x), back_to_back=back_to_back)
    timeline.drain()
    assert (stats.device_busy_s, stats.device_idle_s) == (3.5, 0.5)


def test_exiting_while_a_step_runs_does_not_abort_the_process():
    """Python ends daemon threads at exit when they next take the GIL; a waiter inside jax's
    block_until_ready then aborted the process ("FATAL: exception not rethrown", exit code -6)."""
    script = textwrap.dedent("""
        import time
        import jax, jax.numpy as jnp
        from jserve.engine.device_timeline import DeviceTimeline
        from jserve.engine.stats import EngineStats

        slow = jax.jit(lambda x: jax.lax.fori_loop(0, 60, lambda i, y: jnp.tanh(y @ y), x))
        x = jnp.full((768, 768), 0.01)
        slow(x).block_until_ready()  # compiled before the timed launch
        DeviceTimeline(EngineStats()).launched(time.perf_counter(), slow(x), back_to_back=False)
        time.sleep(0.1)  # the waiter is now blocked on the step
        print("leaving")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "leaving"
