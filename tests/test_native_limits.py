"""Hostile sizes never reach the compiled layout's writes: refused by name with a `BatchError`,
and the process lives. Each case runs in a child process, so that a crash (the wrapped
``P * N + T`` of a 2**62 padding once ended in a ``memset`` of about 2**62 bytes: SIGSEGV) is
seen as a crash and not as the end of the test run.

The Python checks come first (ctypes truncates a Python int that does not fit int64, silently:
``2**64 + 8`` would reach C as 8); the C code checks again, which the last test calls
directly with what the Python checks would have refused.
"""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from runner_fsm.pcp import native

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PRELUDE = """
import numpy as np
from runner_fsm.errors import BatchError
from runner_fsm.pcp import native
from runner_fsm.pcp.plan import PlanWorkspace, num_tokens_for_dispatch, plan_batch

ws = PlanWorkspace()
first = plan_batch([5, 1, 1], [True, False, False], [0, 3, 3], 4, chunking="mrv2", workspace=ws, native=True)
assert first.num_tokens_padded == 2
lengths, flags = np.array([5, 1, 1]), np.array([True, False, False])
"""


def run_child(body: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(body)], capture_output=True, text=True,
                          env=env, timeout=120)


def refusal_of(call: str) -> str:
    proc = run_child(f"""
        try:
            {call}
        except BatchError as error:
            print("BatchError:", error)
        else:
            print("planned")
    """)
    assert proc.returncode == 0, f"the child died (rc {proc.returncode}): {proc.stderr[-2000:]}"
    return proc.stdout.strip()


