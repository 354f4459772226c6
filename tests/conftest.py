"""Fixtures shared by the test files that run the real model end to end."""

import pytest


@pytest.fixture(scope="session")
def models(tmp_path_factory):
    """A tiny random Mixtral target and draft (HF format), made once per test session."""
    from runner_fsm.model import DRAFT_SPEC, TARGET_SPEC, make_random_model

    root = tmp_path_factory.mktemp("models")
    make_random_model(root / "target", TARGET_SPEC, seed=11)
    make_random_model(root / "draft", DRAFT_SPEC, seed=12)
    return str(root / "target"), str(root / "draft")
