"""`--device null` (batonlm/device/null.py): the whole host side, no model. Its tokens follow
its rule through the FutureMap relay under every memory scheme and both loops (overlap ==
normal), accounting ends with everything free, constraints and speculative verification keep
working, and it is never chosen unless asked for."""

from __future__ import annotations

import re

import pytest
import torch
from helpers import SchedulerHarness
from test_memory_scheduling import CONFIGS, _run, workload
from transformers import AutoTokenizer

from batonlm.config import ServerArgs
from batonlm.device.null import next_allowed, null_tokens, token_table
from batonlm.device.spec import DeviceConfigError, device_spec
from batonlm.model_runner.model_config import ModelConfig
from batonlm.scheduler.planner import NewTokenRatio


def follows_rule(prompt: list[int], out: list[int], table: torch.Tensor) -> bool:
    seq = prompt + out
    pos = torch.arange(len(prompt) - 1, len(seq) - 1)
    return null_tokens(torch.tensor(seq[len(prompt) - 1 : -1]), pos, table).tolist() == out


def test_tokens_follow_the_rule_under_every_memory_scheme_and_loop(stories_path):
    table = token_table(ModelConfig.from_hf(stories_path))
    assert table.tolist() == list(range(259, 512))  # clear of <unk>, <s>, </s> and the byte pieces <0x00>..<0xFF>
    reqs = workload(7, long_prompt=False)
    h = SchedulerHarness(stories_path, device="null", max_running_requests=16, max_total_tokens=4096,
                         debug_future_map=True)
    try:
        h.reconfigure(disable_radix_cache=True, chunked_prefill_size=None)
        expected = _run(h, reqs, overlap=False)
        prompts = {rid: ids for rid, ids, _, _ in reqs}
        for rid, (out, reason) in expected.items():
            assert reason == "length" and follows_rule(prompts[rid], out, table), rid
        retracted = 0
        for label, changes, capacity, overlap in CONFIGS:
            h.reconfigure(kv_capacity=capacity, **changes)
            if capacity is not None:
                h.sched.planner.ratio = NewTokenRatio(init=0.0, minimum=0.0)
            got = _run(h, reqs, overlap)  # asserts every KV and request slot free after
            assert got == expected, label
            retracted += h.sched.planner.num_retractions
        assert retracted >= len(reqs)  # the small pools really retracted, and the relay resumed them
    finally:
        h.close()


def test_constraints_and_speculative_verification(stories_path):
    h = SchedulerHarness(stories_path, device="null", max_running_requests=8, max_total_tokens=4096,
                         speculative_algorithm="ngram", speculative_cost_ratio=0.0)
    try:
        tok = AutoTokenizer.from_pretrained(stories_path)
        prompt = [1, 403, 55, 9, 403, 55, 9, 403, 55]  # repeats: the n-gram index drafts
        plain = {"max_new_tokens": 24, "temperature": 0.0}
        for overlap in (False, True):
            h.submit("regex", [1, 403], {"max_new_tokens": 40, "temperature": 0.0, "regex": "(yes|no)( maybe)*"})
            h.submit("spec", prompt, plain)
            records = h.run(overlap=overlap)
            h.assert_all_free()
            text = tok.decode(records["regex"].token_ids, skip_special_tokens=True)
            assert re.fullmatch("(yes|no)( maybe)*", text), text
            assert follows_rule(prompt, records["spec"].token_ids, token_table(ModelConfig.from_hf(stories_path)))
        assert h.sched.speculator is not None and h.sched.speculator.stats.steps > 0
    finally:
        h.close()


def test_next_allowed_is_the_first_allowed_id_from_the_token_on():
    allowed = torch.zeros(3, 10, dtype=torch.bool)
    allowed[0, [2, 7]] = True
    allowed[1, [2, 7]] = True
    allowed[2, 5] = True
    assert next_allowed(torch.tensor([3, 8, 5]), allowed).tolist() == [7, 2, 5]


def test_never_chosen_implicitly(stories_path):
    cfg = ModelConfig.from_hf(stories_path)
    assert ServerArgs(model=stories_path).resolved_device in ("cpu", "cuda")
    assert device_spec(ServerArgs(model=stories_path), cfg).device == "cpu"  # this machine has no GPU
    assert device_spec(ServerArgs(model=stories_path, device="null"), cfg).device == "null"
    for bad in (dict(tp_size=2), dict(compile="on")):
        with pytest.raises(DeviceConfigError, match="--device null computes nothing"):
            device_spec(ServerArgs(model=stories_path, device="null", **bad), cfg)


def test_stream_interval_sends_tokens_in_groups_and_changes_nothing_else(stories_path):
    h = SchedulerHarness(stories_path, device="null", max_running_requests=8, max_total_tokens=4096)
    try:
        sizes: dict[str, list[int]] = {}
        h.io.on_output = lambda msg: [sizes.setdefault(o.rid, []).append(len(o.token_ids)) for o in msg.outputs]
        params = {"max_new_tokens": 11, "logprobs": 2}
        reference = {}
        for interval in (1, 4):
            h.reconfigure(stream_interval=interval)
            sizes.clear()
            h.submit("a", [1, 403, 55], params)
            h.submit("b", [1, 9], {**params, "max_new_tokens": 3})
            records = h.run(overlap=True)
            h.assert_all_free()
            got = {rid: (r.token_ids, r.logprobs, r.finish_reason) for rid, r in records.items()}
            reference = reference or got
            assert got == reference  # the same tokens, logprobs and ends
            if interval == 4:  # the first at once, then every 4, the last when it ends
                assert sizes == {"a": [1, 4, 4, 2], "b": [1, 2]}
            else:
                assert sizes == {"a": [1] * 11, "b": [1] * 3}
    finally:
        h.close()
