"""The step connection between a rank on another host and node 0's engine: authenticated with
``MOESERVE_NODE_KEY``, dialled by the rank (nodes start in any order). Used by ``worker`` (the
rank's side) and ``nodes`` / ``executor`` (node 0's side)."""

from __future__ import annotations

import os
import time
from multiprocessing.connection import Client, Connection


def node_authkey() -> bytes:
    return os.environ.get("MOESERVE_NODE_KEY", "moeserve").encode()


def dial_engine(address: tuple[str, int], rank: int, timeout: float = 600.0) -> Connection:
    """Connect to node 0's step port, waiting for it to come up (nodes start in any order)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            conn = Client(address, authkey=node_authkey())
            break
        except (ConnectionRefusedError, OSError):
            if time.monotonic() > deadline:
                raise RuntimeError(f"rank {rank}: node 0 did not open {address[0]}:{address[1]} within {timeout:.0f} s") from None
            time.sleep(0.2)
    conn.send(("hello", rank))
    return conn
