"""`runner-fsm`: look at plans and state tables, run demos, replay and print audit logs."""

from __future__ import annotations

import argparse
import json
import sys

from runner_fsm.engine.commands import add_demo, add_run
from runner_fsm.errors import RunnerError


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")


def _add_plan(sub) -> None:
    p = sub.add_parser("plan", help="show how a batch is cut across PCP ranks")
    p.add_argument("--pcp", type=int, required=True, help="PCP size P")
    p.add_argument("--scheduled", type=_int_list, required=True, help="tokens per request, e.g. 1,10")
    p.add_argument("--prefill", type=_int_list, required=True, help="1 if prefilling, e.g. 0,1")
    p.add_argument("--computed", type=_int_list, help="computed tokens per request (default 0)")
    p.add_argument("--chunking", choices=("ceil", "balanced", "mrv2"), default="ceil",
                   help="mrv2: vLLM Model Runner V2's layout (decodes sharded over the ranks)")
    p.add_argument("--padded", type=int, default=None, help="pad every rank to this many rows")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_cmd_plan)


def _cmd_plan(args) -> int:
    from runner_fsm.pcp.plan import plan_batch

    computed = args.computed if args.computed is not None else [0] * len(args.scheduled)
    plan = plan_batch(
        args.scheduled, args.prefill, computed, args.pcp,
        padded_num_tokens=args.padded, chunking=args.chunking,
    )
    if args.json:
        print(json.dumps(_plan_as_dict(plan)))
    else:
        print(_format_plan(plan, args.chunking))
    return 0


def _plan_as_dict(plan) -> dict:
    ranks = [
        {k: getattr(r, k).tolist() for k in
         ("token_idx", "req_idx", "positions", "query_start_loc", "seq_lens", "seg_req_idx")}
        for r in plan.ranks
    ]
    return {
        "pcp_size": plan.pcp_size,
        "per_rank_num_tokens": list(plan.per_rank_num_tokens),
        "num_tokens_padded": plan.num_tokens_padded,
        "padded_gather_idx": plan.padded_gather_idx.tolist(),
        "kv_write_mask": plan.kv_write_mask.astype(int).tolist(),
        "hidden_restore_idx": plan.hidden_restore_idx.tolist(),
        "ranks": ranks,
    }


def _format_plan(plan, chunking: str) -> str:
    lines = [f"PCP plan: P={plan.pcp_size}, chunking={chunking}, {plan.num_tokens} global tokens"]
    for r, rank in enumerate(plan.ranks):
        qsl = rank.query_start_loc.tolist()
        segs = [rank.token_idx[a:b].tolist() for a, b in zip(qsl, qsl[1:])]
        pos = [rank.positions[a:b].tolist() for a, b in zip(qsl, qsl[1:])]
        lines.append(f"rank {r}: {rank.num_tokens} rows")
        lines.append("  tokens    " + " | ".join(" ".join(map(str, s)) for s in segs))
        lines.append("  positions " + " | ".join(" ".join(map(str, s)) for s in pos))
        lines.append(f"  segments  requests {rank.seg_req_idx.tolist()}, seq_lens {rank.seq_lens.tolist()}")
    lines.append(f"per-rank counts {list(plan.per_rank_num_tokens)}, dispatch count N = {plan.num_tokens_padded}")
    lines.append(f"padded_gather_idx  {plan.padded_gather_idx.tolist()}")
    lines.append(f"kv_write_mask      {plan.kv_write_mask.astype(int).tolist()}")
    lines.append(f"hidden_restore_idx {plan.hidden_restore_idx.tolist()}")
    return "\n".join(lines)


def _add_states(sub) -> None:
    p = sub.add_parser("states", help="print the transition table as a Mermaid stateDiagram-v2")
    p.set_defaults(func=_cmd_states)


def _cmd_states(args) -> int:
    from runner_fsm.states import mermaid

    print(mermaid(), end="")
    return 0


_MODEL_SHAPE_FLAGS = ("layers", "hidden", "heads", "kv_heads", "experts", "top_k", "vocab", "intermediate")


