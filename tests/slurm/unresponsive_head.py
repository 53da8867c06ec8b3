#!/usr/bin/env python3
"""A Ray head that never comes up, for the bring-up deadline tests: used as ``ARMOR_RAY``, its
``start --head --port=P --node-ip-address=IP`` listens on IP:P and accepts connections but
never answers (to a Ray client this is a GCS that does not respond: ``ray.init`` blocks), and
``start`` of a worker blocks without joining. It runs until it is signalled.

    unresponsive_head.py start --head --port=6379 --node-ip-address=10.0.0.1 ...
"""

from __future__ import annotations

import signal
import socket
import sys


def option(args: list[str], name: str, default: str) -> str:
    for arg in args:
        if arg.startswith(f"--{name}="):
            return arg.split("=", 1)[1]
    return default


def main(args: list[str]) -> int:
    if "--head" not in args:
        signal.pause()
        return 0
    server = socket.create_server((option(args, "node-ip-address", "127.0.0.1"),
                                   int(option(args, "port", "6379"))))  # fmt: skip
    print(f"unresponsive head listening on {server.getsockname()}", flush=True)
    accepted = []
    while True:
        connection, _ = server.accept()
        accepted.append(connection)  # kept open, never read or answered


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
