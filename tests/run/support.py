"""Helpers shared by the run-layer tests."""

import socket


def free_port() -> int:
    """A TCP port on localhost that nothing listens on now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
