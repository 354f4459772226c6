"""Config validation and rank topology."""

import pytest

from runner_fsm.config import GraphMode, ParallelLayout, RunnerConfig
from runner_fsm.errors import ConfigError


def test_defaults_validate():
    cfg = RunnerConfig().validate()
    assert cfg.layout == ParallelLayout(1, 1, 1)
    assert cfg.graph_mode is GraphMode.NONE
    assert cfg.num_segments == 2 * cfg.max_num_reqs


@pytest.mark.parametrize("mode", [GraphMode.PIECEWISE, GraphMode.FULL, GraphMode.FULL_AND_PIECEWISE])
def test_pcp_with_dp_refuses_other_graph_modes(mode):
    with pytest.raises(ConfigError, match="PCP\\+DP .* supports eager mode \\(NONE\\) or FULL_DECODE_ONLY"):
        RunnerConfig(layout=ParallelLayout(dp_size=2, pcp_size=2), graph_mode=mode).validate()


@pytest.mark.parametrize("mode", [GraphMode.NONE, GraphMode.FULL_DECODE_ONLY])
def test_pcp_with_dp_allows_eager_and_full_decode_only(mode):
    RunnerConfig(layout=ParallelLayout(dp_size=2, pcp_size=2), graph_mode=mode).validate()


def test_other_modes_fine_without_both_dimensions():
    RunnerConfig(layout=ParallelLayout(dp_size=2, pcp_size=1), graph_mode=GraphMode.FULL).validate()
    RunnerConfig(layout=ParallelLayout(dp_size=1, pcp_size=2), graph_mode=GraphMode.PIECEWISE).validate()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"layout": ParallelLayout(dp_size=0)}, "dp_size must be an integer >= 1, got 0"),
        ({"layout": ParallelLayout(pcp_size=4, dcp_size=2)}, "dcp_size must be 1 or equal to pcp_size=4"),
        ({"num_speculative_tokens": -1}, "num_speculative_tokens must be >= 0"),
        ({"max_num_reqs": 8, "max_num_segments": 15}, "must hold 2 \\* max_num_reqs = 16"),
        ({"max_num_tokens": 0}, "max_num_tokens must be positive"),
        ({"capture_sizes": (4, 2)}, "strictly increasing"),
        ({"capture_sizes": (1, 4096), "max_num_tokens": 512}, "exceeds max_num_tokens=512"),
        ({"chunking": "zigzag"}, "chunking must be one of"),
        ({"collective_timeout_s": 0}, "collective_timeout_s must be > 0"),
    ],
)
def test_invalid_configs(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        RunnerConfig(**kwargs).validate()


def test_rank_mapping_round_trips_and_groups():
    layout = ParallelLayout(dp_size=2, pcp_size=3)
    for g in range(layout.world_size):
        assert layout.global_rank(*layout.coords(g)) == g
    assert layout.coords(4) == (1, 1)
    assert layout.pcp_group_ranks() == [[0, 1, 2], [3, 4, 5]]
    assert layout.dp_group_ranks() == [[0, 3], [1, 4], [2, 5]]
    assert layout.expert_group_ranks() == [0, 1, 2, 3, 4, 5]
    with pytest.raises(ConfigError, match="global rank must lie in \\[0, 6\\), got 6"):
        layout.coords(6)
