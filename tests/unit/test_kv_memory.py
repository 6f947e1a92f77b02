"""KVMemory: requests take their cached prefix and allocate their own slots; when they end, what
they computed is cached (or freed), and every slot is always free, cached or held."""

import pytest

from batonlm.sampling_params import SamplingParams
from batonlm.scheduler.kv_allocator import OutOfSlots
from batonlm.scheduler.kv_memory import KVMemory
from batonlm.scheduler.request import Request


def request(prompt, max_new=5, ctx=100):
    return Request("r", list(prompt), SamplingParams(max_new_tokens=max_new), 0, ctx, (2,))


def run_to_end(mem: KVMemory, req: Request, outputs: list[int]) -> None:
    """Admit, compute the prompt, decode `outputs` (the last one's KV never computed), finish."""
    mem.match(req)
    mem.alloc(req, req.fill_len - req.kv_len)
    req.kv_len = req.fill_len
    for i, tok in enumerate(outputs):
        req.output_ids.append(tok)
        if i < len(outputs) - 1:
            mem.alloc(req, 1)
            req.kv_len += 1
        mem.check_invariant()
    mem.release(req)
    mem.release_req_slot(req)
    mem.check_invariant()


def test_a_request_needs_its_prompt_and_outputs_but_the_last():
    assert request(range(10), 5).max_kv_len == 14  # the last output is never fed back
    r = request(range(90), 50, ctx=100)  # capped by the context: 10 new tokens at most
    assert (r.max_kv_len, r.max_new_tokens) == (99, 10)


def test_without_the_cache_everything_is_freed():
    mem = KVMemory(40, 2, radix_cache=False)
    a = request(range(1, 11))
    run_to_end(mem, a, [50, 51, 52])
    assert mem.kv.num_free == 40 and mem.held == 0 and mem.evictable == 0
    assert mem.req_slots.num_free == 2 and a.req_slot is None


def test_a_finished_request_is_cached_and_the_next_one_starts_from_it():
    mem = KVMemory(40, 2)
    a = request(range(1, 11))
    run_to_end(mem, a, [50, 51, 52])
    # Prompt (10) + the outputs whose KV was computed (2): 12 tokens cached.
    assert mem.evictable == 12 and mem.kv.num_free == 28
    b = request([*range(1, 11), 50, 77])
    mem.match(b)
    assert b.cached_len == 11 and b.kv_len == 11 and b.fill_len == 12  # all but the last token
    assert mem.protected == 11 and mem.evictable == 1 and b.first_cached_len == 11
    mem.check_invariant()
    # The whole prompt cached: one token is still left to compute (its logits give the output).
    c = request(range(1, 11))
    mem.match(c)
    assert c.cached_len == 9
    assert mem.cached_tokens == 0 + 11 + 9 and mem.admitted_tokens == 10 + 12 + 10


def test_allocation_evicts_least_recently_used_unlocked_entries():
    mem = KVMemory(20, 4)
    run_to_end(mem, request([1, 2, 3, 4, 5, 6]), [9])  # cached: 6 tokens
    run_to_end(mem, request([7, 8, 9, 10, 11, 12]), [9])  # cached: 6 more, used more recently
    assert mem.kv.num_free == 8 and mem.evictable == 12
    user = request([7, 8, 9, 10, 11, 12, 13])
    mem.match(user)  # locks the second entry (6 tokens)
    mem.alloc(user, 14)  # needs 6 more than are free: the first (least recent, unlocked) goes
    assert mem.cache.match_len([1, 2, 3]) == 0 and mem.cache.match_len([7, 8, 9]) == 3
    mem.check_invariant()
    with pytest.raises(OutOfSlots):
        mem.alloc(user, 1)  # what is left is locked
    mem.release(user)
    mem.check_invariant()


def test_duplicates_are_freed_when_two_requests_computed_the_same_prefix():
    mem = KVMemory(40, 4)
    a, b = request([1, 2, 3, 4, 5]), request([1, 2, 3, 4, 5])
    for r in (a, b):  # both admitted before either finished: no cache hit
        mem.match(r)
        mem.alloc(r, 5)
        r.kv_len = 5
        r.output_ids.append(9)
    mem.release(a)
    mem.release(b)  # its 5 slots duplicate a's
    assert mem.evictable == 5 and mem.kv.num_free == 35
    mem.check_invariant()
    mem.flush()
    assert mem.kv.num_free == 40 and mem.kv.num_runs == 1


def test_prompt_logprobs_limit_the_cached_prefix_until_they_are_computed():
    """Prompt logprobs need the logits of every position from logprob_start_len - 1 on: the
    cache may serve only the positions before it, and only until the request has its first
    output (a resumed request's prompt logprobs were sent already)."""
    mem = KVMemory(200, 4)
    run_to_end(mem, request(range(3, 40)), [7])
    for start, cached in ((0, 0), (1, 0), (2, 1), (20, 19)):
        r = Request("p", list(range(3, 40)), SamplingParams(prompt_logprobs=0, logprob_start_len=start), 0, 100, (2,))
        mem.match(r)
        assert r.cached_len == cached
        mem.release(r)
        mem.release_req_slot(r)
    r = Request("q", list(range(3, 40)), SamplingParams(prompt_logprobs=0), 0, 100, (2,))
    r.output_ids.append(5)  # resumed after a retraction: the whole cached prompt is fine
    mem.match(r)
    assert r.cached_len == 37
    mem.check_invariant()


