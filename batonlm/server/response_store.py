"""Stored responses of the Responses API: a bounded in-memory map (least recently used out
first, `--responses-store-size`), per server process. A stored response keeps its answer and the
conversation through it, so that `previous_response_id` continues it; a background response
also keeps the task computing it, so that it can be cancelled."""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any


@dataclass
class StoredResponse:
    body: dict[str, Any]  # the response object, as GET /v1/responses/{id} answers it
    # The conversation through this response's output, as chat messages (instructions apart:
    # a response continuing this one gives its own).
    messages: list[dict[str, Any]] = field(default_factory=list)
    input_items: list[dict[str, Any]] = field(default_factory=list)  # this request's input, as items
    task: asyncio.Task | None = None  # a background response's, until it ends


class ResponseStore:
    def __init__(self, size: int) -> None:
        self.size = size
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, rid: str, entry: StoredResponse) -> None:
        self._items[rid] = entry
        self._items.move_to_end(rid)
        while len(self._items) > self.size:
            _, old = self._items.popitem(last=False)
            if old.task is not None:  # a background response pushed out is no longer reachable
                old.task.cancel()

    def get(self, rid: str) -> StoredResponse | None:
        entry = self._items.get(rid)
        if entry is not None:
            self._items.move_to_end(rid)
        return entry

    def delete(self, rid: str) -> bool:
        entry = self._items.pop(rid, None)
        if entry is not None and entry.task is not None:
            entry.task.cancel()
        return entry is not None
