"""Which of a step's optional stages run, and who decides: the device at run time, or the host at launch.

Most steps need little of what sampling can do: the stages below are left alone by plain greedy or
temperature sampling. On a CPU or TPU the step contains each behind a device conditional (`lax.cond`) that
skips it when no row needs it, so one executable per bucket serves every batch. On a GPU the host, which
knows what each row asked for, decides instead: a step is compiled with the stages some row needs, which run
unconditionally (rows that did not ask are unaffected), and without the others: an executable per
combination in use (step_executables.py). Its executable is smaller (no branch's kernels, no memory held for
the branch not taken: 93 MiB of temporaries instead of 646 at 256 rows of an 8B model), and it needs no
device conditional, which XLA records into the step's CUDA graph only from CUDA 12.3 (runtime and driver):
below that, each copies its predicate to the host and waits for the device (XLA's ConditionalThunk), holding
the thread that launches the step until the device has run its forward pass.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import TypeVar

import jax
import numpy as np

T = TypeVar("T")


class Gate(enum.Enum):
    SKIP = "skip"  # left out of the step: no row needs it
    RUN = "run"  # runs whatever the rows ask; it must leave rows that did not ask for it as skipping would
    WHEN_NEEDED = "when needed"  # a device conditional skips it at run time when no row needs it


@dataclass(frozen=True)
class StepStages:
    """A step's optional stages (static: part of what a step is compiled for)."""

    adjust: Gate = Gate.WHEN_NEEDED  # logit bias, penalties and grammar masks
    draw: Gate = Gate.WHEN_NEEDED  # temperature, min-p and the random draw (some row samples)
    filters: Gate = Gate.WHEN_NEEDED  # top-k and top-p
    logprobs: Gate = Gate.WHEN_NEEDED  # the sampled token's logprob and the top ones
    prompt_scores: Gate = Gate.WHEN_NEEDED  # prompt logprobs
    carry: Gate = Gate.WHEN_NEEDED  # state later steps read: penalised rows' token history, deferred rows' logits

    def __str__(self) -> str:
        running = [f.name for f in fields(self) if getattr(self, f.name) is Gate.RUN]
        return "stages " + (", ".join(running) if running else "none")


DEVICE_DECIDES = StepStages()
NO_STAGES = StepStages(*[Gate.SKIP] * len(fields(StepStages)))  # a greedy step's (and warm-up's all-padding one)


def gated(gate: Gate, needed: Callable[[], jax.Array], run: Callable[[], T], skip: Callable[[], T]) -> T:
    """run() or skip() as `gate` says; WHEN_NEEDED: a conditional on needed() (a boolean scalar)."""
    if gate is Gate.SKIP:
        return skip()
    if gate is Gate.RUN:
        return run()
    return jax.lax.cond(needed(), run, skip)


def host_decides(platform: str) -> bool:
    """Whether steps on `platform` (jax.default_backend()'s name) take their stages from the host."""
    return platform in ("gpu", "cuda", "rocm")


# Which rows need a stage, from a SamplingBatch's columns: numpy arrays on the host, jax arrays in the sampler.


def penalised_rows(sampling):
    return (sampling.repetition_penalty != 1) | (sampling.presence_penalty != 0) | (sampling.frequency_penalty != 0)


def top_k_rows(sampling, vocab_size: int):
    """Rows whose top-k leaves tokens out (0, or k of at least the vocabulary, keeps them all)."""
    return (sampling.top_k > 0) & (sampling.top_k < vocab_size)


def filtered_rows(sampling, vocab_size: int):
    """Sampling rows (temperature 0 is greedy) that top-k or top-p filter."""
    return (sampling.temperature != 0) & (top_k_rows(sampling, vocab_size) | (sampling.top_p < 1))


def step_stages(step, vocab_size: int) -> StepStages:
    """The stages a step's rows need, from its host arrays (a StepInput of numpy arrays). Logit bias rows
    arrive as numpy arrays only when some row has a bias (else the runner's constant on the device)."""

    def gate(needed) -> Gate:
        return Gate.RUN if needed else Gate.SKIP

    sampling, penalties = step.sampling, step.penalties
    biased = isinstance(sampling.bias_ids, np.ndarray) and bool((sampling.bias_ids >= 0).any())
    return StepStages(
        adjust=gate(biased or penalised_rows(sampling).any() or np.asarray(sampling.constrained).any()),
        draw=gate((sampling.temperature != 0).any()),
        filters=gate(filtered_rows(sampling, vocab_size).any()),
        logprobs=gate(sampling.wants_top_logprobs.any()),
        prompt_scores=gate((step.prompt_targets >= 0).any()),
        # (a deferred grammar row is not `constrained` in its step: its mask comes after launch)
        carry=gate(penalties.recorded.any() or penalties.reset.any() or step.deferred.any()),
    )
