"""The files of a synthetic run (`synth`, whose `SynthSpec` and rank writer each function takes;
not imported here: `synth` imports this module): one rank's records written as the runner writes them,
in full, compact (`audit.compact`), or through `AuditLog` itself under a cap (segments).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson

from runner_fsm.audit.compact import FORMAT, FORMAT_FIELD, CompactRenderer
from runner_fsm.audit.decisions import DECISIONS_FIELD, DIGEST_FIELD
from runner_fsm.audit.log import SCHEMA_VERSION, AuditLog, log_path
from runner_fsm.audit.render import RecordRenderer


def _steps(spec: Any, writer: Any):
    """The records of the rank, a step at a time: [(event, step_id, fields), ...]."""
    writer.start()
    alive, step = True, 0
    while True:
        yield writer.records
        writer.records = []
        if not alive or step > spec.steps:
            return
        if step == spec.steps:
            writer.finish(spec.steps - 1)
        else:
            alive = writer.step(step)
        step += 1


def write_rank_log(run_dir: Path, spec: Any, writer: Any) -> Path:
    """Write the rank's log (`writer`'s records) into `run_dir`: in full or compact as `spec`
    says, or through `AuditLog` itself under `spec.max_log_bytes`; return its path."""
    if spec.max_log_bytes:
        return _write_capped(run_dir, spec, writer)
    header = {"schema": SCHEMA_VERSION, "run_id": spec.run_id, "dp_rank": writer.dp_rank, "pcp_rank": writer.pcp_rank}
    plain = RecordRenderer(SCHEMA_VERSION, spec.run_id, writer.dp_rank, writer.pcp_rank)
    compact = None
    path = log_path(run_dir, writer.global_rank)
    seq = 0
    with open(path, "wb") as out:
        for records in _steps(spec, writer):
            lines, dropped = [], False
            for event, step_id, fields in records:
                if event == "buffers" and not dropped and writer.has("gap", step_id):
                    dropped, seq = True, seq + 1  # the lost record leaves its seq unused
                    continue
                t_ns = 1_000_000 + seq * 1000
                if spec.compact and event == "job":
                    lines.append(plain.line(seq, t_ns, event, step_id, {**fields, FORMAT_FIELD: FORMAT}))
                    compact = CompactRenderer(t_ns)
                elif compact is not None:
                    lines.append(compact.lines(seq, [(t_ns, event, step_id, dict(fields))], t_ns))
                else:
                    record = {**header, "seq": seq, "t_ns": t_ns, "event": event, "step_id": step_id, **fields}
                    lines.append(orjson.dumps(record))
                seq += 1
            if lines:
                out.write(b"\n".join(lines) + b"\n")
    return path


def _write_capped(run_dir: Path, spec: Any, writer: Any) -> Path:
    """The rank's records through `AuditLog` itself, under `spec.max_log_bytes` (segments)."""
    log = None
    for records in _steps(spec, writer):
        for event, step_id, fields in records:
            if event == "job":
                log = AuditLog(run_dir, spec.run_id, writer.global_rank, writer.dp_rank, writer.pcp_rank,
                               shape=fields, max_log_bytes=spec.max_log_bytes, pinned_steps=spec.pinned_steps,
                               compress_segments=spec.compress_segments)
                continue
            fields = dict(fields)
            if event == "transition":
                decided = (fields[DIGEST_FIELD], fields.get(DECISIONS_FIELD)) if DIGEST_FIELD in fields else None
                log.transition(step_id, fields["trigger"], fields["src"], fields["dst"], fields["outcome"], decided)
            elif event == "collective":
                log.collective(step_id, fields.pop("group"), fields.pop("op"), fields.pop("phase"),
                               fields.pop("shapes"), fields.pop("pg_seq"), fields.pop("stage"), **fields)
            elif event == "buffers":
                log.buffers(step_id, fields["reason"], fields["buffers"])
            elif event == "graph":
                log.graph(step_id, fields.pop("action"), **fields)
            elif event == "fault":
                log.fault(step_id, fields["error"], fields["message"])
        if log is not None and log.segments.compressor is not None:
            # A compressor that keeps up, as on a server between steps: without the wait, what the
            # cap keeps would hang on how fast this box's thread runs (a loaded CI box kept no more
            # compressed than plain).
            log.segments.compressor.drain()
    if log is None:
        raise ValueError("a capped synthetic log needs the job's shape (job_shape=True)")
    log.close()
    if log.segments.compressor is not None:
        log.segments.compressor.drain()  # every closed segment compressed: the run is whole
    return log.path
