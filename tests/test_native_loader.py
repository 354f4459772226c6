"""How `runner_fsm.pcp.native` loads the compiled layout: once, under a lock; only a library
built from the `_mrv2_layout.c` beside it; any failure leaves plans to numpy, with the reason.

Each test points the loader at libraries and sources of its own (the module's paths, and its
loaded state reset, monkeypatched back afterwards). The libraries are built with the C compiler
this tier needs anyway (`$CC`, else `cc`), as the Makefile builds the real one.
"""

import hashlib
import os
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from runner_fsm.errors import BatchError
from runner_fsm.pcp import native
from runner_fsm.pcp.plan import plan_batch

BATCH = ([900, 1, 1, 700], [True, False, False, True], [0, 5, 5, 0], 2)


def compile_library(source: Path, library: Path, digest: str | None = None) -> Path:
    digest = digest or hashlib.sha256(source.read_bytes()).hexdigest()[:16]
    subprocess.run([os.environ.get("CC", "cc"), "-O1", "-shared", "-fPIC", f'-DMRV2_SOURCE_DIGEST="{digest}"',
                    "-o", str(library), str(source)], check=True)
    return library


@pytest.fixture
def loader(monkeypatch, tmp_path):
    """Point the loader at tmp_path/_mrv2_layout.{c,so}, not loaded yet."""
    source = tmp_path / "_mrv2_layout.c"
    source.write_bytes(native.SOURCE.read_bytes())
    monkeypatch.setattr(native, "SOURCE", source)
    monkeypatch.setattr(native, "LIBRARY", tmp_path / "_mrv2_layout.so")
    monkeypatch.setattr(native, "BUILD_ERROR", tmp_path / "_mrv2_layout.build-error")
    monkeypatch.setattr(native, "_state", None)
    monkeypatch.delenv("RUNNER_FSM_NATIVE", raising=False)
    return tmp_path


def assert_plans_in_numpy(reason: str) -> None:
    assert native.status() == {"native": False, "reason": reason}
    plan = plan_batch(*BATCH, chunking="mrv2")  # the default: the compiled layout where it loads
    expected = plan_batch(*BATCH, chunking="mrv2", native=False)
    assert plan.padded_gather_idx.tolist() == expected.padded_gather_idx.tolist()
    with pytest.raises(BatchError, match="native=True, but the compiled layout is not available: "):
        plan_batch(*BATCH, chunking="mrv2", native=True)


def test_the_library_built_from_the_source_beside_it_loads(loader):
    """The control for the tests below: their set-up loads a good library."""
    compile_library(native.SOURCE, native.LIBRARY)
    assert native.status() == {"native": True}
    assert plan_batch(*BATCH, chunking="mrv2", native=True).num_tokens_padded == 801


def test_a_library_lacking_a_function_is_not_loaded_and_says_which(loader):
    """Mutation that fails it: `_load` catching only OSError (the AttributeError escapes)."""
    stub = loader / "stub.c"
    stub.write_text('#include <stdint.h>\n'
                    'const char *mrv2_layout_source_digest(void) { return MRV2_SOURCE_DIGEST; }\n'
                    'int64_t mrv2_dispatch_count(void) { return 0; }\n')
    compile_library(stub, native.LIBRARY, digest=native.source_digest())
    reason = native.status()["reason"]
    assert reason.startswith("_mrv2_layout.so does not load: AttributeError: ") and "mrv2_plan" in reason
    assert_plans_in_numpy(reason)


def test_a_library_built_from_other_source_is_not_loaded(loader):
    """A library left from before an edit of the source. Mutation that fails it: `_load`
    without the digest comparison (the stale library loads)."""
    compile_library(native.SOURCE, native.LIBRARY)
    built_from = native.source_digest()
    native.SOURCE.write_text(native.SOURCE.read_text() + "/* edited after the build */\n")
    assert_plans_in_numpy(f"_mrv2_layout.so was built from other source (sha256 {built_from}...) than the"
                          f" _mrv2_layout.c beside it ({native.source_digest()}...): rebuild it")


def test_a_file_that_is_no_library_is_not_loaded(loader):
    native.LIBRARY.write_text("not a shared library")
    reason = native.status()["reason"]
    assert reason.startswith("_mrv2_layout.so does not load: OSError: ")
    assert_plans_in_numpy(reason)


def test_a_package_installed_without_the_library_says_why(loader):
    """Where the package's build failed (no C compiler), setup.py left its error beside the
    package; a checkout that was never built says how to build it."""
    assert_plans_in_numpy("_mrv2_layout.so is not built (in a checkout `make` builds it; pip install builds it"
                          " where a C compiler is)")
    native._state = None
    native.BUILD_ERROR.write_text("building runner_fsm/pcp/_mrv2_layout.c failed: CompileError: no cc\n")
    assert_plans_in_numpy("_mrv2_layout.so was not built when this package was installed: building"
                          " runner_fsm/pcp/_mrv2_layout.c failed: CompileError: no cc. Installing it where a C"
                          " compiler is builds it")


def test_it_is_loaded_once_and_a_concurrent_caller_waits_for_it(loader, monkeypatch):
    """Eight threads plan with native=True while the library takes 0.3 s to load: every one gets
    a compiled plan, and the library is opened once. Mutations that fail it: the lock dropped
    (each thread opens it), the state set before the library is loaded (the others read
    "not available: None")."""
    compile_library(native.SOURCE, native.LIBRARY)
    opened, real_cdll = [], native.ctypes.CDLL

    def slow_cdll(path, *args, **kwargs):
        opened.append(path)
        time.sleep(0.3)
        return real_cdll(path, *args, **kwargs)
    monkeypatch.setattr(native.ctypes, "CDLL", slow_cdll)
    start, results = threading.Barrier(8), []

    def plan():
        start.wait()
        try:
            results.append(plan_batch(*BATCH, chunking="mrv2", native=True).num_tokens_padded)
        except Exception as error:  # noqa: BLE001 - the test reports what any thread got
            results.append(repr(error))
    threads = [threading.Thread(target=plan) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert results == [801] * 8 and opened == [str(native.LIBRARY)]


def test_the_library_in_use_was_built_from_this_checkout():
    """The real one (not the fixture's): its stamp is the digest of the source beside it."""
    lib = native.library()
    assert lib is not None, native.status()
    assert lib.mrv2_layout_source_digest().decode() == native.source_digest() == hashlib.sha256(
        native.SOURCE.read_bytes()).hexdigest()[:16]
    assert np.array_equal(plan_batch(*BATCH, chunking="mrv2", native=True).hidden_restore_idx,
                          plan_batch(*BATCH, chunking="mrv2", native=False).hidden_restore_idx)
