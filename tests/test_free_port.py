"""The tests' free ports come from below the kernel's ephemeral range (tests/support/stack.py): a port from
bind(0) can be taken as the local port of an outgoing connection before the server meant for it binds,
which failed a CI run with EADDRINUSE."""
from __future__ import annotations

import socket

from tests.support.stack import _ephemeral_range, free_port


def test_free_ports_are_below_the_ephemeral_range_distinct_and_bindable():
    lo, _ = _ephemeral_range()
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    assert all(1024 < p < lo for p in ports), ports
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[-1]))
