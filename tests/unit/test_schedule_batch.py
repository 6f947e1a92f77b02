"""ScheduleBatch.to_launch: what the device is told, row by row, for extend and decode rows."""

from batonlm.ipc import codec
from batonlm.sampling_params import LogitChanges, SamplingParams
from batonlm.scheduler.batch import ExtendRow, ScheduleBatch
from batonlm.scheduler.request import Request

CTX = 64
EOS = (2,)


def request(rid, prompt, params, *, slot, kv_slots, kv_len=None, seed=7):
    """An admitted request whose first kv_len positions have their KV launched."""
    r = Request(rid, prompt, params, seed, CTX, EOS)
    r.req_slot, r.kv_slots, r.fill_len = slot, kv_slots, len(prompt)
    r.kv_len = len(prompt) if kv_len is None else kv_len
    return r


def whole(r: Request) -> ExtendRow:
    return ExtendRow(r, 0, r.prompt_len, first=True)


def test_extend_rows_then_decode_rows():
    greedy = SamplingParams(temperature=0.0, max_new_tokens=5)
    sampled = SamplingParams(temperature=0.7, top_k=5, max_new_tokens=5, logprobs=3, stop_token_ids=[9])
    a = request("a", [5, 6, 7], greedy, slot=3, kv_slots=list(range(10, 17)))
    b = request("b", [8, 9], sampled, slot=1, kv_slots=list(range(20, 26)))
    # c: its prompt (4 tokens) and one decode launched before; this decode feeds position 5.
    c = request("c", [1, 2, 3, 4], greedy, slot=0, kv_slots=list(range(30, 38)), kv_len=6)
    launch = ScheduleBatch(11, extend=[whole(a), whole(b)], decode=[c]).to_launch()
    assert launch.batch_id == 11
    assert launch.req_slots == [3, 1, 0]
    assert launch.prefix_lens == [0, 0, 5]
    assert launch.extend_lens == [3, 2, 1]
    assert launch.from_future == [False, False, True]
    assert launch.input_ids == [5, 6, 7, 8, 9]  # decode inputs come from the FutureMap
    # Prompt tokens go to the first slots of each extend row; the decode row writes position 5.
    assert launch.out_cache_loc == [10, 11, 12, 20, 21, 35]
    assert not launch.all_greedy and launch.logit_changes == LogitChanges.NONE
    assert launch.top_logprobs == 3 and launch.sample
    assert launch.table_writes == [] and launch.output_rows is None


def test_sampling_records_travel_once_with_the_extend_row():
    penalized = SamplingParams(repetition_penalty=1.3, min_new_tokens=2, stop_token_ids=[40, 9])
    a = request("a", [5, 6, 7], penalized, slot=2, kv_slots=[1, 2, 3, 4], seed=2**64 - 1)
    d = request("d", [4], SamplingParams(), slot=5, kv_slots=[7, 8], kv_len=2)
    launch = ScheduleBatch(0, extend=[whole(a)], decode=[d]).to_launch()
    (rec,) = launch.new_slots
    assert rec.req_slot == 2 and rec.params == penalized and rec.seed == 2**64 - 1
    assert rec.stop_ids == [2, 9, 40]  # EOS and the request's own, sorted
    assert rec.prompt_len == 3 and rec.prompt_ids == [5, 6, 7]  # penalties need the prompt
    assert launch.logit_changes == LogitChanges.COUNTED and launch.top_logprobs == -1
    assert codec.decode(codec.encode(launch)) == launch  # it crosses the pipe intact


def test_records_without_penalties_leave_the_prompt_home():
    a = request("a", [5, 6, 7], SamplingParams(ignore_eos=True), slot=0, kv_slots=[1, 2, 3])
    (rec,) = ScheduleBatch(0, extend=[whole(a)]).to_launch().new_slots
    assert rec.prompt_ids == [] and rec.prompt_len == 3 and rec.stop_ids == []


def test_all_greedy_and_delayed_sampling():
    g = request("g", [1], SamplingParams(top_k=1), slot=0, kv_slots=[1, 2])
    batch = ScheduleBatch(0, extend=[whole(g)], delay_sampling=True)
    launch = batch.to_launch()
    assert launch.all_greedy and not launch.sample and len(batch) == 1 and batch.is_extend


