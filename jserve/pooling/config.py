"""How an embedding model turns a sequence's hidden states into one vector: the pooling modes (concatenated
in order), then Dense layers, then L2 normalization, as sentence-transformers' modules do it."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from jserve.setting import json_object

# sentence-transformers' names, in the order its older configs' pooling_mode_* flags concatenate them
POOLING_MODES = ("cls", "max", "mean", "mean_sqrt_len_tokens", "weightedmean", "lasttoken")
# vLLM's --pooler-config pooling_type names
POOLING_TYPES = {"LAST": "lasttoken", "MEAN": "mean", "CLS": "cls", "MAX": "max"}
ACTIVATIONS = {
    "Identity": lambda x: x,
    "Tanh": np.tanh,
    "ReLU": lambda x: np.maximum(x, 0),
    "Sigmoid": lambda x: 1 / (1 + np.exp(-x)),
    "SiLU": lambda x: x / (1 + np.exp(-x)),
}


@dataclass(frozen=True)
class DenseLayer:
    """sentence-transformers' Dense module: activation(x @ weight.T + bias), plus x (or x @ residual.T) when
    it has a residual connection."""

    weight: np.ndarray  # [out, in] float32
    bias: np.ndarray | None  # [out]
    activation: str  # a key of ACTIVATIONS
    residual: bool = False
    residual_weight: np.ndarray | None = None  # [out, in]: the residual's projection when in != out

    def __call__(self, x: np.ndarray) -> np.ndarray:
        y = x @ self.weight.T
        if self.bias is not None:
            y = y + self.bias
        y = ACTIVATIONS[self.activation](y)
        if self.residual:
            y = y + (x if self.residual_weight is None else x @ self.residual_weight.T)
        return y


@dataclass(frozen=True)
class PoolingConfig:
    modes: tuple[str, ...]  # of POOLING_MODES, each mode's vector concatenated in this order
    normalize: bool
    dense: tuple[DenseLayer, ...] = ()
    # Matryoshka models (trained so a vector's first d dimensions stand alone): the dimensions a request may
    # truncate to; () any up to the full size; None: not a matryoshka model (requests may not truncate)
    matryoshka_dimensions: tuple[int, ...] | None = None
    prompts: dict[str, str] = field(default_factory=dict)  # named prefixes for the input text ("query": ...)
    default_prompt_name: str | None = None  # the prompt used when a request names none
    max_seq_length: int | None = None  # sentence-transformers' limit on input tokens
    lower_case: bool = False  # the text is lower-cased before tokenizing
    # sentence-transformers' message modality: a text goes in as a user message through the chat template,
    # its content a string ("flat") or a list of typed parts ("structured"); None: as plain text
    message_format: str | None = None
    source: str = "defaults"  # where it was read from, for the engine's log

    def __post_init__(self):
        if not self.modes or any(mode not in POOLING_MODES for mode in self.modes):
            raise ValueError(f"pooling modes {self.modes!r}: choose from {', '.join(POOLING_MODES)}")

    @property
    def reads_every_token(self) -> bool:
        """Whether pooling reads hidden states before the last token's (all but last-token pooling do): then no
        token's hidden state may be skipped, so prompt prefixes cannot come from the prefix cache."""
        return self.modes != ("lasttoken",)

    def dimension(self, hidden_size: int) -> int:
        return self.dense[-1].weight.shape[0] if self.dense else len(self.modes) * hidden_size

    def describe(self) -> str:
        parts = ["+".join(self.modes), *(f"dense {d.weight.shape[1]}->{d.weight.shape[0]}" for d in self.dense)]
        return ", ".join([*parts, "normalized" if self.normalize else "not normalized"]) + f" ({self.source})"

    def overridden(self, pooler_config: dict | str | None) -> PoolingConfig:
        """With vLLM's --pooler-config keys applied: pooling_type (LAST, MEAN, CLS, MAX, or one of
        POOLING_MODES) and normalize; the rest of a checkpoint's modules stay."""
        overrides = parse_pooler_config(pooler_config)
        if not overrides:
            return self
        modes = (overrides["pooling_type"],) if "pooling_type" in overrides else self.modes
        normalize = overrides.get("normalize", self.normalize)
        return replace(self, modes=modes, normalize=normalize, source=f"{self.source}, --pooler-config")


def parse_pooler_config(value: dict | str | None) -> dict:
    """vLLM's --pooler-config (a dict or its JSON): {"pooling_type": "MEAN", "normalize": false}, checked."""
    if value is None:
        return {}
    value = json_object(value, "pooler_config")
    unknown = set(value) - {"pooling_type", "normalize"}
    if unknown:
        raise ValueError(f"pooler_config: unknown keys {sorted(unknown)}; jserve reads pooling_type and normalize")
    parsed = {}
    if "pooling_type" in value:
        name = str(value["pooling_type"])
        mode = POOLING_TYPES.get(name.upper(), name.lower())
        if mode not in POOLING_MODES:
            choices = ", ".join([*POOLING_TYPES, *POOLING_MODES])
            raise ValueError(f"pooler_config: pooling_type {name!r} is none of {choices}")
        parsed["pooling_type"] = mode
    if "normalize" in value:
        if not isinstance(value["normalize"], bool):
            raise ValueError(f"pooler_config: normalize must be true or false, not {value['normalize']!r}")
        parsed["normalize"] = value["normalize"]
    return parsed


# A causal LM served as an embedder without sentence-transformers files: its last token's hidden state (the
# only one that has seen the whole input), normalized, as vLLM does for decoder models.
DECODER_DEFAULT = PoolingConfig(modes=("lasttoken",), normalize=True)
