"""The run every rank of a vLLM job agrees on at start-up (`rundir.agree_run`), without vLLM: the
gather over vLLM's world group is stood in for by the entries every rank would contribute."""

import pytest

from runner_fsm.errors import ConfigError
from runner_fsm.integrations.vllm.rundir import agree_run


def _world(*entries):
    """A gather that returns these (run_id, default name, host) entries, rank 0 first."""
    return lambda mine: [tuple(e) for e in entries]


def test_every_rank_takes_rank_0s_default_directory_and_id():
    """Mutation seen failing: each rank keeping its own default name (`entries[rank]` for
    `entries[0]`: what a broadcast over the DP group amounted to with DP = 1)."""
    world = _world((None, "vllm-a-1", "h0"), (None, "vllm-b-2", "h0"), (None, "vllm-c-3", "h1"))
    run = agree_run(None, None, gather=world)
    assert (run.run_dir, run.run_id) == ("runs/vllm-a-1", "vllm-a-1")
    assert run.hosts == {"h0": [0, 1], "h1": [2]}


def test_a_node_s_own_directory_is_kept_but_the_id_is_the_job_s():
    world = _world((None, "vllm-a-1", "node-a"), (None, "vllm-b-2", "node-b"))
    run = agree_run("/data/node-b-logs", None, gather=world)
    assert (run.run_dir, run.run_id) == ("/data/node-b-logs", "vllm-a-1")


def test_a_given_run_id_must_be_the_same_on_every_rank():
    world = _world(("job-7", "x", "node-a"), ("job-7", "y", "node-a"), ("job-8", "z", "node-b"))
    with pytest.raises(ConfigError, match=r"run_id must be the same on every rank of a job; got 'job-7' on ranks"
                                          r" 0@node-a, 1@node-a; 'job-8' on ranks 2@node-b"):
        agree_run(None, "job-7", gather=world)
    same = agree_run(None, "job-7", gather=_world(("job-7", "x", "a"), ("job-7", "y", "b")))
    assert same.run_id == "job-7" and same.run_dir == "runs/x"
