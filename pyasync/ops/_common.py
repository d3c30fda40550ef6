"""Shared pieces of the torch-facing kernel wrappers: ids, the Payload type, validation, streams."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pyasync import _ext

# Must match pyasync::DType and pyasync::Codec in csrc/include/pyasync/common.h.
DTYPE_IDS = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
CODEC_IDS = {"none": 0, "fp16": 1, "bf16": 2, "int8": 3, "sign": 4, "topk": 5}
CODEC_NAMES = {v: k for k, v in CODEC_IDS.items()}
BLOCK_CODECS = ("int8", "sign")  # codecs with a per-block fp32 scale
CODE_DTYPES = {
    "none": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "int8": torch.int8,
    "sign": torch.uint8,
    "topk": torch.float32,
}


def payload_parts(codec: str, n: int, block: int, k: int) -> tuple[tuple[str, torch.dtype, int], ...]:
    """The tensors of a payload of ``codec`` for ``n`` elements, in wire order: (field, dtype, numel).

    The one place the payload layout is written (ops.codecs allocates and checks payloads with it, the
    wire lays frames out with it). ``block``: elements per scale (int8, sign); ``k``: kept elements
    (top-k). Arguments are trusted: validate them first."""
    if codec in ("none", "fp16", "bf16"):
        return (("codes", CODE_DTYPES[codec], n),)
    if codec == "int8":
        return (("codes", torch.int8, n), ("scales", torch.float32, -(-n // block)))
    if codec == "sign":
        return (("codes", torch.uint8, -(-n // 8)), ("scales", torch.float32, -(-n // block)))
    return (("codes", torch.float32, k), ("indices", torch.int32, k))


@dataclass
class Payload:
    """An encoded gradient slice (see ``Payload`` in csrc/include/pyasync/params.h).

    codes:   "none": n float32; "fp16"/"bf16": n float16/bfloat16; "int8": n int8;
             "sign": ceil(n/8) uint8 (bit i%8 of byte i//8 is element i, LSB first);
             "topk": k float32 values.
    scales:  "int8"/"sign": ceil(n/block) float32, else None.
    indices: "topk": k int32 indices in ascending order, else None.
    n:       elements of the dense tensor; k: kept elements (top-k), else 0; block: int8/sign, else 0.
    """

    codec: str
    n: int
    codes: torch.Tensor
    scales: torch.Tensor | None = None
    indices: torch.Tensor | None = None
    k: int = 0
    block: int = 0
    finite: bool = True  # False when the encoded gradient held NaN/Inf (the push must not be applied)

    @property
    def device(self) -> torch.device:
        return self.codes.device

    @property
    def nbytes(self) -> int:
        """Bytes of all tensors in the payload (what goes on the wire, headers aside)."""
        total = self.codes.numel() * self.codes.element_size()
        for t in (self.scales, self.indices):
            if t is not None:
                total += t.numel() * t.element_size()
        return total

    def tensors(self) -> list[torch.Tensor]:
        """The payload's tensors in wire order: codes, then scales or indices when present."""
        return [t for t in (self.codes, self.scales, self.indices) if t is not None]


def addr(t: torch.Tensor | None) -> int:
    """Raw address of a tensor's first element, 0 for None."""
    return 0 if t is None else t.data_ptr()


def check_tensor(
    name: str,
    t: torch.Tensor,
    *,
    dtype: torch.dtype | None = None,
    dtypes: tuple | None = None,
    device: torch.device | None = None,
    numel: int | None = None,
) -> None:
    """Raise TypeError/ValueError naming `name` unless t is a contiguous tensor of the given kind."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dtype is not None and t.dtype != dtype:
        raise TypeError(f"{name} must have dtype {dtype}, got {t.dtype}")
    if dtypes is not None and t.dtype not in dtypes:
        raise TypeError(f"{name} must have one of the dtypes {[str(d) for d in dtypes]}, got {t.dtype}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device} but the other tensors are on {device}; move it first")
    if t.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{name} is on {t.device}; pyasync kernels support cpu and cuda tensors")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous; call .contiguous() first")
    if numel is not None and t.numel() != numel:
        raise ValueError(f"{name} must have {numel} elements, got {t.numel()}")


def check_num_threads(num_threads: int | None) -> int:
    if num_threads is None:
        return 0
    if not isinstance(num_threads, int) or isinstance(num_threads, bool) or num_threads < 0:
        raise ValueError(f"num_threads must be None or an int >= 0, got {num_threads!r}")
    return num_threads


def backend(device: torch.device):
    """(module, kwargs) for launching on `device`: CPU kernels, or CUDA kernels on the current stream."""
    if device.type == "cuda":
        c = _ext.require_cuda()
        with torch.cuda.device(device):
            stream = torch.cuda.current_stream(device).cuda_stream
        return c, "cuda", {"stream": stream}
    return _ext.C(), "cpu", {}


def launch(op: str, device: torch.device, **kwargs) -> None:
    """Call `<op>_cpu` or `<op>_cuda` of the core for `device` with kwargs (plus the stream on CUDA)."""
    c, suffix, extra = backend(device)
    if device.type == "cuda":
        with torch.cuda.device(device):
            getattr(c, f"{op}_{suffix}")(**kwargs, **extra)
    else:
        getattr(c, f"{op}_{suffix}")(**kwargs)
