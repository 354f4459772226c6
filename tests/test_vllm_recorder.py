"""The worker's per-replica recorder without vLLM: what a FULL-graph idle dummy leaves in the log.

vLLM's idle replica runs `execute_dummy_batch`; under a FULL graph mode that replays the graph
captured for the batch size, reading the persistent buffers as the previous real batch left
them (vLLM fills no fresh inputs for a dummy unless asked to randomise). The recorder logs the
buffers' content hashes before each forward and a `graph` replay record, so `runner-fsm
replay` names that replay; a dummy that did get fresh inputs, or an eager one, is sound.
CPU runs of vLLM have no FULL graphs, so the runner here is a stand-in with real buffers.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from runner_fsm.audit import AuditLog, read_records
from runner_fsm.audit.records import plain_fields
from runner_fsm.replay.judge import replay
from runner_fsm.audit.shape import job_shape_fields
from runner_fsm.integrations.vllm.common.errors import StepRefused
from runner_fsm.integrations.vllm.recording.journal import BATCH as journal_batch, Journal, read_journal
from runner_fsm.integrations.vllm.recording.probe import JUDGED, NAMES, TOKEN_BUFFERS, InputProbe, resolve
from runner_fsm.integrations.vllm.recording.recorder import ReplicaRecorder
from runner_fsm.integrations.vllm.runners.v1 import V1Runner

DESC = (4, 4, True)  # the batch descriptor: 4 tokens, 4 requests, uniform decode


def stand_in_runner():
    table = SimpleNamespace(block_table=torch.zeros(8, 4, dtype=torch.int32),
                            slot_mapping=torch.zeros(16, dtype=torch.int64))
    return SimpleNamespace(input_ids=torch.zeros(16, dtype=torch.int32), positions=torch.zeros(16, dtype=torch.int64),
                           query_start_loc=torch.zeros(9, dtype=torch.int32), seq_lens=torch.zeros(8, dtype=torch.int32),
                           input_batch=SimpleNamespace(num_reqs=4, block_table=[table]))


def records(run_dir: str) -> list[dict]:
    return list(read_records(f"{run_dir}/rank-0.jsonl"))


def take(probe: InputProbe, adapter: V1Runner, args: dict, num_tokens: int = 4):
    """The probe over the stand-in as the V1 adapter reads it: `num_tokens` tokens, 4 requests."""
    inputs = adapter.forward_inputs({"input_ids": adapter.runner.input_ids[:num_tokens]}, dummy=False,
                                    capturing=False)
    return probe.take(inputs, args)


def write_batch(adapter: V1Runner, step: int) -> None:
    """What vLLM's _prepare_inputs writes for a decode step of 4 requests (a write the adapter
    sees: its stamp moves)."""
    runner = adapter.runner
    adapter.inputs_written()
    runner.input_ids[:4] = torch.arange(4) + 10 * step
    runner.positions[:4] = torch.arange(4) + 20 + step
    runner.seq_lens[:4] = 21 + step
    runner.query_start_loc[:5] = torch.arange(5)
    runner.input_batch.block_table[0].slot_mapping[:4] = torch.arange(4) * 32 + 20 + step


def write_dummy(adapter: V1Runner) -> None:
    """What vLLM's _dummy_run writes: -1 slots, its own lengths (the same bytes every time)."""
    runner = adapter.runner
    adapter.inputs_written()
    runner.input_ids[:4] = 0
    runner.seq_lens[:4] = 1
    runner.input_batch.block_table[0].slot_mapping[:4] = -1


def run(tmp_path, *, mode: str, fresh_dummy: bool, dummies: int = 1, copied: bool = False) -> str:
    run_dir = str(tmp_path / "run")
    adapter = V1Runner(stand_in_runner())
    runner = adapter.runner
    probe = InputProbe()
    rec = ReplicaRecorder(AuditLog(run_dir, "t", 0, 0, 0), Journal(run_dir, 0))

    def forward(dummy: bool):
        ids = runner.input_ids[:4].clone() if copied else runner.input_ids[:4]
        args = {"input_ids": ids, "positions": runner.positions[:4]}
        rec.on_forward(*take(probe, adapter, args), dummy, mode, DESC, None)

    rec.start_capture()
    write_dummy(adapter)
    forward(dummy=True)  # graph capture on vLLM's dummy inputs
    rec.end_capture()
    for step in range(2):
        rec.begin_step("decode", {"tokens": 4})
        write_batch(adapter, step)
        forward(dummy=False)
        rec.note(sampled=[[1], [2], [3], [4]])
        rec.end_step()
    for _ in range(dummies):
        rec.begin_step("idle")
        if fresh_dummy:
            write_dummy(adapter)
        forward(dummy=True)
        rec.end_step()
    rec.shutdown()
    return run_dir


