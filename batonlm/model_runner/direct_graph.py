"""The compiled decode step's graphs, called without dynamo once they are built.

Entering a `torch.compile`d function costs dynamo's frame evaluation, its cache lookup and
guards, and the wrappers that keep dynamo off inside the graph: 0.14 ms of stories260K's
one-row step of 0.36 ms, measured by calling the same graph both ways. A decode step knows its
graphs in advance (one per batch range and variant, compiled by CompiledDecode.prepare) and
makes their inputs the same way every step, so once they are compiled it calls inductor's
compiled graph itself, with the arguments dynamo would pass:

* the step's own inputs, `packed` and `key_pos`, and their sizes (batch, context width): per call;
* everything the graph reads through the step's module (parameters, the KV pool, the
  req-to-token table, LoRA slots, and their sizes), as dynamo passed them at the graph's first
  call: the same objects for the life of the step (written in place, never replaced).

A graph whose arguments come from anywhere else, or whose frame returns more than the graph's
one output, stays behind dynamo (`DirectGraph.callable`).

Sizes go in as 0-dim int64 tensors, made once per value: the C++ wrapper (`cpp_wrapper`) hands
its graph every argument as a tensor, and would otherwise make one from each int at every call
(13 on stories260K, 0.05 ms a step). `check` runs the graph both ways once and keeps ints where
the results differ.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch

# The decode step's entry points take (self, packed, key_pos): dynamo names their sources so.
_PER_CALL = re.compile(r"^L\['(packed|key_pos)'\](?:\.size\(\)\[(\d+)\])?$")
_OF_THE_MODULE = "L['self']"


class DirectGraph:
    """One compiled graph: dynamo calls it while it is compiled and warmed up (the first call's
    arguments are kept), the step calls `run` afterwards."""

    def __init__(self, gm: torch.fx.GraphModule, example_inputs: list[Any], compiled: Callable[..., Any],
                 sizes_as_tensors: bool = False) -> None:
        self.compiled = compiled
        self.args: list[Any] | None = None
        self.sizes_as_tensors = sizes_as_tensors
        self._sizes: dict[int, torch.Tensor] = {}
        # (argument position, "packed" or "key_pos", the size's dim or None for the tensor itself)
        self._per_call: list[tuple[int, str, int | None]] = []
        self.packed_shape: tuple[int, ...] | None = None
        self.callable = True
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        for at, (node, example) in enumerate(zip(placeholders, example_inputs)):
            grapharg = node.meta.get("grapharg")
            name = getattr(getattr(grapharg, "source", None), "name", None)
            name = name() if callable(name) else name  # a method in older torch
            if not isinstance(name, str):
                self.callable = False
                continue
            if m := _PER_CALL.match(name):
                self._per_call.append((at, m.group(1), None if m.group(2) is None else int(m.group(2))))
                if m.group(1) == "packed" and m.group(2) is None and isinstance(example, torch.Tensor):
                    self.packed_shape = tuple(example.shape)
            elif not name.startswith(_OF_THE_MODULE):
                self.callable = False
        outputs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
        if self.packed_shape is None or not isinstance(outputs, (tuple, list)) or len(outputs) != 1:
            self.callable = False

    def __call__(self, *args: Any) -> Any:
        if self.args is None:
            self.args = list(args)
        return self.compiled(*args)

    def _size(self, n: int) -> int | torch.Tensor:
        if not self.sizes_as_tensors:
            return n
        t = self._sizes.get(n)
        if t is None:
            t = self._sizes[n] = torch.tensor(n, dtype=torch.int64)
        return t

    def check(self) -> None:
        """Run the graph on its first call's arguments as dynamo passed them and as `run`
        passes them (the sizes as tensors): where the two differ, or the second fails, sizes go
        in as ints."""
        assert self.args is not None
        if not self.sizes_as_tensors:
            return
        given = list(self.args)
        expected = self.compiled(*given)[0]
        self.args = [self._size(a) if isinstance(a, int) else a for a in given]
        try:
            same = torch.equal(self.compiled(*self.args)[0], expected)
        except Exception:  # noqa: BLE001 - a wrapper that wants its ints: keep them
            same = False
        if not same:
            self.sizes_as_tensors, self.args = False, given

    def run(self, packed: torch.Tensor, key_pos: torch.Tensor) -> torch.Tensor:
        args = self.args
        assert args is not None, "a graph runs directly after dynamo has called it once"
        for at, name, dim in self._per_call:
            value = packed if name == "packed" else key_pos
            args[at] = value if dim is None else self._size(value.shape[dim])
        return self.compiled(*args)[0]


class GraphCapture:
    """A torch.compile backend: inductor (`options` as its config patches, as torch.compile's
    own inductor backend passes them), each compiled graph kept as a DirectGraph."""

    def __init__(self, options: dict[str, Any]) -> None:
        self.options = options
        self.graphs: list[DirectGraph] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> DirectGraph:
        from torch._inductor.compile_fx import compile_fx

        compiled = compile_fx(gm, example_inputs, config_patches=self.options)
        assert callable(compiled)  # compile_fx's other results are for its export modes
        graph = DirectGraph(gm, example_inputs, compiled, sizes_as_tensors=bool(self.options.get("cpp_wrapper")))
        self.graphs.append(graph)
        return graph

    def direct(self, rows: int) -> dict[bool, DirectGraph]:
        """The graphs of `rows`-row packed inputs that can run directly, by whether they are the
        one-row graph: only where dynamo built exactly one graph for it (more would mean it
        chooses between them by guards)."""
        by_kind: dict[bool, list[DirectGraph]] = {}
        for g in self.graphs:
            if g.packed_shape is not None and g.packed_shape[0] == rows:
                by_kind.setdefault(g.packed_shape[1] == 1, []).append(g)
        direct = {one: gs[0] for one, gs in by_kind.items()
                  if len(gs) == 1 and gs[0].callable and gs[0].args is not None}
        for g in direct.values():
            g.check()
        return direct
