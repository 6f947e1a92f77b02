"""`batonlm serve`: start the scheduler, then serve HTTP until told to stop or the scheduler dies."""

from __future__ import annotations

import asyncio
import errno
import importlib
import logging
import os
import signal
import socket
from pathlib import Path
from typing import Any

import uvicorn

from batonlm.config import ConfigError, ServerArgs
from batonlm.device import cpu_affinity
from batonlm.gc_tuning import tune_for_serving
from batonlm.launcher import SchedulerStartError, start_scheduler
from batonlm.logging_setup import configure_logging
from batonlm.process_tree import tree_rss
from batonlm.server.http_protocol import guarded_protocol
from batonlm.tokenizer_manager.manager import TokenizerManager
from batonlm.tokenizer_manager.tokenizer import TokenizerLoadError
from batonlm.version import __version__

logger = logging.getLogger("batonlm.serve")

KEEP_ALIVE_S = 30.0
GRACEFUL_MARGIN_S = 5.0


class DrainingServer(uvicorn.Server):
    """On SIGTERM or Ctrl-C, uvicorn stops accepting connections and waits for open ones; this
    also drains the requests: new ones get a 503, those in flight get `shutdown_timeout`
    seconds to finish, then end with an error (an error event on a stream, a 503 otherwise)."""

    def __init__(self, config: uvicorn.Config, manager: TokenizerManager, shutdown_timeout: float) -> None:
        super().__init__(config)
        self.manager = manager
        self.shutdown_timeout = shutdown_timeout
        self._drain: asyncio.Task | None = None

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self._drain is None:
            logger.info("shutting down: %d request(s) in flight get up to %.0f s to finish",
                        len(self.manager.states), self.shutdown_timeout)
            self._drain = asyncio.get_event_loop().create_task(self.manager.drain(self.shutdown_timeout))
            super().handle_exit(sig, frame)
            return
        # A second signal: end what still runs now. Not uvicorn's "force exit", which would skip
        # the app's shutdown (the scheduler's) and leave its task to be cancelled mid-way.
        if self.manager.states:
            logger.info("stopping now: %d request(s) in flight end with an error", len(self.manager.states))
        self._drain.cancel()
        self.manager.fail_all("the server is shutting down")