def test_full_graph_idle_dummy_on_the_previous_batch_is_named_by_replay(tmp_path):
    run_dir = run(tmp_path, mode="FULL", fresh_dummy=False)
    report = replay(run_dir)
    assert [(v.kind, v.replica, v.step) for v in report.verdicts] == [("stale_buffer_replay", 0, 2)]
    assert "graph replay at step 2 reads stale inputs" in report.verdicts[0].detail
    assert "['slot_mapping', 'seq_lens'] were not refreshed" in report.verdicts[0].detail
    journal = read_journal(run_dir)
    assert [(e["step"], e["kind"]) for e in journal] == [(0, "decode"), (1, "decode"), (2, "idle")]
    assert journal[2]["forwards"] == [["dummy", "FULL", [4, 4, True], None]]


def test_full_graph_dummy_with_fresh_inputs_is_sound(tmp_path):
    assert replay(run(tmp_path, mode="FULL", fresh_dummy=True)).sound


def test_eager_dummy_reading_old_inputs_is_not_a_graph_replay(tmp_path):
    assert replay(run(tmp_path, mode="NONE", fresh_dummy=False)).sound


def test_two_identical_fresh_dummies_in_a_row_are_sound(tmp_path):
    """Each dummy was written (the stamp moved), though with the very bytes of the one before:
    equal bytes are no evidence of a missing write."""
    report = replay(run(tmp_path, mode="FULL", fresh_dummy=True, dummies=2))
    assert report.sound, report.format()


def test_a_second_dummy_nobody_wrote_is_stale_though_the_first_was_fresh(tmp_path):
    run_dir = run(tmp_path, mode="FULL", fresh_dummy=False, dummies=2)
    report = replay(run_dir)
    assert [(v.kind, v.step) for v in report.verdicts] == [("stale_buffer_replay", 2), ("stale_buffer_replay", 3)]


def test_a_replay_handed_copies_is_still_judged(tmp_path):
    """Copies of input_ids are logged apart (`copied`), not in the reason, so the rule applies."""
    run_dir = run(tmp_path, mode="FULL", fresh_dummy=False, copied=True)
    replays = [r for r in records(run_dir) if r["event"] == "buffers" and r["reason"] == "replay"]
    assert replays and all(r["copied"] == ["input_ids"] for r in replays)
    assert [(v.kind, v.step) for v in replay(run_dir).verdicts] == [("stale_buffer_replay", 2)]


def test_a_step_before_capture_is_refused_and_logged(tmp_path):
    run_dir = str(tmp_path / "run")
    rec = ReplicaRecorder(AuditLog(run_dir, "t", 0, 0, 0), None)
    with pytest.raises(StepRefused, match="'decode' is not allowed in state 'init'"):
        rec.begin_step("decode")
    rec.shutdown()
    report = replay(run_dir)
    assert report.sound, report.format()  # a refusal leaves the state as it was: legal


def test_a_refusal_after_edges_were_taken_is_refused_from_the_replicas_state(tmp_path):
    """The machine keeps each edge it took (`StepMachine.moves`): a trigger refused in a state
    whose other edges are known is still refused, logged from that state, and moves nothing;
    the steps after it go on. Mutation seen to fail this: `_first_move` asking the core without
    setting its state first (the core still in `init`: every edge looks refused or wrong)."""
    run_dir = str(tmp_path / "run")
    rec = ReplicaRecorder(AuditLog(run_dir, "t", 0, 0, 0, shape=job_shape_fields(1, 1, 0, 0)), None)
    rec.end_capture()
    for _ in range(3):
        rec.begin_step("decode")
        rec.end_step()
    rec.begin_step("decode")
    with pytest.raises(StepRefused, match="'prefill' is not allowed in state 'decode'"):
        rec.begin_step("prefill")
    assert rec.machine.state == "decode"
    rec.end_step()
    rec.begin_step("idle")
    rec.end_step()
    rec.shutdown()
    records = [r for r in read_records(Path(run_dir) / "rank-0.jsonl") if r["event"] == "transition"]
    refused = [r for r in records if r["outcome"] == "refused"]
    assert [(r["trigger"], r["src"], r["dst"], r["step_id"]) for r in refused] == [("prefill", "decode", "decode", 3)]
    assert [r["trigger"] for r in records if r["outcome"] == "ok"][-3:] == ["idle", "finish", "shutdown"]
    assert replay(run_dir).sound


