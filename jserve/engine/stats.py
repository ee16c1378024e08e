"""Counters the engine keeps about its steps, and the periodic log line built from them."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np

from jserve.spec_decode.config import MAX_SPECULATIVE_TOKENS

log = logging.getLogger("jserve")

LOG_INTERVAL_S = 10.0
# Where a step's host time goes: planning it, building its inputs, dispatching it, handing each sample to its
# request (stop checks, logprobs), decoding text, and making the step's RequestOutputs.
PHASES = ("schedule", "prepare", "launch", "process", "detokenize", "outputs")


@dataclass(frozen=True)
class EngineSnapshot:
    """The engine as its monitors see it after a step (LLMEngine.snapshot): gauges, then running totals."""

    running: int  # requests in the running batch
    waiting: int  # requests queued, preempted ones included
    kv_cache_usage: float  # fraction of KV pages held by requests
    prefix_cache_usage: float  # fraction of KV pages holding cached prefixes no request uses (free to reclaim)
    prompt_tokens: int
    generated_tokens: int
    preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    steps: int
    host_s: float
    device_busy_s: float
    device_idle_s: float
    spec_drafts: int
    spec_draft_tokens: int
    spec_accepted_tokens: int
    spec_accepted_per_pos: tuple[int, ...]  # one per draft position the engine proposes (empty without)

    @classmethod
    def of(cls, stats: EngineStats, scheduler, spec_accepted_per_pos: tuple[int, ...] = ()) -> EngineSnapshot:
        """The gauges read off the engine's Scheduler, the totals off its stats."""
        running, pages = len(scheduler.running), scheduler.pool.num_pages
        return cls(
            running=running,
            waiting=scheduler.num_unfinished - running,
            kv_cache_usage=scheduler.num_used_pages / pages,
            prefix_cache_usage=scheduler.num_reclaimable_pages / pages,
            **{name: getattr(stats, name) for name in TOTALS},
            spec_accepted_per_pos=spec_accepted_per_pos,
        )


# EngineSnapshot's running totals (the fields it copies from EngineStats).
TOTALS = (
    "prompt_tokens",
    "generated_tokens",
    "preemptions",
    "prefix_cache_queries",
    "prefix_cache_hits",
    "steps",
    "host_s",
    "device_busy_s",
    "device_idle_s",
    "spec_drafts",
    "spec_draft_tokens",
    "spec_accepted_tokens",
)


@dataclass
class EngineStats:
    steps: int = 0
    host_s: float = 0.0  # scheduling, building and dispatching the batch, processing outputs (not waiting)
    # host_s by phase (see PHASES); what no phase covers is the step's own bookkeeping
    phase_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    device_busy_s: float = 0.0  # steps running on the device (see device_timeline.py)
    device_idle_s: float = 0.0  # gaps between steps while work was waiting: overhead the device felt
    prompt_tokens: int = 0  # prefill tokens computed (recomputation after preemption included)
    generated_tokens: int = 0
    preemptions: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, tokens found cached
    # Speculative decoding (vLLM's counters): verifications, draft tokens proposed, of them accepted, and
    # accepted at each draft position.
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_pos: np.ndarray = field(default_factory=lambda: np.zeros(MAX_SPECULATIVE_TOKENS, np.int64))
    generates: bool = True  # False for an embedding engine: its log line has no generation rate
    _last_log: float = field(default_factory=time.monotonic, repr=False)  # the interval's start
    _last_step_end: float = field(default_factory=time.monotonic, repr=False)
    _last_counts: tuple[int, int] = (0, 0)
    _last_spec: tuple[int, int] = (0, 0)  # verifications and accepted drafts at the interval's start

    @property
    def device_idle_fraction(self) -> float:
        return self.device_idle_s / max(self.device_idle_s + self.device_busy_s, 1e-9)

    def start(self) -> None:
        """Start the first interval once the engine is ready: loading and warm-up are no one's throughput."""
        self._last_log = self._last_step_end = time.monotonic()

    def resume(self) -> None:
        """Work arrives after an idle spell: leave the spell out of the interval the rates are taken over."""
        now = time.monotonic()
        self._last_log += now - self._last_step_end
        self._last_step_end = now

    def maybe_log(self, running: int, waiting: int, kv_used: float) -> None:
        """After a step: every LOG_INTERVAL_S of work, a line with the interval's rates."""
        now = self._last_step_end = time.monotonic()
        elapsed = now - self._last_log
        prompt, generated = self.prompt_tokens - self._last_counts[0], self.generated_tokens - self._last_counts[1]
        if elapsed < LOG_INTERVAL_S or prompt + generated == 0:
            return
        hit_rate = 100 * self.prefix_cache_hits / max(self.prefix_cache_queries, 1)
        drafts, accepted = self.spec_drafts - self._last_spec[0], self.spec_accepted_tokens - self._last_spec[1]
        speculation = ""
        if drafts:  # vLLM's mean acceptance length: tokens a verification yields, its bonus token included
            speculation = f"; speculation: {drafts} verifications, mean acceptance length {1 + accepted / drafts:.2f}"
        rates = f"prefill {prompt / elapsed:.1f} tok/s"
        if self.generates:
            rates += f", generation {generated / elapsed:.1f} tok/s"
        log.info(
            "%s over %.0fs of work; running %d, waiting %d; KV cache %.0f%% used by requests; prefix cache hit rate "
            "%.1f%%; host %.1f ms/step, device idle %.1f%%; %d preemptions so far%s",
            rates, elapsed, running, waiting, 100 * kv_used, hit_rate, 1000 * self.host_s / max(self.steps, 1),
            100 * self.device_idle_fraction, self.preemptions, speculation,
        )  # fmt: skip
        self._last_log, self._last_counts = now, (self.prompt_tokens, self.generated_tokens)
        self._last_spec = (self.spec_drafts, self.spec_accepted_tokens)