def raise_open_file_limit(wanted: int) -> None:
    """Each connection holds a file descriptor: raise the soft limit toward `wanted`."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        if soft != resource.RLIM_INFINITY and soft < target:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ImportError, ValueError, OSError) as e:  # not POSIX, or not allowed
        logger.warning("could not raise the open-file limit: %s", e)


class StartupError(RuntimeError):
    """A usual mistake at start-up; the message says what to do (no traceback needed)."""


class StopRequested(KeyboardInterrupt):
    """SIGTERM before the HTTP server runs (it handles signals itself from then on): the start
    stops as after Ctrl-C, its processes stopped with it."""


def _stop_requested(signum: int, frame: Any) -> None:
    raise StopRequested()


def resolve_model(model: str) -> str:
    """A local directory as is; a hub id (org/name) downloaded with huggingface_hub."""
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise StartupError(f"model directory {model!r} has no config.json")
        return str(path)
    looks_like_hub_id = model.count("/") == 1 and not model.startswith((".", "/", "~"))
    if not looks_like_hub_id:
        raise StartupError(f"model path {model!r} does not exist")
    try:
        from huggingface_hub import snapshot_download

        logger.info("downloading %s from the Hugging Face hub", model)
        return snapshot_download(
            model, allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"]
        )
    except Exception as e:
        offline = os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0")
        hint = " (HF_HUB_OFFLINE is set)" if offline else ""
        raise StartupError(
            f"model {model!r} is not a local directory and could not be fetched from the Hugging Face hub{hint}: "
            f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        ) from None


def check_device(args: ServerArgs) -> None:
    """Fail before loading anything when the device or dtype cannot work here."""
    if args.device != "cuda":
        return
    import torch

    if not torch.cuda.is_available():
        raise StartupError("--device cuda was given but no CUDA device is available (use --device cpu)")
    if args.dtype == "bfloat16" and not torch.cuda.is_bf16_supported():
        raise StartupError(f"{torch.cuda.get_device_name()} does not support bfloat16; use --dtype float16")


def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise StartupError(f"port {port} on {host} is already in use; choose another with --port") from None
        raise StartupError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    sock.set_inheritable(True)
    return sock


async def _serve(args: ServerArgs, sock: socket.socket) -> int:
    manager = TokenizerManager(args, None, start_scheduler)
    # The app's modules (fastapi and the API's models: ~0.7 s) load while the scheduler starts,
    # not after it is ready.
    app_modules = asyncio.create_task(asyncio.to_thread(importlib.import_module, "batonlm.server.app"))
    try:  # stopped before serving (a signal, an error): the scheduler(s) go too
        info = await manager.start_with_tokenizer()
        await app_modules
        server, sched_died = _http_server(args, manager)
        tune_for_serving()  # start-up is done
        # Listening from the ready line on (refused while loading): a client that connects before
        # uvicorn's loop runs waits in the backlog.
        sock.listen(2048)
        cpu_affinity.keep_off(info.worker_cpus)  # the device worker's cores are its own
        _log_ready(args, info, sock)
        # From here uvicorn's handlers take SIGINT/SIGTERM (from the start of server.serve), and
        # re-raise them after its graceful shutdown into the handlers it found: those only
        # record, so a requested shutdown exits 0. A signal that lands before uvicorn's handlers
        # are in place is recorded too, and handed to uvicorn as soon as they are.
        requested: list[int] = []
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda signum, _frame: requested.append(signum))
    except BaseException as e:
        await manager.shutdown()
        if isinstance(e, SchedulerStartError):
            raise StartupError(f"the model could not be started: {e}") from None
        raise
    asyncio.get_running_loop().call_soon(lambda: requested and server.handle_exit(requested[0], None))
    await server.serve(sockets=[sock])
    code = 1 if sched_died() else 0
    logger.info("batonlm stopped (exit code %d)", code)
    return code


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _log_ready(args: ServerArgs, info: Any, sock: socket.socket) -> None:
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    scale = "".join((f", tp {args.tp_size}" if args.tp_size > 1 else "",
                     f", {args.nnodes} nodes" if args.nnodes > 1 else "",
                     f", dp {args.dp_size}" if args.dp_size > 1 else "",
                     " with DP attention" if args.enable_dp_attention else "",
                     f", speculative {args.speculative_algorithm}" if args.speculative_algorithm != "none" else "",
                     f", {args.kv_cache_dtype} KV cache" if args.kv_cache_dtype != "auto" else ""))
    # The KV pool per device, and what the server's processes hold now (on the CPU the pool's
    # pages count only once written: a fresh server's RSS is mostly weights and libraries).
    kv = f" in {_size(info.kv_bytes)}" if info.kv_bytes else ""
    rss = tree_rss()
    held = f"; {_size(rss[0])} resident in {rss[1]} processes" if rss else ""
    logger.info(
        "batonlm ready on http://%s:%d (model %s, %s, %s, %d KV slots%s%s, %s loop%s%s)",
        shown, port, args.model_name + (" on transformers' modeling code" if info.model_impl == "transformers" else ""),
        info.device, info.dtype + (f", {info.quantization} weights" if info.quantization else ""), info.kv_capacity,
        " per replica" if args.dp_size > 1 else "", kv, "overlap" if info.overlap else "normal", scale, held,
    )


def _http_server(args: ServerArgs, manager: TokenizerManager):
    """The app and its uvicorn server around a started manager, and a function saying whether
    the scheduler died (the server then stops and exits 1)."""
    from batonlm.server.app import create_app

    app = create_app(args, manager)
    config = uvicorn.Config(
        app, log_level="warning", access_log=False, lifespan="on",
        http=guarded_protocol(args.client_timeout, args.max_connections),
        # uvicorn annotates these two int; it hands them to asyncio timers, which take seconds as floats.
        timeout_keep_alive=min(KEEP_ALIVE_S, args.client_timeout),  # type: ignore[arg-type]
        # A backstop: the drain below ends every request within shutdown_timeout.
        timeout_graceful_shutdown=args.shutdown_timeout + GRACEFUL_MARGIN_S,  # type: ignore[arg-type]
    )
    server = DrainingServer(config, manager, args.shutdown_timeout)
    died = False

    def on_scheduler_death() -> None:
        nonlocal died
        died = True
        server.should_exit = True

    manager.on_scheduler_death = on_scheduler_death
    manager.link.on_stop = lambda: setattr(server, "should_exit", True)
    return server, lambda: died


def serve(args: ServerArgs) -> int:
    """Run the server; returns the process exit code."""
    configure_logging(args.log_level)
    if args.node_rank > 0:  # a node that only runs tensor-parallel ranks: no HTTP
        from batonlm.device.node_ranks import run_node

        try:
            check_device(args)
            return run_node(args.replace(model=resolve_model(args.model)))
        except (StartupError, ConfigError, ValueError) as e:
            logger.error("%s", e)
            return 2
        except KeyboardInterrupt:
            return 130
    # Until the HTTP server handles the signals: SIGINT and SIGTERM stop the start (the scheduler
    # and its workers are stopped with it), and a requested stop exits 0. (SIGINT had asyncio's
    # handler, which cancels the main task: a cancel landing in uvicorn's start-up is the likely
    # cause of a --tp 2 start that ignored its SIGINT once in the signal matrix.)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _stop_requested)
    try:
        logger.info("batonlm %s starting: model %s, %s device", __version__, args.model, args.device)
        check_device(args)
        model = resolve_model(args.model)
        if model != args.model:
            args = args.replace(model=model, served_model_name=args.served_model_name or args.model)
        args = args.replace(api_key=args.resolved_api_key(), api_key_file=None)
        raise_open_file_limit(args.max_connections + 256)
        sock = bind_socket(args.host, args.port)
        return asyncio.run(_serve(args, sock))
    except (StartupError, TokenizerLoadError, ConfigError) as e:
        logger.error("%s", e)
        return 2
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM while starting
        logger.info("batonlm stopped while starting (exit code 0)")
        return 0