def test_a_fault_inside_a_step_moves_to_faulted_and_replays_as_a_fault(tmp_path):
    run_dir = str(tmp_path / "run")
    rec = ReplicaRecorder(AuditLog(run_dir, "t", 0, 0, 0), None)
    rec.end_capture()
    rec.begin_step("prefill")
    rec.fault(RuntimeError("kernel failed"))
    rec.shutdown()
    assert rec.fault_cause is not None
    kinds = [(v.kind, v.replica, v.step) for v in replay(run_dir).verdicts]
    assert kinds == [("fault", 0, 0)]


def test_forward_hook_on_a_graph_wrapper_runs_before_its_call():
    """On CUDA the runner's model (`RunnerAdapter.model()`) may be vLLM's CUDAGraphWrapper (not a
    module); the hook must run right before its `__call__` (where a graph replays), and the object
    keeps its type."""
    from runner_fsm.integrations.vllm.recording.forwards import hook_forward

    order = []

    class GraphWrapper:  # stands in for vllm.compilation.cuda_graph.CUDAGraphWrapper
        def __call__(self, *, input_ids, positions):
            order.append(("replay", int(input_ids.sum())))
            return positions

    wrapper, other = GraphWrapper(), GraphWrapper()
    hook_forward(wrapper, lambda _m, _a, kwargs: order.append(("hook", sorted(kwargs))))
    ids = torch.ones(3)
    assert wrapper(input_ids=ids, positions=ids) is ids
    assert order == [("hook", ["input_ids", "positions"]), ("replay", 3)]
    assert isinstance(wrapper, GraphWrapper) and type(other) is GraphWrapper  # only that object changed
    order.clear()
    module = torch.nn.Identity()
    hook_forward(module, lambda _m, _a, kwargs: order.append(("hook", sorted(kwargs))))
    module(ids)
    assert order == [("hook", [])]


def test_a_replica_killed_mid_step_leaves_that_step_as_its_last_record(tmp_path):
    """The step's start is on disk before its forward runs: a process killed in the forward
    (no fault path, no shutdown) leaves replay the step it died in, and its state."""
    run_dir = str(tmp_path / "run")
    adapter = V1Runner(stand_in_runner())
    probe = InputProbe()
    rec = ReplicaRecorder(AuditLog(run_dir, "t", 0, 0, 0), None)
    rec.start_capture()
    rec.end_capture()
    for step in range(2):
        rec.begin_step("decode", {"tokens": 4})
        write_batch(adapter, step)
        rec.on_forward(*take(probe, adapter, {}), False, "NONE", DESC, None)
        if step == 0:
            rec.end_step()
    # step 1 is in its forward when the process dies: nothing more is written
    report = replay(run_dir)
    assert [(v.kind, v.replica, v.step) for v in report.verdicts] == [("unfinished", 0, 1)]
    assert "in state 'decode' at step 1" in report.verdicts[0].detail


def test_journal_holds_the_hash_of_exactly_the_rows_each_forward_read(tmp_path):
    """Per forward, the journal's `inputs` are crc32 of the bytes the forward read: one row per
    token of the token-indexed buffers, one per request of the others (+1 query offset)."""
    import zlib

    run_dir = run(tmp_path, mode="NONE", fresh_dummy=True)
    journal = read_journal(run_dir)
    adapter = V1Runner(stand_in_runner())
    runner = adapter.runner
    write_batch(adapter, 1)  # what step 1's forward read (4 tokens of 4 requests)
    table = runner.input_batch.block_table[0]

    def crc(t: torch.Tensor) -> int:
        return zlib.crc32(t.contiguous().numpy().tobytes())

    expected = {"input_ids": crc(runner.input_ids[:4]), "positions": crc(runner.positions[:4]),
                "slot_mapping": crc(table.slot_mapping[:4]), "query_start_loc": crc(runner.query_start_loc[:5]),
                "seq_lens": crc(runner.seq_lens[:4]), "block_table": crc(table.block_table[:4])}
    assert journal[1]["inputs"] == [expected]
    assert journal[0]["inputs"] != journal[1]["inputs"]  # step 0 read other bytes