CASES = {
    # the crash: 4 * 2**62 wraps to 0 in int64
    "padding 2**62 after a plan into the workspace": (
        'plan_batch([5, 1, 1], [True, False, False], [0, 3, 3], 4, chunking="mrv2", padded_num_tokens=2**62,'
        " workspace=ws, native=True)",
        "BatchError: padded_num_tokens=4611686018427387904 is too large: pcp_size * padded_num_tokens"
        " = 18446744073709551616 passes 2**62"),
    "padding 2**64 + 8 (ctypes would pass 8)": (
        'plan_batch([5, 1, 1], [True, False, False], [0, 3, 3], 4, chunking="mrv2", padded_num_tokens=2**64 + 8,'
        " workspace=ws, native=True)",
        "BatchError: padded_num_tokens=18446744073709551624 is too large: pcp_size * padded_num_tokens"
        " = 73786976294838206496 passes 2**62"),
    "pcp_size a huge numpy uint64": (
        'plan_batch([5, 1, 1], [True, False, False], [0, 3, 3], np.uint64(2**63 + 5), chunking="mrv2",'
        " workspace=ws, native=True)",
        "BatchError: pcp_size must be at most 65536, got {}".format(repr(np.uint64(2**63 + 5)))),
    "dispatch count with pcp_size a huge numpy uint64": (
        'num_tokens_for_dispatch([5, 1, 1], [True, False, False], np.uint64(2**63 + 5), chunking="mrv2", native=True)',
        "BatchError: pcp_size must be at most 65536, got {}".format(repr(np.uint64(2**63 + 5)))),
    "negative padding": (
        'plan_batch([5, 1, 1], [True, False, False], [0, 3, 3], 4, chunking="mrv2", padded_num_tokens=-3,'
        " workspace=ws, native=True)",
        "BatchError: padded_num_tokens must be >= 0, got -3"),
    "negative pcp_size": (
        'plan_batch([5, 1, 1], [True, False, False], [0, 3, 3], -4, chunking="mrv2", workspace=ws, native=True)',
        "BatchError: pcp_size must be an integer >= 1, got -4"),
    "a negative length": (
        'plan_batch([5, -1, 1], [True, False, False], [0, 3, 3], 4, chunking="mrv2", workspace=ws, native=True)',
        "BatchError: num_scheduled must be >= 0, got -1 for request 1"),
    "lengths whose sum passes 2**62 (checked in C)": (
        'plan_batch([2**62, 2**62], [True, True], [0, 0], 2, chunking="mrv2", workspace=ws, native=True)',
        "BatchError: the batch is too large: T (the sum of num_scheduled) and pcp_size * N + T must be at most"
        " 2**62 (pcp_size=2, padded_num_tokens=None)"),
    "native.plan_into called with 2**64 + 8": (
        "native.plan_into(lengths, flags, 4, 2**64 + 8, ws)",
        "BatchError: padded_num_tokens must be in [0, 1152921504606846976], got 18446744073709551624"),
    "native.dispatch_count called with a huge numpy uint64": (
        "native.dispatch_count(lengths, flags, np.uint64(2**63 + 5))",
        "BatchError: pcp_size must be in [1, 65536], got 9223372036854775813"),
    "the planner, with a length past int64": (
        "p = native.Planner(2); p.load(np.array([2**63 + 5, 1], dtype=np.uint64), np.array([True, False]));"
        " p.plan(None)",
        "BatchError: num_scheduled must be >= 0: the compiled layout found a negative length"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_hostile_size_is_refused_by_name_and_the_process_lives(case):
    """Mutations that fail it: `_check_padding` without its 2**62 bound (the C code's TOO_LARGE
    answers instead: another message), `_validate` without the upper bound on pcp_size
    (`_integer` in native.py then names it differently), native.py's `_integer` checks gone
    (ctypes truncates: the call plans, or the child dies)."""
    call, expected = CASES[case]
    assert refusal_of(call) == expected


C_CHECKS = """
import ctypes, json
lib = native.library()
P = 2
lengths, flags = np.array([9, 1, 1], dtype=np.int64), np.array([True, False, False])
ints, bools = np.full(64, -7, dtype=np.int64), np.zeros(64, dtype=bool)
scratch, segs = np.full(3 * P + 1, -7, dtype=np.int64), np.full(5 * 4, -7, dtype=np.int64)
at = lambda a: a.ctypes.data

def plan(lengths=lengths, pcp=P, padded=-1, n=None, ints_cap=64, bools_cap=64, scratch_cap=3 * P + 1):
    n = lengths.size if n is None else n
    return lib.mrv2_plan(at(lengths), at(flags), n, pcp, padded, at(ints), ints_cap, at(bools), bools_cap,
                         at(scratch), scratch_cap)

def untouched():
    return ints.tolist() == [-7] * 64 and not bools.any() and segs.tolist() == [-7] * 20

out = {}
for name, call in [
    ("pcp 0", lambda: plan(pcp=0)), ("pcp -3", lambda: plan(pcp=-3)), ("pcp 2**16 + 1", lambda: plan(pcp=2**16 + 1)),
    ("requests -1", lambda: plan(n=-1)), ("padded -2", lambda: plan(padded=-2)),
    ("ints_cap -1", lambda: plan(ints_cap=-1)), ("bools_cap -1", lambda: plan(bools_cap=-1)),
    ("scratch one short", lambda: plan(scratch_cap=3 * P)),
    ("padded 2**62 (P*N wraps to 0)", lambda: plan(padded=2**62)),
    ("padded 2**61 (P*N + T passes 2**62)", lambda: plan(padded=2**61)),
    ("a negative length", lambda: plan(lengths=np.array([9, -1, 1]))),
    ("lengths past 2**62", lambda: plan(lengths=np.array([2**62, 1, 1]))),
    ("lengths whose sum wraps", lambda: plan(lengths=np.array([2**63 - 1, 2, 1]))),
    ("dispatch: pcp 0", lambda: lib.mrv2_dispatch_count(at(lengths), at(flags), 3, 0)),
    ("dispatch: a negative length", lambda: lib.mrv2_dispatch_count(at(np.array([-5, 1, 1])), at(flags), 3, P)),
    ("dispatch: a sum that wraps", lambda: lib.mrv2_dispatch_count(at(np.array([2**63 - 1, 2, 1])), at(flags), 3, P)),
    ("segments: rank -1", lambda: lib.mrv2_rank_segments(at(lengths), at(flags), 3, P, -1, at(segs), 4)),
    ("segments: rank P", lambda: lib.mrv2_rank_segments(at(lengths), at(flags), 3, P, P, at(segs), 4)),
    ("segments: cap -1", lambda: lib.mrv2_rank_segments(at(lengths), at(flags), 3, P, 0, at(segs), -1)),
    ("segments: a negative length",
     lambda: lib.mrv2_rank_segments(at(np.array([9, -1, 1])), at(flags), 3, P, 0, at(segs), 4)),
    ("segments: a sum that wraps",
     lambda: lib.mrv2_rank_segments(at(np.array([2**63 - 1, 2, 1])), at(flags), 3, P, 0, at(segs), 4)),
    ("starts: fewer than R + 1", lambda: lib.mrv2_is_running_sum(at(lengths), 3, at(np.array([0, 9, 10])), 3)),
    ("starts: a negative length",
     lambda: lib.mrv2_is_running_sum(at(np.array([9, -1, 1])), 3, at(np.array([0, 9, 8, 9])), 4)),
    ("starts: a sum that wraps",
     lambda: lib.mrv2_is_running_sum(at(np.array([2**63 - 1, 2, 1])), 3, at(np.array([0, 2**63 - 1, 0, 0])), 4)),
]:
    out[name] = [call(), untouched(), scratch.tolist() if name == "scratch one short" else None]
# rank 1 has three segments (a decode, the prefill's chunks 1 and 2): room for two
out["segments: room for two of three"] = [lib.mrv2_rank_segments(at(lengths), at(flags), 3, P, 1, at(segs), 2),
                                          segs.tolist(), None]
print(json.dumps(out))
"""


def test_the_c_code_refuses_what_python_would_have_refused_and_writes_nothing():
    """The C checks alone, called straight (as a caller without native.py's checks would).
    Mutations that fail it: `__builtin_mul_overflow` replaced by a plain product (padded 2**62:
    P*N wraps to 0 and the child dies in memset), the `scratch_cap` or `rank` check dropped,
    `rows_per_rank` without its negative-length or overflow checks (an answer >= 0),
    `mrv2_rank_segments` writing past `cap`."""
    proc = run_child(C_CHECKS)
    assert proc.returncode == 0, f"the child died (rc {proc.returncode}): {proc.stderr[-2000:]}"
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    bad, large, space = native.BAD_ARGUMENT, native.TOO_LARGE, native.NEEDS_SPACE
    expected_codes = {
        "pcp 0": bad, "pcp -3": bad, "pcp 2**16 + 1": bad, "requests -1": bad, "padded -2": bad, "ints_cap -1": bad,
        "bools_cap -1": bad, "scratch one short": bad, "padded 2**62 (P*N wraps to 0)": large,
        "padded 2**61 (P*N + T passes 2**62)": large, "a negative length": bad, "lengths past 2**62": large,
        "lengths whose sum wraps": large, "dispatch: pcp 0": bad, "dispatch: a negative length": bad,
        "dispatch: a sum that wraps": large, "segments: rank -1": bad, "segments: rank P": bad,
        "segments: cap -1": bad, "segments: a negative length": bad, "segments: a sum that wraps": large,
        "starts: fewer than R + 1": bad, "starts: a negative length": bad, "starts: a sum that wraps": 0,
    }
    for name, code in expected_codes.items():
        answer, untouched, scratch = got[name]
        assert (answer, untouched) == (code, True), (name, got[name])
    assert got["scratch one short"][2] == [-7] * 7  # not even scratch was written
    answer, segs, _ = got["segments: room for two of three"]
    assert answer == space
    # rank 1: the second decode (request 2, token 10), then the prefill's chunks 1 (tokens 3-5)
    # and 2 (6-8); five columns of room 2 (request, start, end, local start, local end), the
    # third segment and everything past the columns left alone
    assert segs[:10] == [2, 0, 10, 3, 11, 6, 0, 1, 1, 4] and segs[10:] == [-7] * 10
