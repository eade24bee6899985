"""The engine-core socket is private: its folder is 0700 whatever the umask, and the core acts on no client that
has not presented its secret (not a shutdown, not a request), while its own API servers' clients are served."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import zmq
from loraplex.engine.core.messages import Codec, Hello, Ready, Shutdown
from loraplex.engine.core.mp_client import handshake
from loraplex.platform.engine_process import SECRET_NAME, core_secret, new_core_address, remove_core_address


def test_the_socket_folder_is_private_whatever_the_umask() -> None:
    old = os.umask(0o002)  # group-writable by default: the socket used to follow it
    try:
        address = new_core_address()
    finally:
        os.umask(old)
    folder = Path(address.removeprefix("ipc://")).parent
    try:
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700
        assert stat.S_IMODE((folder / SECRET_NAME).stat().st_mode) == 0o600
        assert len(core_secret(address)) == 64
    finally:
        remove_core_address(address)
    assert not folder.exists()


def _send(address: str, message: Any) -> zmq.Socket:
    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(address)
    socket.send(Codec().encode(message))
    return socket


def test_the_core_ignores_a_client_without_its_secret(engine_core: Any) -> None:
    address = engine_core.address
    stranger = _send(address, Hello("not-the-secret"))
    try:
        assert not stranger.poll(1500), "a client with a wrong secret was answered"
        stranger.send(Codec().encode(Shutdown()))
        nameless = _send(address, Shutdown())  # no hello at all
        nameless.close()
        # Sent after those: a core that had obeyed them would have stopped answering.
        for _ in range(2):
            ready = handshake(address, timeout_s=30, secret=core_secret(address))
            assert isinstance(ready, Ready) and ready.pid == engine_core.pid
    finally:
        stranger.close()
    assert engine_core.is_alive()