def test_journal_entries_are_all_on_disk_at_a_fault_and_at_shutdown(tmp_path):
    """Entries are rendered in batches (`journal.BATCH`): a fault writes those held back and the
    faulted step's own entry; shutdown writes the rest, in step order."""
    run_dir = str(tmp_path / "run")
    rec = ReplicaRecorder(AuditLog(run_dir, "t", 0, 0, 0), Journal(run_dir, 0), fingerprints=False)
    rec.start_capture()
    rec.end_capture()
    steps = journal_batch + 5
    for step in range(steps):
        rec.begin_step("decode", {"tokens": step})
        rec.note(sampled=[[step]])
        rec.end_step()
    rec.begin_step("decode", {"tokens": -1})
    rec.fault(RuntimeError("forward failed"))
    on_disk = read_journal(run_dir)
    assert [e["step"] for e in on_disk] == list(range(steps + 1))
    assert [e["sampled"] for e in on_disk[:steps]] == [[[s]] for s in range(steps)]
    assert on_disk[-1] == {"step": steps, "kind": "decode", "tokens": -1}
    rec.shutdown()
    assert read_journal(run_dir) == on_disk


def test_an_entry_the_journal_cannot_render_costs_only_its_own_line(tmp_path):
    journal = Journal(str(tmp_path), 0)
    journal.write({"step": 0, "sampled": [[1]]})
    journal.write({"step": 1, "sampled": object()})  # not JSON: a bug of the caller
    journal.write({"step": 2, "sampled": [[3]]})
    journal.close()
    lines = read_journal(str(tmp_path))
    assert [line["step"] for line in lines] == [0, 1, 2]
    assert lines[0]["sampled"] == [[1]] and lines[2]["sampled"] == [[3]]
    assert "not JSON serializable: object" in lines[1]["journal_error"]


def test_resolve_reads_device_digests_back_once(tmp_path):
    """On an accelerator the hashes are 0-d tensors until `resolve` (here CPU tensors stand in)."""
    ptrs, sizes = tuple(range(100, 106)), tuple(range(16, 22))
    hashes = [torch.tensor(h, dtype=torch.int64) for h in (11, 12, -13, 14, 15, 16)]
    inputs, body = resolve((ptrs, sizes, 4, 2, hashes, 7), "replay", ["input_ids"], 8)
    assert inputs._asdict() == dict(zip(NAMES, (11, 12, -13, 14, 15, 16)))  # the journal renders it so
    inputs = inputs._asdict()
    at = {name: NAMES.index(name) for name in JUDGED}
    rows = {name: 4 if name in TOKEN_BUFFERS else 2 for name in JUDGED}
    assert plain_fields("buffers", body) == {"reason": "replay", "buffers": {  # the compact body, in full
        name: {"ptr": ptrs[at[name]], "shape": [sizes[at[name]]], "version": 7, "digest": inputs[name],
               "rows": rows[name]} for name in JUDGED}, "copied": ["input_ids"], "graph_tokens": 8}

def _two_size_run(tmp_path, *, move_storage: bool) -> str:
    """Graphs captured for 4 and 8 tokens, then replays of 8 and 4 tokens on fresh inputs; with
    `move_storage`, the second replay reads a slot mapping in other storage than its capture's."""
    run_dir = str(tmp_path / "run")
    adapter = V1Runner(stand_in_runner())
    runner = adapter.runner
    probe = InputProbe()
    rec = ReplicaRecorder(AuditLog(run_dir, "t", 0, 0, 0), None)

    def forward(size: int, dummy: bool):
        rec.on_forward(*take(probe, adapter, {}, num_tokens=size), dummy, "FULL", (size, 4, True), None)

    rec.start_capture()
    for size in (4, 8):
        write_dummy(adapter)
        forward(size, dummy=True)
    rec.end_capture()
    for step, size in enumerate((8, 4)):
        if move_storage and step == 1:
            table = runner.input_batch.block_table[0]
            moved = SimpleNamespace(block_table=table.block_table, slot_mapping=table.slot_mapping.clone())
            runner.input_batch = SimpleNamespace(num_reqs=4, block_table=[moved])
        rec.begin_step("decode", {"tokens": size})
        write_batch(adapter, step)
        forward(size, dummy=False)
        rec.end_step()
    rec.shutdown()
    return run_dir


