"""Headers that tell OpenAI's SDKs whether retrying a refused request can help.

The `openai` SDK retries 408, 409, 429 and 5xx answers by default (twice,
with backoff) unless the response carries `x-should-retry: false`. A spent
monthly budget stays spent until the month turns or an admin raises it, so
retrying it only burns the client's time and our capacity.
"""

from __future__ import annotations

# Error codes whose refusal no retry can change (a full store empties only as the tenant deletes).
NO_RETRY_CODES = frozenset({"insufficient_quota", "stored_state_limit_exceeded"})


def retry_headers(code: str | None) -> dict[str, str]:
    return {"x-should-retry": "false"} if code in NO_RETRY_CODES else {}
