"""`runner-fsm run` (the embedded engine on a model directory) and `runner-fsm demo`."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from runner_fsm.config import GraphMode, ParallelLayout
from runner_fsm.engine.api import EngineResult, run_engine
from runner_fsm.engine.config import EngineConfig
from runner_fsm.engine.requests import load_trace, outputs_equal, synthetic_requests


def add_run(sub) -> None:
    p = sub.add_parser("run", help="serve requests with the embedded engine on DP x PCP processes")
    p.add_argument("--model", required=True, help="model directory (config.json + *.safetensors)")
    p.add_argument("--draft", help="draft model directory (speculative decoding)")
    p.add_argument("--spec", type=int, default=0, help="draft tokens per step K (needs --draft)")
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--pcp", type=int, default=1)
    p.add_argument("--graphs", action="store_true", help="FULL_DECODE_ONLY graphs (else eager)")
    p.add_argument("--chunking", choices=("ceil", "balanced"), default="ceil")
    p.add_argument("--trace", help="JSON Lines requests: id, prompt, max_new_tokens, arrival_step?, replica?")
    p.add_argument("--requests", type=int, default=8, help="synthetic requests when no --trace")
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--budget", type=int, default=256, help="token budget per replica and step")
    p.add_argument("--kv-blocks", type=int, default=512)
    p.add_argument("--run-dir", default=None, help="where the audit logs go (default runs/<time>)")
    p.add_argument("--inject", action="append", default=[], metavar="KIND@replica=R,step=S")
    p.add_argument("--timeout", type=float, default=60.0, help="collective timeout in seconds")
    p.add_argument("--json", action="store_true", help="print outputs as JSON")
    p.set_defaults(func=_cmd_run)


def _cmd_run(args) -> int:
    run_dir = args.run_dir or f"runs/{time.strftime('%Y%m%d-%H%M%S')}"
    cfg = EngineConfig(
        model_dir=args.model, draft_dir=args.draft, run_dir=run_dir,
        layout=ParallelLayout(args.dp, args.pcp), num_speculative_tokens=args.spec,
        graph_mode=GraphMode.FULL_DECODE_ONLY if args.graphs else GraphMode.NONE,
        chunking=args.chunking, token_budget=args.budget, num_kv_blocks=args.kv_blocks,
        collective_timeout_s=args.timeout, injections=tuple(args.inject), progress_every=20,
    )
    if args.trace:
        requests = load_trace(args.trace)
    else:
        vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
        requests = synthetic_requests(args.requests, vocab_size=vocab, seed=args.seed,
                                      max_new_tokens=args.max_new_tokens)
    result = run_engine(cfg, requests, timeout_s=max(120.0, 4 * args.timeout))
    if args.json:
        print(json.dumps({"outputs": result.outputs, "errors": [r.error for r in result.errors]}))
    else:
        _print_result(result, f"DP={args.dp} x PCP={args.pcp}")
    return 0 if result.ok else 1


def _print_result(result: EngineResult, label: str) -> None:
    tokens = sum(len(t) for t in result.outputs.values())
    print(f"{label}: {len(result.outputs)} requests, {tokens} tokens in {result.num_steps} steps,"
          f" {result.elapsed_s:.2f} s ({tokens / max(result.elapsed_s, 1e-9):.1f} tokens/s);"
          f" audit logs in {result.run_dir}")
    for rank in result.errors:
        err = rank.error
        print(f"  rank {rank.global_rank} (replica {rank.dp_rank}, pcp {rank.pcp_rank}) failed at"
              f" step {err['step']}: {err['type']}: {err['message']}")


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
    reference, code = None, 0
    for label, layout, k, mode in runs:
        cfg = EngineConfig(model_dir=str(target), draft_dir=str(draft), layout=layout,
                           num_speculative_tokens=k, graph_mode=mode,
                           run_dir=str(root / "logs" / f"{stamp}-dp{layout.dp_size}-pcp{layout.pcp_size}-k{k}-{mode.value}"))
        result = run_engine(cfg, requests)
        _print_result(result, label)
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
    try:
        from runner_fsm.audit.replay import replay_run
    except ImportError:
        return 0
    report = replay_run(run_dir)
    print(f"  replay {run_dir}: {'sound' if report.sound else 'UNSOUND'}"
          f" ({report.num_records} records)")
    if not report.sound:
        for verdict in report.verdicts[:5]:
            print(f"    {verdict}", file=sys.stderr)
    return 0 if report.sound else 1
