"""`runner-fsm run` (the embedded engine on a model directory) and `runner-fsm demo`."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from runner_fsm.audit.segments import DEFAULT_MAX_LOG_BYTES, parse_bytes
from runner_fsm.config import GraphMode, ParallelLayout
from runner_fsm.engine.config import DTYPES, EngineConfig
from runner_fsm.engine.preflight import check_model_dir
from runner_fsm.engine.requests import load_trace, outputs_equal, synthetic_requests

if TYPE_CHECKING:
    from runner_fsm.engine.api import EngineResult

# The engine (and torch with it, seconds on a cold machine) is imported by the commands that
# run it, not by the parser: `runner-fsm replay` and `plan` never load torch.


def add_run(sub) -> None:
    p = sub.add_parser("run", help="serve requests with the embedded engine on DP x PCP processes")
    p.add_argument("--model", help="model directory (config.json + *.safetensors); default: a tiny"
                                   " random model made in OUT/model")
    p.add_argument("--draft", help="draft model directory; default with --spec-tokens: a tiny one")
    p.add_argument("--dtype", choices=DTYPES, default="float32")
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--pcp", type=int, default=1)
    p.add_argument("--spec-tokens", type=int, default=0, help="draft tokens per step K")
    p.add_argument("--graph-mode", choices=("none", "full_decode_only"), default="none")
    p.add_argument("--chunking", choices=("ceil", "balanced"), default="ceil")
    p.add_argument("--trace", help="JSON Lines: id, prompt_token_ids, max_new_tokens, arrival_step, replica?")
    p.add_argument("--requests", type=int, default=16, help="synthetic requests when no --trace")
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--budget", type=int, default=256, help="token budget per replica and step")
    p.add_argument("--kv-blocks", type=int, default=512, help="KV blocks per replica (16 tokens each);"
                   " a request that cannot fit in them is refused before the run starts")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt + new tokens accepted (default: the model's max_position_embeddings)")
    p.add_argument("--out", required=True, help="run directory: outputs.jsonl and the audit logs")
    p.add_argument("--inject", action="append", default=[], metavar="KIND@replica=R,step=S[,rank=K]")
    p.add_argument("--collective-timeout", type=float, default=60.0, help="watchdog, seconds")
    p.add_argument("--consensus", action="store_true",
                   help="each replica's ranks compare their step decisions online, every step")
    p.add_argument("--max-log-bytes", type=_log_bytes, default=DEFAULT_MAX_LOG_BYTES, metavar="BYTES",
                   help="cap on what each rank writes (audit log segments, Flight Recorder dump), e.g. 512M;"
                        " the oldest segments go first (default 2G; 0: one file, no cap)")
    p.add_argument("--compress-logs", action="store_true", help="gzip the closed log segments (a capped log)")
    p.add_argument("--listen-address", default="127.0.0.1",
                   help="address rank 0's rendezvous store listens on (default 127.0.0.1: nothing a"
                        " run opens listens beyond loopback); gloo uses the interface in"
                        " GLOO_SOCKET_IFNAME, 'lo' unless set")
    p.set_defaults(func=_cmd_run)


def _cmd_run(args) -> int:
    out = Path(args.out)
    model, draft = _models(args, out)
    cfg = EngineConfig(
        model_dir=model, draft_dir=draft, run_dir=str(out), dtype=args.dtype,
        layout=ParallelLayout(args.dp, args.pcp), num_speculative_tokens=args.spec_tokens,
        graph_mode=GraphMode(args.graph_mode), chunking=args.chunking, token_budget=args.budget,
        num_kv_blocks=args.kv_blocks, max_model_len=args.max_model_len, collective_timeout_s=args.collective_timeout,
        injections=tuple(args.inject), progress_every=1, listen_address=args.listen_address, consensus=args.consensus,
        max_log_bytes=args.max_log_bytes, compress_logs=args.compress_logs,
    ).validate()
    vocab = check_model_dir(model).vocab_size  # a bad model directory is a one-line error
    if args.trace:
        requests = load_trace(args.trace, dp_size=args.dp)
    else:
        requests = synthetic_requests(args.requests, vocab_size=vocab, seed=args.seed,
                                      max_new_tokens=args.max_new_tokens, arrival_every=1)
    from runner_fsm.engine.api import run_engine

    # Fresh interpreters, not forks of a fork server: a run killed whole (SIGKILL to its process
    # group) leaves nothing outside its run directory, and the server's socket lies in TMPDIR.
    result = run_engine(cfg, requests, timeout_s=max(300.0, 4 * args.collective_timeout), fresh_interpreters=True)
    if result.primary:
        print(format_summary(result, f"DP={args.dp} x PCP={args.pcp}"))
        if result.ok:
            write_outputs(out / "outputs.jsonl", requests, result)
            print(f"outputs: {out / 'outputs.jsonl'}; audit logs: {out}/rank-*.jsonl")
        for injection, why in result.not_fired.items():
            print(f"runner-fsm run: --inject {injection} never fired: {why}", file=sys.stderr)
    if not result.ok:
        return 1
    return NOT_FIRED_EXIT if result.not_fired else 0


NOT_FIRED_EXIT = 3  # the run went well, but an --inject never applied: it tested nothing


def _log_bytes(text: str) -> int | None:
    import argparse

    try:
        return parse_bytes(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _models(args, out: Path) -> tuple[str, str | None]:
    """The model dirs; tiny random ones are made in OUT when none are given (torch is imported
    only then: the launcher of a run on given models never loads it)."""
    model, draft = args.model, args.draft
    if model is None:
        model = str(out / "model")
        if not (out / "model" / "config.json").exists():
            _make_model(model, "target", seed=args.seed)
    if args.spec_tokens > 0 and draft is None:
        draft = str(out / "draft")
        if not (out / "draft" / "config.json").exists():
            _make_model(draft, "draft", seed=args.seed + 1)
    return model, draft


def _make_model(path: str, kind: str, seed: int) -> None:
    from runner_fsm.model_files.make import DRAFT_SPEC, TARGET_SPEC, make_random_model

    make_random_model(path, TARGET_SPEC if kind == "target" else DRAFT_SPEC, seed=seed)


def write_outputs(path: Path, requests, result: EngineResult) -> None:
    """One line per request, in trace order; written whole, then renamed into place."""
    tmp = path.with_suffix(".jsonl.tmp")
    with tmp.open("w") as f:
        for req in requests:
            f.write(json.dumps({"id": req.req_id, "token_ids": result.outputs[req.req_id],
                                "prompt_len": len(req.prompt)}) + "\n")
    tmp.replace(path)


def format_summary(result: EngineResult, label: str) -> str:
    tokens = sum(len(t) for t in result.outputs.values())
    lines = [f"{label}: {len(result.outputs)} requests, {tokens} generated tokens,"
             f" {result.num_steps} steps, {result.elapsed_s:.2f} s,"
             f" {tokens / max(result.elapsed_s, 1e-9):.1f} tokens/s"]
    lines.append(f"  {'replica':>7} {'prefill':>7} {'decode':>7} {'idle':>7} {'handoffs':>8}"
                 f" {'agreements/step':>15} {'preempted':>9}")
    for rank in result.ranks:
        if rank.pcp_rank != 0:
            continue
        st = rank.steps_per_state
        lines.append(f"  {rank.dp_rank:>7} {st.get('prefill', 0):>7} {st.get('decode', 0):>7}"
                     f" {st.get('idle_dummy', 0):>7} {rank.num_handoffs:>8}"
                     f" {rank.num_agreements / max(rank.num_steps, 1):>15.2f} {rank.num_preemptions:>9}")
    for rank in result.errors:
        err = rank.error
        lines.append(f"  rank {rank.global_rank} (replica {rank.dp_rank}, pcp {rank.pcp_rank}) failed at"
                     f" step {err['step']}: {err['type']}: {err['message']}")
    return "\n".join(lines)


def add_demo(sub) -> None:
    p = sub.add_parser("demo", help="the main job: a DP x PCP demo on the CPU")
    p.add_argument("--dir", default="runs/demo", help="where the models and logs go")
    p.set_defaults(func=_cmd_demo)


def _cmd_demo(args) -> int:
    from runner_fsm.model import DRAFT_SPEC, TARGET_SPEC, make_random_model

    root = Path(args.dir)
    target, draft = root / "model", root / "draft"
    for path, spec in ((target, TARGET_SPEC), (draft, DRAFT_SPEC)):
        if not (path / "config.json").exists():
            print(f"writing a tiny random Mixtral model to {path}")
            make_random_model(path, spec, seed=0)
    vocab = json.loads((target / "config.json").read_text())["vocab_size"]
    requests = synthetic_requests(12, vocab_size=vocab, seed=7, max_new_tokens=10, max_prompt=80,
                                  arrival_every=1)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    runs = [
        ("reference: DP=1 x PCP=1, eager, no drafting", ParallelLayout(1, 1), 0, GraphMode.NONE),
        ("DP=2 x PCP=2, eager, 2 draft tokens", ParallelLayout(2, 2), 2, GraphMode.NONE),
        ("DP=2 x PCP=2, FULL_DECODE_ONLY graphs", ParallelLayout(2, 2), 0, GraphMode.FULL_DECODE_ONLY),
    ]
    from runner_fsm.engine.api import run_engine

    reference, code = None, 0
    for label, layout, k, mode in runs:
        cfg = EngineConfig(model_dir=str(target), draft_dir=str(draft), layout=layout,
                           num_speculative_tokens=k, graph_mode=mode,
                           run_dir=str(root / "logs" / f"{stamp}-dp{layout.dp_size}-pcp{layout.pcp_size}-k{k}-{mode.value}"))
        result = run_engine(cfg, requests)
        print(format_summary(result, label))
        if reference is None:
            reference = result.outputs
        elif not result.ok or outputs_equal(reference, result.outputs):
            print(f"  outputs differ from the reference for {outputs_equal(reference, result.outputs)}")
            code = 1
        else:
            print("  outputs identical to the reference")
        code = max(code, _replay(result.run_dir))
    first = sorted(reference)[0]
    print(f"e.g. {first}: {reference[first]}")
    return code


def _replay(run_dir: str) -> int:
    """Judge the run's audit logs offline, as `runner-fsm replay` does."""
    from runner_fsm.replay.judge import replay

    report = replay(run_dir)
    s = report.summary
    print(f"  replay: {'sound' if report.sound else 'UNSOUND'} ({s.ranks} ranks, {s.records} records)")
    if not report.sound:
        print(report.format(limit=5), file=sys.stderr)
    return report.exit_code
