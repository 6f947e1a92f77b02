"""The in-process API: batonlm.Engine."""

import time

import pytest

import batonlm
from batonlm.config import ConfigError
from batonlm.request_checks import RequestRejected
from batonlm.sampling_params import InvalidSamplingParams

GREEDY = {"temperature": 0.0}
LILY = ", there was a little girl named Lily. She loved to play outside in the park."
STORY_END = (
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the park. One day,"
    " she saw a big, red ball. She wanted to play with it, but it was too high. Lily asked her mom for help."
    " Her mom smiled and lifted her up. Lily got the ball and they played together all day. The end."
)


@pytest.fixture(scope="module")
def engine():
    with batonlm.Engine() as e:
        yield e


def _wait_all_free(engine, timeout=10.0):
    deadline = time.monotonic() + timeout
    while True:
        stats = engine.get_stats()
        if stats["kv_used"] == 0 and stats["req_slots_used"] == 0 and stats["num_running"] == 0:
            return stats
        assert time.monotonic() < deadline, f"slots not freed: {stats}"
        time.sleep(0.05)


def test_generate_one_prompt(engine):
    out = engine.generate("Once upon a time", sampling_params={**GREEDY, "max_new_tokens": 30})
    assert out["text"].startswith(LILY)
    assert out["finish_reason"] == "length"
    assert out["prompt_tokens"] == 5 and out["completion_tokens"] == 30 == len(out["output_ids"])


def test_generate_batch_with_per_prompt_params(engine):
    outs = engine.generate(
        ["Once upon a time", "Once upon a time"],
        sampling_params=[{**GREEDY, "max_new_tokens": 5}, {**GREEDY, "max_new_tokens": 9}],
    )
    assert [o["completion_tokens"] for o in outs] == [5, 9]
    assert outs[1]["output_ids"][:5] == outs[0]["output_ids"]


def test_generate_from_input_ids(engine):
    ids = engine.tokenizer("Once upon a time").input_ids
    by_ids = engine.generate(input_ids=ids, sampling_params={**GREEDY, "max_new_tokens": 12})
    by_text = engine.generate("Once upon a time", sampling_params={**GREEDY, "max_new_tokens": 12})
    assert by_ids == by_text
    both = engine.generate(input_ids=[ids, ids[:2]], sampling_params={**GREEDY, "max_new_tokens": 3})
    assert len(both) == 2 and both[0]["output_ids"] == by_ids["output_ids"][:3]


def test_eos_stops_with_either_stop_id_and_min_and_ignore_eos(engine):
    done = engine.generate(STORY_END, sampling_params={**GREEDY, "max_new_tokens": 50})
    assert done["finish_reason"] == "stop" and done["output_ids"][-1] in (1, 2)
    assert done["text"] == ""  # the stop token is special: not in the text
    at_least = engine.generate(STORY_END, sampling_params={**GREEDY, "max_new_tokens": 50, "min_new_tokens": 6})
    assert len(at_least["output_ids"]) >= 7
    assert not {1, 2} & set(at_least["output_ids"][:6])
    ignored = engine.generate(STORY_END, sampling_params={**GREEDY, "max_new_tokens": 10, "ignore_eos": True})
    assert ignored["finish_reason"] == "length" and len(ignored["output_ids"]) == 10


def test_stop_token_ids(engine):
    ref = engine.generate("Once upon a time", sampling_params={**GREEDY, "max_new_tokens": 20})
    stop_at = ref["output_ids"][3]
    out = engine.generate("Once upon a time", sampling_params={**GREEDY, "max_new_tokens": 20, "stop_token_ids": [stop_at]})
    assert out["finish_reason"] == "stop"
    assert out["output_ids"] == ref["output_ids"][: ref["output_ids"].index(stop_at) + 1]


def test_seeded_sampling_is_reproducible(engine):
    params = {"temperature": 1.0, "top_p": 0.9, "seed": 42, "max_new_tokens": 30}
    a = engine.generate("Lily", sampling_params=params)
    b = engine.generate(["Tom", "Lily", "Sue"], sampling_params=params)[1]
    assert a["output_ids"] == b["output_ids"]
    c = engine.generate("Lily", sampling_params={**params, "seed": 43})
    assert c["output_ids"] != a["output_ids"]


def test_stream_deltas_add_up_to_the_full_result(engine):
    params = {**GREEDY, "max_new_tokens": 30}
    full = engine.generate(["Once upon a time", "Tom"], sampling_params=params)
    texts, ids, finish = ["", ""], [[], []], [None, None]
    for chunk in engine.generate_stream(["Once upon a time", "Tom"], sampling_params=params):
        i = chunk["index"]
        assert finish[i] is None, "no chunk after a prompt's last one"
        texts[i] += chunk["text"]
        ids[i] += chunk["output_ids"]
        finish[i] = chunk["finish_reason"]
    assert texts == [f["text"] for f in full] and ids == [f["output_ids"] for f in full]
    assert finish == ["length", "length"]


