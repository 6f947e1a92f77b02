"""`batonlm.Engine`: the whole engine in-process, with a blocking Python API.

The scheduler runs in its own process exactly as under the server; this object plays the
frontend, running the TokenizerManager on an asyncio loop in a background thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from collections.abc import Iterator
from typing import Any

from batonlm.config import EMBEDDED_MODEL, ConfigError, ServerArgs
from batonlm.launcher import start_scheduler
from batonlm.pooling import finish_vector, pooling_of
from batonlm.request_checks import RequestRejected
from batonlm.sampling_params import SamplingParams
from batonlm.tokenizer_manager.manager import TokenizerManager
from batonlm.tokenizer_manager.request_state import GenerationChunk

_DONE = object()


class Engine:
    """Load a model (the embedded stories260K when `model` is None) and generate from it.

    Server arguments are `batonlm.config.ServerArgs` fields, e.g. `disable_overlap=True`,
    `max_running_requests=64`, `max_total_tokens=100_000`, `dtype="float32"`, `device="cpu"`.
    """

    def __init__(self, model: str | None = None, **server_args: Any) -> None:
        self.args = ServerArgs.from_kwargs(model=model or EMBEDDED_MODEL, **server_args)
        if self.args.node_rank > 0:
            raise ConfigError("node_rank", "a node other than 0 only runs ranks: start it with `batonlm serve "
                              "--node-rank K`; the Engine is node 0")
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="batonlm-engine-loop", daemon=True)
        self._thread.start()
        self._manager = TokenizerManager(self.args, None, start_scheduler)
        try:
            self.info = self._call(self._manager.start_with_tokenizer())
        except BaseException:
            with contextlib.suppress(Exception):  # the start's own error is the one to raise
                self._call(self._manager.shutdown())
            self._stop_loop()
            raise
        self.tokenizer = self._manager.tokenizer
        self._closed = False

    # ------------------------------------------------------------------ plumbing
    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10.0)

    def _prepare(
        self,
        prompt: str | list[str] | None,
        input_ids: list[int] | list[list[int]] | None,
        sampling_params: dict | list[dict] | None,
    ) -> tuple[bool, list[list[int]], list[SamplingParams]]:
        if (prompt is None) == (input_ids is None):
            raise ValueError("give exactly one of prompt and input_ids")
        if prompt is not None:
            single = isinstance(prompt, str)
            prompts = [prompt] if isinstance(prompt, str) else list(prompt)
            if not all(isinstance(p, str) for p in prompts):
                raise ValueError("prompt must be a string or a list of strings")
            ids = [self._manager.tokenize(p) for p in prompts]
        else:
            assert input_ids is not None  # exactly one of the two is given (checked above)
            single = not input_ids or isinstance(input_ids[0], int)
            rows: list[Any] = [input_ids] if single else input_ids  # a caller's lists, checked just below
            ids = [list(x) for x in rows]
            if not all(isinstance(t, int) and not isinstance(t, bool) for x in ids for t in x):
                raise ValueError("input_ids must be a list of ints or a list of lists of ints")
        if isinstance(sampling_params, list):
            if len(sampling_params) != len(ids):
                raise ValueError(f"{len(sampling_params)} sampling_params for {len(ids)} prompts")
            params = [SamplingParams.from_dict(p) for p in sampling_params]
        else:
            params = [SamplingParams.from_dict(sampling_params)] * len(ids)
        for i, (x, p) in enumerate(zip(ids, params)):
            try:
                self._manager.validate_prompt(x, p)
            except ValueError as e:
                raise RequestRejected(f"prompt {i}: {e}") from None
        return single, ids, params

    def _check_generates(self) -> None:
        info = self._manager.info
        if info is not None and info.embedding_only:
            raise ValueError(f"{info.model_path} is an embedding model (its checkpoint has no LM head): use embed()")

    # ------------------------------------------------------------------ API
    def generate(
        self,
        prompt: str | list[str] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        sampling_params: dict | list[dict] | None = None,
    ) -> dict | list[dict]:
        """Generate to completion. One prompt gives one dict, a list gives a list of dicts with
        `text`, `output_ids`, `finish_reason`, `prompt_tokens`, `completion_tokens`."""
        self._check_generates()
        single, ids, params = self._prepare(prompt, input_ids, sampling_params)

        async def one(x: list[int], p: SamplingParams) -> dict:
            result: dict[str, Any] = {"text": "", "output_ids": [], "finish_reason": None, "prompt_tokens": len(x),
                                      "completion_tokens": 0}
            async for chunk in self._manager.generate(x, p):
                _merge(result, chunk)
            return result

        async def run() -> list[dict]:
            return list(await asyncio.gather(*(one(x, p) for x, p in zip(ids, params))))

        results = self._call(run())
        return results[0] if single else results

    def embed(
        self,
        prompt: str | list[str] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        pooling: str | None = None,
        normalize: bool = True,
        dimensions: int | None = None,
    ) -> list[float] | list[list[float]]:
        """Embeddings: each prompt's last hidden states pooled (`pooling` "last" or "mean"; None:
        the server argument `pooling`), its first `dimensions` values kept, L2-normalised unless
        `normalize` is False. One prompt gives one vector, a list a list of vectors."""
        if pooling is not None and pooling not in ("last", "mean"):
            raise ValueError(f"pooling must be last or mean, got {pooling!r}")
        mode = pooling_of(pooling or self.args.pooling, self._manager.info.model_path if self._manager.info else "")
        single, ids, params = self._prepare(prompt, input_ids, {"max_new_tokens": 1, "temperature": 0.0})

        async def one(x: list[int], p: SamplingParams) -> list[float]:
            vector: list[float] | None = None
            async for chunk in self._manager.generate(x, p, pooling=mode):
                vector = chunk.embedding if chunk.embedding is not None else vector
                if chunk.error:
                    raise RequestRejected(chunk.error)
            assert vector is not None  # the scheduler sends it with the request's output
            return finish_vector(vector, dimensions, normalize).tolist()

        async def run() -> list[list[float]]:
            return list(await asyncio.gather(*(one(x, p) for x, p in zip(ids, params))))

        vectors = self._call(run())
        return vectors[0] if single else vectors

    def generate_stream(
        self,
        prompt: str | list[str] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        sampling_params: dict | list[dict] | None = None,
    ) -> Iterator[dict]:
        """Yield chunks as they are produced: `index` (the prompt's), `text` and `output_ids`
        (what is new), `finish_reason` (set on a prompt's last chunk). Stopping the iteration
        early aborts the unfinished requests."""
        self._check_generates()
        _, ids, params = self._prepare(prompt, input_ids, sampling_params)
        out: queue.Queue = queue.Queue()

        async def one(i: int, x: list[int], p: SamplingParams) -> None:
            async for chunk in self._manager.generate(x, p):
                out.put({"index": i, "text": chunk.text, "output_ids": chunk.token_ids,
                         "finish_reason": chunk.finish_reason, **({"error": chunk.error} if chunk.error else {})})

        async def run() -> None:
            try:
                await asyncio.gather(*(one(i, x, p) for i, (x, p) in enumerate(zip(ids, params))))
            except BaseException as e:
                out.put(e)
                raise
            finally:
                out.put(_DONE)

        fut = asyncio.run_coroutine_threadsafe(run(), self._loop)
        try:
            while (item := out.get()) is not _DONE:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            if not fut.done():
                fut.cancel()  # cancels each request's stream, which aborts it

    def get_stats(self) -> dict:
        """Scheduler counters: running/waiting requests, KV and request slots in use."""
        import msgspec

        return msgspec.structs.asdict(self._call(self._manager.get_stats()))

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._call(self._manager.shutdown())
        finally:
            self._stop_loop()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            try:
                self.shutdown()
            except Exception:
                pass


def _merge(result: dict, chunk: GenerationChunk) -> None:
    result["text"] += chunk.text
    result["output_ids"].extend(chunk.token_ids)
    result["completion_tokens"] = chunk.completion_tokens
    if chunk.finish_reason is not None:
        result["finish_reason"] = chunk.finish_reason
        if chunk.error:
            result["error"] = chunk.error
