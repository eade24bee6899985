"""What one tenant may keep in a store: how many records, how many bytes in all, how large one record may be.

Stores count a record's bytes as they hold it (its JSON), keep each tenant's
count and bytes as running totals (never by scanning), and call `check` in the
same atomic step that stores the record. Each refusal names the setting that
set the cap: a record too large is a 400 (`StoredStateTooLargeError`), a
tenant at its cap a 429 (`StoredStateLimitError`) that deleting or expiring
records clears.
"""

from __future__ import annotations

from dataclasses import dataclass

from loraplex.sessions.errors import StoredStateLimitError, StoredStateTooLargeError

# Reasons a store's atomic check reports (Lua scripts return these numbers too)
FITS, OVER_COUNT, OVER_BYTES = 0, 1, 2


@dataclass(frozen=True, slots=True)
class StoreQuota:
    """0 for a cap: none. `*_setting`: the Settings fields the caps come from (named in refusals)."""

    what: str = "records"
    max_count: int = 0
    max_bytes: int = 0
    max_record_bytes: int = 0
    max_count_setting: str = "max_count"
    max_bytes_setting: str = "max_bytes"
    max_record_bytes_setting: str = "max_record_bytes"

    def check_record(self, num_bytes: int, *, param: str | None = None) -> None:
        if self.max_record_bytes and num_bytes > self.max_record_bytes:
            raise StoredStateTooLargeError(
                f"this would store {num_bytes} bytes in one of this tenant's {self.what}, more than "
                f"{self.max_record_bytes} ({self.max_record_bytes_setting})", param=param)

    def reason(self, *, count: int, used_bytes: int, num_new_bytes: int) -> int:
        """FITS, OVER_COUNT or OVER_BYTES for one more record of `num_new_bytes` beside `count` holding `used_bytes`."""
        if self.max_count and count + 1 > self.max_count:
            return OVER_COUNT
        if self.max_bytes and used_bytes + num_new_bytes > self.max_bytes:
            return OVER_BYTES
        return FITS

    def check(self, *, count: int, used_bytes: int, num_new_bytes: int) -> None:
        self.raise_for(self.reason(count=count, used_bytes=used_bytes, num_new_bytes=num_new_bytes),
                       count=count, used_bytes=used_bytes)

    def raise_for(self, reason: int, *, count: int, used_bytes: int) -> None:
        if reason == OVER_COUNT:
            raise StoredStateLimitError(
                f"this tenant keeps {count} {self.what}, the most it may ({self.max_count_setting} = "
                f"{self.max_count}); delete some or let them expire, then retry")
        if reason == OVER_BYTES:
            raise StoredStateLimitError(
                f"this tenant's {self.what} hold {used_bytes} bytes, and this one would pass the limit of "
                f"{self.max_bytes} ({self.max_bytes_setting}); delete some or let them expire, then retry")


NO_QUOTA = StoreQuota()
