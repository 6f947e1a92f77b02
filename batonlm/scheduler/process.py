"""Entry point of the scheduler process."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection

from batonlm import spawn
from batonlm.config import DEFAULT_CHUNK, ServerArgs
from batonlm.ipc import codec
from batonlm.ipc.messages import SchedulerFailed, SchedulerInfo
from batonlm.logging_setup import configure_logging

logger = logging.getLogger(__name__)


def chunked_prefill_size(flag: int | None, device: str) -> int | None:
    """The chunk size: the flag's, the device's default, or None (off) for a flag <= 0."""
    if flag is None:
        return DEFAULT_CHUNK["cuda" if device.startswith("cuda") else device]
    return flag if flag > 0 else None


def build_scheduler(args: ServerArgs, io, dp_rank: int = 0, dp_dir: str | None = None):  # -> (Scheduler, info)
    """Load the model onto its device (data-parallel replica `dp_rank`'s) and build a scheduler
    around `io`. With DP attention the replicas meet in `dp_dir`, a directory they share."""
    from batonlm.device.factory import create_device
    from batonlm.device.spec import device_spec, kv_pool_bytes
    from batonlm.model_runner.model_config import ModelConfig
    from batonlm.scheduler.scheduler import Scheduler, SchedulerConfig
    from batonlm.scheduler.speculative import SpecConfig
    from batonlm.settings import derive

    cfg = ModelConfig.from_hf(args.model, args.model_impl, args.quantization)
    spec = device_spec(args, cfg, dp_rank, dp_dir)
    device = create_device(spec)
    speculative = None
    if args.speculative_algorithm != "none":
        speculative = derive(SpecConfig, args, prefix="speculative_", draft_model=args.speculative_algorithm == "draft")
    config = derive(
        SchedulerConfig,
        args,
        vocab_size=cfg.vocab_size,
        context_length=spec.context_length,
        eos_token_ids=cfg.eos_token_ids,
        chunked_prefill_size=chunked_prefill_size(args.chunked_prefill_size, spec.device),
        tokenizer_path=args.tokenizer or cfg.path,
        dp_rank=dp_rank,
        speculative=speculative,
        long_rope_from=cfg.long_rope_from,
    )
    sched = Scheduler(io, device, config)
    if args.enable_dp_attention:
        from batonlm.scheduler.agreement import DPAttention
        from batonlm.scheduler.dp_sync import DPSync

        try:
            sched.agreement = DPAttention(DPSync(dp_rank, args.dp_size, f"file://{dp_dir}/dp-sync", args.dist_timeout),
                                          device)
        except BaseException:
            device.close()
            raise
    info = SchedulerInfo(
        model_path=cfg.path,
        context_length=spec.context_length,
        vocab_size=cfg.vocab_size,
        kv_capacity=spec.kv_capacity,
        kv_bytes=kv_pool_bytes(spec, cfg),
        device=spec.device,
        dtype=spec.dtype,
        overlap=not args.disable_overlap,
        model_impl=cfg.impl,
        embedding_only=cfg.embedding_only,
        hidden_size=cfg.hidden_size,
        quantization=cfg.quantization.description if cfg.quantization else "",
        worker_cpus=list(spec.worker_cpus),
    )
    return sched, info


# How often a starting scheduler looks whether the process that started it is still there.
PARENT_CHECK_S = 0.25


def _exit_with_parent_while_starting() -> None:
    """Loading the model and compiling the decode step take a while, and nothing else would
    notice a main process killed meanwhile (SIGKILL, or a SIGTERM to it alone): a thread
    watches it and ends this process (its device workers die with it). Once serving, the loop
    notices the parent is gone by itself (`SchedulerIO.orphaned`)."""
    parent = spawn.parent_pid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_CHECK_S)
        if not _started.is_set():
            logger.warning("the main process is gone: stopping the start-up")
            os._exit(1)

    threading.Thread(target=watch, name="batonlm-parent-watch", daemon=True).start()


_started = threading.Event()  # set once the scheduler is ready: the loop watches the parent from then on


def run_scheduler_process(
    args: ServerArgs, request_endpoint: str, output_endpoint: str, ready: Connection, dp_rank: int = 0,
    dp_dir: str | None = None,
) -> None:
    configure_logging(args.log_level, process="scheduler" if args.dp_size == 1 else f"scheduler-dp{dp_rank}")
    # The main process handles Ctrl-C and tells us to shut down; don't die halfway on SIGINT.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _exit_with_parent_while_starting()
    from batonlm.scheduler.io import ZmqSchedulerIO

    io = ZmqSchedulerIO(request_endpoint, output_endpoint)
    try:
        sched, info = build_scheduler(args, io, dp_rank, dp_dir)
    except Exception as e:
        logger.debug("scheduler start-up failed", exc_info=True)
        # Our own checks raise ValueErrors whose message says it all; name anything else.
        message = str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
        ready.send_bytes(codec.encode(SchedulerFailed(message)))
        io.close()
        sys.exit(1)
    signal.signal(signal.SIGTERM, lambda *_: setattr(sched, "_shutdown", True))
    from batonlm.device import cpu_affinity

    cpu_affinity.keep_off(info.worker_cpus)  # the worker's cores are its own
    _started.set()
    ready.send_bytes(codec.encode(info))
    ready.close()
    from batonlm.gc_tuning import tune_for_serving

    tune_for_serving()
    try:
        if args.disable_overlap:
            sched.event_loop_normal()
        else:
            sched.event_loop_overlap()
    except Exception as e:
        logger.error("scheduler failed: %s\n%s", e, traceback.format_exc())
        try:
            io.send(SchedulerFailed(f"{type(e).__name__}: {e}"))
        except Exception:
            pass
        sched.device.close()
        io.close()
        sys.exit(1)
    sched.device.close()
    sched.agreement.close()
    io.close()
    spawn.exit_child(0)
