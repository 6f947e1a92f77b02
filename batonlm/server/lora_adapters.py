"""LoRA adapters in the frontend: which adapter a request's `model` names (its slot, and which
load of it: `key`), and loading and unloading at run time (vLLM's routes):

* `POST /v1/load_lora_adapter` `{"lora_name", "lora_path"}`: a PEFT directory, checked here (its
  config, rank, target modules and tensor shapes), held by every replica, up to
  `--max-loaded-loras` adapters;
* `POST /v1/unload_lora_adapter` `{"lora_name"}`: refused while requests of the adapter run (a
  400 saying how many); its room is free for the next load.

Each load has its own key: the prefix cache keeps an adapter's KV under it, the scheduler puts
it in a device slot by it (batonlm/scheduler/lora_slots.py), and a request that named an adapter
unloaded before it reached the scheduler is refused there, never run on other weights."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse
from pydantic import Field

from batonlm.config import ServerArgs
from batonlm.ipc.messages import LoadLoRARequest, UnloadLoRARequest
from batonlm.server.errors import APIError, bad_request, model_not_found
from batonlm.server.protocol import _Strict
from batonlm.server.state import server_state

router = APIRouter()


@dataclass(frozen=True)
class Adapter:
    name: str
    path: str
    key: int  # which load (--lora-paths: 1, 2, ... in order; run-time loads after them)


class AdapterRegistry:
    """The served adapters by name, up to `--max-loaded-loras` of them."""

    def __init__(self, args: ServerArgs) -> None:
        self.limit = args.lora_pool
        self.by_name = {name: Adapter(name, path, key) for key, (name, path) in enumerate(args.lora_adapters, start=1)}
        self.next_key = len(self.by_name) + 1
        self.loading: set[str] = set()  # names being loaded

    def has_room(self) -> bool:
        return len(self.by_name) + len(self.loading) < self.limit

    def unload(self, name: str, running: Callable[[int], int]) -> Adapter:
        """Forget an adapter (its slot is free again); a 404 for an unknown name, a 400 while
        `running(key)` of its requests run."""
        adapter = self.by_name.get(name)
        if adapter is None:
            raise model_not_found(name, "lora_name")
        n = running(adapter.key)
        if n:
            raise bad_request(f"LoRA adapter {name!r} has {n} request(s) running: unload it when they finish",
                              param="lora_name", code="adapter_in_use")
        return self.by_name.pop(name)


class LoadLoRAAdapter(_Strict):
    lora_name: Annotated[str, Field(min_length=1, max_length=256)]
    lora_path: Annotated[str, Field(min_length=1)]


class UnloadLoRAAdapter(_Strict):
    lora_name: Annotated[str, Field(min_length=1, max_length=256)]


@router.post("/v1/load_lora_adapter", response_class=PlainTextResponse)
async def load_lora_adapter(request: Request) -> str:
    from batonlm.model_runner.lora import LoRAError, check_adapter, read_adapter
    from batonlm.model_runner.model_config import ModelConfig
    from batonlm.tokenizer_manager.offload import maybe_offload

    state = server_state(request)
    req = await state.read(request, LoadLoRAAdapter)
    state.check_healthy()
    registry, name = state.adapters, req.lora_name
    if not registry.limit:
        raise bad_request("LoRA is off: start the server with --lora-paths or --max-loaded-loras", param="lora_name")
    if name in (state.model_name, state.args.model) or name in registry.by_name or name in registry.loading:
        raise bad_request(f"a model named {name!r} is already served", param="lora_name", code="already_loaded")
    info = state.manager.info
    assert info is not None  # healthy

    def check() -> None:
        check_adapter(read_adapter(name, req.lora_path, state.args.max_lora_rank), ModelConfig.from_hf(info.model_path))

    try:
        await maybe_offload(1 << 30, "text", check)  # reads the adapter's files: off the event loop
    except LoRAError as e:
        raise bad_request(str(e), param="lora_path") from None
    if not registry.has_room():
        raise bad_request(f"{registry.limit} LoRA adapters (--max-loaded-loras) are loaded: unload one first",
                          param="lora_name", code="too_many_adapters")
    key, registry.next_key = registry.next_key, registry.next_key + 1
    registry.loading.add(name)
    try:
        result = await state.manager.update_lora(LoadLoRARequest(key, name, req.lora_path))
    finally:
        registry.loading.discard(name)
    if not result.ok:
        raise APIError(500, f"LoRA adapter {name!r} could not be loaded: {result.message}", type="server_error")
    registry.by_name[name] = Adapter(name, req.lora_path, key)
    return f"Success: LoRA adapter '{name}' added successfully."


@router.post("/v1/unload_lora_adapter", response_class=PlainTextResponse)
async def unload_lora_adapter(request: Request) -> str:
    state = server_state(request)
    req = await state.read(request, UnloadLoRAAdapter)
    registry, name = state.adapters, req.lora_name
    if name in (state.model_name, state.args.model):
        raise bad_request("the base model cannot be unloaded", param="lora_name")
    adapter = registry.unload(name, lambda key: state.manager.lora_inflight.get(key, 0))
    result = await state.manager.update_lora(UnloadLoRARequest(adapter.key))
    if not result.ok:
        raise APIError(500, f"LoRA adapter {name!r} could not be unloaded: {result.message}", type="server_error")
    return f"Success: LoRA adapter '{name}' removed successfully."
