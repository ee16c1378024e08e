"""The structured-output fields of a request body: OpenAI's `response_format` and vLLM's `structured_outputs`.

`response_format` {"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}
constrains the output to the schema, {"type": "json_object"} to any JSON object, {"type": "text"} to nothing.
`structured_outputs` takes StructuredOutputsParams' fields (json, regex, choice, grammar, json_object,
disable_any_whitespace). A request gives at most one of the two.
"""

from __future__ import annotations

from jserve.errors import RequestError, short_repr
from jserve.server.errors import bad_request
from jserve.structured import StructuredOutputsParams

STRUCTURED_FIELDS = {"json", "regex", "choice", "grammar", "json_object", "disable_any_whitespace"}
JSON_SCHEMA_FIELDS = {"name", "schema", "strict", "description"}


def parse_structured_outputs(body: dict) -> StructuredOutputsParams | None:
    response_format, structured = body.get("response_format"), body.get("structured_outputs")
    if response_format is not None and structured is not None:
        raise bad_request("give either response_format or structured_outputs, not both", "structured_outputs")
    if structured is not None:
        return _structured_outputs(structured)
    if response_format is not None:
        return _response_format(response_format)
    return None


def _structured_outputs(value: object) -> StructuredOutputsParams:
    if not isinstance(value, dict):
        raise bad_request(f"structured_outputs must be an object, got {short_repr(value)}", "structured_outputs")
    given = {key: v for key, v in value.items() if v is not None}
    unknown = sorted(set(given) - STRUCTURED_FIELDS)
    if unknown:
        raise bad_request(f"structured_outputs: unsupported field(s) {short_repr(unknown)}", "structured_outputs")
    return _build("structured_outputs", **given)


def _response_format(value: object) -> StructuredOutputsParams | None:
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text" and set(value) == {"type"}:
        return None
    if kind == "json_object" and set(value) == {"type"}:
        return _build("response_format", json_object=True)
    if kind == "json_schema" and set(value) <= {"type", "json_schema"}:
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or set(spec) - JSON_SCHEMA_FIELDS:
            raise bad_request(
                f"response_format.json_schema must be an object with fields {sorted(JSON_SCHEMA_FIELDS)}",
                "response_format",
            )
        if not isinstance(spec.get("name"), str) or not spec["name"]:
            raise bad_request("response_format.json_schema.name must be a non-empty string", "response_format")
        if spec.get("schema") is None:
            raise bad_request("response_format.json_schema.schema is required", "response_format")
        if not isinstance(spec.get("strict", False), (bool, type(None))):
            raise bad_request("response_format.json_schema.strict must be a boolean", "response_format")
        return _build("response_format", json=spec["schema"])
    raise bad_request(
        "response_format must be {'type': 'text'}, {'type': 'json_object'} or "
        f"{{'type': 'json_schema', 'json_schema': {{...}}}}, got {short_repr(value)}",
        "response_format",
    )


def _build(param: str, **fields: object) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**fields)
    except RequestError as error:
        raise bad_request(str(error), param) from None
