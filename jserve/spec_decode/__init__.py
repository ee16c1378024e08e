"""Speculative decoding: cheap proposals of a request's next tokens, verified by the target model in one step."""

from jserve.spec_decode.config import SpeculativeConfig
from jserve.spec_decode.ngram import propose_ngram
from jserve.spec_decode.speculator import Speculator

__all__ = ["SpeculativeConfig", "Speculator", "propose_ngram"]
