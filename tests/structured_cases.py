"""JSON schemas the structured-output tests constrain generation to, each with a prompt that asks for it.

Together they cover nested objects, arrays with min/max items, enums and consts, anyOf, integers and
numbers with bounds, string patterns, formats and lengths, required and optional properties, and
$ref/$defs. Strings and arrays are bounded so a small model's output ends well within max_tokens.
"""

NAME = {"type": "string", "minLength": 1, "maxLength": 12}
INT = {"type": "integer", "minimum": -999, "maximum": 999}  # unbounded, a small model may write digits forever

SCHEMAS = {
    "person": {
        "type": "object",
        "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    "optional fields": {
        "type": "object",
        "properties": {"title": NAME, "subtitle": NAME, "pages": {"type": "integer", "minimum": 1, "maximum": 999}},
        "required": ["title"],
        "additionalProperties": False,
    },
    "enum": {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}, "shade": {"enum": [1, 2, 3, None]}},
        "required": ["color", "shade"],
        "additionalProperties": False,
    },
    "const": {
        "type": "object",
        "properties": {"version": {"const": "v1"}, "ok": {"type": "boolean"}},
        "required": ["version", "ok"],
        "additionalProperties": False,
    },
    "number bounds": {
        "type": "object",
        "properties": {
            "price": {"type": "number", "minimum": 0, "maximum": 1000},
            "discount": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1},
        },
        "required": ["price", "discount"],
        "additionalProperties": False,
    },
    "integer bounds": {
        "type": "object",
        "properties": {"year": {"type": "integer", "minimum": 1900, "maximum": 2100}},
        "required": ["year"],
        "additionalProperties": False,
    },
    "array bounds": {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 2, "maxItems": 4}},
        "required": ["tags"],
        "additionalProperties": False,
    },
    "array of objects": {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {
                "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
                "qty": {"type": "integer", "minimum": 1, "maximum": 99},
            },
            "required": ["sku", "qty"],
            "additionalProperties": False,
        },
        "minItems": 1,
        "maxItems": 3,
    },
    "nested objects": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "name": NAME,
                    "address": {
                        "type": "object",
                        "properties": {"city": NAME, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                        "required": ["city", "zip"],
                        "additionalProperties": False,
                    },
                },
                "required": ["name", "address"],
                "additionalProperties": False,
            }
        },
        "required": ["user"],
        "additionalProperties": False,
    },
    "anyOf": {
        "type": "object",
        "properties": {
            "id": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 10**6}, {"type": "string", "maxLength": 8}]}
        },
        "required": ["id"],
        "additionalProperties": False,
    },
    "nullable": {
        "type": "object",
        "properties": {"nickname": {"type": ["string", "null"], "maxLength": 10}},
        "required": ["nickname"],
        "additionalProperties": False,
    },
    "string pattern": {
        "type": "object",
        "properties": {"phone": {"type": "string", "pattern": "^\\+[0-9]{2} [0-9]{3}-[0-9]{4}$"}},
        "required": ["phone"],
        "additionalProperties": False,
    },
    "string formats": {
        "type": "object",
        "properties": {"day": {"type": "string", "format": "date"}, "id": {"type": "string", "format": "uuid"}},
        "required": ["day", "id"],
        "additionalProperties": False,
    },
    "email format": {
        "type": "object",
        "properties": {"email": {"type": "string", "format": "email", "maxLength": 30}},
        "required": ["email"],
        "additionalProperties": False,
    },
    "string length": {
        "type": "object",
        "properties": {"code": {"type": "string", "minLength": 4, "maxLength": 4}},
        "required": ["code"],
        "additionalProperties": False,
    },
    "refs and defs": {
        "type": "object",
        "$defs": {
            "point": {
                "type": "object",
                "properties": {"x": INT, "y": INT},
                "required": ["x", "y"],
                "additionalProperties": False,
            }
        },
        "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
        "required": ["start", "end"],
        "additionalProperties": False,
    },  # fmt: skip
    "boolean flags": {
        "type": "object",
        "properties": {"done": {"type": "boolean"}, "archived": {"type": "boolean"}},
        "required": ["done", "archived"],
        "additionalProperties": False,
    },
    "tuple items": {
        "type": "array",
        "prefixItems": [{"type": "integer", "minimum": 0, "maximum": 9}, {"enum": ["x", "y"]}],
        "items": False,
        "minItems": 2,
    },
    "map of integers": {
        "type": "object",
        "properties": {"counts": {"type": "object", "additionalProperties": INT, "maxProperties": 3}},
        "required": ["counts"],
        "additionalProperties": False,
    },
    "top-level enum": {"enum": ["small", "medium", "large"]},
    "product": {
        "type": "object",
        "properties": {
            "name": NAME,
            "category": {"enum": ["book", "toy", "food"]},
            "price": {"type": "number", "minimum": 0, "maximum": 100},
            "in_stock": {"type": "boolean"},
        },
        "required": ["name", "category", "price", "in_stock"],
        "additionalProperties": False,
    },
    "oneOf": {
        "oneOf": [
            {"type": "object", "properties": {"cat": NAME}, "required": ["cat"], "additionalProperties": False},
            {"type": "object", "properties": {"dog": NAME}, "required": ["dog"], "additionalProperties": False},
        ]
    },
}

PROMPTS = {name: f"Reply with JSON only. Give an example of {name.replace('-', ' ')} data." for name in SCHEMAS}
