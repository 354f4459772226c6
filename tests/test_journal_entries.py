"""The vLLM journal's entries hold vLLM's scheduler output and any field vLLM resolves after the
step (`journal.Later`) as they are: both are read when the entry is rendered, `BATCH` entries at a
time, into the same line an entry built at the step's start would have been."""

from __future__ import annotations

from types import SimpleNamespace

from runner_fsm.audit import AuditLog
from runner_fsm.integrations.vllm.recording.journal import BATCH, Journal, Later, read_journal, step_entry
from runner_fsm.integrations.vllm.recording.recorder import ReplicaRecorder


def scheduler_output(tokens: dict, new: int = 0, resumed=(), finished=(), spec=None):
    """What the journal reads of vLLM's SchedulerOutput."""
    return SimpleNamespace(total_num_scheduled_tokens=sum(tokens.values()), num_scheduled_tokens=tokens,
                           scheduled_new_reqs=[object()] * new,
                           scheduled_cached_reqs=SimpleNamespace(resumed_req_ids=set(resumed)),
                           finished_req_ids=set(finished), scheduled_spec_decode_tokens=spec or {})


def test_an_entry_renders_the_scheduler_output_in_its_place(tmp_path):
    """The fields in the order of an entry built whole; the scheduled drafts as they were at the
    step's start (a drafter may take some out of the scheduler output during the step).
    Mutations seen to fail this: `step_entry` counting the drafts when rendered; `_resolved`
    appending the scheduler's fields at the end."""
    journal = Journal(str(tmp_path), 0)
    so = scheduler_output({"a": 3, "b": 1}, new=1, resumed=("b",), finished=("z",), spec={"a": [7, 8]})
    entry = step_entry(so, 5, "prefill")
    entry["forwards"] = [["real", "NONE", [4, 2, False], None]]
    so.scheduled_spec_decode_tokens.pop("a")  # vLLM's GPU n-gram proposer does this mid-step
    journal.write(entry)
    journal.close()
    (line,) = read_journal(str(tmp_path))
    assert list(line.items()) == [("step", 5), ("kind", "prefill"), ("tokens", 4), ("sched", [3, 1]), ("new", 1),
                                  ("resumed", 1), ("finished", 1), ("spec", 2),
                                  ("forwards", [["real", "NONE", [4, 2, False], None]])]


def test_a_later_field_is_read_when_rendered_and_left_out_when_empty(tmp_path):
    """MRV2's sampled tokens exist once vLLM's engine resolved its async output, after the step:
    the journal reads them at render time; an output never resolved (or resolved empty) leaves
    no field. Entries without either keep their own dict. Mutation seen to fail this: `_resolved`
    keeping an empty value."""
    journal = Journal(str(tmp_path), 0)
    resolved, never, empty = SimpleNamespace(), SimpleNamespace(), SimpleNamespace(sampled_token_ids=[])
    for step, source in enumerate((resolved, never, empty)):
        journal.write({"step": step, "sampled": Later(source, "sampled_token_ids"), "drafts": [[1]]})
    journal.write({"step": 3, "sampled": [[9]]})
    resolved.sampled_token_ids = [[4], [5]]  # after the steps, before the render
    journal.close()
    assert read_journal(str(tmp_path)) == [{"step": 0, "sampled": [[4], [5]], "drafts": [[1]]},
                                           {"step": 1, "drafts": [[1]]}, {"step": 2, "drafts": [[1]]},
                                           {"step": 3, "sampled": [[9]]}]


def test_the_recorder_hands_entries_over_in_batches_and_digests_no_later_tokens(tmp_path):
    """The recorder hands each step's entry to the journal, which renders `BATCH` at a time; a
    step whose tokens come later (`note_later`, MRV2) digests none at its `finish`. Mutation seen
    to fail this: `Journal.write` never calling `render` (every entry still pending)."""
    run_dir = str(tmp_path / "run")
    journal = Journal(run_dir, 0)
    rec = ReplicaRecorder(AuditLog(run_dir, "t", 0, 0, 0), journal, fingerprints=False)
    rec.start_capture()
    rec.end_capture()
    outputs = []
    for step in range(BATCH + 2):
        so = scheduler_output({"a": 1})
        rec.begin_step("decode", None, so.num_scheduled_tokens, entry=step_entry(so, step, "decode"))
        outputs.append(SimpleNamespace())
        rec.note_later("sampled", outputs[-1], "sampled_token_ids")
        rec.end_step()
        assert rec.decided.tokens == 0
        outputs[-1].sampled_token_ids = [[step]]
    # steps 0..BATCH handed over (each at the next step's start): the first BATCH rendered
    assert [entry["step"] for entry in journal.pending] == [BATCH]
    journal.flush()  # renders the rest
    on_disk = read_journal(run_dir)
    assert [entry["sampled"] for entry in on_disk] == [[[step]] for step in range(BATCH + 1)]
    assert on_disk[0] == {"step": 0, "kind": "decode", "tokens": 1, "sched": [1], "new": 0, "resumed": 0,
                          "finished": 0, "spec": 0, "sampled": [[0]]}
    rec.shutdown()
    assert [entry["step"] for entry in read_journal(run_dir)] == list(range(BATCH + 2))
