"""The schema set of the structured-output and tool-calling tests: nested objects, arrays,
enums, `anyOf`, string patterns and formats, numbers with bounds, `$ref`/`$defs`, `const`,
`additionalProperties`, and a few keywords in the manner of the JSON-Schema-Test-Suite's
cases (minItems/maxItems, uniqueness left out: llguidance does not enforce `uniqueItems`).
Each schema has a prompt that asks a small model for such a value. Bounds keep every value
finite (`maxLength`, `maxItems`) so a sampled answer ends within the tests' max_tokens."""

SCHEMAS = {
    "weather": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 40},
            "temperature_c": {"type": "number", "minimum": -60, "maximum": 60},
            "sky": {"enum": ["sunny", "cloudy", "rain", "snow"]},
        },
        "required": ["city", "temperature_c", "sky"],
        "additionalProperties": False,
    },
    "order": {
        "type": "object",
        "properties": {
            "order_id": {"type": "string", "pattern": "^ORD-[0-9]{4}$"},
            "customer": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 30},
                    "email": {"type": "string", "pattern": "^[a-z]{1,10}@[a-z]{1,10}\\.(com|org)$"},
                },
                "required": ["name", "email"],
                "additionalProperties": False,
            },
            "items": {
                "type": "array",
                "minItems": 1,
                "maxItems": 3,
                "items": {
                    "type": "object",
                    "properties": {
                        "sku": {"type": "string", "maxLength": 12},
                        "quantity": {"type": "integer", "minimum": 1, "maximum": 99},
                    },
                    "required": ["sku", "quantity"],
                    "additionalProperties": False,
                },
            },
        },
        "required": ["order_id", "customer", "items"],
        "additionalProperties": False,
    },
    "inventory": {
        "type": "array",
        "minItems": 2,
        "maxItems": 4,
        "items": {
            "type": "object",
            "properties": {
                "fruit": {"type": "string", "maxLength": 20},
                "count": {"type": "integer", "minimum": 0, "maximum": 500},
            },
            "required": ["fruit", "count"],
            "additionalProperties": False,
        },
    },
    "contact": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 30},
            "phone": {"anyOf": [{"type": "string", "pattern": "^\\+[0-9]{6,12}$"}, {"type": "null"}]},
            "age": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 120}, {"type": "null"}]},
        },
        "required": ["name", "phone", "age"],
        "additionalProperties": False,
    },
    "shape": {
        "anyOf": [
            {
                "type": "object",
                "properties": {"kind": {"const": "circle"}, "radius": {"type": "number", "exclusiveMinimum": 0,
                                                                        "maximum": 100}},
                "required": ["kind", "radius"],
                "additionalProperties": False,
            },
            {
                "type": "object",
                "properties": {"kind": {"const": "rectangle"},
                               "width": {"type": "number", "minimum": 0, "maximum": 100},
                               "height": {"type": "number", "minimum": 0, "maximum": 100}},
                "required": ["kind", "width", "height"],
                "additionalProperties": False,
            },
        ]
    },
    "matrix": {
        "type": "array",
        "minItems": 2,
        "maxItems": 2,
        "items": {"type": "array", "minItems": 2, "maxItems": 2,
                  "items": {"type": "integer", "minimum": -9, "maximum": 9}},
    },
    "event": {
        "$defs": {
            "person": {
                "type": "object",
                "properties": {"name": {"type": "string", "maxLength": 20},
                               "role": {"enum": ["host", "guest", "speaker"]}},
                "required": ["name", "role"],
                "additionalProperties": False,
            }
        },
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 40},
            "date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"},
            "people": {"type": "array", "maxItems": 3, "items": {"$ref": "#/$defs/person"}},
        },
        "required": ["title", "date", "people"],
        "additionalProperties": False,
    },
    "flags": {
        "type": "object",
        "properties": {
            "verbose": {"type": "boolean"},
            "level": {"type": "integer", "multipleOf": 5, "minimum": 0, "maximum": 50},
            "mode": {"type": "string", "enum": ["fast", "safe"]},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 3},
        },
        "required": ["verbose", "level", "mode"],
        "additionalProperties": False,
    },
}

PROMPTS = {
    "weather": "What is the weather in Paris today? Answer as JSON.",
    "order": "Write an example customer order with two items as JSON.",
    "inventory": "List the fruits in my kitchen and how many of each, as JSON.",
    "contact": "Give me a contact card for Alice as JSON.",
    "shape": "Describe a geometric shape as JSON.",
    "matrix": "Write a 2 by 2 matrix of small integers as JSON.",
    "event": "Describe a conference talk with its people as JSON.",
    "flags": "Give the settings of a command line tool as JSON.",
}
