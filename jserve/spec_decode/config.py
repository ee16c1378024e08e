"""SpeculativeConfig: how the engine speculates, read from vLLM's `speculative_config` (a dict, or its JSON
as `--speculative-config` takes it)."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

from jserve.setting import json_object

NGRAM, DRAFT_MODEL = "ngram", "draft_model"
METHODS = (NGRAM, DRAFT_MODEL)
MAX_SPECULATIVE_TOKENS = 16
# Proposals are verified only while at most this many requests run (vLLM's disable_by_batch_size): a big
# batch already reads the weights once for many tokens, and every draft token there is extra compute.
DEFAULT_DISABLE_BY_BATCH_SIZE = 4
DRAFT_QUANTIZATIONS = ("auto", "none", "int8", "w8a8")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = NGRAM  # "draft_model" when a model is given
    num_speculative_tokens: int = 4  # draft tokens a step verifies per request, at most
    # n-gram prompt lookup: the longest n in [min, max] whose last n tokens occurred before proposes what
    # followed them; vLLM's rule for unset bounds (both unset: 5; one set: the other equals it).
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH_SIZE
    # draft model: any model jserve loads (same tokenizer as the target), and its weights' quantization
    # (default: the target's --quantization)
    model: str | None = None
    quantization: str | None = None

    @property
    def uses_draft_model(self) -> bool:
        return self.method == DRAFT_MODEL

    @staticmethod
    def parse(value: SpeculativeConfig | dict[str, Any] | str | None) -> SpeculativeConfig | None:
        """The config from a dict or its JSON text (None: no speculation); a ValueError says what is wrong."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        value = json_object(value, "speculative_config")
        known = {f.name for f in fields(SpeculativeConfig)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {unknown}; known: {sorted(known)}")
        if "method" not in value and value.get("model") is not None:
            value = {**value, "method": DRAFT_MODEL}  # as vLLM infers it
        config = SpeculativeConfig(**value)
        config._check()
        return config.with_lookup_defaults() if config.method == NGRAM else config

    def with_lookup_defaults(self) -> SpeculativeConfig:
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        if low is None and high is None:
            low = high = 5
        low, high = (high if low is None else low), (low if high is None else high)
        if low > high:
            raise ValueError(f"speculative_config: prompt_lookup_min ({low}) exceeds prompt_lookup_max ({high})")
        return replace(self, prompt_lookup_max=high, prompt_lookup_min=low)

    def _check(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config: method must be one of {list(METHODS)}, got {self.method!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "disable_by_batch_size"):
            value = getattr(self, name)
            if value is None and name.startswith("prompt_lookup"):
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"speculative_config: {name} must be a positive integer, got {value!r}")
        if self.num_speculative_tokens > MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"speculative_config: num_speculative_tokens must be at most {MAX_SPECULATIVE_TOKENS}, "
                f"got {self.num_speculative_tokens}"
            )
        if self.method == NGRAM:
            for name in ("model", "quantization"):
                if getattr(self, name) is not None:
                    raise ValueError(f"speculative_config: {name!r} is for method 'draft_model', not 'ngram'")
            return
        if not isinstance(self.model, str) or not self.model:
            raise ValueError("speculative_config: method 'draft_model' needs a 'model' (a path or hub id)")
        for name in ("prompt_lookup_max", "prompt_lookup_min"):
            if getattr(self, name) is not None:
                raise ValueError(f"speculative_config: {name!r} is for method 'ngram', not 'draft_model'")
        if self.quantization is not None and self.quantization not in DRAFT_QUANTIZATIONS:
            raise ValueError(
                f"speculative_config: quantization must be one of {list(DRAFT_QUANTIZATIONS)}, "
                f"got {self.quantization!r}"
            )
