"""Flax NNX models for the Llama, Mistral and Qwen2/Qwen3 families, and `forward`, the one way to run them."""

from jserve.models.causal_lm import CausalLM
from jserve.models.forward import forward

__all__ = ["CausalLM", "forward"]
