"""Ports for the servers a test starts (a control plane, the S3 server, a rank's store, a pod's agent): below the
kernel's ephemeral range (32768-60999 here), so no outgoing connection of any process takes one between the test's
choice and its server's bind, and, under `make test`, from a range of the stream's own (KUBETRON_TEST_PORTS, which
tests.suite sets), so the two pytest processes never pick the same one. A clean-clone run once lost a test so: a
pod's rendezvous store could not be reached on the port picked for it."""

from __future__ import annotations

import os
import random
import socket
import threading

RANGE_VAR = "KUBETRON_TEST_PORTS"  # "LOW-HIGH": this process's ports (tests.suite gives each stream half)
DEFAULT = (20000, 32767)
_lock = threading.Lock()
_taken: set[int] = set()
_cursor: list[int] = []


def port_range() -> tuple[int, int]:
    """[low, high) of this process's ports: KUBETRON_TEST_PORTS, else DEFAULT."""
    try:
        low, high = (int(x) for x in os.environ.get(RANGE_VAR, "").split("-"))
    except ValueError:
        return DEFAULT
    return (low, high) if 1024 <= low < high <= 65536 else DEFAULT


def free_port() -> int:
    """A port of this process's range that is free now and was never handed out before in this process."""
    low, high = port_range()
    with _lock:
        if not _cursor:
            _cursor.append(random.Random(os.getpid()).randrange(low, high))
        for _ in range(high - low):
            port = _cursor[0]
            _cursor[0] = low + (port + 1 - low) % (high - low)
            if port in _taken:
                continue
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:  # in use, or still in TIME_WAIT
                    continue
            _taken.add(port)
            return port
    raise RuntimeError(f"no free port left in {low}-{high}")
