from __future__ import annotations

import time

import pytest
from loraplex.engine.errors import InvalidRequestError
from loraplex.grammar.schema.walk import SchemaShapeLimits
from loraplex.grammar.spec import GrammarKind
from loraplex.grammar.validation import check_spec_sizes, parse_tools, response_format_spec


def tool(name: str, parameters: dict | None = None, **extra) -> dict:
    function = {"name": name, "parameters": parameters or {"type": "object", "properties": {}}, **extra}
    return {"type": "function", "function": function}


def schema_format(schema, strict: bool = False, name: str = "answer") -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": strict}}


@pytest.mark.parametrize(
    ("response_format", "kind"),
    [
        (None, None),
        ({"type": "text"}, None),
        ({"type": "json_object"}, GrammarKind.JSON_OBJECT),
        (schema_format({"type": "object"}), GrammarKind.JSON_SCHEMA),
        ({"type": "regex", "regex": r"\d+"}, GrammarKind.REGEX),
        ({"type": "grammar", "grammar": 'root ::= "a"'}, GrammarKind.EBNF),
        ({"type": "choice", "choices": ["a", "b"]}, GrammarKind.CHOICE),
    ],
)
def test_good_response_formats(response_format, kind):
    spec = response_format_spec(response_format)
    assert (spec.kind if spec else None) == kind


@pytest.mark.parametrize(
    ("response_format", "param", "needle"),
    [
        ("json", "response_format", "object"),
        ({"type": "yaml"}, "response_format.type", "must be one of"),
        ({"type": "json_schema"}, "response_format.json_schema", "name"),
        ({"type": "json_schema", "json_schema": {"schema": {}}}, "response_format.json_schema.name", "name"),
        (schema_format({"type": "strnig"}), "response_format.json_schema.schema", "not a valid JSON schema"),
        (schema_format({"type": "object", "properties": {"a": {"minimum": "3"}}}),
         "response_format.json_schema.schema", "properties/a/minimum"),
        (schema_format({"type": "object", "required": "a"}), "response_format.json_schema.schema", "not a valid"),
        (schema_format([1, 2]), "response_format.json_schema.schema", "JSON schema object"),
        (schema_format({"type": "object"}, strict="yes"), "response_format.json_schema.strict", "boolean"),
        ({"type": "regex", "regex": ""}, "response_format.regex", "non-empty"),
        ({"type": "grammar", "grammar": 42}, "response_format.grammar", "EBNF"),
        ({"type": "choice", "choices": []}, "response_format.choices", "non-empty"),
        ({"type": "choice", "choices": ["a", 3]}, "response_format.choices", "non-empty"),
    ],
)
def test_bad_response_format_is_a_400_naming_the_field(response_format, param, needle):
    with pytest.raises(InvalidRequestError) as info:
        response_format_spec(response_format)
    assert type(info.value) is InvalidRequestError  # the platform maps it to 400
    assert info.value.param == param
    assert needle in info.value.message


