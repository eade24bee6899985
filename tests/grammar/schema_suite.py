"""Realistic JSON schemas with prompts, for the end-to-end structured-output tests.

Each case: (name, user prompt, schema). The schemas cover nested objects,
arrays with min/max items, enums, anyOf, $ref/$defs, string formats and
patterns, bounded numbers, optional fields and additionalProperties false.
"""

from __future__ import annotations

from typing import Any

NAME = {"type": "string", "minLength": 1, "maxLength": 40}
SHORT = {"type": "string", "maxLength": 60}

CASES: list[tuple[str, str, dict[str, Any]]] = [
    ("person", "Describe a fictional person.", {
        "type": "object",
        "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"], "additionalProperties": False,
    }),
    ("contact", "Give a contact card for a colleague.", {
        "type": "object",
        "properties": {"name": NAME, "email": {"type": "string", "format": "email"},
                       "phone": {"type": "string", "pattern": r"^\+?[0-9]{7,12}$"}},
        "required": ["name", "email"], "additionalProperties": False,
    }),
    ("address", "Write a postal address in France.", {
        "type": "object",
        "properties": {"street": SHORT, "city": NAME, "postcode": {"type": "string", "pattern": "^[0-9]{5}$"},
                       "country": {"const": "FR"}},
        "required": ["street", "city", "postcode", "country"], "additionalProperties": False,
    }),
    ("sentiment", "Classify the sentiment of: 'I loved this film!'", {
        "type": "object",
        "properties": {"label": {"enum": ["positive", "negative", "neutral"]},
                       "confidence": {"type": "number", "minimum": 0, "maximum": 1}},
        "required": ["label", "confidence"], "additionalProperties": False,
    }),
    ("todo_list", "Make a short todo list for moving house.", {
        "type": "object",
        "properties": {"items": {"type": "array", "minItems": 2, "maxItems": 4,
                                 "items": {"type": "string", "maxLength": 40}}},
        "required": ["items"], "additionalProperties": False,
    }),
    ("event", "Create a calendar event for a team meeting.", {
        "type": "object",
        "properties": {"title": SHORT, "date": {"type": "string", "format": "date"},
                       "duration_minutes": {"type": "integer", "minimum": 5, "maximum": 480}},
        "required": ["title", "date", "duration_minutes"], "additionalProperties": False,
    }),
    ("timestamped_log", "Write one server log entry.", {
        "type": "object",
        "properties": {"timestamp": {"type": "string", "format": "date-time"},
                       "level": {"enum": ["DEBUG", "INFO", "WARN", "ERROR"]}, "message": SHORT},
        "required": ["timestamp", "level", "message"], "additionalProperties": False,
    }),
    ("order", "Produce an order with two line items.", {
        "type": "object",
        "properties": {
            "order_id": {"type": "string", "format": "uuid"},
            "lines": {"type": "array", "minItems": 1, "maxItems": 3, "items": {"$ref": "#/$defs/line"}},
        },
        "required": ["order_id", "lines"], "additionalProperties": False,
        "$defs": {"line": {"type": "object", "properties": {
            "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
            "quantity": {"type": "integer", "minimum": 1, "maximum": 10}},
            "required": ["sku", "quantity"], "additionalProperties": False}},
    }),
    ("book", "Describe a classic novel.", {
        "type": "object",
        "properties": {"title": SHORT, "author": NAME, "year": {"type": "integer", "minimum": 1500, "maximum": 2025},
                       "genres": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 3}},
        "required": ["title", "author", "year"], "additionalProperties": False,
    }),
    ("weather", "Report the weather in Oslo.", {
        "type": "object",
        "properties": {"city": NAME, "temperature_c": {"type": "number", "minimum": -60, "maximum": 60},
                       "conditions": {"enum": ["sunny", "cloudy", "rain", "snow", "fog"]}},
        "required": ["city", "temperature_c", "conditions"], "additionalProperties": False,
    }),
    ("boolean_flags", "Which features are enabled?", {
        "type": "object",
        "properties": {"dark_mode": {"type": "boolean"}, "beta": {"type": "boolean"},
                       "notifications": {"type": "boolean"}},
        "required": ["dark_mode", "beta", "notifications"], "additionalProperties": False,
    }),
    ("nested_company", "Describe a small company and its CEO.", {
        "type": "object",
        "properties": {
            "company": {"type": "object", "properties": {
                "name": NAME, "employees": {"type": "integer", "minimum": 1, "maximum": 100000},
                "ceo": {"type": "object", "properties": {"name": NAME, "since": {"type": "integer", "minimum": 1950,
                                                                                 "maximum": 2025}},
                        "required": ["name"], "additionalProperties": False}},
                "required": ["name", "ceo"], "additionalProperties": False},
        },
        "required": ["company"], "additionalProperties": False,
    }),
    ("payment_anyof", "Describe how a customer paid.", {
        "type": "object",
        "properties": {"method": {"anyOf": [
            {"type": "object", "properties": {"card_last4": {"type": "string", "pattern": "^[0-9]{4}$"}},
             "required": ["card_last4"], "additionalProperties": False},
            {"type": "object", "properties": {"iban": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}[A-Z0-9]{8,20}$"}},
             "required": ["iban"], "additionalProperties": False},
        ]}, "amount": {"type": "number", "exclusiveMinimum": 0, "maximum": 10000}},
        "required": ["method", "amount"], "additionalProperties": False,
    }),
    ("nullable_middle_name", "Give a person's full name.", {
        "type": "object",
        "properties": {"first": NAME, "middle": {"anyOf": [NAME, {"type": "null"}]}, "last": NAME},
        "required": ["first", "middle", "last"], "additionalProperties": False,
    }),
    ("coordinates", "Give the coordinates of Paris.", {
        "type": "object",
        "properties": {"lat": {"type": "number", "minimum": -90, "maximum": 90},
                       "lon": {"type": "number", "minimum": -180, "maximum": 180}},
        "required": ["lat", "lon"], "additionalProperties": False,
    }),
    ("rgb_color", "Pick a color.", {
        "type": "object",
        "properties": {"name": NAME, "rgb": {"type": "array", "minItems": 3, "maxItems": 3,
                                             "items": {"type": "integer", "minimum": 0, "maximum": 255}},
                       "hex": {"type": "string", "pattern": "^#[0-9a-f]{6}$"}},
        "required": ["name", "rgb", "hex"], "additionalProperties": False,
    }),
    ("tuple_point", "A 2D point with a label.", {
        "type": "object",
        "properties": {"point": {"type": "array", "prefixItems": [{"type": "number"}, {"type": "number"}],
                                 "items": False, "minItems": 2},
                       "label": {"type": "string", "maxLength": 20}},
        "required": ["point", "label"], "additionalProperties": False,
    }),
    ("server_config", "Write a server configuration.", {
        "type": "object",
        "properties": {"host": {"type": "string", "format": "ipv4"}, "port": {"type": "integer", "minimum": 1,
                                                                             "maximum": 65535},
                       "tls": {"type": "boolean"}, "mode": {"enum": ["dev", "prod"]}},
        "required": ["host", "port", "tls"], "additionalProperties": False,
    }),
    ("link", "Share a link to a documentation page.", {
        "type": "object",
        "properties": {"title": SHORT,
                       "url": {"type": "string", "pattern": r"^https://[a-z]{1,20}\.(com|org|io)(/[a-z]{1,12}){0,3}$"}},
        "required": ["title", "url"], "additionalProperties": False,
    }),
    ("recipe", "A simple pancake recipe.", {
        "type": "object",
        "properties": {
            "name": NAME,
            "servings": {"type": "integer", "minimum": 1, "maximum": 12},
            "ingredients": {"type": "array", "minItems": 2, "maxItems": 4, "items": {
                "type": "object", "properties": {"item": {"type": "string", "maxLength": 20},
                                                 "grams": {"type": "integer", "minimum": 1, "maximum": 1000}},
                "required": ["item", "grams"], "additionalProperties": False}},
        },
        "required": ["name", "servings", "ingredients"], "additionalProperties": False,
    }),
    ("tree_ref", "Describe a folder with one subfolder.", {
        "$defs": {"node": {"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 20},
            "children": {"type": "array", "maxItems": 2, "items": {"$ref": "#/$defs/leaf"}}},
            "required": ["name", "children"], "additionalProperties": False},
            "leaf": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}},
                     "required": ["name"], "additionalProperties": False}},
        "$ref": "#/$defs/node",
    }),
    ("product_optional", "Describe a product for an online shop.", {
        "type": "object",
        "properties": {"name": NAME, "price": {"type": "number", "minimum": 0, "maximum": 9999},
                       "currency": {"enum": ["EUR", "USD", "GBP"]}, "discount_pct": {"type": "integer",
                                                                                     "minimum": 0, "maximum": 90}},
        "required": ["name", "price", "currency"], "additionalProperties": False,
    }),
    ("rating", "Rate the restaurant you visited.", {
        "type": "object",
        "properties": {"stars": {"type": "integer", "minimum": 1, "maximum": 5}, "would_return": {"type": "boolean"},
                       "comment": {"type": "string", "maxLength": 80}},
        "required": ["stars", "would_return"], "additionalProperties": False,
    }),
    ("translation", "Translate 'good morning' to French.", {
        "type": "object",
        "properties": {"source_lang": {"type": "string", "pattern": "^[a-z]{2}$"},
                       "target_lang": {"type": "string", "pattern": "^[a-z]{2}$"}, "text": SHORT},
        "required": ["source_lang", "target_lang", "text"], "additionalProperties": False,
    }),
    ("matrix", "A 2x2 identity matrix.", {
        "type": "object",
        "properties": {"rows": {"type": "array", "minItems": 2, "maxItems": 2, "items": {
            "type": "array", "minItems": 2, "maxItems": 2, "items": {"type": "integer", "minimum": -9, "maximum": 9}}}},
        "required": ["rows"], "additionalProperties": False,
    }),
    ("api_error", "An API error response for a missing resource.", {
        "type": "object",
        "properties": {"error": {"type": "object", "properties": {
            "code": {"type": "integer", "minimum": 400, "maximum": 599},
            "type": {"enum": ["not_found", "invalid_request", "server_error"]}, "message": SHORT},
            "required": ["code", "type", "message"], "additionalProperties": False}},
        "required": ["error"], "additionalProperties": False,
    }),
    ("git_commit", "Describe a git commit.", {
        "type": "object",
        "properties": {"sha": {"type": "string", "pattern": "^[0-9a-f]{7}$"}, "author": NAME,
                       "files_changed": {"type": "integer", "minimum": 1, "maximum": 50}},
        "required": ["sha", "author", "files_changed"], "additionalProperties": False,
    }),
    ("flight", "A flight from Paris to Rome.", {
        "type": "object",
        "properties": {"from": {"type": "string", "pattern": "^[A-Z]{3}$"}, "to": {"type": "string",
                                                                                 "pattern": "^[A-Z]{3}$"},
                       "departure": {"type": "string", "format": "date-time"},
                       "seats": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["from", "to", "departure"], "additionalProperties": False,
    }),
    ("survey_answers", "Answer a three-question yes/no survey.", {
        "type": "object",
        "properties": {"answers": {"type": "array", "minItems": 3, "maxItems": 3,
                                   "items": {"enum": ["yes", "no"]}}},
        "required": ["answers"], "additionalProperties": False,
    }),
    ("inventory_defs", "Inventory of a small shop with two products.", {
        "type": "object",
        "properties": {"shop": NAME, "products": {"type": "array", "minItems": 1, "maxItems": 2,
                                                  "items": {"$ref": "#/definitions/product"}}},
        "required": ["shop", "products"], "additionalProperties": False,
        "definitions": {"product": {"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 20}, "stock": {"type": "integer", "minimum": 0, "maximum": 999},
            "status": {"$ref": "#/definitions/status"}},
            "required": ["name", "stock", "status"], "additionalProperties": False},
            "status": {"enum": ["in_stock", "sold_out"]}},
    }),
    ("temperature_series", "Hourly temperatures for three hours.", {
        "type": "object",
        "properties": {"unit": {"const": "celsius"}, "values": {"type": "array", "minItems": 3, "maxItems": 3,
                                                                "items": {"type": "number", "minimum": -30,
                                                                          "maximum": 45}}},
        "required": ["unit", "values"], "additionalProperties": False,
    }),
    ("user_profile", "Create a user profile.", {
        "type": "object",
        "properties": {
            "username": {"type": "string", "pattern": "^[a-z][a-z0-9_]{2,15}$"},
            "email": {"type": "string", "pattern": r"^[a-z]{1,12}@[a-z]{1,12}\.(com|org|net)$"},
            "roles": {"type": "array", "minItems": 1, "maxItems": 3, "items": {"enum": ["admin", "editor", "viewer"]}},
            "settings": {"type": "object", "properties": {"theme": {"enum": ["light", "dark"]},
                                                          "language": {"type": "string", "pattern": "^[a-z]{2}$"}},
                         "required": ["theme"], "additionalProperties": False},
        },
        "required": ["username", "email", "roles", "settings"], "additionalProperties": False,
    }),
    ("integer_only", "Pick a lucky number between 1 and 99.", {
        "type": "object", "properties": {"number": {"type": "integer", "minimum": 1, "maximum": 99}},
        "required": ["number"], "additionalProperties": False,
    }),
]