def test_a_chunk_on_a_cached_prefix_and_a_resumed_request():
    # r: a 9-token prompt whose first 4 tokens were cached; this launch computes positions 4..6.
    p = SamplingParams(frequency_penalty=0.5)
    r = request("r", list(range(10, 19)), p, slot=6, kv_slots=[40, 41, 42, 43, 50, 51, 52], kv_len=7)
    first = ExtendRow(r, 4, 3, first=True)
    # s: retracted after 2 outputs, resuming: its fill is prompt + outputs, the last chunk.
    s = request("s", [1, 2, 3], p, slot=7, kv_slots=[60, 61, 62, 63, 64], kv_len=5)
    s.output_ids = [7, 8]
    s.fill_len = 5
    last = ExtendRow(s, 3, 2, first=False)
    launch = ScheduleBatch(3, extend=[first, last]).to_launch()
    assert launch.prefix_lens == [4, 3] and launch.extend_lens == [3, 2]
    assert launch.input_ids == [14, 15, 16, 7, 8] and launch.out_cache_loc == [50, 51, 52, 63, 64]
    assert launch.table_writes == [(6, [40, 41, 42, 43])]  # only a first launch points at its prefix
    assert launch.output_rows == [1]  # r's chunk does not finish its prompt
    (rec,) = launch.new_slots
    assert rec.req_slot == 6 and rec.output_ids == []
    s.slot_sent = False
    assert s.slot_sampling().output_ids == [7, 8] and s.slot_sampling().prompt_len == 3


def test_prompt_logprobs_score_each_chunk_on_the_next_prompt_token():
    """A chunk at positions p..p+e-1 scores the prompt tokens at p+1..p+e (never past the
    prompt: the last position's logits give the output), from logprob_start_len - 1 on; its
    flat token indices follow the rows before it."""
    prompt = list(range(10, 30))  # 20 tokens
    plain = request("a", [1, 2, 3], SamplingParams(), slot=1, kv_slots=[1, 2, 3])
    r = request("b", prompt, SamplingParams(prompt_logprobs=2, logprob_start_len=5), slot=2,
                kv_slots=list(range(4, 24)), kv_len=8)
    batch = ScheduleBatch(0, extend=[whole(plain), ExtendRow(r, 0, 8, first=True)])
    launch = batch.to_launch()
    # Positions 4..7 (start 5 - 1) score tokens 5..8; row b's tokens start at flat index 3.
    assert launch.prompt_logprob_at == [3 + 4, 3 + 5, 3 + 6, 3 + 7]
    assert launch.prompt_logprob_targets == prompt[5:9]
    assert launch.prompt_top_logprobs == 2 and batch.prompt_logprob_counts == [0, 4]
    last = ScheduleBatch(1, extend=[ExtendRow(r, 8, 12, first=False)])
    launch = last.to_launch()
    assert launch.prompt_logprob_at == list(range(0, 11)) and launch.prompt_logprob_targets == prompt[9:20]
    r.output_ids.append(4)  # resumed after its first output: nothing left to score
    assert ScheduleBatch(2, extend=[ExtendRow(r, 0, 21, first=True)]).to_launch().prompt_logprob_at == []


def test_logit_bias_alone_counts_no_tokens():
    """Bias is added to the logits; only penalties need the prompt and the counted outputs."""
    biased = request("b", [5, 6, 7], SamplingParams(logit_bias={4: -100.0}), slot=0, kv_slots=[1, 2, 3])
    launch = ScheduleBatch(0, extend=[whole(biased)]).to_launch()
    assert launch.logit_changes == LogitChanges.BIAS and launch.new_slots[0].prompt_ids == []
    counted = request("c", [5, 6], SamplingParams(presence_penalty=0.5), slot=1, kv_slots=[4, 5])
    launch = ScheduleBatch(0, extend=[whole(biased), whole(counted)]).to_launch()
    assert launch.logit_changes == LogitChanges.COUNTED and launch.new_slots[1].prompt_ids == [5, 6]
