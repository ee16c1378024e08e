"""Speculative decoding: cheap proposals of a request's next tokens, verified by the target model in one step."""

from jserve.spec_decode.config import SpeculativeConfig
from jserve.spec_decode.draft_model import Drafter, check_draft_model
from jserve.spec_decode.ngram import propose_ngram
from jserve.spec_decode.speculator import Speculator

__all__ = ["Drafter", "SpeculativeConfig", "Speculator", "check_draft_model", "propose_ngram"]
