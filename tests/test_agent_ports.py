"""The ports an agent offers are its own until a task is given one."""

from __future__ import annotations

import socket

import pytest

from strata.worker.agent import _hold_port


def _bind(port: int, reuse: bool) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        if reuse:  # as gRPC's servers and portpicker bind
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
            return True
        except OSError:
            return False


def test_a_held_port_cannot_be_taken_and_is_free_once_let_go():
    held = _hold_port()
    port = held.getsockname()[1]
    try:
        assert not _bind(port, reuse=True) and not _bind(port, reuse=False)
        # and it accepts nothing: a peer waiting for the task to listen is not fooled
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as c:
            c.settimeout(2)
            with pytest.raises(OSError):
                c.connect(("127.0.0.1", port))
    finally:
        held.close()
    assert _bind(port, reuse=True)
