"""Gloo transport: torch.distributed point-to-point messages on private process groups.

Two private groups are created from the user's group: one for the push flow (worker -> owner) and
one for the reply flow (owner -> worker), each with its own tag, so the engine's traffic never
mixes with the user's collectives nor with each other. No collective is ever issued from a background
thread. See docs/architecture.md.
"""

from __future__ import annotations

import datetime
import warnings

import torch
import torch.distributed as dist

from pyasync.transport.base import FLOWS, Handle, Transport

__all__ = ["GlooTransport"]

_TAGS = {"push": 11, "reply": 21}
assert set(_TAGS) == set(FLOWS)

#: How long a receiver thread may sit idle on one receive (between steps, during evaluation, ...).
IDLE_TIMEOUT = datetime.timedelta(days=7)


class _GlooHandle(Handle):
    def __init__(self, work: dist.Work, buf: torch.Tensor, dst: int, flow: str) -> None:
        self.work, self.buf, self.dst, self.flow = work, buf, dst, flow
        self._waited = False

    def done(self) -> bool:
        # Gloo send work reports completion only once wait() has returned.
        return self._waited or self.work.is_completed()

    def wait(self, timeout: datetime.timedelta) -> None:
        if self._waited:
            return
        try:
            self.work.wait(timeout)
            self._waited = True
        except RuntimeError as e:
            raise TimeoutError(
                f"send of {self.buf.numel()} bytes to rank {self.dst} on flow {self.flow} did "
                f"not complete within {timeout}: is rank {self.dst} alive? ({e})"
            ) from e


class GlooTransport(Transport):
    """Point-to-point messages over gloo among the ranks of ``process_group`` (None: the default)."""

    def __init__(
        self, process_group: dist.ProcessGroup | None = None, timeout: datetime.timedelta | None = None
    ) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is not initialised: call torch.distributed.init_process_group "
                "(e.g. backend='gloo') on every rank before creating the DistributedOptimizer"
            )
        pg = process_group if process_group is not None else dist.group.WORLD
        self.world_size = dist.get_world_size(pg)
        self.rank = dist.get_rank(pg)
        ranks = (
            [dist.get_global_rank(pg, r) for r in range(self.world_size)]
            if pg is not dist.group.WORLD
            else list(range(self.world_size))
        )
        local = pg is not dist.group.WORLD
        self._groups = {}
        if self.world_size > 1:
            for name in ("push", "reply"):
                # sort_ranks=False keeps the user's group order, so rank r here is rank r there.
                g = dist.new_group(
                    ranks=ranks,
                    backend="gloo",
                    timeout=IDLE_TIMEOUT,
                    use_local_synchronization=local,
                    sort_ranks=False,
                )
                if dist.get_rank(g) != self.rank:
                    raise RuntimeError(
                        f"private group rank {dist.get_rank(g)} != process_group rank {self.rank}"
                    )
                self._groups[name] = g
        self._closed = False

    def _group(self, flow: str) -> tuple[dist.ProcessGroup, int]:
        if flow not in _TAGS:
            raise ValueError(f"unknown flow {flow!r}: expected one of {sorted(_TAGS)}")
        return self._groups[flow], _TAGS[flow]

    # The ProcessGroup's own send/recv take group ranks and skip torch.distributed's per-call Python
    # checks (group lookup, rank translation, membership): this rank is always a member of its
    # private groups, and every buffer is a contiguous CPU tensor (checked here, cheaply).
    @staticmethod
    def _check_buf(buf: torch.Tensor) -> None:
        if buf.device.type != "cpu" or not buf.is_contiguous() or buf.is_complex():
            raise ValueError(
                f"gloo transport buffers must be contiguous real CPU tensors, got {buf.dtype} on "
                f"{buf.device} (contiguous={buf.is_contiguous()}): stage device tensors through the host"
            )

    def send(self, buf: torch.Tensor, dst: int, flow: str) -> Handle:
        g, tag = self._group(flow)
        self._check_buf(buf)
        return _GlooHandle(g.send([buf], dst, tag), buf, dst, flow)

    def recv(
        self,
        buf: torch.Tensor,
        src: int,
        flow: str,
        timeout: datetime.timedelta | None = None,
    ) -> None:
        g, tag = self._group(flow)
        self._check_buf(buf)
        work = g.recv([buf], src, tag)
        work.wait(timeout if timeout is not None else IDLE_TIMEOUT)

    def recv_any(self, buf: torch.Tensor, flow: str) -> int:
        g, tag = self._group(flow)
        self._check_buf(buf)
        work = g.recv_anysource([buf], tag)
        work.wait(IDLE_TIMEOUT)
        return int(work._source_rank())

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for g in self._groups.values():
            try:
                dist.destroy_process_group(g)
            except Exception as e:
                warnings.warn(
                    f"pyasync: could not destroy a private gloo group: {e}", RuntimeWarning, stacklevel=2
                )
        self._groups = {}
