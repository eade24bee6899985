"""How the engine's child processes end with their parent (the serving processes and tensor-parallel workers)."""

from __future__ import annotations

import signal


def die_with_parent(signum: int = signal.SIGTERM) -> None:
    """Ask Linux to send this process `signum` when its parent dies, so no orphan keeps the model, the GPU or the
    port. Elsewhere a no-op."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signum)
    except (OSError, AttributeError):
        return