def test_replays_of_two_sizes_are_judged_against_their_own_captures(tmp_path):
    run_dir = _two_size_run(tmp_path, move_storage=False)
    replays = [r for r in records(run_dir) if r["event"] == "buffers" and r["reason"] == "replay"]
    # the storage in `shape`, the rows this replay read apart from it, the graph's size
    assert [(r["graph_tokens"], r["buffers"]["slot_mapping"]["rows"], r["buffers"]["slot_mapping"]["shape"])
            for r in replays] == [(8, 8, [16]), (4, 4, [16])]
    report = replay(run_dir)
    assert report.sound, report.format()


def test_a_replay_reading_other_storage_than_its_capture_is_named(tmp_path):
    report = replay(_two_size_run(tmp_path, move_storage=True))
    assert [(v.kind, v.step) for v in report.verdicts] == [("stale_buffer_replay", 1)]
    assert "reads storage that differs from capture: slot_mapping" in report.verdicts[0].detail


def test_each_step_ends_with_its_decisions(tmp_path):
    """FSMWorker's recorder logs each step's decisions on its `finish` (`audit.decisions`): the
    batch vLLM scheduled, the forward's padded size and graph mode (vLLM's forward context), the
    drafter's steps, the sampled tokens; only the changed decisions after the first step.
    Mutations: `end_step` firing `finish` without the decisions -> no digest; `end_step` not
    noting the tokens handed to it -> step 2's journal entry lacks them."""
    from runner_fsm.audit.decisions import DECISIONS_FIELD, DIGEST_FIELD, StepDecisions, batch_identity, tokens_digest

    run_dir = str(tmp_path / "run")
    rec = ReplicaRecorder(AuditLog(run_dir, "t", 0, 0, 0), Journal(run_dir, 0))
    rec.start_capture()
    rec.end_capture()
    scheduled = {"a": 1, "b": 1, "c": 1}
    sampled = ([[1], [2], [3]], [[4], [5], [6]], [[7], [8], [9]])
    for step, tokens in enumerate(sampled):
        rec.begin_step("decode", {"tokens": 3}, scheduled)
        rec.on_forward(None, [], False, "FULL", (4, 3, True), None)
        if step < 2:
            rec.note(sampled=tokens)
            rec.end_step(True, 2)
        else:  # the worker's way: the tokens handed to `end_step`
            rec.end_step(True, 2, tokens)
    rec.begin_step("idle")
    rec.on_forward(None, [], True, "NONE", (1, 1, False), None)
    rec.end_step(True, 2)
    rec.shutdown()
    finishes = [r for r in records(run_dir) if r.get("trigger") == "finish"]
    batch = batch_identity(scheduled, scheduled.values())
    assert finishes[0][DECISIONS_FIELD] == {"real": 1, "batch": batch, "dispatch": 3, "padded": 4, "graph": 4,
                                            "draft": 2}
    assert DECISIONS_FIELD not in finishes[1] and finishes[1][DIGEST_FIELD] != finishes[0][DIGEST_FIELD]
    for step in (1, 2):  # the tokens are in the digest, whichever way they came
        assert finishes[step][DIGEST_FIELD] == StepDecisions(True, batch, 3, 4, 4, 2, tokens_digest(sampled[step])).digest()
    assert finishes[3][DECISIONS_FIELD] == {"real": 0, "batch": 0, "dispatch": 0, "padded": 1, "graph": 0}
    assert finishes[3][DIGEST_FIELD] == StepDecisions(False, 0, 0, 1, 0, 2).digest()
    assert [entry.get("sampled") for entry in read_journal(run_dir)] == [*map(list, sampled), None]


def test_the_batch_identity_follows_the_requests_their_order_and_their_tokens(tmp_path):
    """A run of steps over one batch keeps its identity (computed once); the same requests in
    another order, another token count or another request is another batch. Mutations seen to
    fail this: the order left out of the comparison; the tokens left out."""
    from runner_fsm.audit.decisions import batch_identity

    rec = ReplicaRecorder(AuditLog(str(tmp_path / "run"), "t", 0, 0, 0), None)
    rec.start_capture()
    rec.end_capture()
    batches = [{"a": 1, "b": 1}, {"a": 1, "b": 1}, {"b": 1, "a": 1}, {"b": 2, "a": 1}, {"b": 2, "a": 1, "c": 1},
               {"b": 2, "a": 1}]
    seen = []
    for scheduled in batches:
        rec.begin_step("decode", None, dict(scheduled))  # vLLM's scheduler makes a new dict each step
        rec.end_step()
        seen.append((rec.decided.batch, rec.decided.dispatch))
    rec.shutdown()
    assert seen == [(batch_identity(list(s), list(s.values())), sum(s.values())) for s in batches]
    assert len(set(seen)) == 4


