"""A job's store outside every worker: ``python -m pyasync.store --port 29400``.

Elastic membership (``DistributedOptimizer(elastic=True)``, session/membership.py) keeps the membership
of each epoch in the job's store, so the store must outlive any worker. torchrun's agents host the
rendezvous store in one agent, whose death (with its worker's) would take the store down; this process
hosts it on its own instead. Start it once per job, then point every agent at it with
``--rdzv-endpoint HOST:PORT --rdzv-conf is_host=false`` (see the README's recipe). It serves until it
is interrupted (Ctrl-C, SIGTERM).
"""

from __future__ import annotations

import argparse
import datetime
import signal
import threading
from collections.abc import Sequence

import torch.distributed as dist

__all__ = ["main", "serve"]


def serve(host: str, port: int, timeout_s: float = 300.0) -> dist.TCPStore:
    """Host a TCPStore on ``host:port`` (port 0: a free one, read ``.port``); it serves while the returned
    object lives."""
    return dist.TCPStore(
        host, port, None, True, timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False
    )


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="0.0.0.0", help="address to listen on (default 0.0.0.0)")
    p.add_argument("--port", type=int, default=29400, help="TCP port (default 29400)")
    args = p.parse_args(argv)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    store = serve(args.host, args.port)
    print(f"pyasync: the job's store serves on {args.host}:{store.port} (Ctrl-C stops it)", flush=True)
    while not stop.wait(3600.0):
        pass


if __name__ == "__main__":
    main()
