"""Unit tier: the free port a run's process binds later (``megatron_armor/net.py``)."""

from __future__ import annotations

import socket

import pytest

from megatron_armor import net

pytestmark = pytest.mark.unit


def test_a_free_port_is_drawn_below_the_ephemeral_range_and_binds(tmp_path, monkeypatch):
    ranges = tmp_path / "ip_local_port_range"
    ranges.write_text("40000\t60999\n")
    monkeypatch.setattr(net, "EPHEMERAL_RANGE", ranges)
    ports = {net.free_port() for _ in range(20)}
    assert all(40000 - net.BELOW_EPHEMERAL <= p < 40000 for p in ports), ports
    assert len(ports) > 1  # drawn at random, whatever the seed of the random module
    with socket.socket() as sock:
        sock.bind(("", ports.pop()))


def test_a_taken_port_is_never_returned(tmp_path, monkeypatch):
    ranges = tmp_path / "ip_local_port_range"
    with socket.socket() as held:  # the one port drawn from is taken: the kernel chooses
        held.bind(("", 0))
        port = held.getsockname()[1]
        ranges.write_text(f"{port + 1}\t60999\n")
        monkeypatch.setattr(net, "EPHEMERAL_RANGE", ranges)
        monkeypatch.setattr(net, "BELOW_EPHEMERAL", 1)
        chosen = net.free_port()
        assert chosen != port
        with socket.socket() as sock:
            sock.bind(("", chosen))


def test_without_the_range_the_kernel_chooses(tmp_path, monkeypatch):
    monkeypatch.setattr(net, "EPHEMERAL_RANGE", tmp_path / "absent")
    port = net.free_port()
    with socket.socket() as sock:
        sock.bind(("", port))
