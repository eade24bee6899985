"""An input file's lines are checked before anything runs: each hostile line is one clear error with its line."""

from __future__ import annotations

from pathlib import Path

from batch_helpers import chat_line, completion_line, jsonl
from loraplex.platform.batches.validation import validate_file

ENDPOINT = "/v1/chat/completions"


def _check(tmp_path: Path, lines: list, *, max_requests: int = 100, endpoint: str = ENDPOINT):
    path = tmp_path / "input.jsonl"
    path.write_bytes(jsonl(lines) if lines else b"")
    return validate_file(path, endpoint=endpoint, max_requests=max_requests, max_custom_id_chars=64)


def test_a_valid_file_gives_each_line_its_bytes(tmp_path: Path) -> None:
    lines = [chat_line("a", "one"), chat_line("b", "two", model="adapter-x")]
    checked = _check(tmp_path, lines)
    assert checked.errors == []
    assert [(p.index, p.custom_id, p.model) for p in checked.lines] == [(0, "a", "SmolLM2-135M-Instruct"),
                                                                       (1, "b", "adapter-x")]
    raw = (tmp_path / "input.jsonl").read_bytes()
    second = checked.lines[1]
    assert raw[second.offset:second.offset + second.length].strip() == jsonl([lines[1]]).strip()


def test_each_hostile_line_is_one_error_naming_its_line(tmp_path: Path) -> None:
    lines = [
        chat_line("ok", "fine"),
        "{not json",
        '["a", "list"]',
        {"method": "POST", "url": ENDPOINT, "body": {}},
        {**chat_line("ok", "again")},
        {**chat_line("get", "x"), "method": "GET"},
        {**chat_line("url", "x"), "url": "https://example.com/v1/chat/completions"},
        {**chat_line("stream", "x", stream=True)},
        {**chat_line("bad", "x"), "body": {"model": "m", "messages": "not a list"}},
        {**chat_line("x" * 65, "x")},
        # half a surrogate pair, escaped: JSON's syntax allows it, but it is not text
        '{"custom_id": "s", "method": "POST", "url": "' + ENDPOINT + '", "body": {"model": "m", "messages": '
        '[{"role": "user", "content": "\\ud800"}]}}',
        "[" * 100_000 + "]" * 100_000,  # nested past the parser's recursion limit
    ]
    checked = _check(tmp_path, lines)
    found = [(e["line"], e["code"], e["param"]) for e in checked.errors]
    assert found == [
        (2, "invalid_json_line", None),
        (3, "invalid_request", None),
        (4, "missing_required_parameter", "custom_id"),
        (5, "duplicate_custom_id", "custom_id"),
        (6, "invalid_method", "method"),
        (7, "invalid_url", "url"),
        (8, "invalid_request", "body.stream"),
        (9, "invalid_request", "body.messages"),
        (10, "invalid_request", "custom_id"),
        (11, "invalid_json_line", None),
        (12, "invalid_json_line", None),
    ]
    assert all(e["message"] for e in checked.errors)


def test_limits_and_empty_files(tmp_path: Path) -> None:
    assert [e["code"] for e in _check(tmp_path, []).errors] == ["empty_file"]
    too_many = _check(tmp_path, [chat_line(f"r{i}", "x") for i in range(4)], max_requests=3)
    assert [(e["code"], e["line"]) for e in too_many.errors] == [("too_many_requests", 4)]
    other_endpoint = _check(tmp_path, [completion_line("c", "The sky is")], endpoint=ENDPOINT)
    assert [e["code"] for e in other_endpoint.errors] == ["invalid_url"]
    assert _check(tmp_path, [completion_line("c", "The sky is")], endpoint="/v1/completions").errors == []
