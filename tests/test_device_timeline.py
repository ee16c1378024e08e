"""The device timeline's waiter thread: it accounts for every launched step, and never outlives Python."""

import subprocess
import sys
import textwrap
import time

import jax.numpy as jnp

from jserve.engine.device_timeline import DeviceTimeline
from jserve.engine.stats import EngineStats


def test_drain_accounts_for_every_launched_step():
    stats = EngineStats()
    timeline = DeviceTimeline(stats)
    x = jnp.ones((256, 256))
    for _ in range(3):
        timeline.launched(time.perf_counter(), jnp.tanh(x @ x), back_to_back=True)
    timeline.drain()
    assert stats.device_busy_s > 0
    assert stats.device_idle_s >= 0


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
