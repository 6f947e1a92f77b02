import pytest

from batonlm.sampling_params import SamplingParams
from batonlm.scheduler.batch import ScheduleBatch
from batonlm.scheduler.overlap_policy import is_disable_overlap_for_batch
from batonlm.scheduler.request import Request


def _req(i: int) -> Request:
    return Request(f"r{i}", [1, 2, 3], SamplingParams(), 0, 512, (2,))


def prefill(global_is_extend=None, **kw) -> ScheduleBatch:
    return ScheduleBatch(0, extend=[_req(0)], global_is_extend=global_is_extend, **kw)


def decode(global_is_extend=None, **kw) -> ScheduleBatch:
    return ScheduleBatch(1, decode=[_req(1)], global_is_extend=global_is_extend, **kw)


def policy(batch, last, switch=False, queued=True, mlp_sync=False) -> bool:
    return is_disable_overlap_for_batch(
        batch, last, disable_consecutive_prefill=switch, result_queued=queued, require_mlp_sync=mlp_sync
    )


def test_overlap_stays_on_by_default():
    for batch in (prefill(), decode(), None):
        for last in (prefill(), decode(), None):
            assert not policy(batch, last)


def test_consecutive_prefill_switch():
    assert policy(prefill(), prefill(), switch=True)
    assert not policy(prefill(), decode(), switch=True)
    assert not policy(decode(), prefill(), switch=True)
    assert not policy(prefill(), None, switch=True)
    # A mixed batch computes prompt tokens: it counts as a prefill.
    mixed = ScheduleBatch(2, extend=[_req(2)], decode=[_req(3)])
    assert policy(mixed, prefill(), switch=True)


def test_consecutive_prefill_switch_from_environment(monkeypatch, stories_path):
    monkeypatch.setenv("BATONLM_DISABLE_CONSECUTIVE_PREFILL_OVERLAP", "1")
    from helpers import SchedulerHarness

    h = SchedulerHarness(stories_path, cpu_device_worker="inline")
    try:
        assert h.sched.disable_consecutive_prefill_overlap
    finally:
        h.close()


def test_speculative_grammar_batch_with_a_queued_result():
    spec_grammar = decode(is_speculative=True, has_grammar=True)
    assert policy(spec_grammar, decode(), queued=True)
    assert not policy(spec_grammar, decode(), queued=False)
    assert not policy(decode(is_speculative=True), decode(), queued=True)
    assert not policy(decode(has_grammar=True), decode(), queued=True)


def test_data_parallel_uses_the_globally_agreed_flag():
    # Locally a decode, but another rank has a prefill: every rank must disable overlap.
    assert policy(decode(global_is_extend=True), decode(global_is_extend=True), switch=True, mlp_sync=True)
    # Locally a prefill, but globally not: overlap stays on, as on every other rank.
    assert not policy(prefill(global_is_extend=False), prefill(global_is_extend=True), switch=True, mlp_sync=True)
    with pytest.raises(ValueError, match="globally agreed"):
        policy(prefill(), prefill(), switch=True, mlp_sync=True)
