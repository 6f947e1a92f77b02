"""Tool calling in /v1/chat/completions: what a request's tools mean for its prompt, its
constraint and its answer (message.tool_calls, streamed delta.tool_calls, finish_reason
"tool_calls"), in OpenAI's shapes."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from batonlm.sampling_params import SamplingParams
from batonlm.server.errors import bad_request
from batonlm.server.openai_common import check_constraint_param
from batonlm.server.protocol import ChatCompletionRequest, NamedToolChoice
from batonlm.server.reasoning import ReasoningStream, split_reasoning
from batonlm.tokenizer_manager.stop_strings import StopStringMatcher
from batonlm.tool_calls.forced import CallsBudget, forced_schema, parse_forced, partial_forced
from batonlm.tool_calls.parser import ToolCall, ToolCallParser, ToolSchemas
from batonlm.tool_calls.streaming import CallDelta, IncrementalCalls, StreamingToolCalls


@dataclass
class ToolPlan:
    mode: str  # none | auto | required | named
    parser: ToolCallParser | None  # auto: the model's format
    template_tools: list[dict[str, Any]] | None = None  # rendered by the chat template
    constraint: dict[str, str] = field(default_factory=dict)  # required / named: the calls' schema
    parallel: bool = False  # required with parallel_tool_calls: an array of calls
    schemas: ToolSchemas = field(default_factory=dict)  # each function's parameters

    @property
    def skip_special_tokens(self) -> bool:
        """False when the model's format is written in special tokens (harmony)."""
        return self.parser is None or not self.parser.keeps_special_tokens

    @property
    def forced(self) -> bool:
        return self.mode in ("required", "named")

    def make_stop(self, stops: list[str], params: SamplingParams) -> list[str] | StopStringMatcher:
        """A choice's stop rule: its stop strings, and for an array of forced calls the end of
        the array when the next call would not fit (`CallsBudget`)."""
        return CallsBudget(stops, params.max_new_tokens) if self.forced and self.parallel else stops

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a whole completion; no calls: the text is the content."""
        if self.forced:
            calls = parse_forced(text)
            return (None, calls) if calls else (text, [])
        if self.mode == "auto" and self.parser is not None:
            parsed = self.parser.parse(text, self.schemas)
            return (parsed.content or None) if parsed.calls else parsed.content, parsed.calls
        return text, []

    def streamer(self) -> ChoiceStream:
        return ChoiceStream(self)


class ChoiceStream:
    """One streamed choice: content deltas go out as they come unless they may be calls (then
    held: forced outputs are all calls, auto ones from a start marker on), and the calls as they
    are written (`CallDelta`s: a call's name, then its arguments' text)."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.text = ""
        self.stream = StreamingToolCalls(plan.parser, plan.schemas) if plan.mode == "auto" and plan.parser else None
        self.forced = IncrementalCalls()

    def feed(self, delta: str) -> tuple[str, list[CallDelta]]:
        """(content to send, call deltas) of a text delta."""
        if self.plan.forced:
            self.text += delta
            return "", self.forced.update(partial_forced(self.text))
        if self.stream is None:
            return delta, []
        return self.stream.feed(delta), self.stream.deltas()

    def finish(self) -> tuple[str, list[ToolCall], list[CallDelta]]:
        """(content not sent yet, calls as they went out, the deltas that complete them)."""
        if self.plan.forced:
            deltas, calls = self.forced.finish(parse_forced(self.text))
            return ("", calls, deltas) if calls else (self.text, [], [])
        if self.stream is not None:
            parsed, deltas = self.stream.finish()
            return parsed.content, parsed.calls, deltas
        return "", [], []


async def plan_tools(state, req: ChatCompletionRequest) -> ToolPlan:
    """Check the tools (parameter schemas parse), and what the request's tool_choice asks for."""
    mode = req.tool_mode
    tools = req.tools or []
    for i, tool in enumerate(tools):
        params = tool.function.parameters
        if params is None:
            continue
        await check_constraint_param("json_schema", json.dumps(params), f"tools.{i}.function.parameters",
                                     state.args.max_constraint_bytes, what=f"parameters schema of {tool.function.name!r}")
    template_tools = [t.model_dump(exclude_none=True) for t in tools] or None
    plan = ToolPlan(mode, state.tool_parser if mode == "auto" else None, template_tools,
                    schemas={t.function.name: t.function.parameters or {} for t in tools})
    if plan.forced:
        if req.response_format is not None or req.regex is not None or req.ebnf is not None:
            raise bad_request("tool_choice required or a named function cannot be combined with response_format, "
                              "regex or ebnf", param="tool_choice")
        named = req.tool_choice.function.name if isinstance(req.tool_choice, NamedToolChoice) else None
        chosen = [t for t in tools if mode == "required" or t.function.name == named]
        plan.parallel = mode == "required" and req.parallel_tool_calls
        schema = forced_schema([(t.function.name, t.function.parameters) for t in chosen], parallel=plan.parallel)
        plan.constraint = {"json_schema": json.dumps(schema)}
    return plan


def message(content: str | None, calls: list[ToolCall], reasoning: str | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        out["tool_calls"] = [c.to_openai() for c in calls]
    if reasoning is not None:
        out["reasoning_content"] = reasoning
    return out


def finish_reason(reason: str | None, calls: list[ToolCall]) -> str | None:
    return "tool_calls" if calls and reason == "stop" else reason


class ChoiceOutput:
    """One streamed choice's text as the dialects shape it: reasoning (--reasoning-parser),
    content, the calls' deltas as they are written, and at the end the calls (`ChoiceStream`)."""

    def __init__(self, plan: ToolPlan, reasoning_parser: str) -> None:
        self.calls = plan.streamer()
        self.thinking = ReasoningStream(reasoning_parser) if reasoning_parser != "none" else None

    def feed(self, text: str, last: bool) -> tuple[str, str, list[CallDelta], list[ToolCall]]:
        """(reasoning, content, call deltas, calls) to send for a delta; the calls (as their
        deltas wrote them) only with the last one."""
        reasoning = ""
        if self.thinking is not None:
            reasoning, text = self.thinking.feed(text)
            if last:
                r2, c2 = self.thinking.finish()
                reasoning, text = reasoning + r2, text + c2
        text, deltas = self.calls.feed(text)
        calls: list[ToolCall] = []
        if last:
            rest, calls, more = self.calls.finish()
            text, deltas = text + rest, deltas + more
        return reasoning, text, deltas, calls


def whole_output(plan: ToolPlan, reasoning_parser: str, text: str) -> tuple[str | None, str | None, list[ToolCall]]:
    """(reasoning, content, calls) of a whole completion."""
    reasoning, text = split_reasoning(reasoning_parser, text) if reasoning_parser != "none" else (None, text)
    content, calls = plan.parse(text)
    return reasoning, content, calls
