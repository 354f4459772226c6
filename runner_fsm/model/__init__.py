"""The reference model: a Mixtral-architecture MoE decoder and its replicated drafter.

PCP-parallel attention over a paged KV cache (every PCP rank holds the whole cache), experts
parallel over every rank (DP x PCP) with a checked exchange, Hugging Face checkpoints.
"""

from runner_fsm.errors import DispatchCountError, UnsupportedModelError, WeightsError
from runner_fsm.model.drafter import MixtralDrafter
from runner_fsm.model.loader import load_drafter, load_model, model_groups
from runner_fsm.model.model import MixtralModel
from runner_fsm.model.parallel import ModelGroups, resolve_device
from runner_fsm.model_files.hf_config import MixtralConfig
from runner_fsm.model_files.make import DRAFT_SPEC, TARGET_SPEC, ModelSpec, make_random_model

__all__ = [
    "DRAFT_SPEC", "TARGET_SPEC", "DispatchCountError", "MixtralConfig", "MixtralDrafter",
    "MixtralModel", "ModelGroups", "ModelSpec", "UnsupportedModelError", "WeightsError",
    "load_drafter", "load_model", "make_random_model", "model_groups", "resolve_device",
]