def _add_make_model(sub) -> None:
    p = sub.add_parser("make-model", help="write a tiny random Mixtral checkpoint (no network)")
    p.add_argument("dir", help="output directory: config.json, model.safetensors, tokenizer files")
    for name in _MODEL_SHAPE_FLAGS:
        p.add_argument("--" + name.replace("_", "-"), dest=name, type=int, default=None)
    p.add_argument("--seed", type=int, default=0, help="weights are a function of the seed")
    p.add_argument("--draft", action="store_true", help="the smaller draft defaults (same vocab)")
    p.set_defaults(func=_cmd_make_model)


def _cmd_make_model(args) -> int:
    from runner_fsm.model_files.make import DRAFT_SPEC, TARGET_SPEC, make_random_model, with_overrides

    base = DRAFT_SPEC if args.draft else TARGET_SPEC
    spec = with_overrides(base, **{name: getattr(args, name) for name in _MODEL_SHAPE_FLAGS})
    cfg = make_random_model(args.dir, spec, seed=args.seed)
    print(f"wrote {args.dir}: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, {cfg.num_attention_heads}"
          f" heads ({cfg.num_key_value_heads} kv) of {cfg.head_dim}, {cfg.num_local_experts} experts top-"
          f"{cfg.num_experts_per_tok}, vocab {cfg.vocab_size}, seed {args.seed}")
    return 0


def _add_replay(sub) -> None:
    p = sub.add_parser("replay", help="judge a run from its audit logs (exit 0 sound, 1 findings, 2 unreadable)")
    p.add_argument("run_dir", metavar="RUN_DIR", nargs="+",
                   help="directory holding rank-<global_rank>.jsonl files; several (e.g. one per node of a"
                        " job on several machines) are judged as one run. A folder of runs (e.g. runs/demo),"
                        " or directories that are each a whole run: every run judged, one line each (exit"
                        " status the worst; --json: a list of reports)")
    p.add_argument("--json", action="store_true", help="print the verdicts and a summary as JSON")
    p.add_argument("--plot", metavar="FILE", help="write a timeline picture (needs matplotlib)")
    p.add_argument("--limit", type=int, default=20, help="verdicts listed in the human report (default 20)")
    p.add_argument("--jobs", type=int, default=None,
                   help="processes, each judging a range of steps (default: 1 for small runs, else one per CPU)")
    p.add_argument("--world-size", type=int, default=None, metavar="N",
                   help="the job's world size: every rank below N must have left a Flight Recorder dump (a gloo"
                        " job's dumps name no group members) or an audit log; audit logs that declare the"
                        " job's shape must agree with it")
    p.add_argument("--perfetto", metavar="TRACE.json",
                   help="also write the run as a trace for ui.perfetto.dev / chrome://tracing")
    window = p.add_mutually_exclusive_group()
    window.add_argument("--last", type=int, metavar="N",
                        help="judge the last N steps only (seeks: the logs are not read from the start)")
    window.add_argument("--steps", type=_step_range, metavar="A:B", help="judge steps A..B only (both included)")
    p.set_defaults(func=_cmd_replay)


