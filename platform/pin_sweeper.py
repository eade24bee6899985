"""The background sweep of a domain that pins engine KV (sessions, stored responses), and its stop.

While the app's loop runs, `sweep()` runs every interval in a worker thread (it
reads the store: never on the event loop), releasing what expired. On
shutdown the sweep stops and the domain releases the pins this process
holds: an engine that outlives the app (shared, in tests) must not keep them.
With no running loop (a synchronous caller) nothing sweeps; the domain still
works.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol

from loraplex.platform.extensions import Extensions

log = logging.getLogger(__name__)


class PinHolder(Protocol):
    def sweep(self) -> object: ...

    def release_all_here(self) -> object: ...


def sweep_while_running(extensions: Extensions, holder: PinHolder, interval_s: float, what: str) -> None:
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return
    sweeper = loop.create_task(_sweep_forever(holder, interval_s, what))

    async def stop() -> None:
        sweeper.cancel()
        holder.release_all_here()

    extensions.on_shutdown.append(stop)


async def _sweep_forever(holder: PinHolder, interval_s: float, what: str) -> None:
    while True:
        await asyncio.sleep(interval_s)
        try:
            await asyncio.to_thread(holder.sweep)
        except Exception:
            log.exception("%s sweep failed", what)
