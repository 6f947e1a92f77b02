"""`batonlm serve --node-rank K` (K > 0): a node that only runs tensor-parallel ranks.

It starts this node's ranks (device worker processes following rank 0's relay), then
supervises them: when one exits, the others are taken down and the node exits with the
group's verdict — 0 when rank 0 shut the group down, 1 when a rank failed, died or was stopped
past `--dist-timeout` (the others' collectives time out, they exit, this notices). Node 0's
scheduler sees the same failure from its side and takes the server down.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import signal
import time
from multiprocessing.connection import wait

from batonlm import spawn
from batonlm.config import ServerArgs
from batonlm.device.cpu_worker import WORKER_START_TIMEOUT_S, worker_main
from batonlm.device.spec import device_spec
from batonlm.ipc import codec
from batonlm.ipc.device_messages import WorkerReady
from batonlm.model_runner.model_config import ModelConfig

logger = logging.getLogger(__name__)

# After one rank exits cleanly, how long the others get to exit too.
CLEAN_EXIT_GRACE_S = 10.0


def run_node(args: ServerArgs) -> int:
    """Run this node's ranks until the group ends; the exit code."""
    spec = device_spec(args, ModelConfig.from_hf(args.model))
    ctx = mp.get_context("spawn")
    procs: dict[int, mp.process.BaseProcess] = {}
    stop = {"signal": None}
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda s, _f: stop.update(signal=s))
    for rank in spec.local_ranks:
        parent, child = ctx.Pipe(duplex=True)
        procs[rank] = ctx.Process(target=worker_main, args=(child, spec, rank), name=f"batonlm-tp{rank}")
        spawn.start(procs[rank])
        child.close()
        if not _ready(rank, parent, procs[rank]):
            _kill(procs)
            return 1
    logger.info("node %d: tensor-parallel ranks %s ready (rendezvous %s)", args.node_rank,
                list(spec.local_ranks), spec.dist_init_addr)
    while stop["signal"] is None:
        done = wait([p.sentinel for p in procs.values()], timeout=0.5)
        if done:
            break
    if stop["signal"] is not None:
        logger.info("node %d: stopping on signal %d", args.node_rank, stop["signal"])
        _kill(procs)
        return 0
    exited = {r: p for r, p in procs.items() if not p.is_alive()}
    if all(p.exitcode == 0 for p in exited.values()):  # rank 0 relayed the shutdown: all follow
        deadline = time.monotonic() + CLEAN_EXIT_GRACE_S
        for p in procs.values():
            p.join(max(0.0, deadline - time.monotonic()))
    codes = {r: p.exitcode for r, p in procs.items()}
    _kill(procs)
    if all(c == 0 for c in codes.values()):
        logger.info("node %d: the group shut down", args.node_rank)
        return 0
    logger.error("node %d: tensor-parallel ranks ended (exit codes %s); taking the node down", args.node_rank,
                 ", ".join(f"rank {r}: {'running' if c is None else c}" for r, c in codes.items()))
    return 1


def _ready(rank: int, conn, proc) -> bool:
    try:
        msg = codec.decode(conn.recv_bytes()) if conn.poll(WORKER_START_TIMEOUT_S) else None
    except (EOFError, OSError):
        msg = None
    conn.close()
    if isinstance(msg, WorkerReady):
        return True
    logger.error("tensor-parallel rank %d failed to start: %s", rank,
                 getattr(msg, "message", f"exit code {proc.exitcode}"))
    return False


def _kill(procs: dict[int, mp.process.BaseProcess]) -> None:
    for p in procs.values():
        if p.is_alive():
            p.kill()
    for p in procs.values():
        p.join(5.0)
