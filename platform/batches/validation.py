"""An input file's lines, checked before anything runs (the batch's `validating` status).

Each line must be a JSON object `{"custom_id", "method": "POST", "url", "body"}`
whose url is the batch's endpoint, whose custom_id is unique in the file, and
whose body is a valid request of that endpoint (parsed by the same schema as
the online route; `stream` is refused). Errors carry OpenAI's codes and the
1-based line: `invalid_json_line`, `missing_required_parameter`,
`invalid_request`, `invalid_url`, `invalid_method`, `duplicate_custom_id`,
`empty_file`, `too_many_requests`, `model_not_found`. Checks that need the
engine (templates, context length, grammars) run with the line, as online:
their 400 becomes that line's result in the error file.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loraplex.engine.errors import DomainError
from loraplex.platform.api.schemas import ChatCompletionRequest, CompletionRequest
from loraplex.platform.api.strict_json import loads_strict
from loraplex.platform.batches.objects import batch_error
from loraplex.platform.errors import ApiError, validation_param
from loraplex.platform.responses.schemas import ResponseCreate
from pydantic import BaseModel, ValidationError

MAX_REPORTED_ERRORS = 100
BODY_SCHEMAS: dict[str, type[BaseModel]] = {
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/completions": CompletionRequest,
    "/v1/responses": ResponseCreate,
}


@dataclass(frozen=True, slots=True)
class LinePlan:
    index: int            # 0-based among the file's request lines
    custom_id: str
    model: str
    offset: int           # the line's bytes in the file
    length: int


@dataclass(slots=True)
class ValidatedFile:
    lines: list[LinePlan] = field(default_factory=list)
    errors: list[dict[str, Any]] = field(default_factory=list)

    def refuse(self, code: str, message: str, *, line: int | None = None, param: str | None = None) -> None:
        if len(self.errors) < MAX_REPORTED_ERRORS:
            self.errors.append(batch_error(code, message, line=line, param=param))


def parse_body(endpoint: str, body: dict[str, Any]) -> BaseModel:
    """The line's body as the endpoint's request (raises what the online route would answer with a 400)."""
    return BODY_SCHEMAS[endpoint].model_validate(body)


def validate_file(path: Path, *, endpoint: str, max_requests: int, max_custom_id_chars: int) -> ValidatedFile:
    """Every line checked (the first MAX_REPORTED_ERRORS errors kept); `lines` is meaningful only without errors."""
    result = ValidatedFile()
    seen: dict[str, int] = {}
    offset = 0
    with path.open("rb") as f:
        for number, raw in enumerate(f, start=1):
            start, offset = offset, offset + len(raw)
            if not raw.strip():
                continue
            if len(result.lines) >= max_requests:
                result.refuse("too_many_requests", f"the file holds more than {max_requests} requests "
                              "(batch_max_requests); split it into several batches", line=number)
                break
            plan = _check_line(raw, number, endpoint=endpoint, max_custom_id_chars=max_custom_id_chars,
                               result=result)
            if plan is None:
                continue
            custom_id, model = plan
            if custom_id in seen:
                result.refuse("duplicate_custom_id", f"The custom_id {custom_id!r} of this request is a duplicate "
                              f"of line {seen[custom_id]}'s. The custom_id must be unique for each request in a "
                              "batch.", line=number, param="custom_id")
                continue
            seen[custom_id] = number
            result.lines.append(LinePlan(len(result.lines), custom_id, model, start, len(raw)))
    if not result.lines and not result.errors:
        result.refuse("empty_file", "The batch input file is empty.")
    return result


def _check_line(raw: bytes, number: int, *, endpoint: str, max_custom_id_chars: int, result: ValidatedFile
                ) -> tuple[str, str] | None:
    try:
        request = loads_strict(raw)
    except (UnicodeDecodeError, ValueError, RecursionError):  # RecursionError: nested too deep to parse
        result.refuse("invalid_json_line", "This line is not parseable as valid JSON.", line=number)
        return None
    if not isinstance(request, dict):
        result.refuse("invalid_request", "Each line must be a JSON object.", line=number)
        return None
    missing = [name for name in ("custom_id", "method", "url", "body") if name not in request]
    if missing:
        result.refuse("missing_required_parameter", f"Missing required parameter: {missing[0]}", line=number,
                      param=missing[0])
        return None
    custom_id, method, url, body = request["custom_id"], request["method"], request["url"], request["body"]
    if not isinstance(custom_id, str) or not custom_id:
        result.refuse("invalid_request", "custom_id must be a non-empty string.", line=number, param="custom_id")
        return None
    if len(custom_id) > max_custom_id_chars:
        result.refuse("invalid_request", f"custom_id is longer than {max_custom_id_chars} characters "
                      "(batch_max_custom_id_chars).", line=number, param="custom_id")
        return None
    if method != "POST":
        result.refuse("invalid_method", "The method of every request must be POST.", line=number, param="method")
        return None
    if url != endpoint:
        result.refuse("invalid_url", f"The url {url!r} of this request does not match the batch's endpoint "
                      f"{endpoint!r}.", line=number, param="url")
        return None
    if not isinstance(body, dict):
        result.refuse("invalid_request", "body must be a JSON object.", line=number, param="body")
        return None
    if body.get("stream"):
        result.refuse("invalid_request", "Streaming is not supported in a batch: leave out stream.", line=number,
                      param="body.stream")
        return None
    try:
        parsed = parse_body(endpoint, body)
    except ValidationError as exc:
        param, message = validation_param(list(exc.errors()))
        result.refuse("invalid_request", message, line=number, param=f"body.{param}" if param else "body")
        return None
    except (DomainError, ApiError) as exc:
        result.refuse("invalid_request", exc.message, line=number,
                      param=f"body.{exc.param}" if exc.param else "body")
        return None
    return custom_id, parsed.model  # type: ignore[attr-defined]