def nested(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def test_a_response_format_whose_values_never_end_is_a_400_naming_it():
    endless = {"type": "object", "properties": {"a": {"$ref": "#/$defs/b"}}, "required": ["a"],
               "$defs": {"b": {"type": "array", "minItems": 1, "items": {"$ref": "#"}}}}
    with pytest.raises(InvalidRequestError) as info:
        response_format_spec({"type": "json_schema", "json_schema": {"name": "x", "schema": endless}})
    assert info.value.param == "response_format.json_schema.schema" and "no finite JSON value" in info.value.message


def test_a_schema_nested_400_deep_is_a_400_not_a_recursion_error():
    with pytest.raises(InvalidRequestError, match="nests deeper than 64") as info:
        response_format_spec(schema_format(nested(400)))
    assert info.value.param == "response_format.json_schema.schema"
    with pytest.raises(InvalidRequestError, match="nests deeper than 64") as info:
        parse_tools([tool("a", nested(400))], None, None)
    assert info.value.param == "tools[0].function.parameters"
    assert response_format_spec(schema_format(nested(60))).kind == "json_schema"


def test_schema_limits_come_from_the_caller():
    with pytest.raises(InvalidRequestError, match="more than 10 subschemas"):
        response_format_spec(schema_format(nested(20)), limits=SchemaShapeLimits(max_depth=64, max_nodes=10))


def test_tools_count_is_capped_and_the_duplicate_check_is_linear():
    many = [tool(f"t{i}") for i in range(129)]
    with pytest.raises(InvalidRequestError, match="the limit is 128") as info:
        parse_tools(many, None, None)
    assert info.value.param == "tools"
    assert len(parse_tools(many[:128], None, None).tools) == 128
    with pytest.raises(InvalidRequestError, match="limit is 4"):
        parse_tools(many[:5], None, None, max_tools=4)
    with pytest.raises(InvalidRequestError, match=r"duplicate tool names: t3$"):
        parse_tools([*many[:100], tool("t3")], None, None)


def test_strict_flag_travels_with_the_spec():
    schema = {"type": "object", "properties": {"n": {"not": {"type": "string"}}}}
    assert response_format_spec(schema_format(schema, strict=True)).strict is True
    assert response_format_spec(schema_format(schema, strict=False)).strict is False


def test_strict_mode_accepts_what_xgrammar_enforces():
    schema = {
        "type": "object",
        "properties": {
            "id": {"type": "string", "format": "uuid"},
            "tags": {"type": "array", "items": {"$ref": "#/$defs/tag"}, "minItems": 1, "maxItems": 3},
            "score": {"type": "number", "minimum": 0, "maximum": 1},
            "kind": {"anyOf": [{"const": "a"}, {"enum": ["b", "c"]}]},
        },
        "required": ["id", "tags"],
        "additionalProperties": False,
        "$defs": {"tag": {"type": "string", "pattern": "^[a-z]+$", "description": "a tag"}},
    }
    assert response_format_spec(schema_format(schema, strict=True)).payload == schema


def test_tool_choice_forms():
    tools = [tool("a"), tool("b")]
    assert parse_tools(None, None, None) is None
    assert parse_tools(tools, None, None).mode == "auto"
    assert parse_tools(tools, "required", False).parallel is False
    named = parse_tools(tools, {"type": "function", "function": {"name": "b"}}, None)
    assert named.mode == "named" and [t.name for t in named.offered] == ["b"]
    assert parse_tools(tools, "none", None).offered == ()


@pytest.mark.parametrize(
    ("tools", "tool_choice", "parallel", "param", "needle"),
    [
        ([tool("a"), tool("a")], None, None, "tools", "duplicate tool names: a"),
        ([tool("a")], {"type": "function", "function": {"name": "zzz"}}, None, "tool_choice", "'zzz'"),
        ([tool("a")], "sometimes", None, "tool_choice", "tool_choice must be"),
        ([tool("a")], {"type": "function"}, None, "tool_choice", "tool_choice must be"),
        (None, "required", None, "tool_choice", "only allowed when tools"),
        ("a", None, None, "tools", "list"),
        ([{"type": "retrieval"}], None, None, "tools[0]", "function"),
        ([tool("has space")], None, None, "tools[0].function.name", "1-64"),
        ([tool("a", {"type": "object", "properties": {"x": {"type": "nope"}}})], None, None,
         "tools[0].function.parameters", "not a valid JSON schema"),
        ([tool("a", {"type": "array"})], None, None, "tools[0].function.parameters", "type object"),
        ([tool("a", {"type": "object", "properties": {"x": {"type": "string", "format": "idn-email"}}}, strict=True)],
         None, None, "tools[0].function.parameters", "strict"),
        ([tool("a")], None, "yes", "parallel_tool_calls", "boolean"),
        # no finite arguments: each value of `next` must hold another `next`
        ([tool("a", {"type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]})], "auto",
         None, "tools[0].function.parameters", "no finite JSON value"),
        # the same with the type left out: the call's arguments are an object all the same
        ([tool("a", {"properties": {"next": {"$ref": "#"}}, "required": ["next"]})], None, None,
         "tools[0].function.parameters", "no finite JSON value"),
    ],
)
def test_bad_tools_are_a_400_naming_the_field(tools, tool_choice, parallel, param, needle):
    with pytest.raises(InvalidRequestError) as info:
        parse_tools(tools, tool_choice, parallel)
    assert type(info.value) is InvalidRequestError  # the platform maps it to 400
    assert info.value.param == param
    assert needle in info.value.message


def _draft4(enum: list) -> dict:
    return schema_format({"$schema": "http://json-schema.org/draft-04/schema#", "enum": enum})


def test_unique_items_of_the_metaschema_are_checked_in_linear_time():
    # jsonschema compares every pair of items it cannot sort: this enum (~270 KB) took minutes
    started = time.perf_counter()
    assert response_format_spec(_draft4([*range(40_000), "x"])).kind == "json_schema"
    with pytest.raises(InvalidRequestError, match="non-unique") as info:
        parse_tools([tool("a", {"type": "object", "required": [f"k{i}" for i in range(40_000)] + ["k7"]})],
                    None, None)
    assert info.value.param == "tools[0].function.parameters"
    assert time.perf_counter() - started < 5.0
    for duplicated in ([1, "x", 1.0], [{"a": 1, "b": [2]}, {"b": [2], "a": 1}], [[1, "x"], [1.0, "x"]]):
        with pytest.raises(InvalidRequestError, match="non-unique"):
            response_format_spec(_draft4(duplicated))
    for distinct in ([1, True], [0, False], [None, 0, "", [], {}], [{"a": 1}, {"a": True}]):
        assert response_format_spec(_draft4(distinct)).kind == "json_schema"  # JSON's equality, not Python's


def test_a_value_nested_past_the_limit_is_a_400_before_any_recursive_check():
    deep: object = 1
    for _ in range(600):
        deep = [deep]
    with pytest.raises(InvalidRequestError, match="deeper than 160 levels of JSON") as info:
        response_format_spec(schema_format({"type": "object", "properties": {"c": {"const": deep}}}))
    assert info.value.param == "response_format.json_schema.schema"
    shallow: object = 1
    for _ in range(100):
        shallow = [shallow]
    assert response_format_spec(schema_format({"const": shallow})).kind == "json_schema"


def test_a_schema_verdict_is_remembered():
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string", "minLength": 1} for i in range(2_000)}}
    started = time.perf_counter()
    response_format_spec(schema_format(schema))
    first = time.perf_counter() - started
    started = time.perf_counter()
    for _ in range(5):
        response_format_spec(schema_format(dict(reversed(schema.items()))))  # the same schema, keys reordered
    assert (time.perf_counter() - started) / 5 < first / 3
    bad = {**schema, "minProperties": "one"}
    for _ in range(2):  # a refusal is remembered as one too
        with pytest.raises(InvalidRequestError, match="is not a valid JSON schema at minProperties"):
            response_format_spec(schema_format(bad))


def test_spec_sizes_are_checked_before_any_schema_is_walked():
    check_spec_sizes({"tools": [tool("a")], "tool_choice": "auto", "response_format": None}, 1000)
    big = [tool(f"t{i}", {"type": "object", "properties": {f"p{j}": {"type": "string"} for j in range(200)}})
           for i in range(20)]
    with pytest.raises(InvalidRequestError, match="tools is larger than 1000 bytes as JSON") as info:
        check_spec_sizes({"response_format": None, "tools": big}, 1000)
    assert info.value.param == "tools"
