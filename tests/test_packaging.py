"""The package's own build carries its compiled part (setup.py): the PCP layout. An sdist holds
its source, a wheel built from that sdist holds the library, and a fresh venv with the wheel
installed plans natively, equal to numpy; built where no C compiler is, the wheel still builds
and installs, and plans in numpy, saying why.

The builds use this venv's setuptools (`--no-build-isolation`: no network) on a copy of the
package's files; the fresh venvs get this venv's site-packages through a .pth for numpy and
the other dependencies (the wheel is installed with `--no-deps`), and never see this
checkout: the child runs from the venv's directory without PYTHONPATH.
"""

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import textwrap
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PLAN_IN_CHILD = textwrap.dedent("""
    import json
    import runner_fsm
    from runner_fsm.errors import BatchError
    from runner_fsm.pcp import native
    from runner_fsm.pcp.plan import plan_batch

    batch = ([900, 1, 3, 700, 0], [True, False, False, True, False], [0, 5, 5, 0, 2], 4)
    default, numpy = plan_batch(*batch, chunking="mrv2"), plan_batch(*batch, chunking="mrv2", native=False)
    try:
        plan_batch(*batch, chunking="mrv2", native=True)
        refused = None
    except BatchError as error:
        refused = str(error)
    print(json.dumps({
        "package": runner_fsm.__file__, "status": native.status(), "refused": refused,
        "equal": all(getattr(default, name).tolist() == getattr(numpy, name).tolist()
                     for name in ("padded_gather_idx", "kv_write_mask", "hidden_restore_idx")),
    }))
""")

pytestmark = pytest.mark.slow  # about 5 s each: two pip runs and a build


def run(cmd, **kwargs) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=300, **kwargs)
    assert proc.returncode == 0, f"{cmd} exited {proc.returncode}: {proc.stdout[-1500:]} {proc.stderr[-1500:]}"
    return proc


def package_copy(root: Path) -> Path:
    """What an sdist is built from: the metadata, setup.py, the README and the package."""
    src = root / "src"
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(REPO / name, src / name)
    shutil.copytree(REPO / "runner_fsm", src / "runner_fsm",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.dll", "*.build-error"))
    return src


def build_wheel(source: Path, out: Path, env: dict | None = None) -> Path:
    run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", out, source],
        env=env)
    (wheel,) = out.glob("runner_fsm-*.whl")
    return wheel


def install_in_fresh_venv(wheel: Path, root: Path) -> Path:
    venv = root / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", venv])
    python = venv / "bin" / "python"
    site = Path(run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip())
    ours = {sysconfig.get_paths()[key] for key in ("purelib", "platlib")}
    (site / "dependencies.pth").write_text("".join(f"{path}\n" for path in sorted(ours)))
    run([sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps", "--no-index", wheel])
    return python


def plan_in(python: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RUNNER_FSM_NATIVE")}
    out = run([python, "-c", PLAN_IN_CHILD], cwd=python.parent, env=env).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_a_wheel_built_from_the_sdist_plans_natively_in_a_fresh_venv(tmp_path):
    """Mutations that fail it: setup.py without the Extension (no library in the wheel),
    `get_ext_filename` left to setuptools (the library's name has a Python tag that native.py
    does not look for). The source reaches the wheel twice over: pyproject.toml's package data,
    and setuptools' own rule (an extension's sources are package data)."""
    src = package_copy(tmp_path)
    sdist = run([sys.executable, "-c", "import setuptools.build_meta as b, sys; print(b.build_sdist(sys.argv[1]))",
                 tmp_path / "sdist"], cwd=src).stdout.strip().splitlines()[-1]
    with tarfile.open(tmp_path / "sdist" / sdist) as archive:
        names = {Path(*Path(name).parts[1:]).as_posix() for name in archive.getnames()}
    assert {"setup.py", "pyproject.toml", "runner_fsm/pcp/_mrv2_layout.c"} <= names
    wheel = build_wheel(tmp_path / "sdist" / sdist, tmp_path / "wheels")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
    assert {"runner_fsm/pcp/_mrv2_layout.c", "runner_fsm/pcp/_mrv2_layout.so"} <= names
    assert not [name for name in names if name.endswith((".pyd", ".dll")) or ".cpython" in name]  # one compiled part
    got = plan_in(install_in_fresh_venv(wheel, tmp_path))
    assert got["package"].startswith(str(tmp_path / "venv"))
    assert (got["status"], got["refused"], got["equal"]) == ({"native": True}, None, True)


def test_without_a_c_compiler_the_wheel_installs_and_plans_in_numpy_saying_why(tmp_path):
    """No compiler on PATH and CC naming a missing one: the build warns, the wheel holds the
    build's error instead of the library. Mutations that fail it: setup.py's build_extension
    not catching the compiler's error (the Extension being optional, setuptools then only warns:
    no note, and the reason does not say why; not optional either, pip wheel fails)."""
    src = package_copy(tmp_path)
    (tmp_path / "empty-bin").mkdir()
    env = {**os.environ, "CC": str(tmp_path / "no-such-cc"), "PATH": str(tmp_path / "empty-bin")}
    wheel = build_wheel(src, tmp_path / "wheels", env=env)
    with zipfile.ZipFile(wheel) as archive:
        assert "runner_fsm/pcp/_mrv2_layout.so" not in archive.namelist()
    got = plan_in(install_in_fresh_venv(wheel, tmp_path))
    assert got["package"].startswith(str(tmp_path / "venv")) and got["equal"] is True
    reason = got["status"]["reason"]
    assert got["status"]["native"] is False
    assert reason.startswith("_mrv2_layout.so was not built when this package was installed: building"
                             " runner_fsm/pcp/_mrv2_layout.c failed: ") and "no-such-cc" in reason
    assert reason.endswith("Installing it where a C compiler is builds it")
    assert got["refused"] == f"native=True, but the compiled layout is not available: {reason}"
