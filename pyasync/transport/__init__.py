"""Transports: how the engine moves headers and payloads between ranks."""

from pyasync.transport.base import FLOWS, Handle, Transport

__all__ = ["FLOWS", "Handle", "Transport"]
