"""`batonlm serve`: start the scheduler, then serve HTTP until told to stop or the scheduler dies."""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import signal
import socket
from pathlib import Path

import uvicorn

from batonlm.config import ServerArgs
from batonlm.launcher import SchedulerStartError, start_scheduler
from batonlm.logging_setup import configure_logging
from batonlm.tokenizer_manager.manager import TokenizerManager
from batonlm.tokenizer_manager.tokenizer import TokenizerLoadError, load_tokenizer

logger = logging.getLogger("batonlm.serve")

GRACEFUL_SHUTDOWN_S = 3.0


class StartupError(RuntimeError):
    """A usual mistake at start-up; the message says what to do (no traceback needed)."""


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
    sock = socket.socket(family, socket.SOCK_STREAM)
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


async def _serve(args: ServerArgs, sock: socket.socket, tokenizer) -> int:
    from batonlm.server.app import create_app

    manager = TokenizerManager(args, tokenizer, start_scheduler)
    try:
        info = await manager.start()
    except SchedulerStartError as e:
        await manager.shutdown()
        raise StartupError(f"the model could not be started: {e}") from None
    app = create_app(args, manager)
    config = uvicorn.Config(
        app, log_level="warning", access_log=False, lifespan="on", timeout_keep_alive=30,
        # Open streams get this long to finish when shutting down (they end at once when the
        # scheduler is gone: every request has already failed).
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
    )
    server = uvicorn.Server(config)
    exit_code = 0

    def on_scheduler_death() -> None:
        nonlocal exit_code
        exit_code = 1
        server.should_exit = True

    manager.on_scheduler_death = on_scheduler_death
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    logger.info(
        "batonlm ready on http://%s:%d (model %s, %s, %s, %d KV slots, %s loop)",
        shown, port, args.model_name, info.device, info.dtype, info.kv_capacity,
        "overlap" if info.overlap else "normal",
    )
    # uvicorn re-raises SIGINT/SIGTERM after its graceful shutdown, with the handlers found
    # before it started: make those no-ops so a requested shutdown exits with code 0.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    await server.serve(sockets=[sock])
    return exit_code


def serve(args: ServerArgs) -> int:
    """Run the server; returns the process exit code."""
    configure_logging(args.log_level)
    try:
        check_device(args)
        model = resolve_model(args.model)
        if model != args.model:
            args = args.replace(model=model, served_model_name=args.served_model_name or args.model)
        sock = bind_socket(args.host, args.port)
        tokenizer = load_tokenizer(args.tokenizer or args.model)
        return asyncio.run(_serve(args, sock, tokenizer))
    except (StartupError, TokenizerLoadError) as e:
        logger.error("%s", e)
        return 2
    except KeyboardInterrupt:
        return 130
