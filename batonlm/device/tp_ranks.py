"""The loops of device worker processes: rank 0 serves the scheduler's pipe (and relays every
message to the other tensor-parallel ranks); the other ranks follow the relay.

Every rank executes every launch in the same order: the forward's collectives pair up because
they depend only on the relayed launch. Rank 0 alone answers the scheduler. Any failure — a
batch that raises, a collective that times out (a rank stopped) or breaks (a rank gone) — ends
the rank with exit code 1; the scheduler (or a node's supervisor) then takes the group down.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
import traceback
from multiprocessing.connection import Connection

import msgspec

from batonlm.device.base import host_result
from batonlm.device.batch_executor import BatchExecutor
from batonlm.device.spec import DeviceSpec
from batonlm.distributed.divergence import DivergenceCheck
from batonlm.distributed.group import TPGroup, TPGroupError
from batonlm.distributed.relay import HEARTBEAT_S, LaunchRelay
from batonlm.ipc import codec
from batonlm.ipc.device_messages import (
    BatchLaunch,
    IdleLaunch,
    LoRAMessage,
    SampleLaunch,
    WorkerAlive,
    WorkerFailed,
    WorkerShutdown,
)

logger = logging.getLogger(__name__)


def join_group(spec: DeviceSpec, rank: int) -> tuple[TPGroup, LaunchRelay, DeviceSpec]:
    """Rendezvous with the other ranks; rank 0's DeviceSpec becomes every rank's (a node started
    on its own, with other memory, must still build the same KV pool), less what is per node."""
    tp = TPGroup.init(rank, spec.tp_size, spec.dist_init_addr, spec.dist_timeout, spec.rank_device(rank))
    relay = LaunchRelay(tp)
    if rank == 0:
        relay.send(json.dumps(dataclasses.asdict(spec)).encode())
        return tp, relay, spec
    data = relay.recv()
    assert data is not None
    root = json.loads(data)
    # Paths and threads are this node's own (a model directory may sit elsewhere on each node).
    root.update(local_ranks=spec.local_ranks, cpu_threads=spec.cpu_threads, model_path=spec.model_path,
                draft_model_path=spec.draft_model_path, compile_cache_dir=spec.compile_cache_dir)
    root["local_ranks"] = tuple(root["local_ranks"])
    return tp, relay, DeviceSpec(**root)


def _execute(executor: BatchExecutor, msg: object, check: DivergenceCheck | None):
    """Run one launch; the result on the host (None: sampling delayed)."""
    if isinstance(msg, BatchLaunch):
        out = executor.run(msg)
        lengths = [p + e for p, e in zip(msg.prefix_lens, msg.extend_lens)]
    elif isinstance(msg, SampleLaunch):
        out, lengths = executor.sample_delayed(msg), []
    elif isinstance(msg, IdleLaunch):
        executor.run_idle(msg)
        return None
    elif isinstance(msg, LoRAMessage):
        executor.runner.update_lora(msg)
        return None
    else:
        raise TypeError(f"unexpected message {type(msg).__name__}")
    if out is None:
        return None
    res = host_result(out, msg.batch_id)
    if check is not None:
        check.after(msg.batch_id, lengths, res.token_ids, res.accepted)
    return res


def _check(spec: DeviceSpec, tp: TPGroup | None) -> DivergenceCheck | None:
    return DivergenceCheck(tp, spec.debug_tp_check_every) if tp is not None and spec.debug_tp_check_every else None


def serve_root(conn: Connection, executor: BatchExecutor, relay: LaunchRelay | None, spec: DeviceSpec) -> bool:
    """Rank 0 (or the only worker): execute the scheduler's messages until it shuts us down.
    Returns False when the worker stops on a failure (reported to the scheduler first)."""
    check = _check(spec, relay.tp if relay else None)
    batch_id = -1
    while True:
        try:
            if relay is not None and not conn.poll(HEARTBEAT_S):
                relay.heartbeat()
                continue
            data = conn.recv_bytes()
        except (EOFError, OSError):
            return True  # the scheduler is gone
        except TPGroupError as e:  # a heartbeat failed: another rank is gone or stopped
            logger.error("%s", e)
            return _fail(conn, -1, str(e))
        msg = codec.decode(data)
        t0 = time.perf_counter()
        try:
            if relay is not None:
                relay.send(data)
            if isinstance(msg, WorkerShutdown):
                return True
            batch_id = getattr(msg, "batch_id", batch_id)
            res = _execute(executor, msg, check)
        except TPGroupError as e:
            logger.error("%s", e)
            return _fail(conn, batch_id, str(e))
        except Exception as e:
            # The traceback goes to this process's log; the scheduler gets one line.
            logger.error("batch %s failed on the device:\n%s", batch_id, traceback.format_exc())
            return _fail(conn, batch_id, f"{type(e).__name__}: {e}")
        if res is not None:
            conn.send_bytes(codec.encode(msgspec.structs.replace(res, compute_s=time.perf_counter() - t0)))


def _fail(conn: Connection, batch_id: int, message: str) -> bool:
    try:
        conn.send_bytes(codec.encode(WorkerFailed(batch_id, message)))
    except OSError:
        pass
    return False


def follow(executor: BatchExecutor, relay: LaunchRelay, spec: DeviceSpec, supervisor: Connection | None) -> bool:
    """A rank other than 0: execute what rank 0 relays until it relays the shutdown. With a
    `supervisor` (a node other than 0), tell it at most every HEARTBEAT_S that this rank is alive."""
    check = _check(spec, relay.tp)
    last_beat = 0.0
    while True:
        try:
            data = relay.recv()
            if supervisor is not None and time.monotonic() - last_beat >= HEARTBEAT_S:
                supervisor.send_bytes(codec.encode(WorkerAlive()))
                last_beat = time.monotonic()
            if data is None:
                continue
            msg = codec.decode(data)
            if isinstance(msg, WorkerShutdown):
                return True
            _execute(executor, msg, check)
        except TPGroupError as e:
            logger.error("tensor-parallel rank %d stops: %s", relay.tp.rank, e)
            return False
        except Exception:
            logger.error("tensor-parallel rank %d stops:\n%s", relay.tp.rank, traceback.format_exc())
            return False
