"""Routing requests over data-parallel replicas: load, turns, and prefix affinity."""

import pytest

from batonlm.tokenizer_manager.dp_router import BLOCK, PREFIX_SLACK, DPRouter, block_hashes


def _prompt(seed: int, blocks: int, tail: int = 3) -> list[int]:
    return [1] + [(seed * 7919 + i) % 500 + 3 for i in range(blocks * BLOCK - 1)] + list(range(10, 10 + tail))


def test_shortest_queue_fills_the_least_loaded_replica():
    r = DPRouter(3, "shortest_queue")
    assert [r.choose([1, 2]) for _ in range(6)] == [0, 1, 2, 0, 1, 2]
    r.release(1)
    r.release(1)
    assert r.choose([1]) == 1 and r.choose([1]) == 1
    assert r.in_flight == [2, 2, 2]


def test_round_robin_takes_turns_whatever_the_load():
    r = DPRouter(2, "round_robin")
    assert [r.choose([1]) for _ in range(5)] == [0, 1, 0, 1, 0]


def test_a_shared_prefix_goes_where_it_went_before():
    r = DPRouter(4)
    system = _prompt(1, 4, tail=0)
    first = r.choose(system + [50, 51])
    # Other prompts spread over the other replicas ...
    others = [r.choose(_prompt(s, 3)) for s in range(2, 5)]
    assert sorted(others) == sorted(set(range(4)) - {first})
    # ... and every request with the same 4-block system prompt follows the first one.
    for tail in range(3):
        assert r.choose(system + [60 + tail]) == first
    assert r.prefix_hits == 3


def test_an_overloaded_prefix_owner_gives_way_to_the_least_loaded():
    r = DPRouter(2)
    system = _prompt(9, 2, tail=0)
    owner = r.choose(system)
    for _ in range(PREFIX_SLACK - 1):
        assert r.choose(system + [7]) == owner
    assert r.in_flight[owner] - r.in_flight[1 - owner] == PREFIX_SLACK
    assert r.choose(system + [8]) == 1 - owner  # the slack is used up


def test_block_hashes_cover_whole_blocks_and_chain():
    a, b = _prompt(3, 3), _prompt(3, 3)
    b[BLOCK + 1] += 1  # differs in the second block
    ha, hb = block_hashes(a), block_hashes(b)
    assert len(ha) == 3 and len(block_hashes(a[: BLOCK - 1])) == 0
    assert ha[0] == hb[0] and ha[1] != hb[1] and ha[2] != hb[2]


def test_an_unknown_method_is_an_error():
    with pytest.raises(ValueError, match="not one of"):
        DPRouter(2, "random")
