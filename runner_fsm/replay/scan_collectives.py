"""The collectives of one rank's log, as `scan.RankScanner` reads them: each `done` paired with
its `enqueue`, each step's collective sequence (its signature) and first `pg_seq` per group, a
DP agreement's own column checked against what the rank sent (`agreed_mismatch`), and the
evidence a forward or an agreement carries, recomputed (`stale_context`, `stale_buffer_replay`
of an eager forward, `dispatch_mismatch`).

A compact record's collective fields arrive as a tuple (`Expander.lean`): most records of a run
are collectives, and reading them back out of a dict filled for the purpose cost a tenth of a
replay.
"""

from __future__ import annotations

from runner_fsm.rules.checks import check_own_agreement, dispatch_problem
from runner_fsm.rules.integrity import LogIntegrity
from runner_fsm.rules.rank_steps import freeze as _freeze
from runner_fsm.rules.verdicts import label

# Groups whose members must pass equal shapes (an all_reduce, an all_gather of equal parts);
# elsewhere (the expert group's forward) shapes are each rank's own rows: op and phase match.
SHAPE_MATCHED_GROUPS = frozenset({"dp", "pcp"})


class CollectiveReader(LogIntegrity):
    """The collective records of one rank's log; `scan.RankScanner` holds the state it reads
    and writes (`current`, `buffers`, `contexts`, `info`, `_line`, `_last_pg`, `_shapes`)."""

    def _collective(self, record) -> None:
        """A collective record in full (a compact one's fields come from `Expander.lean`)."""
        group = record["group"]
        shapes = record["shapes"] if group in SHAPE_MATCHED_GROUPS else record.get("shapes")
        self._collective_of((group, record["op"], record["phase"], record["pg_seq"], shapes, record["stage"]), record)

    def _collective_of(self, collective: tuple, record) -> None:
        group, op, phase, pg_seq, shapes, stage = collective
        if stage == "done":
            pending = self.current.open.get(group)
            last = pending[-1] if pending else None
            # `done` almost always closes the group's last enqueue; search only otherwise.
            if last is not None and last[4] == pg_seq and last[3] == phase and last[2] == op:
                pending.pop()
                if "agreed" in record:
                    self._agreed(last, record["agreed"])
            else:
                self._done_elsewhere(group, op, phase, pg_seq, record)
        elif stage == "enqueue":
            self._enqueue(group, op, phase, pg_seq, shapes, record)
        else:
            self._malformed(f"collective stage {stage!r} is neither 'enqueue' nor 'done'")

    def _enqueue(self, group: str, op, phase, pg_seq, shapes, record) -> None:
        last = self._last_pg.get(group)
        if last is None or pg_seq != last + 1:
            pg_seq = self._pg_seq_break(group, last, pg_seq)
        if pg_seq is not None:
            self._last_pg[group] = pg_seq
        if group in SHAPE_MATCHED_GROUPS:
            cached = self._shapes.get((group, phase))
            if cached is None or cached[0] != shapes:  # shapes repeat per phase: freeze a new value once
                cached = self._shapes[(group, phase)] = (shapes, _freeze(shapes))
            shapes = cached[1]
        else:
            shapes = None
        step = self.current
        keys = step.keys.get(group)
        if keys is None:
            keys = step.keys[group] = []
            step.first_pg[group] = pg_seq
            step.open[group] = []
        sent = record.get("sent")
        if op == "forward":
            self._forward_evidence(record)
        elif group == "dp":
            if phase == 1 and isinstance(sent, dict):  # TARGET: what it proposed, with its graphs
                step.proposed = _proposed(record, sent, self.buffers.largest_capture())
            if "inputs" in record:
                self._dispatch_evidence(record["inputs"], sent)
            elif isinstance(sent, dict) and sent.get("status"):
                step.aborted = True  # an abort: the agreement fails on every member by design
        elif group == "pcp" and "output" in record:
            step.output = record["output"]["digest"]
        pending = (group, len(keys), op, phase, pg_seq, self._line, sent if isinstance(sent, dict) else None)
        keys.append((op, phase, shapes))
        step.open[group].append(pending)
        self._dangling = pending

    def _agreed(self, pending: tuple, agreed) -> None:
        if not isinstance(agreed, dict):
            if agreed is not None:
                self._malformed(f"`agreed` is a {type(agreed).__name__}, expected an object")
            return
        step, phase, sent = self.current.step, pending[3], pending[6]
        self.current.agreed.append((phase, agreed))
        try:  # the common case, without a call: this step and phase, and what it sent
            fine = agreed["step_id"] == step and agreed["phase"] == phase and (
                sent is None or agreed["num_tokens_across_dp"][self.info.dp_rank] == sent["num_tokens"])
        except (KeyError, IndexError, TypeError):
            fine = False
        if not fine:
            for detail in check_own_agreement(pending, agreed, step, self.info.dp_rank):
                self._verdict("agreed_mismatch", detail)

    def _done_elsewhere(self, group: str, op, phase, pg_seq, record) -> None:
        pending = self.current.open.get(group, [])
        for position in range(len(pending) - 1, -1, -1):
            found = pending[position]
            if found[4] == pg_seq and found[3] == phase and found[2] == op:
                del pending[position]
                self._agreed(found, record.get("agreed"))
                return
        self._verdict("gap", f"`done` of {label(group, op, phase)} (pg_seq {pg_seq}) has no `enqueue`"
                      " in its step: the enqueue record is lost")

    # -- evidence: recomputed, never taken on the runner's word ------------------------

    def _forward_evidence(self, record) -> None:
        """A target forward: the PCP context it used is its batch's; eager, its inputs are fresh."""
        found = self.contexts.forward(self.current.step, record.get("ctx"), record.get("batch"))
        if found is not None:
            self._verdict(found[0], f"replica {self.info.dp_rank}: {found[1]}")
        if record.get("graph") is False:
            for detail in self.buffers.eager_forward(self.current.step):
                self._verdict("stale_buffer_replay", detail)

    def _dispatch_evidence(self, inputs, sent) -> None:
        """The count the replica sent against the count its logged batch yields."""
        if not isinstance(sent, dict):
            return
        told = sent["num_tokens"]
        if not inputs["prefill"] and told == inputs["decode"] and "decodes" not in inputs:
            return  # decode only: the count is the decode tokens, replicated on every PCP rank
        problem = dispatch_problem(inputs, told)
        if problem is not None:
            self._verdict("dispatch_mismatch", f"replica {self.info.dp_rank} {problem}")


def _proposed(record, sent: dict, captured) -> tuple:
    """(num_tokens, graph_mode, largest graph captured) a replica proposed to its target agreement.
    The vLLM worker logs vLLM's own column instead of a graph mode (`sent.vllm`: num_tokens, then
    its `CUDAGraphMode` value, whose NONE and FULL are the rule's eager and FULL), and an idle
    replica's dummy step as `kind: dummy`: a dummy batch is no work, whatever rows it pads to."""
    mode = sent.get("graph_mode")
    column = sent.get("vllm")
    if mode is None and isinstance(column, list) and len(column) > 1:
        tokens = 0 if record.get("kind") == "dummy" else sent.get("num_tokens")
        return tokens, column[1], captured
    return sent.get("num_tokens"), mode, captured