def test_leaving_a_stream_early_aborts_and_frees(engine):
    stream = engine.generate_stream(["Once upon a time"] * 4, sampling_params={"max_new_tokens": 400, "ignore_eos": True})
    for n, _ in enumerate(stream):
        if n == 10:
            break
    stream.close()
    _wait_all_free(engine)


def test_bad_inputs_raise_clear_errors(engine):
    with pytest.raises(RequestRejected, match=r"prompt 1: the prompt has 600 tokens but the context length is 512"):
        engine.generate(input_ids=[[1, 2], [5] * 600])
    with pytest.raises(RequestRejected, match="outside the vocabulary"):
        engine.generate(input_ids=[1, 512])
    with pytest.raises(InvalidSamplingParams, match="top_p"):
        engine.generate("hi", sampling_params={"top_p": 1.5})
    with pytest.raises(InvalidSamplingParams, match="temprature"):
        engine.generate("hi", sampling_params={"temprature": 1.0})
    with pytest.raises(ValueError, match="exactly one of prompt and input_ids"):
        engine.generate("hi", input_ids=[1])
    with pytest.raises(ValueError, match="2 sampling_params for 1 prompts"):
        engine.generate(["hi"], sampling_params=[{}, {}])
    # The engine still serves.
    assert engine.generate("Once upon a time", sampling_params={**GREEDY, "max_new_tokens": 30})["text"].startswith(LILY)
    _wait_all_free(engine)


def test_embed_equals_transformers(engine, stories_path):
    """Engine.embed: each prompt's pooled last hidden states (float64 reference within the float32
    bound), normalised, truncated by dimensions; bad pooling is named."""
    import math

    import torch
    from helpers import pooled_reference

    ids = [[1, 403, 407, 261, 378], [1, 300, 301]]
    for mode in ("last", "mean"):
        got = engine.embed(input_ids=ids, pooling=mode, normalize=False)
        for vector, x in zip(got, ids):
            want, tol = pooled_reference(stories_path, x, mode)
            assert float((torch.tensor(vector, dtype=torch.float64) - want).abs().max()) <= tol
    one = engine.embed("Once upon a time", dimensions=8)
    assert len(one) == 8 and abs(math.fsum(v * v for v in one) - 1) < 1e-5
    with pytest.raises(ValueError, match="pooling must be last or mean"):
        engine.embed("hi", pooling="cls")
    _wait_all_free(engine)


def test_an_embedding_model_embeds_and_refuses_to_generate(tmp_path):
    from helpers import build_embedding_model

    with batonlm.Engine(build_embedding_model(tmp_path / "m", pooling="mean")) as e:
        assert len(e.embed(["a story", "another"])) == 2
        with pytest.raises(ValueError, match="embedding model"):
            e.generate("hi")


def test_unknown_server_argument_is_named():
    with pytest.raises(ConfigError, match="max_runing_requests: unknown server argument"):
        batonlm.Engine(max_runing_requests=4)


def test_normal_loop_engine_and_shutdown():
    e = batonlm.Engine(disable_overlap=True, max_running_requests=8)
    proc = e._manager.handle.process
    try:
        assert not e.info.overlap
        out = e.generate("Once upon a time", sampling_params={**GREEDY, "max_new_tokens": 30})
        assert out["text"].startswith(LILY)
    finally:
        e.shutdown()
    assert not proc.is_alive() and proc.exitcode == 0


def test_a_failed_start_leaves_nothing_behind(tmp_path, stories_path, monkeypatch):
    """The engine's private IPC directory is removed when its scheduler fails to start. The
    engine makes it under a temporary directory of this test's own (other servers on the
    machine make theirs in the shared one), which must hold none afterwards."""
    import shutil
    import tempfile
    from pathlib import Path

    from batonlm.launcher import SchedulerStartError

    d = tmp_path / "m"
    shutil.copytree(stories_path, d)
    (d / "model.safetensors").write_bytes(b"not safetensors")
    # Short: the ipc endpoints inside must fit a unix socket path (107 bytes); pytest's own tmp
    # path grows with its run counter and worker name, and past that the bind failed instead.
    private = Path(tempfile.mkdtemp(prefix="bl-"))
    monkeypatch.setenv("TMPDIR", str(private))  # for the scheduler process too
    monkeypatch.setattr(tempfile, "tempdir", str(private))  # tempfile caches the directory it chose
    with pytest.raises(SchedulerStartError):
        batonlm.Engine(str(d))
    assert not list(private.glob("batonlm-ipc-*"))
