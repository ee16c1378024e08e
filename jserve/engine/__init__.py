"""The engine: requests -> scheduler -> runner (jitted model step + on-device sampling) -> outputs."""

from jserve.engine.engine import LLMEngine

__all__ = ["LLMEngine"]
