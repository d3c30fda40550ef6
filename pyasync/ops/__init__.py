"""Torch-facing wrappers of the core kernels: validate, pick CPU or CUDA, pass the stream.

Every op has a pure-torch twin in :mod:`pyasync.reference` with the same signature.
"""

from pyasync.ops._common import CODEC_IDS, Payload

__all__ = ["CODEC_IDS", "Payload"]
