"""The plugin vLLM loads in its engine cores (`integrations.vllm.engine_stops`), without vLLM: a
process named as vLLM names its engine cores registers the plugin in front of its own SIGTERM
handler, starts a worker that joins it (`WorkerNotice`), and is SIGTERMed, then both are
SIGKILLed at once, children first, as `vllm serve` does on SIGTERM to the server. The worker
never got a signal from outside, yet its log holds the engine core's SIGTERM.

Mutation seen to fail it: `tell_workers` not signalling the registered workers.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
import tomllib
from pathlib import Path

import pytest

from runner_fsm.audit import read_records

pytestmark = pytest.mark.multiproc


def _worker(run_dir: str, ready, blocked: bool) -> None:
    from runner_fsm.audit import AuditLog
    from runner_fsm.integrations.vllm.engine_stops import NOTICE, WorkerNotice

    log = AuditLog(run_dir, "r", 0, 0, 0)
    notice = WorkerNotice(lambda name: log.stop(4, "signal", name, detail="told by the engine core"))
    ready.put(notice.install())
    _idle(blocked, NOTICE)


def _idle(blocked: bool, signum: int) -> None:
    if blocked:  # as inside a collective: the main thread cannot run a Python handler
        signal.pthread_sigmask(signal.SIG_BLOCK, {signum})
        time.sleep(3600)
    while True:
        time.sleep(0.01)  # idle, as between steps: the handler runs at once


def _engine(run_dir: str, ready, worker_pid, blocked: bool) -> None:
    from runner_fsm.integrations.vllm.engine_stops import register

    signal.signal(signal.SIGTERM, lambda *_: None)  # vLLM's engine-core handler, installed first
    register()
    context = multiprocessing.get_context("spawn")
    worker = context.Process(target=_worker, args=(run_dir, ready, blocked), name="VLLM::Worker_DP0")
    worker.start()
    worker_pid.value = worker.pid
    _idle(blocked, signal.SIGTERM)


@pytest.mark.parametrize("blocked", [False, True], ids=["idle", "both-blocked-in-c"])
def test_an_engine_core_s_sigterm_reaches_its_workers_log_before_the_kill(tmp_path, monkeypatch, blocked):
    """both-blocked-in-c: the engine core's main thread and the worker's wait in C (a DP
    all-reduce, a collective): the engine core's watch thread tells the worker, whose watch
    thread records it (`signal_watch`). Mutation seen to fail that case: `WATCH.subscribe`
    returning None (no watch: handlers only)."""
    temp = tmp_path / "tmp"  # vLLM kills engine cores and workers: nothing of theirs may be in a temp dir
    temp.mkdir()
    monkeypatch.setenv("TMPDIR", str(temp))
    context = multiprocessing.get_context("spawn")
    ready, worker_pid = context.Queue(), context.Value("i", 0)
    engine = context.Process(target=_engine, args=(str(tmp_path), ready, worker_pid, blocked),
                             name="EngineCore_DP0")
    engine.start()
    try:
        assert ready.get(timeout=60) is True  # the worker found its engine core's registry
        os.kill(engine.pid, signal.SIGTERM)
        time.sleep(0.2)
    finally:
        for pid in (worker_pid.value, engine.pid):  # vLLM's kill_process_tree: children first
            if pid:
                os.kill(pid, signal.SIGKILL)
        engine.join(10)
    assert list(temp.iterdir()) == []  # the registry was in no file system (`EngineRegistry`)
    records = list(read_records(tmp_path / "rank-0.jsonl"))
    assert [(r["event"], r["signal"], r["detail"]) for r in records] == [("stop", "SIGTERM", "told by the engine core")]


def test_the_plugin_is_inert_outside_an_engine_core(monkeypatch):
    from runner_fsm.integrations.vllm import engine_stops

    monkeypatch.delenv(engine_stops.REGISTRY_ENV, raising=False)
    before = signal.getsignal(signal.SIGTERM)
    engine_stops.register()  # the main process of pytest: not an engine core
    assert signal.getsignal(signal.SIGTERM) == before and engine_stops.REGISTRY_ENV not in os.environ
    assert engine_stops.WorkerNotice(lambda name: None).install() is False  # no engine core published one


def test_the_package_declares_the_plugin_to_vllm():
    """vLLM finds them by these entry points only: without them the engine core stays silent, and
    the front process records no stop request (`stop_origin`)."""
    pyproject = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())
    plugins = pyproject["project"]["entry-points"]["vllm.general_plugins"]
    assert plugins == {"runner_fsm_stops": "runner_fsm.integrations.vllm.engine_stops:register",
                       "runner_fsm_stop_origin": "runner_fsm.integrations.vllm.stop_origin:register"}


def _failing_worker(run_dir: str, ready) -> None:
    from runner_fsm.audit import AuditLog
    from runner_fsm.integrations.vllm.engine_stops import WorkerStops

    log = AuditLog(run_dir, "r", 0, 0, 0)
    recorder = type("Recorder", (), {"audit": log, "step_id": 11})()  # what `WorkerStops.into` reads
    stops = WorkerStops.into(recorder)
    stops.install()
    ready.put(stops.notice._registry is not None)
    _idle(False, signal.SIGTERM)


def _failing_engine(run_dir: str, ready, registered, worker_pid) -> None:
    import logging

    from runner_fsm.integrations.vllm.engine_stops import register

    signal.signal(signal.SIGTERM, lambda *_: None)  # vLLM's engine-core handler, installed first
    register()
    context = multiprocessing.get_context("spawn")
    worker = context.Process(target=_failing_worker, args=(run_dir, registered), name="VLLM::Worker_DP0")
    worker.start()
    worker_pid.value = worker.pid
    assert registered.get(timeout=60)  # the worker registered: now the busy loop fails, as vLLM logs it
    try:
        raise RuntimeError("the scheduler failed at call 12")
    except RuntimeError:
        logging.getLogger("vllm.v1.engine.core").exception("EngineCore encountered a fatal error.")
    ready.put("failed")
    _idle(False, signal.SIGTERM)


def test_an_engine_core_failure_reaches_its_workers_as_a_fault_before_the_teardown(tmp_path):
    """The engine core fails (vLLM logs its fatal error with the exception), then vLLM tears it and
    its workers down (SIGTERM, SIGKILL): the worker's log holds a `fault` naming the failure, then
    the SIGTERM it was told of as a stop; replay reads the end as that failure (UNSOUND, the fault
    named), never as a stop someone asked for. Mutation: no `_FailureHandler` -> only the SIGTERM,
    replay SOUND."""
    from runner_fsm.replay.judge import replay

    context = multiprocessing.get_context("spawn")
    ready, registered, worker_pid = context.Queue(), context.Queue(), context.Value("i", 0)
    engine = context.Process(target=_failing_engine, args=(str(tmp_path), ready, registered, worker_pid),
                             name="EngineCore_DP0")
    engine.start()
    try:
        assert ready.get(timeout=60) == "failed"
        time.sleep(0.3)
        os.kill(engine.pid, signal.SIGTERM)  # vLLM's shutdown of the failed engine core
        time.sleep(0.3)
    finally:
        for pid in (worker_pid.value, engine.pid):
            if pid:
                os.kill(pid, signal.SIGKILL)
        engine.join(10)
    records = list(read_records(tmp_path / "rank-0.jsonl"))
    assert [(r["event"], r.get("error"), r.get("signal")) for r in records] == [
        ("fault", "EngineCoreFailure", None), ("stop", None, "SIGTERM")], records
    assert "RuntimeError: the scheduler failed at call 12" in records[0]["message"]
    report = replay(tmp_path)
    # the failure, then the end it led to (killed in the teardown): the SIGTERM after it explains nothing
    assert not report.sound and [v.kind for v in report.verdicts] == ["fault", "unfinished"], report.format()
    assert "the scheduler failed at call 12" in report.verdicts[0].detail
    assert any("all follow a fault" in note for note in report.summary.notes), report.summary.notes


def test_notice_goes_only_to_the_process_that_registered():
    """A worker SIGKILLed leaves its line in the registry, and its pid may be another process's
    later: NOTICE goes to a pid only while the process holding it started when the line says.
    Mutation: `tell_workers` without the start-time check -> the stranger is told."""
    import subprocess
    import sys

    from runner_fsm.integrations.vllm.engine_stops import EngineRegistry, process_start, tell_workers

    child = subprocess.Popen([sys.executable, "-c", (
        "import signal, sys, time\n"
        "signal.signal(signal.SIGWINCH, lambda *_: print('told', flush=True))\n"
        "print('ready', flush=True)\n"
        "time.sleep(3)\n")], stdout=subprocess.PIPE, text=True)
    registry = EngineRegistry.create()
    try:
        assert child.stdout.readline().strip() == "ready"
        registry.append(f"worker {child.pid} 1")  # registered by a process that started at another time
        tell_workers(registry, "SIGTERM")
        registry.append(f"worker {child.pid} {process_start(child.pid)}")  # by this very process
        tell_workers(registry, "SIGTERM")
        out, _ = child.communicate(timeout=30)
    finally:
        child.kill()
        registry.close()
    assert out.split() == ["told"], out  # once: the second notice only


def test_a_registry_is_joined_only_through_the_engine_core_that_made_it():
    """The address names a pid, its start time and a descriptor: a pid held by another process
    now, or a descriptor that is another file, joins nothing (a worker would otherwise register
    with a stranger). Mutation: `join` without the header check -> the other file is joined."""
    from runner_fsm.integrations.vllm.engine_stops import EngineRegistry, process_start

    registry = EngineRegistry.create()
    me, fd = os.getpid(), registry.fd
    joined = EngineRegistry.join(registry.address)
    assert joined is not None and joined.lines() == [f"engine {me} {process_start(me)}"]
    joined.append("worker 4194303 7")
    assert registry.workers() == [(4194303, "7")]  # one file, both ends
    joined.close()
    other = os.memfd_create("another")
    try:
        assert EngineRegistry.join(f"{me}:1:{fd}") is None  # the pid is another process's now
        assert EngineRegistry.join(f"{me}:{process_start(me)}:{other}") is None  # not a registry
        assert EngineRegistry.join("") is None and EngineRegistry.join(None) is None
    finally:
        os.close(other)
        registry.close()
