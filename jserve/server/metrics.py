"""Prometheus metrics under vLLM's names with a `jserve:` prefix, updated by the engine thread after each step."""

from __future__ import annotations

import threading

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics_core import HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from jserve.engine.stats import EngineSnapshot
from jserve.outputs import EmbeddingRequestOutput, RequestOutput

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)
TOKEN_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)


class StepHistogram:
    """A histogram of many values a step (one per streaming completion), added with one numpy pass per step:
    prometheus_client's Histogram takes its lock and a Python pass for each value, on the engine thread.
    Read by /metrics as an ordinary Prometheus histogram (its buckets, count and sum)."""

    def __init__(self, name: str, documentation: str, buckets: tuple[float, ...], labels: dict[str, str]):
        self.name, self.documentation, self.labels = name, documentation, labels
        self.bounds = np.asarray(buckets, np.float64)
        self.counts = np.zeros(len(buckets) + 1, np.int64)  # per bucket, the last past every bound (+Inf)
        self.sum = 0.0
        self._lock = threading.Lock()  # the engine thread adds, the /metrics handler reads

    def observe(self, values: list[float]) -> None:
        if not values:
            return
        array = np.asarray(values, np.float64)
        # A value falls in the first bucket whose bound it does not exceed (Prometheus' `le`).
        counts = np.bincount(np.searchsorted(self.bounds, array, side="left"), minlength=len(self.counts))
        with self._lock:
            self.counts += counts
            self.sum += float(array.sum())

    def collect(self):
        with self._lock:
            cumulative, total = np.cumsum(self.counts).tolist(), self.sum
        family = HistogramMetricFamily(self.name, self.documentation, labels=list(self.labels))
        bounds = [floatToGoString(bound) for bound in self.bounds.tolist()] + ["+Inf"]
        family.add_metric(list(self.labels.values()), list(zip(bounds, cumulative, strict=True)), total)
        yield family


class ServerMetrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        labels = self._labels = {"model_name": model_name}

        def make(kind, name, doc, **kwargs):
            extra = kwargs.pop("labelnames", ())
            metric = kind(f"jserve:{name}", doc, labelnames=("model_name", *extra), registry=self.registry, **kwargs)
            return metric if extra else metric.labels(**labels)

        self.running = make(Gauge, "num_requests_running", "Requests in the running batch")
        self.waiting = make(Gauge, "num_requests_waiting", "Requests waiting to be scheduled")
        self.kv_usage = make(Gauge, "kv_cache_usage_perc", "Fraction of KV cache pages held by requests (0-1)")
        self.prefix_cache_usage = make(Gauge, "prefix_cache_usage_perc", "Fraction of KV cache pages holding cached "
                                       "prefixes no request uses (0-1): free to reclaim")  # fmt: skip
        self.prefix_queries = make(Counter, "prefix_cache_queries", "Prompt tokens looked up in the prefix cache")
        self.prefix_hits = make(Counter, "prefix_cache_hits", "Prompt tokens found in the prefix cache")
        self.preemptions = make(Counter, "num_preemptions", "Requests preempted (to be recomputed)")
        self.prompt_tokens = make(Counter, "prompt_tokens", "Prefill tokens computed")
        self.generation_tokens = make(Counter, "generation_tokens", "Tokens generated")
        self.steps = make(Counter, "engine_steps", "Engine steps run")
        self.host_seconds = make(Counter, "engine_host_seconds", "Host time in steps: scheduling, batch "
                                 "building, dispatch, output processing (not waiting for the device)")  # fmt: skip
        self.device_busy = make(Counter, "device_busy_seconds", "Time the device spent running steps")
        self.device_idle = make(Counter, "device_idle_seconds", "Device idle between steps while work waited")
        self.spec_drafts = make(Counter, "spec_decode_num_drafts", "Speculative verifications (a request's drafts "
                                "checked in one step)")  # fmt: skip
        self.spec_draft_tokens = make(Counter, "spec_decode_num_draft_tokens", "Draft tokens proposed")
        self.spec_accepted = make(Counter, "spec_decode_num_accepted_tokens", "Draft tokens accepted")
        self.spec_accepted_per_pos = make(
            Counter, "spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, by draft position",
            labelnames=("position",),
        )  # fmt: skip
        self._accepted_per_pos = None  # the counts at the last observation
        success = make(Counter, "request_success", "Completions finished, by reason", labelnames=("finished_reason",))
        reasons = ("stop", "length", "abort", "error")
        self.success = {reason: success.labels(finished_reason=reason, **labels) for reason in reasons}
        self.ttft = make(Histogram, "time_to_first_token_seconds", "Time to first token", buckets=LATENCY_BUCKETS)
        self.itl = StepHistogram("jserve:inter_token_latency_seconds", "Time between tokens of a completion",
                                 TOKEN_LATENCY_BUCKETS, labels)  # fmt: skip
        self.registry.register(self.itl)
        self._itl_values: list[float] = []  # this step's, added to self.itl at observe_step
        self.e2e = make(Histogram, "e2e_request_latency_seconds", "Arrival to finish", buckets=LATENCY_BUCKETS)
        self.queue_time = make(
            Histogram, "request_queue_time_seconds", "Arrival to first scheduled", buckets=LATENCY_BUCKETS
        )
        # EngineSnapshot's running totals, by name, and their values at the last observation
        self._totals = {"prompt_tokens": self.prompt_tokens, "generated_tokens": self.generation_tokens,
                        "preemptions": self.preemptions, "prefix_cache_queries": self.prefix_queries,
                        "prefix_cache_hits": self.prefix_hits, "steps": self.steps, "host_s": self.host_seconds,
                        "device_busy_s": self.device_busy, "device_idle_s": self.device_idle,
                        "spec_drafts": self.spec_drafts, "spec_draft_tokens": self.spec_draft_tokens,
                        "spec_accepted_tokens": self.spec_accepted}  # fmt: skip
        self._counted: dict[str, float] = {}
        self._last_token: dict[tuple[str, int], float] = {}  # (request, completion) -> when its last token came
        self._started: set[str] = set()  # requests whose first token was counted
        # Completions counted as finished: with n > 1 a finished one is in every output until its siblings end.
        self._finished: set[tuple[str, int]] = set()

    def observe_step(self, snapshot: EngineSnapshot) -> None:
        """After the step's outputs were observed."""
        self.itl.observe(self._itl_values)
        self._itl_values = []
        self.running.set(snapshot.running)
        self.waiting.set(snapshot.waiting)
        self.kv_usage.set(snapshot.kv_cache_usage)
        self.prefix_cache_usage.set(snapshot.prefix_cache_usage)
        for name, counter in self._totals.items():
            now, before = getattr(snapshot, name), self._counted.get(name, 0)
            if now > before:
                counter.inc(now - before)
            self._counted[name] = now
        per_pos = snapshot.spec_accepted_per_pos  # one series per draft position the engine can propose
        before = self._accepted_per_pos or (0,) * len(per_pos)
        for position, (now, then) in enumerate(zip(per_pos, before, strict=True)):
            if now > then or self._accepted_per_pos is None:
                self.spec_accepted_per_pos.labels(position=str(position), **self._labels).inc(now - then)
        self._accepted_per_pos = per_pos

    def observe_output(self, out: RequestOutput | EmbeddingRequestOutput, now: float) -> None:
        metrics = out.metrics
        if isinstance(out, EmbeddingRequestOutput):  # one output, when its vector is made
            self.success["stop"].inc()
            self.e2e.observe(metrics.finish_time - metrics.arrival_time)
            if metrics.queue_time is not None:
                self.queue_time.observe(metrics.queue_time)
            return
        for completion in out.outputs:
            key = (out.request_id, completion.index)
            if new_tokens := len(completion.delta_token_ids):
                last_time = self._last_token.get(key)
                if last_time is not None:
                    self._itl_values.append((now - last_time) / new_tokens)
                self._last_token[key] = now
            if completion.finished and key not in self._finished:
                self._finished.add(key)
                self._last_token.pop(key, None)
                self.success[completion.finish_reason].inc()
        if metrics.first_token_time is not None and out.request_id not in self._started:
            self._started.add(out.request_id)
            self.ttft.observe(metrics.time_to_first_token)
        if out.finished:
            self._started.discard(out.request_id)
            self._finished.difference_update((out.request_id, c.index) for c in out.outputs)
            if metrics.finish_time is not None:
                self.e2e.observe(metrics.finish_time - metrics.arrival_time)
            if metrics.queue_time is not None:
                self.queue_time.observe(metrics.queue_time)
