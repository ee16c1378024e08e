"""Flax NNX models for the Llama, Mistral and Qwen2/Qwen3 families, and their jitted step."""

from jserve.models.causal_lm import CausalLM
from jserve.models.forward import forward_step

__all__ = ["CausalLM", "forward_step"]
