"""A StructuredOutputsParams as llguidance grammar text, checked against the vocabulary.

JSON schemas follow llguidance's JSON-schema support (nested objects, arrays with min/max items, enums,
anyOf/oneOf, numeric bounds, string patterns and formats, $ref/$defs); `grammar` takes Lark (llguidance's
dialect) or llama.cpp's GBNF.
"""

from __future__ import annotations

import json

import llguidance as llg
from llguidance.gbnf_to_lark import any_to_lark

from jserve.errors import RequestError
from jserve.structured.params import PARAM, StructuredOutputsParams

ANY_JSON_OBJECT = {"type": "object"}


def grammar_text(params: StructuredOutputsParams) -> str:
    """The llguidance grammar for the constraint; raises RequestError naming what is wrong."""
    kind = params.kind
    try:
        if kind in ("json", "json_object"):
            schema = json.loads(params.json) if kind == "json" else ANY_JSON_OBJECT
            options = {"whitespace_flexible": not params.disable_any_whitespace}
            return llg.LLMatcher.grammar_from_json_schema(schema, defaults=options)
        if kind == "regex":
            return llg.LLMatcher.grammar_from_regex(params.regex)
        if kind == "choice":
            return llg.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in params.choice))
        return llg.LLMatcher.grammar_from_lark(any_to_lark(params.grammar))
    except Exception as error:  # llguidance's and the GBNF converter's own errors: bad input, named
        raise RequestError(f"structured outputs: invalid {kind}: {error}", PARAM) from None


def schema_error(schema: dict | bool) -> str | None:
    """What makes a JSON schema unusable as a constraint, found without a vocabulary (so before a request
    reaches the engine, whose compiler would name only the constraint); None if nothing does."""
    try:
        return llg.LLMatcher.validate_grammar(llg.LLMatcher.grammar_from_json_schema(schema)) or None
    except Exception as error:  # llguidance's own errors: the schema's fault
        return str(error)
