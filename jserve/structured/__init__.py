"""Structured outputs: constrain a request's tokens to a JSON schema, regex, choice list or grammar.

The constraint (StructuredOutputsParams) compiles once per spec (GrammarCompiler, with llguidance); each
request carries a GrammarMatcher that advances with its sampled tokens; before each step the runner asks
the matchers for token bitmasks, which the sampler applies to the logits on device.
"""

from jserve.structured.compiler import CompiledGrammar, GrammarCompiler
from jserve.structured.matcher import BitmaskFiller, GrammarMatcher, GrammarViolation, bitmask_words
from jserve.structured.params import StructuredOutputsParams

__all__ = [
    "BitmaskFiller",
    "CompiledGrammar",
    "GrammarCompiler",
    "GrammarMatcher",
    "GrammarViolation",
    "StructuredOutputsParams",
    "bitmask_words",
]
