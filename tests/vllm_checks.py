"""Helpers of the vLLM test files: reading a run's audit log and journal, replaying it."""

from __future__ import annotations

import os
from pathlib import Path

from runner_fsm.audit import read_records


def records(run_dir, rank: int = 0) -> list[dict]:
    """The rank's records (a log its process never closed ends in blank lines: skipped)."""
    return list(read_records(Path(run_dir) / f"rank-{rank}.jsonl"))


def transitions(run_dir, rank: int = 0) -> list[str]:
    return [r["trigger"] for r in records(run_dir, rank) if r["event"] == "transition"]


def assert_replays_sound(run_dir):
    from runner_fsm.replay.judge import replay

    report = replay(run_dir)
    assert report.sound, report.format()
    return report


def log_tail(path, chars: int = 3000) -> str:
    """The end of a server's or node's log, for a failure message (what it said last)."""
    path = Path(path)
    text = path.read_text(errors="replace")[-chars:] if path.exists() else "(no log)"
    return f"--- the end of {path}:\n{text}"


def stop_note(report) -> str:
    """Replay's note of the run's stop ("stop requested: SIGINT ..."); fails naming the report."""
    notes = [n for n in report.summary.notes if n.startswith("stop requested")]
    assert notes, report.format()
    return notes[0]


def hf_greedy(model_dir: str, prompts: dict[str, list[int]], new_tokens: int) -> dict[str, list[int]]:
    """Hugging Face transformers' greedy continuation of each prompt (float32, no vLLM)."""
    import torch
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = {}
    for name, prompt in prompts.items():
        ids = torch.tensor([prompt])
        generated = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                   do_sample=False, pad_token_id=0)
        out[name] = generated[0, len(prompt):].tolist()
    return out


def mrv2_env(**extra: str) -> dict[str, str]:
    """What a child process needs in its environment to run vLLM's Model Runner V2 on this CPU
    (as `make test-vllm-mrv2` sets it): Triton's interpreter, and first on PYTHONPATH the
    test-only stand-in backend of tests/vllm_site, then this checkout; `extra` adds to it."""
    tests = Path(__file__).resolve().parent
    paths = [str(tests / "vllm_site"), str(tests.parent), os.environ.get("PYTHONPATH", "")]
    return {"VLLM_USE_V2_MODEL_RUNNER": "1", "TRITON_INTERPRET": "1",
            "PYTHONPATH": os.pathsep.join(filter(None, paths)), **extra}


def plugin_env(root: Path) -> dict[str, str]:
    """Environment for a vLLM child process in which vLLM finds this package's plugin
    (pyproject's `vllm.general_plugins` entry point, `engine_stops`). The installed metadata has
    it once the package is installed from this checkout; an editable install made before the
    plugin existed does not, and then a site directory declaring the same entry point, written
    from pyproject, goes first on PYTHONPATH."""
    import importlib.metadata
    import tomllib

    project = Path(__file__).resolve().parent.parent
    declared = tomllib.loads((project / "pyproject.toml").read_text())["project"]["entry-points"]["vllm.general_plugins"]
    installed = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="vllm.general_plugins")}
    if all(installed.get(name) == value for name, value in declared.items()):
        return {}
    site = Path(root) / "plugin-site"
    info = site / "runner_fsm_vllm_plugin-0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: runner-fsm-vllm-plugin\nVersion: 0\n")
    (info / "entry_points.txt").write_text("[vllm.general_plugins]\n" + "".join(
        f"{name} = {value}\n" for name, value in declared.items()))
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(site), str(project), os.environ.get("PYTHONPATH", "")]))}


def pid_writing(path: Path) -> int | None:
    """The process holding `path` open (a rank's audit log: its worker), from /proc."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fds = list((entry / "fd").iterdir())
            except OSError:
                continue
            for fd in fds:
                try:  # a descriptor closed since the listing skips itself, not its process
                    if os.readlink(fd) == str(path):
                        return int(entry.name)
                except OSError:
                    pass
    return None


def graph_records(run_dir, action: str, rank: int = 0) -> list[dict]:
    """The rank's `graph` records of `action` ("capture", "replay", "warmup")."""
    return [r for r in records(run_dir, rank) if r["event"] == "graph" and r["action"] == action]
