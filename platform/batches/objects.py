"""The Batch API's public shapes, as OpenAI sends them: File and Batch objects, list pages, result lines.

Result lines (the output and error files): a request that got an HTTP answer is

    {"id": "batch_req_...", "custom_id": ..., "response": {"status_code", "request_id", "body"}, "error": null}

(status 200 in the output file, any other in the error file, with the error body OpenAI's routes send);
one that never ran (batch expired, cancelled) has `"response": null, "error": {"code", "message"}`.
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
import time
from typing import Any

from loraplex.platform.batches.models import BatchRow, FileRow

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
COMPLETION_WINDOWS = ("24h",)
INPUT_PURPOSE = "batch"
OUTPUT_PURPOSE = "batch_output"

VALIDATING, IN_PROGRESS, FINALIZING, COMPLETED = "validating", "in_progress", "finalizing", "completed"
FAILED, EXPIRED, CANCELLING, CANCELLED = "failed", "expired", "cancelling", "cancelled"
ACTIVE_STATUSES = (VALIDATING, IN_PROGRESS, FINALIZING, CANCELLING)   # a worker still has work on these
TERMINAL_STATUSES = (COMPLETED, FAILED, EXPIRED, CANCELLED)

_PLAIN_CUSTOM_ID = re.compile(r"[A-Za-z0-9_.:\-]{1,64}")


def file_public(row: FileRow) -> dict[str, Any]:
    return {
        "id": row.id, "object": "file", "bytes": row.bytes, "created_at": row.created_at, "filename": row.filename,
        "purpose": row.purpose, "status": "processed", "expires_at": row.expires_at, "status_details": None,
    }


def batch_public(row: BatchRow) -> dict[str, Any]:
    return {
        "id": row.id,
        "object": "batch",
        "endpoint": row.endpoint,
        "model": row.model,
        "errors": json.loads(row.errors_json) if row.errors_json else None,
        "input_file_id": row.input_file_id,
        "completion_window": row.completion_window,
        "status": row.status,
        "output_file_id": row.output_file_id,
        "error_file_id": row.error_file_id,
        "created_at": row.created_at,
        "in_progress_at": row.in_progress_at,
        "expires_at": row.expires_at,
        "finalizing_at": row.finalizing_at,
        "completed_at": row.completed_at,
        "failed_at": row.failed_at,
        "expired_at": row.expired_at,
        "cancelling_at": row.cancelling_at,
        "cancelled_at": row.cancelled_at,
        "request_counts": {"total": row.num_total, "completed": row.num_completed, "failed": row.num_failed},
        "usage": {
            "input_tokens": row.input_tokens,
            "input_tokens_details": {"cached_tokens": row.cached_input_tokens},
            "output_tokens": row.output_tokens,
            "output_tokens_details": {"reasoning_tokens": row.reasoning_tokens},
            "total_tokens": row.input_tokens + row.output_tokens,
        },
        "metadata": json.loads(row.metadata_json) if row.metadata_json else None,
    }


def new_id(prefix: str) -> str:
    """`<prefix><microseconds, hex><random>`: ids of one tenant sort in the order they were made, so a page
    ordered by (created_at, id) keeps creation order within a second."""
    return f"{prefix}{time.time_ns() // 1000:013x}{secrets.token_hex(6)}"


def list_page(items: list[dict[str, Any]], *, has_more: bool) -> dict[str, Any]:
    return {"object": "list", "data": items, "first_id": items[0]["id"] if items else None,
            "last_id": items[-1]["id"] if items else None, "has_more": has_more}


def batch_error(code: str, message: str, *, line: int | None = None, param: str | None = None) -> dict[str, Any]:
    """One entry of a failed batch's `errors.data`; `line` is 1-based, as OpenAI counts."""
    return {"code": code, "message": message, "param": param, "line": line}


def request_id_for(batch_id: str, custom_id: str) -> str:
    """The request id of one line: the ledger's key, so a line is billed once whoever runs it and how often.

    Readable (`<batch id>-<custom id>`) when the custom id is short and plain, else hashed.
    """
    if _PLAIN_CUSTOM_ID.fullmatch(custom_id):
        return f"{batch_id}-{custom_id}"
    return f"{batch_id}-h{hashlib.sha256(custom_id.encode()).hexdigest()[:32]}"


def line_id(request_id: str) -> str:
    return "batch_req_" + hashlib.sha256(request_id.encode()).hexdigest()[:24]


def answered_line(request_id: str, custom_id: str, *, status_code: int, body: dict[str, Any]) -> str:
    return json.dumps({
        "id": line_id(request_id), "custom_id": custom_id,
        "response": {"status_code": status_code, "request_id": request_id, "body": body}, "error": None,
    }, separators=(",", ":"), ensure_ascii=False)


def unanswered_line(request_id: str, custom_id: str, *, code: str, message: str) -> str:
    return json.dumps({"id": line_id(request_id), "custom_id": custom_id, "response": None,
                       "error": {"code": code, "message": message}}, separators=(",", ":"), ensure_ascii=False)


EXPIRED_MESSAGE = "This request could not be executed before the completion window expired."
CANCELLED_MESSAGE = "This request was not executed: the batch was cancelled."
