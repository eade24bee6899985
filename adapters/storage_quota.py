"""A tenant's adapter storage quota: how many adapters that may still be served, and their weights' bytes.

The registry checks it in the same transaction that creates the record (a
per-tenant lock around count-and-insert), so concurrent uploads can never
pass it together; uploads still streaming in count too (upload_slots.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from loraplex.adapters.errors import StorageQuotaExceededError


@dataclass(frozen=True, slots=True)
class StorageQuota:
    """Per tenant; failed adapters count as adapters until deleted but hold no storage. None: no cap."""

    max_bytes: int | None = None
    max_adapters: int | None = None

    @property
    def is_unlimited(self) -> bool:
        return self.max_bytes is None and self.max_adapters is None

    def check(self, *, num_adapters: int, used_bytes: int, num_new_bytes: int) -> None:
        """Refuse one more adapter of `num_new_bytes` (0: is there room at all?) beside what the tenant has."""
        if self.max_adapters is not None and num_adapters + 1 > self.max_adapters:
            raise StorageQuotaExceededError(
                f"the adapter quota is {self.max_adapters} adapters per tenant (adapter_quota_count_per_tenant) "
                f"and this tenant has {num_adapters} (failed ones count until deleted); delete one first"
            )
        if self.max_bytes is not None and used_bytes + max(num_new_bytes, 1) > self.max_bytes:
            raise StorageQuotaExceededError(
                f"the adapter storage quota is {self.max_bytes} bytes per tenant (adapter_quota_bytes_per_tenant); "
                f"this tenant uses {used_bytes} and the upload adds {num_new_bytes}"
            )
