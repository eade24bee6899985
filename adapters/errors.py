"""Typed refusals for adapter uploads; each carries the HTTP status the API returns."""

from __future__ import annotations

from loraplex.engine.errors import EngineError, InvalidRequestError


class AdapterRejectedError(InvalidRequestError):
    """The adapter's files are not a servable LoRA adapter for our base model (the reason says why)."""

    status = 422
    code = "adapter_invalid"


class UnsafeUploadError(InvalidRequestError):
    """The upload is hostile or malformed: pickles, path traversal, links, bombs, lying headers."""

    status = 400
    code = "unsafe_upload"


class UploadTooLargeError(InvalidRequestError):
    status = 413
    code = "upload_too_large"


class StorageQuotaExceededError(UploadTooLargeError):
    """The tenant's adapters would pass its storage quota (bytes or number of adapters)."""

    code = "storage_quota_exceeded"


class UnsupportedMediaError(InvalidRequestError):
    status = 415
    code = "unsupported_media_type"


class AdapterNotFoundError(EngineError):
    status = 404
    code = "adapter_not_found"


class AdapterNameTakenError(InvalidRequestError):
    status = 409
    code = "adapter_name_taken"


class AdapterInUseError(EngineError):
    status = 409
    code = "adapter_in_use"


class TooManyUploadsError(EngineError):
    """The tenant already has as many uploads in progress as it may (one finishing frees a place)."""

    status = 429
    code = "too_many_uploads"