def test_a_retraction_before_the_first_output_starts_prompt_logprobs_over():
    from batonlm.scheduler.planner import BatchPlanner, PlannerConfig

    mem = KVMemory(200, 4)
    planner = BatchPlanner(PlannerConfig(max_running_requests=4, max_prefill_tokens=64, chunked_prefill_size=8, mixed=True), mem)
    r = Request("p", list(range(3, 40)), SamplingParams(prompt_logprobs=0), 0, 100, (2,))
    mem.match(r)
    mem.alloc(r, 20)
    r.kv_len = 20
    r.prompt_lp, r.prompt_top = [-1.0] * 19, [[]] * 19  # two chunks' worth were processed
    running = [r]
    planner._retract(r, running)
    assert (r.prompt_lp, r.prompt_top, r.epoch) == ([], [], 1)
    done = Request("d", list(range(3, 40)), SamplingParams(prompt_logprobs=0), 0, 100, (2,))
    mem.match(done)
    done.output_ids.append(4)
    done.prompt_lp = [-1.0] * 36
    planner._retract(done, [done])
    assert len(done.prompt_lp) == 36  # sent with its first output already: nothing to redo


def test_embeddings_mean_pooling_skips_the_cache_and_a_retraction_starts_the_sum_over():
    from batonlm.scheduler.planner import BatchPlanner, PlannerConfig

    mem = KVMemory(200, 4, radix_cache=True)
    warm = Request("w", list(range(3, 40)), SamplingParams(), 0, 100, (2,))
    mem.match(warm)
    mem.alloc(warm, 37)
    warm.kv_len = 37
    mem.release(warm)  # its prompt is cached now
    mem.release_req_slot(warm)
    last = Request("l", list(range(3, 40)), SamplingParams(max_new_tokens=1), 0, 100, (2,), pooling="last")
    mean = Request("m", list(range(3, 40)), SamplingParams(max_new_tokens=1), 0, 100, (2,), pooling="mean")
    mem.match(last)
    mem.match(mean)
    assert (last.cached_len, mean.cached_len) == (36, 0)  # mean pooling needs every position's hidden state
    assert (last.pool_span(0, 37), last.pool_span(0, 20), mean.pool_span(20, 37)) == ((36, 1), None, (0, 17))
    planner = BatchPlanner(PlannerConfig(max_running_requests=4, max_prefill_tokens=64, chunked_prefill_size=8,
                                         mixed=True), mem)
    mem.alloc(mean, 16)
    mean.kv_len = 16
    mean.add_pooled([1.0, 2.0])
    mean.add_pooled([0.5, 0.5])
    assert mean.pool_sum == [1.5, 2.5]
    planner._retract(mean, [mean])
    assert mean.pool_sum is None and mean.epoch == 1
    mean.pool_sum = [37.0, 74.0]
    assert mean.embedding == [1.0, 2.0]  # the mean over the prompt
    mem.release(last)
    mem.release_req_slot(last)
    mem.check_invariant()


def test_a_decode_batch_over_a_full_pool_walks_the_cache_once():
    """Eight decode rows, the pool's free slots all taken by cached entries: one eviction frees
    the batch's eight slots (a walk of the whole cache per row cost O(cached entries) a token),
    least recently used first, and every row gets its slot."""
    from collections import deque

    from batonlm.scheduler.planner import BatchPlanner, PlannerConfig

    mem = KVMemory(8 * 4 + 10 * 3, 8)
    for k in range(10):  # ten cached entries of 3 tokens (2 prompt + 1 output), oldest first
        run_to_end(mem, request([100 + 2 * k, 101 + 2 * k]), [7, 8])
    running = []
    for k in range(8):
        r = request([k + 1, k + 1, k + 1])
        mem.match(r)
        mem.alloc(r, 3)
        r.kv_len = 3
        r.output_ids.append(5)
        r.num_outputs_launched = 1
        running.append(r)
    mem.check_invariant()
    assert mem.kv.num_free == 8 * 4 - 8 * 3 == 8  # room for every row: nothing evicted yet
    for r in running:  # fill the free slots with one more token each: the next step must evict
        mem.alloc(r, 1)
        r.kv_len += 1
        r.output_ids.append(5)
        r.num_outputs_launched += 1
    assert mem.kv.num_free == 0 and mem.evictable == 30
    walks = []
    evict = mem.cache.evict
    mem.cache.evict = lambda n: walks.append(n) or evict(n)
    planner = BatchPlanner(PlannerConfig(max_running_requests=8, max_prefill_tokens=64, chunked_prefill_size=8,
                                         mixed=False), mem)
    batch = planner.plan(1, deque(), running)
    assert len(batch.decode) == 8 and walks == [8]
    assert mem.evictable == 30 - 9  # three 3-token entries, the oldest (8 slots needed)
    assert mem.cache.match_len([100, 101]) == 0 and mem.cache.match_len([106, 107]) == 2
    mem.check_invariant()
