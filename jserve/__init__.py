"""jserve: an LLM inference engine on JAX."""

__version__ = "0.1.0"
