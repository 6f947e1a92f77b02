"""`batonlm serve --node-rank K` (K > 0): a node that only runs tensor-parallel ranks.

It starts this node's ranks (device worker processes following rank 0's relay), then
supervises them: when one exits, the others are taken down and the node exits with the
group's verdict — 0 when rank 0 shut the group down, 1 when a rank failed, died or was stopped
past `--dist-timeout` (the others' collectives time out, they exit, this notices). Node 0's
scheduler sees the same failure from its side and takes the server down. A rank that is stopped
or hung exits nothing: it falls silent (ranks send a heartbeat up their pipe as they follow the
relay), and after `--dist-timeout` the supervisor takes the node down.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import signal
import time
from multiprocessing.connection import Connection, wait

from batonlm import spawn
from batonlm.config import ServerArgs
from batonlm.device.base import DeviceError
from batonlm.device.cpu_worker import wait_ready, worker_main
from batonlm.device.spec import device_spec
from batonlm.distributed.relay import HEARTBEAT_S
from batonlm.model_runner.model_config import ModelConfig

logger = logging.getLogger(__name__)

# After one rank exits cleanly, how long the others get to exit too.
CLEAN_EXIT_GRACE_S = 10.0


def run_node(args: ServerArgs) -> int:
    """Run this node's ranks until the group ends; the exit code."""
    spec = device_spec(args, ModelConfig.from_hf(args.model, args.model_impl, args.quantization))
    ctx = mp.get_context("spawn")  # for the pipes: the processes' method is spawn.worker_process's
    procs: dict[int, mp.process.BaseProcess] = {}
    conns: dict[int, Connection] = {}
    stop: dict[str, int | None] = {"signal": None}
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda s, _f: stop.update(signal=s))
    for rank in spec.local_ranks:  # all of them first: none is ready before every rank has met
        parent, child = ctx.Pipe(duplex=True)
        procs[rank] = spawn.worker_process(worker_main, (child, spec, rank), f"batonlm-tp{rank}")
        spawn.start(procs[rank])
        child.close()
        conns[rank] = parent
    try:
        wait_ready(conns, procs, logger.info)
    except DeviceError as e:
        logger.error("node %d: %s", args.node_rank, e)
        _kill(procs)
        return 1
    logger.info("node %d: tensor-parallel ranks of this node ready: %s (rendezvous %s)", args.node_rank,
                ", ".join(f"rank {r} pid {p.pid}" for r, p in procs.items()), spec.dist_init_addr)
    # A rank is alive while it beats; stopped or hung, it falls silent (rank 0 relays at least
    # a heartbeat every HEARTBEAT_S, and a collective waits at most dist_timeout).
    silent_limit = spec.dist_timeout + 2 * HEARTBEAT_S
    last = dict.fromkeys(procs, time.monotonic())
    beating = {c: r for r, c in conns.items()}
    while stop["signal"] is None:
        ready = wait([p.sentinel for p in procs.values()] + list(beating), timeout=0.5)
        if any(p.sentinel in ready for p in procs.values()):
            break
        for conn in [c for c in ready if c in beating]:
            try:
                while conn.poll():
                    conn.recv_bytes()
                    last[beating[conn]] = time.monotonic()
            except (EOFError, OSError):
                del beating[conn]  # the rank is exiting: its sentinel says so next
        silent = [r for r, t in last.items() if time.monotonic() - t > silent_limit]
        if silent:
            logger.error("node %d: tensor-parallel rank %d silent for %.0f s (stopped or hung); taking the node "
                         "down", args.node_rank, silent[0], silent_limit)
            _kill(procs)
            return 1
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


def _kill(procs: dict[int, mp.process.BaseProcess]) -> None:
    for p in procs.values():
        if p.is_alive():
            p.kill()
    for p in procs.values():
        p.join(5.0)
