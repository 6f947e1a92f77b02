"""ScheduleBatch.to_launch: what the device is told, row by row, for extend and decode rows."""

from batonlm.ipc import codec
from batonlm.sampling_params import SamplingParams
from batonlm.scheduler.batch import ScheduleBatch
from batonlm.scheduler.request import Request

CTX = 64
EOS = (2,)


def request(rid, prompt, params, *, slot, kv_slots, launched=0, seed=7):
    r = Request(rid, prompt, params, seed, CTX, EOS)
    r.req_slot, r.kv_slots, r.num_launched = slot, kv_slots, launched
    return r


def test_extend_rows_then_decode_rows():
    greedy = SamplingParams(temperature=0.0, max_new_tokens=5)
    sampled = SamplingParams(temperature=0.7, top_k=5, max_new_tokens=5, logprobs=3, stop_token_ids=[9])
    a = request("a", [5, 6, 7], greedy, slot=3, kv_slots=list(range(10, 17)), launched=1)
    b = request("b", [8, 9], sampled, slot=1, kv_slots=list(range(20, 26)), launched=1)
    # c started two launches ago: its prompt (4 tokens) and one decode are in flight or done.
    c = request("c", [1, 2, 3, 4], greedy, slot=0, kv_slots=list(range(30, 38)), launched=3)
    launch = ScheduleBatch(11, extend=[a, b], decode=[c]).to_launch()
    assert launch.batch_id == 11
    assert launch.req_slots == [3, 1, 0]
    assert launch.prefix_lens == [0, 0, c.kv_len - 1] == [0, 0, 5]
    assert launch.extend_lens == [3, 2, 1]
    assert launch.from_future == [False, False, True]
    assert launch.input_ids == [5, 6, 7, 8, 9]  # decode inputs come from the FutureMap
    # Prompt tokens go to the first slots of each extend row; the decode row writes position 5.
    assert launch.out_cache_loc == [10, 11, 12, 20, 21, 35]
    assert not launch.all_greedy and not launch.any_penalties
    assert launch.top_logprobs == 3 and launch.sample


def test_sampling_records_travel_once_with_the_extend_row():
    penalized = SamplingParams(repetition_penalty=1.3, min_new_tokens=2, stop_token_ids=[40, 9])
    a = request("a", [5, 6, 7], penalized, slot=2, kv_slots=[1, 2, 3, 4], launched=1, seed=2**64 - 1)
    d = request("d", [4], SamplingParams(), slot=5, kv_slots=[7, 8], launched=1)
    d.num_launched = 2
    launch = ScheduleBatch(0, extend=[a], decode=[d]).to_launch()
    (rec,) = launch.new_slots
    assert rec.req_slot == 2 and rec.params == penalized and rec.seed == 2**64 - 1
    assert rec.stop_ids == [2, 9, 40]  # EOS and the request's own, sorted
    assert rec.prompt_len == 3 and rec.prompt_ids == [5, 6, 7]  # penalties need the prompt
    assert launch.any_penalties and launch.top_logprobs == -1
    assert codec.decode(codec.encode(launch)) == launch  # it crosses the pipe intact


def test_records_without_penalties_leave_the_prompt_home():
    a = request("a", [5, 6, 7], SamplingParams(ignore_eos=True), slot=0, kv_slots=[1, 2, 3], launched=1)
    (rec,) = ScheduleBatch(0, extend=[a]).to_launch().new_slots
    assert rec.prompt_ids == [] and rec.prompt_len == 3 and rec.stop_ids == []


def test_all_greedy_and_delayed_sampling():
    g = request("g", [1], SamplingParams(top_k=1), slot=0, kv_slots=[1, 2], launched=1)
    batch = ScheduleBatch(0, extend=[g], delay_sampling=True)
    launch = batch.to_launch()
    assert launch.all_greedy and not launch.sample and len(batch) == 1 and batch.is_extend
