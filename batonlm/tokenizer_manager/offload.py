"""Work too heavy for the main process's event loop, run in bounded thread pools of its own.

The event loop serves every stream: a request that makes it compute for a second stalls every
other client for that second. Tokenizing and rendering long inputs, checking large constraints
and serialising large answers run here instead, in small pools owned by batonlm (not asyncio's
default executor, which anything may fill). Each kind of work has its own pool, so that slow
constraint checks cannot hold up tokenization. Fast tokenizers and orjson release the GIL;
pure-Python work (jinja templates) shares it, yet the loop keeps its turn every few ms.

Small inputs are handled inline: a thread hop costs more than they do.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")

# kind -> threads. "text": tokenizing, detokenizing, chat templates, answers' serialisation;
# "constraint": parsing JSON schemas, regexes and grammars (the scheduler compiles them).
POOL_SIZES = {"text": 2, "constraint": 2}
INLINE_CHARS = 8192  # inputs up to this size are handled on the loop


@functools.cache
def _pool(kind: str) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=POOL_SIZES[kind], thread_name_prefix=f"batonlm-{kind}")


async def offload(kind: str, fn: Callable[..., T], *args) -> T:
    """`fn(*args)` in the `kind` pool, awaited."""
    return await asyncio.get_running_loop().run_in_executor(_pool(kind), functools.partial(fn, *args))


async def maybe_offload(size: int, kind: str, fn: Callable[..., T], *args) -> T:
    """`fn(*args)` inline when `size` (characters, tokens, items: what the work scales with)
    is small, else in the `kind` pool."""
    if size <= INLINE_CHARS:
        return fn(*args)
    return await offload(kind, fn, *args)
