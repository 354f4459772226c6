"""`runner-fsm` command line."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from runner_fsm.cli import main


def test_plan_prints_worked_example(capsys):
    assert main(["plan", "--pcp", "2", "--scheduled", "1,10", "--prefill", "0,1", "--computed", "37,0"]) == 0
    out = capsys.readouterr().out
    assert "tokens    0 | 10 | 1 2 3" in out
    assert "positions 37 | 3 4 5 | 6 7 8" in out
    assert "dispatch count N = 7" in out
    assert "hidden_restore_idx [0, 2, 3, 4, 8, 9, 10, 11, 12, 13, 1]" in out


def test_plan_json(capsys):
    assert main(["plan", "--pcp", "4", "--scheduled", "18", "--prefill", "1", "--chunking", "balanced", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["per_rank_num_tokens"] == [5, 5, 4, 4]


def test_plan_mrv2_shards_the_decodes(capsys):
    args = ["plan", "--pcp", "2", "--scheduled", "6,1,1,10", "--prefill", "1,0,0,1", "--computed", "0,3,4,0"]
    assert main([*args, "--chunking", "mrv2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["per_rank_num_tokens"] == [7, 11]
    # the first decode (request 1) on rank 0, the second (request 2) on rank 1, each first
    assert data["ranks"][0]["seg_req_idx"] == [1, 0, 3, 3]
    assert data["ranks"][1]["seg_req_idx"] == [2, 0, 0, 3, 3]
    assert data["ranks"][1]["positions"][:1] == [4]


def test_plan_bad_input_exits_2_with_message():
    proc = subprocess.run(
        [sys.executable, "-m", "runner_fsm.cli", "plan", "--pcp", "2", "--scheduled", "1,10", "--prefill", "0"],
        capture_output=True, text=True,
    )
    assert proc.returncode == 2
    assert "BatchError" in proc.stderr and "got lengths 2, 1, 2" in proc.stderr


# -- `runner-fsm run`: every user error is one line on stderr and exit status 2 -------------

def _bad_model_dirs(root, target):
    """Model directories that are wrong in one way each, copied from a good one."""
    root, target = Path(root), Path(target)
    dirs = {name: root / name for name in ("empty", "bad-json", "truncated", "wrong-shapes")}
    dirs["empty"].mkdir(parents=True)
    dirs["bad-json"].mkdir()
    (dirs["bad-json"] / "config.json").write_text("{nope")
    for name in ("truncated", "wrong-shapes"):
        shutil.copytree(target, dirs[name])
    shard = dirs["truncated"] / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[:100])
    cfg = json.loads((dirs["wrong-shapes"] / "config.json").read_text())
    cfg["hidden_size"] *= 2
    (dirs["wrong-shapes"] / "config.json").write_text(json.dumps(cfg))
    return {name: str(path) for name, path in dirs.items()}


# flags (with {model}, {dirs[...]}, {trace}, {tmp} filled in) -> what the one line must say
BAD_RUNS = {
    "missing model dir": (["--model", "{tmp}/nope"], "ConfigError: model directory {tmp}/nope does not exist"),
    "model dir without config.json": (["--model", "{dirs[empty]}"], "UnsupportedModelError: {dirs[empty]}: no config.json"),
    "config.json not JSON": (["--model", "{dirs[bad-json]}"], "config.json: not valid JSON"),
    "truncated weights": (["--model", "{dirs[truncated]}"], "model.safetensors: header of"),
    "weights disagree with config": (["--model", "{dirs[wrong-shapes]}"],
                                     "WeightsError: {dirs[wrong-shapes]}: model.embed_tokens.weight has shape"),
    "missing trace": (["--model", "{model}", "--trace", "{tmp}/missing.jsonl"],
                      "ConfigError: cannot read the trace {tmp}/missing.jsonl: No such file or directory"),
    "malformed trace line": (["--model", "{model}", "--trace", "{trace}"], "ConfigError: {trace}:2: bad trace line"),
    "unknown fault kind": (["--model", "{model}", "--inject", "bogus@replica=0,step=1"],
                           "ConfigError: unknown fault kind 'bogus'"),
    "malformed injection": (["--model", "{model}", "--inject", "garbage"],
                            "ConfigError: --inject expects KIND@replica=R,step=S[,rank=K], got 'garbage'"),
    "dp 0": (["--model", "{model}", "--dp", "0"], "ConfigError: dp_size must be an integer >= 1, got 0"),
    "pcp -1": (["--model", "{model}", "--pcp", "-1"], "ConfigError: pcp_size must be an integer >= 1, got -1"),
    "no kv blocks": (["--model", "{model}", "--kv-blocks", "0"], "ConfigError: num_kv_blocks and block_size must be >= 1"),
    "bad dtype": (["--model", "{model}", "--dtype", "float8"], "error: argument --dtype: invalid choice: 'float8'"),
    "dp not a number": (["--model", "{model}", "--dp", "two"], "error: argument --dp: invalid int value: 'two'"),
}


@pytest.mark.parametrize("case", list(BAD_RUNS))
def test_run_user_error_is_one_line_and_exit_2(models, tmp_path, capsys, case):
    target, _ = models
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"id": "a", "prompt_token_ids": [1, 2, 3], "max_new_tokens": 2}\n{"id": "b", "prompt_\n')
    names = dict(model=target, trace=str(trace), tmp=str(tmp_path), dirs=_bad_model_dirs(tmp_path / "bad", target))
    flags, expected = BAD_RUNS[case]
    out = tmp_path / "run"
    try:
        code = main(["run", "--out", str(out), *[f.format(**names) for f in flags]])
    except SystemExit as exc:  # argparse leaves through SystemExit
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1, err
    assert err.startswith("runner-fsm run: ")
    assert expected.format(**names) in err
    assert not (out / "outputs.jsonl").exists()
    assert not list(out.glob("rank-*.jsonl"))


def test_run_float16(models, tmp_path):
    target, _ = models
    assert main(["run", "--model", target, "--dtype", "float16", "--requests", "3", "--max-new-tokens", "3",
                 "--out", str(tmp_path / "run")]) == 0
    lines = (tmp_path / "run" / "outputs.jsonl").read_text().splitlines()
    assert [len(json.loads(line)["token_ids"]) for line in lines] == [3, 3, 3]


def test_replay_and_plan_never_import_torch(tmp_path):
    """`runner-fsm replay` reads logs: importing torch would cost it seconds on a cold machine
    (2-3 s here, most of a `--last 1000` over 64 ranks). A fresh interpreter runs the CLI's
    replay and plan and reports what was imported."""
    from runner_fsm.testing.synth import SynthSpec, write_run

    write_run(tmp_path / "run", SynthSpec(dp_size=2, pcp_size=1, steps=20))
    code = ("import sys\nfrom runner_fsm.cli import main\n"
            f"rc = main(['replay', {str(tmp_path / 'run')!r}, '--last', '5'])\n"
            "rc2 = main(['plan', '--pcp', '2', '--scheduled', '4,1', '--prefill', '1,0'])\n"
            "print('RESULT', rc, rc2, 'torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120).stdout
    assert out.strip().splitlines()[-1] == "RESULT 0 0 False", out[-2000:]
