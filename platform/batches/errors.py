"""The Batch API's refusals, each with its HTTP status (platform/errors.py renders them in OpenAI's shape)."""

from __future__ import annotations

from loraplex.platform.errors import ApiError, NotFoundError, RateLimitedError


class FileTooLargeError(ApiError):
    status = 413
    code = "file_too_large"


class FileQuotaExceededError(ApiError):
    status = 413
    code = "storage_quota_exceeded"


class UnsupportedFileError(ApiError):
    status = 415
    code = "unsupported_media_type"


class FileInUseError(ApiError):
    status = 409
    code = "file_in_use"


class BatchNotCancellableError(ApiError):
    status = 409
    code = "batch_not_cancellable"


class BatchLimitError(RateLimitedError):
    def __init__(self, limit: int) -> None:
        super().__init__(f"this tenant already has {limit} batches not yet finished (batch_max_active_per_tenant); "
                         "create more once some finish", retry_after_s=60, code="batch_limit_exceeded")


def file_not_found(file_id: str) -> NotFoundError:
    return NotFoundError(f"No such File object: {file_id}", param="file_id", code="file_not_found")


def batch_not_found(batch_id: str) -> NotFoundError:
    return NotFoundError(f"No such Batch object: {batch_id}", param="batch_id", code="batch_not_found")
