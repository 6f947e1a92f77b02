"""The scale-out flags: what combinations are refused, naming the flag, and which ranks a node runs."""

import pytest

from batonlm.config import ConfigError, ServerArgs


@pytest.mark.parametrize(("kwargs", "field", "says"), [
    ({"tp_size": 0}, "tp_size", "positive integer"),
    ({"dp_size": 0}, "dp_size", "positive integer"),
    ({"nnodes": 2}, "nnodes", "multiple of the node count"),
    ({"tp_size": 2, "nnodes": 2}, "dist_init_addr", "node 0's host:port"),
    ({"tp_size": 2, "nnodes": 2, "node_rank": 2, "dist_init_addr": "h:1"}, "node_rank", "0..1"),
    ({"dist_init_addr": "nohost"}, "dist_init_addr", "host:port"),
    ({"dist_init_addr": "h:99999"}, "dist_init_addr", "host:port"),
    ({"dist_timeout": 0}, "dist_timeout", "positive number"),
    ({"debug_tp_check_every": -1}, "debug_tp_check_every", ">= 0"),
    ({"enable_dp_attention": True}, "enable_dp_attention", "two data-parallel replicas"),
    ({"dp_size": 2, "enable_dp_attention": True, "tp_size": 2}, "enable_dp_attention", "--tp 1"),
    ({"dp_size": 2, "enable_dp_attention": True, "speculative_algorithm": "ngram"}, "enable_dp_attention",
     "speculative"),
    ({"dp_size": 2, "nnodes": 2, "tp_size": 2, "dist_init_addr": "h:1"}, "dp_size", "one node"),
    ({"dp_size": 2, "dist_init_addr": "h:1"}, "dist_init_addr", "free local port"),
    ({"load_balance_method": "random"}, "load_balance_method", "prefix"),
])
def test_bad_combinations_name_the_flag(kwargs, field, says):
    with pytest.raises(ConfigError, match=says) as e:
        ServerArgs(**kwargs)
    assert e.value.field == field


def test_each_node_runs_its_share_of_the_ranks():
    nodes = [ServerArgs(tp_size=8, nnodes=2, node_rank=k, dist_init_addr="node0:29500") for k in range(2)]
    assert [list(a.local_tp_ranks) for a in nodes] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert list(ServerArgs(tp_size=2).local_tp_ranks) == [0, 1]
