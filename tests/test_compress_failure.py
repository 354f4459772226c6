"""A closed segment that cannot be compressed (a full disk) stays plain, and the log says so: a
`storage` record in the rank's log and a line on stderr; replay lists it among its notes and
judges the run as before. The compressor's failures went unsaid before (an `except OSError: pass`)."""

from __future__ import annotations

import errno
import gzip

from runner_fsm.audit import compress, read_records
from runner_fsm.audit.segments import MIN_SEGMENT
from runner_fsm.replay.judge import replay
from runner_fsm.testing.synth import SynthSpec, write_run


def test_a_segment_that_cannot_be_compressed_is_said(tmp_path, monkeypatch, capfd):
    """On ranks 0 and 3 of DP=2 x PCP=2, every compression fails with ENOSPC: each of their
    segments past the head stays plain, each failure is a `storage` record of its rank and a
    stderr line; the other ranks compress. Replay: SOUND, a note per failure naming rank and file.
    Mutation: the compressor's `except OSError` without `on_error` -> no record, no note."""
    real = compress.compress
    failing = {"rank-0.", "rank-3."}

    def full_disk(path, lock=None):
        if any(path.name.startswith(prefix) for prefix in failing):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(path, lock)
    monkeypatch.setattr(compress, "compress", full_disk)
    spec = SynthSpec(dp_size=2, pcp_size=2, steps=600, max_log_bytes=6 * MIN_SEGMENT, pinned_steps=20,
                     compress_segments=True)
    run = write_run(tmp_path / "run", spec, [])
    err = capfd.readouterr().err
    for rank in range(4):
        plain = sorted(run.glob(f"rank-{rank}.*.jsonl"))
        gz = sorted(run.glob(f"rank-{rank}.*.jsonl.gz"))
        # the plain segments kept (the head first): where a storage record can be; none is in a .gz
        said = [r for path in [run / f"rank-{rank}.jsonl", *plain] for r in read_records(path)
                if r["event"] == "storage"]
        assert not any(b"storage" in gzip.decompress(path.read_bytes()) for path in gz), rank
        if rank in (0, 3):
            assert said and not gz, (rank, said, gz)
            assert all(r["action"] == "compress" and "No space left" in r["error"] for r in said), said
            assert all(f"rank-{rank}.jsonl: compressing {r['file']} failed (OSError: [Errno 28]" in err
                       for r in said), err
        else:
            assert not said and gz and f"rank-{rank}.jsonl: compressing" not in err, (rank, said, plain)
    report = replay(run)
    assert report.sound, report.format()
    notes = [n for n in report.summary.notes if "could not compress" in n]
    assert {n.split("'")[0] for n in notes} == {"rank 0", "rank 3"}, report.summary.notes