def _step_range(text: str) -> tuple[int, int]:
    from runner_fsm.replay.coverage import parse_steps

    try:
        return parse_steps(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _cmd_replay(args) -> int:
    from runner_fsm.replay.discover import Run
    from runner_fsm.replay.flight import flight_only
    from runner_fsm.replay.judge import replay, replay_with_plot
    from runner_fsm.replay.progress import TerminalProgress
    from runner_fsm.replay.runs import find_runs, print_runs

    runs = find_runs(args.run_dir)
    if runs is not None:  # a folder of several runs
        return print_runs(args.run_dir, runs, as_json=args.json, jobs=args.jobs, steps=args.steps, last=args.last,
                          plot=args.plot, perfetto=args.perfetto, world_size=args.world_size)
    # The run found once, for the judgement, the picture and the trace alike (Flight Recorder
    # dumps alone have no ranks to find: replay reads them itself)
    run = args.run_dir if flight_only(args.run_dir) else Run.find(args.run_dir)
    window = {"steps": args.steps, "last": args.last}
    progress = TerminalProgress()  # on stderr, only when it is a terminal
    try:
        if args.plot:
            report = replay_with_plot(run, args.plot, jobs=args.jobs, world_size=args.world_size, **window)
        else:
            report = replay(run, jobs=args.jobs, world_size=args.world_size, progress=progress, **window)
    finally:
        progress.close()
    if args.perfetto:  # the same verdicts, as instants on the ranks' timelines
        from runner_fsm.replay.perfetto import export_perfetto

        export_perfetto(run, args.perfetto, report)
    if args.json:
        print(json.dumps(report.as_dict(), indent=1))
    else:
        print(report.format(limit=args.limit))
    return report.exit_code


def _add_log(sub) -> None:
    p = sub.add_parser("log", help="print a run's audit records in full, one JSON object per line",
                       description="Print the audit records of RUN_DIR in full (DESIGN section 7: schema,"
                                   " run_id, seq, t_ns, dp_rank, pcp_rank, event, step_id and the event's"
                                   " fields; the compact on-disk format expanded), one JSON object per line,"
                                   " across rotated (rank-<g>.<k>.jsonl) and compressed (.jsonl.gz) segments."
                                   " Without --rank: every rank, rank by rank in global-rank order, each"
                                   " rank's records in the order it wrote them. With --steps or --last, each"
                                   " rank's output keeps the records of those steps, after the `job` record"
                                   " that heads each segment they come from. Exit status 0, or 2 when the"
                                   " logs cannot be read (one line on stderr).")
    p.add_argument("run_dir", metavar="RUN_DIR", nargs="+",
                   help="directory holding rank-<global_rank>.jsonl files; several (one per node of a job)"
                        " are read as one run, as replay reads them")
    p.add_argument("--rank", type=int, action="append", metavar="R",
                   help="only global rank R (repeat for several); default: every rank")
    window = p.add_mutually_exclusive_group()
    window.add_argument("--steps", type=_step_range, metavar="A:B",
                        help="only steps A..B (both included, as replay --steps)")
    window.add_argument("--last", type=_positive, metavar="N",
                        help="only the last N steps of each rank's own log")
    p.set_defaults(func=_cmd_log)


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive number of steps, got {text!r}")
    return value


def _cmd_log(args) -> int:
    from runner_fsm.replay.show_log import print_log

    return print_log(args.run_dir, ranks=args.rank, steps=args.steps, last=args.last)


def _add_vllm_check(sub) -> None:
    p = sub.add_parser("vllm-check", help="check every vLLM name the worker uses against a vLLM source tree"
                                          " (exit 0 all hold, 1 some moved, 2 unreadable)",
                       description="Check every vLLM name, signature and pinned source digest that FSMWorker"
                                   " relies on against a vLLM source tree, read statically (vLLM is never"
                                   " imported: a tree for another release or device works): one line per"
                                   " group that holds, one per name that moved. Run it before upgrading"
                                   " vLLM. Exit status 0 when every name holds, 1 when one moved, 2 when"
                                   " the tree cannot be read.")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--source", metavar="PATH",
                       help="a directory holding vllm/ (an unpacked wheel or sdist), or vllm/ itself")
    where.add_argument("--installed", action="store_true",
                       help="the vLLM installed for this Python (found without importing it)")
    p.set_defaults(func=_cmd_vllm_check)


def _cmd_vllm_check(args) -> int:
    from runner_fsm.integrations.vllm.vllm_check import run

    return run(args.source, installed=args.installed)


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr (exit status 2), like every user error."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="runner-fsm", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    _add_plan(sub)
    add_demo(sub)
    add_run(sub)
    _add_states(sub)
    _add_make_model(sub)
    _add_replay(sub)
    _add_log(sub)
    _add_vllm_check(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except RunnerError as exc:  # a user error: one line, exit status 2
        print(f"runner-fsm {args.command}: {type(exc).__name__}: {_one_line(exc)}", file=sys.stderr)
        return 2
    except OSError as exc:  # a path the user named that cannot be read or written
        print(f"runner-fsm {args.command}: {type(exc).__name__}: {_one_line(exc)}", file=sys.stderr)
        return 2


def _one_line(exc: BaseException) -> str:
    return " / ".join(line.strip() for line in str(exc).splitlines() if line.strip())


if __name__ == "__main__":
    sys.exit(main())
