"""How one request wants its tokens chosen: SamplingParams, validated and normalised on construction.

Field names and meanings follow vLLM's SamplingParams (and so the OpenAI API). Every bad value raises a
RequestError (a ValueError) whose message gives the allowed range and whose `param` is the field, so the
server can hand both to the client.
Checks that need the model's vocabulary are left to `validate_for_vocab`, which the engine's RequestValidator
(engine/validation.py) calls with its other checks. Sizes
a request could use to exhaust the server (stop strings, logit_bias entries) have limits, below.
"""

from __future__ import annotations

import contextlib
import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass

from jserve.errors import RequestError, short_repr
from jserve.structured.params import StructuredOutputsParams

MAX_LOGPROBS = 20  # most top alternatives a request may ask for per token (OpenAI's limit)
MAX_LOGIT_BIAS = 300  # most logit_bias entries a request may carry (OpenAI's limit)
# Stop strings are searched after every token and the streamed text holds back a tail as long as the
# longest one, so both their number and their length are bounded.
MAX_STOP_STRINGS = 32
MAX_STOP_LENGTH = 256  # characters
SEED_RANGE = (-(2**63), 2**63 - 1)  # 64-bit, as vLLM takes it


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Sampling options of one request.

    After construction the numbers are plain int/float, `top_k` -1 reads as 0, `stop` and `stop_token_ids`
    are tuples and `logit_bias` a dict with int keys (each empty when not given).
    """

    n: int = 1
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # 1 = off
    top_k: int = 0  # 0 (or -1) = off
    min_p: float = 0.0  # 0 = off
    repetition_penalty: float = 1.0  # 1 = off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: str | list[str] | tuple[str, ...] | None = None
    stop_token_ids: list[int] | tuple[int, ...] | None = None
    max_tokens: int | None = 16  # None = up to the model's context length
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None  # top alternatives to return per token; None = no logprobs
    prompt_logprobs: int | None = None  # the same for each prompt token (scored by the model); None = none
    logit_bias: Mapping[int | str, float] | None = None  # token id -> bias added to its logit
    skip_special_tokens: bool = True
    # the output must match a JSON schema, regex, choice or grammar (a dict is read as its fields)
    structured_outputs: StructuredOutputsParams | Mapping | None = None

    def __post_init__(self) -> None:
        max_tokens = None if self.max_tokens is None else _integer("max_tokens", self.max_tokens, low=1)
        logprobs = None if self.logprobs is None else _integer("logprobs", self.logprobs, low=0, high=MAX_LOGPROBS)
        prompt_logprobs = self.prompt_logprobs
        if prompt_logprobs is not None:  # vLLM's -1 (the whole vocabulary) is refused: MAX_LOGPROBS at most
            prompt_logprobs = _integer("prompt_logprobs", prompt_logprobs, low=0, high=MAX_LOGPROBS)
        min_tokens = _integer("min_tokens", self.min_tokens, low=0)
        if max_tokens is not None and min_tokens > max_tokens:
            raise RequestError(f"min_tokens must be <= max_tokens ({max_tokens}), got {min_tokens}", "min_tokens")
        values = {
            "n": _integer("n", self.n, low=1),
            "temperature": _real("temperature", self.temperature, low=0),
            "top_p": _real("top_p", self.top_p, low=0, high=1, low_open=True),
            "top_k": max(_integer("top_k", self.top_k, low=-1), 0),
            "min_p": _real("min_p", self.min_p, low=0, high=1),
            "repetition_penalty": _real("repetition_penalty", self.repetition_penalty, low=0, low_open=True),
            "presence_penalty": _real("presence_penalty", self.presence_penalty, low=-2, high=2),
            "frequency_penalty": _real("frequency_penalty", self.frequency_penalty, low=-2, high=2),
            "seed": None if self.seed is None else _integer("seed", self.seed, *SEED_RANGE),
            "stop": _stop_strings(self.stop),
            "stop_token_ids": _stop_token_ids(self.stop_token_ids),
            "max_tokens": max_tokens,
            "min_tokens": min_tokens,
            "ignore_eos": _boolean("ignore_eos", self.ignore_eos),
            "logprobs": logprobs,
            "prompt_logprobs": prompt_logprobs,
            "logit_bias": _logit_bias(self.logit_bias),
            "skip_special_tokens": _boolean("skip_special_tokens", self.skip_special_tokens),
            "structured_outputs": _structured(self.structured_outputs),
        }
        for name, value in values.items():
            object.__setattr__(self, name, value)  # the dataclass is frozen; normalised values land once, here

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def stop_ids(self, eos_ids: tuple[int, ...]) -> tuple[int, ...]:
        """The ids that end a completion: its stop_token_ids, and the model's EOS ids unless ignore_eos."""
        return (*self.stop_token_ids, *(() if self.ignore_eos else eos_ids))

    @property
    def uses_penalties(self) -> bool:
        """Repetition / presence / frequency penalties: they need the request's whole history."""
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0

    def validate_for_vocab(self, vocab_size: int) -> None:
        """Raises RequestError if top_k exceeds the vocabulary or a stop_token_ids / logit_bias id is outside it."""
        if self.top_k > vocab_size:
            raise RequestError(
                f"top_k must be -1, 0 or at most the vocabulary size ({vocab_size}), got {self.top_k}", "top_k"
            )
        for name, ids in (("stop_token_ids", self.stop_token_ids), ("logit_bias", self.logit_bias)):
            bad = [i for i in ids if i >= vocab_size]
            if bad:
                raise RequestError(f"{name} token ids must be < vocab_size ({vocab_size}), got {bad[0]}", name)


