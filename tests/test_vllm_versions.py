"""Which vLLM releases the package knows (`common/versions.py`), the tables chosen by release, and
the gate at the worker's start: a release never checked stops with one message, unless the user
sets the override; then the run says what it turned off. No vLLM needed (the real run through
the worker is tests/test_vllm_version_gate.py). Mutation seen to fail 4 of them: `gate` letting
every release through (returning None before its `known` test)."""

from __future__ import annotations

import pytest

from runner_fsm.integrations.vllm.common import versions
from runner_fsm.integrations.vllm.common.versions import KNOWN, UNCHECKED_ENV, VLLMVersionError


@pytest.mark.parametrize("version, release", [("0.33.0", "0.33.0"), ("0.33.0+cu129", "0.33.0"),
                                              ("0.32.0.dev12+g1234", "0.32.0"), ("0.33", "0.33.0"),
                                              ("(not importable)", "(not importable)")])
def test_release_of_a_version_string(version, release):
    assert versions.release(version) == release


def test_pick_chooses_the_release_else_the_newest_not_newer():
    tables = {"0.32.0": "a", "0.33.0": "b"}
    assert [versions.pick(tables, v) for v in ("0.32.0", "0.33.0+cu129", "0.34.2", "0.31.0", "?")] == \
        ["a", "b", "b", "a", "a"]


@pytest.mark.parametrize("version", KNOWN)
def test_a_known_release_passes_the_gate_silently(version, capsys):
    assert versions.gate(version, {}) is None
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("version", ["0.34.0", "0.31.2", "1.0.0rc1"])
def test_an_unknown_release_stops_with_one_message(version):
    with pytest.raises(VLLMVersionError) as caught:
        versions.gate(version, {UNCHECKED_ENV: "0"})
    message = str(caught.value)
    assert f"the installed vLLM is {version}" in message
    assert "checked against vLLM 0.32.0, 0.33.0" in message
    assert f"{UNCHECKED_ENV}=1" in message and "runner-fsm vllm-check --installed" in message


def test_the_override_runs_it_saying_what_is_off(capsys):
    note = versions.gate("0.34.1", {UNCHECKED_ENV: "1"})
    assert note["version"] == "0.34.1" and note["tables"] == "0.33.0" and note["known"] == list(KNOWN)
    assert [item.split(" ")[0] for item in note["turned_off"]] == ["draft_dp_sync", "fast_pcp_layout"]
    err = capsys.readouterr().err
    assert err.startswith("runner_fsm: vLLM 0.34.1 is not a release this package was checked against")
    assert "with vLLM 0.33.0's tables; turned off: draft_dp_sync" in err


def test_the_vllm_extras_bound_is_the_releases_known():
    """`pip install runner_fsm[vllm]` installs only a release the gate lets through."""
    import tomllib
    from pathlib import Path

    project = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())["project"]
    minors = sorted({tuple(int(p) for p in v.split(".")[:2]) for v in KNOWN})
    low, high = minors[0], minors[-1]
    assert project["optional-dependencies"]["vllm"] == [f"vllm>={low[0]}.{low[1]},<{high[0]}.{high[1] + 1}"]
