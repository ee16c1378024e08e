"""Progress of the engine's long start-up work: a tqdm bar where a person watches (notebooks, the CLI), log
lines where a server's logs are read."""

from __future__ import annotations

import logging
import time

from tqdm.auto import tqdm

log = logging.getLogger("jserve")


class LogProgress:
    """tqdm's `update` / context-manager surface, writing one log line per finished unit."""

    def __init__(self, total: int, desc: str, unit: str):
        self.total, self.desc, self.unit = total, desc, unit
        self.done, self.start = 0, time.perf_counter()

    def update(self, n: int = 1) -> None:
        self.done += n
        log.info("%s: %d/%d %ss, %.1fs", self.desc, self.done, self.total, self.unit, time.perf_counter() - self.start)

    def __enter__(self) -> LogProgress:
        return self

    def __exit__(self, *exc) -> None:
        pass


def progress(total: int, desc: str, unit: str, bars: bool) -> tqdm | LogProgress:
    return tqdm(total=total, desc=desc, unit=unit) if bars else LogProgress(total, desc, unit)