def _range(low: float | None, high: float | None, low_open: bool) -> str:
    if high is None:
        return f"{'>' if low_open else '>='} {low}"
    return f"in {'(' if low_open else '['}{low}, {high}]"


def _integer(name: str, value: object, low: int | None = None, high: int | None = None) -> int:
    # bool is an int subclass, but n=True is a caller's mistake, not a number
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise RequestError(f"{name} must be an integer, got {short_repr(value)}", name)
    if (low is not None and value < low) or (high is not None and value > high):
        raise RequestError(f"{name} must be {_range(low, high, False)}, got {value}", name)
    return int(value)


def _real(
    name: str, value: object, low: float, high: float | None = None, low_open: bool = False, param: str | None = None
) -> float:
    """`name` is what the message calls the value; `param` (default: `name`) the field it came in."""
    param = param or name
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not _finite(value):
        raise RequestError(f"{name} must be a finite number, got {short_repr(value)}", param)
    if value < low or (low_open and value == low) or (high is not None and value > high):
        raise RequestError(f"{name} must be {_range(low, high, low_open)}, got {value}", param)
    return float(value)


def _finite(value: numbers.Real) -> bool:
    """Finite as a float: an integer past float's range (JSON can spell one out) is not."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _boolean(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise RequestError(f"{name} must be a bool, got {short_repr(value)}", name)
    return value


def _stop_strings(stop: object) -> tuple[str, ...]:
    strings = () if stop is None else (stop,) if isinstance(stop, str) else stop
    if not isinstance(strings, (list, tuple)) or not all(isinstance(s, str) for s in strings):
        raise RequestError(f"stop must be a string or a list of strings, got {short_repr(stop)}", "stop")
    if not all(strings):
        raise RequestError("stop strings must be non-empty, got ''", "stop")
    if len(strings) > MAX_STOP_STRINGS:
        raise RequestError(f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(strings)}", "stop")
    longest = max(map(len, strings), default=0)
    if longest > MAX_STOP_LENGTH:
        raise RequestError(f"stop strings must be at most {MAX_STOP_LENGTH} characters, got one of {longest}", "stop")
    return tuple(strings)


def _stop_token_ids(ids: object) -> tuple[int, ...]:
    if ids is None:
        return ()
    if not isinstance(ids, (list, tuple)):
        raise RequestError(f"stop_token_ids must be a list of token ids, got {short_repr(ids)}", "stop_token_ids")
    return tuple(_integer("stop_token_ids", i, low=0) for i in ids)


def _structured(value: object) -> StructuredOutputsParams | None:
    if value is None or isinstance(value, StructuredOutputsParams):
        return value
    if isinstance(value, Mapping):
        try:
            return StructuredOutputsParams(**value)
        except TypeError as error:  # an unknown key
            raise RequestError(f"structured_outputs: {error}", "structured_outputs") from None
    message = f"structured_outputs must be a StructuredOutputsParams, got {short_repr(value)}"
    raise RequestError(message, "structured_outputs")


def _logit_bias(bias: object) -> dict[int, float]:
    if bias is None:
        return {}
    if not isinstance(bias, Mapping):
        raise RequestError(f"logit_bias must be a mapping of token id to bias, got {short_repr(bias)}", "logit_bias")
    if len(bias) > MAX_LOGIT_BIAS:
        raise RequestError(f"logit_bias must have at most {MAX_LOGIT_BIAS} entries, got {len(bias)}", "logit_bias")
    out = {}
    for key, value in bias.items():
        token = key
        if isinstance(key, str) and key.isascii() and key.isdigit():  # JSON object keys are strings: {"50256": -100}
            with contextlib.suppress(ValueError):  # more digits than int() reads: no token id, refused below
                token = int(key)
        if isinstance(token, bool) or not isinstance(token, numbers.Integral) or token < 0:
            raise RequestError(f"logit_bias keys must be token ids >= 0, got {short_repr(key)}", "logit_bias")
        out[int(token)] = _real(f"logit_bias[{token}]", value, low=-100, high=100, param="logit_bias")
    return out
