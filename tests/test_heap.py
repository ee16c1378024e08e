"""Keeping the garbage collector off start-up's objects: frozen while generating, handed back afterwards."""

import gc
import subprocess
import sys
import threading
import weakref

from jserve.heap import frozen_heap


class Cycle:
    def __init__(self):
        self.me = self


def test_frozen_heap_freezes_what_exists_and_gives_it_back():
    assert gc.get_freeze_count() == 0
    before = Cycle()
    with frozen_heap():
        assert gc.get_freeze_count() > 0
        # A cycle dropped meanwhile is frozen: no collection sees it while generating...
        ref = weakref.ref(before)
        del before
        gc.collect()
        assert ref() is not None
    # ...and it is collected once the call ends.
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert ref() is None


def test_overlapping_calls_unfreeze_when_the_last_one_ends():
    entered, leave = threading.Event(), threading.Event()

    def other():
        with frozen_heap():
            entered.set()
            leave.wait(timeout=30)

    thread = threading.Thread(target=other)
    thread.start()
    entered.wait(timeout=30)
    with frozen_heap():
        assert gc.get_freeze_count() > 0
    assert gc.get_freeze_count() > 0  # the other call still runs
    leave.set()
    thread.join(timeout=30)
    assert gc.get_freeze_count() == 0


def test_generate_leaves_nothing_frozen(plain):
    from jserve import SamplingParams

    out = plain.generate(["a prompt"], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    assert gc.get_freeze_count() == 0


def test_a_process_frozen_for_good_stays_frozen():
    # (in a child: freezing the test process for good would keep every engine later tests drop)
    code = (
        "import gc\nfrom jserve.heap import freeze_startup_objects, frozen_heap\n"
        "count = freeze_startup_objects()\nassert count > 0 and gc.get_freeze_count() == count\n"
        "with frozen_heap():\n    pass\nassert gc.get_freeze_count() >= count\nprint('ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.stdout.strip() == "ok", result.stderr
