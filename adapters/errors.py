"""Typed refusals of adapter uploads and lookups. No HTTP statuses here: the platform's error table
(platform/errors.py) maps each class to one."""

from __future__ import annotations

from loraplex.engine.errors import DomainError, InvalidRequestError


class AdapterRejectedError(InvalidRequestError):
    """The adapter's files are not a servable LoRA adapter for our base model (the reason says why)."""

    code = "adapter_invalid"


class UnsafeUploadError(InvalidRequestError):
    """The upload is hostile or malformed: pickles, path traversal, links, bombs, lying headers."""

    code = "unsafe_upload"


class UploadTooLargeError(InvalidRequestError):
    code = "upload_too_large"


class StorageQuotaExceededError(UploadTooLargeError):
    """The tenant's adapters would pass its storage quota (bytes or number of adapters)."""

    code = "storage_quota_exceeded"


class UnsupportedMediaError(InvalidRequestError):
    code = "unsupported_media_type"


class AdapterNotFoundError(DomainError):
    code = "adapter_not_found"


class AdapterNameTakenError(InvalidRequestError):
    code = "adapter_name_taken"


class AdapterInUseError(DomainError):
    code = "adapter_in_use"


class TooManyUploadsError(DomainError):
    """The tenant already has as many uploads in progress as it may (one finishing frees a place)."""

    code = "too_many_uploads"
