"""What a request constrains its output to: StructuredOutputsParams, with vLLM's field names.

Exactly one of `json` (a JSON schema), `regex`, `choice`, `grammar` (Lark, or llama.cpp's GBNF) or
`json_object` is set. The spec is normalised on construction (a schema becomes its compact JSON text), so
two requests with the same constraint share one compiled grammar however they spelled it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from jserve.errors import RequestError, short_repr

PARAM = "structured_outputs"
MAX_SPEC_CHARS = 1_000_000  # a schema or grammar this long is an attack, not a format
MAX_CHOICES = 1024
SPEC_FIELDS = ("json", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutputsParams:
    json: str | dict | bool | None = None  # a JSON schema (object or its JSON text)
    regex: str | None = None
    choice: list[str] | tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None  # any JSON object
    disable_any_whitespace: bool = False  # JSON without whitespace between its tokens

    def __post_init__(self) -> None:
        if self.json_object is not None and not isinstance(self.json_object, bool):
            raise RequestError(f"json_object must be a bool, got {short_repr(self.json_object)}", PARAM)
        given = [name for name in SPEC_FIELDS if getattr(self, name) is not None]
        if self.json_object:
            given.append("json_object")
        if len(given) != 1:
            raise RequestError(
                "structured outputs take exactly one of json, regex, choice, grammar or json_object, got "
                + (", ".join(given) or "none"),
                PARAM,
            )
        if not isinstance(self.disable_any_whitespace, bool):
            raise RequestError("disable_any_whitespace must be a bool", PARAM)
        if self.json is not None:
            object.__setattr__(self, "json", _schema_text(self.json))
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                message = f"structured outputs: {name} must be a non-empty string, got {short_repr(value)}"
                raise RequestError(message, PARAM)
        if self.choice is not None:
            object.__setattr__(self, "choice", _choices(self.choice))
        if len(self.spec) > MAX_SPEC_CHARS:
            raise RequestError(f"structured outputs: the {self.kind} is longer than {MAX_SPEC_CHARS} characters", PARAM)

    @property
    def kind(self) -> str:
        """Which constraint: "json", "regex", "choice", "grammar" or "json_object"."""
        if self.json_object:
            return "json_object"
        return next(name for name in SPEC_FIELDS if getattr(self, name) is not None)

    @property
    def spec(self) -> str:
        """The constraint as text: a schema's canonical JSON, a choice list as JSON, "" for json_object."""
        kind = self.kind
        if kind == "json_object":
            return ""
        return json.dumps(list(self.choice)) if kind == "choice" else getattr(self, kind)

    @property
    def key(self) -> tuple[str, str, bool]:
        """What compiles to the same grammar: the cache key."""
        return self.kind, self.spec, self.disable_any_whitespace


def _schema_text(schema: object) -> str:
    """Canonical JSON text of a schema given as an object, a boolean schema, or JSON text."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as error:
            raise RequestError(f"structured outputs: json is not valid JSON: {error}", PARAM) from None
    if not isinstance(schema, (dict, bool)):
        raise RequestError(f"structured outputs: json must be a JSON schema object, got {short_repr(schema)}", PARAM)
    return json.dumps(schema, ensure_ascii=False)  # key order kept: it is the order properties are written in


def _choices(choice: object) -> tuple[str, ...]:
    if not isinstance(choice, (list, tuple)) or not choice or not all(isinstance(c, str) and c for c in choice):
        raise RequestError(
            f"structured outputs: choice must be a non-empty list of non-empty strings, got {short_repr(choice)}",
            PARAM,
        )
    if len(choice) > MAX_CHOICES:
        raise RequestError(f"structured outputs: at most {MAX_CHOICES} choices, got {len(choice)}", PARAM)
    return tuple(choice)
