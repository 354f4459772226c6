"""How verdicts name a collective: `dp all_reduce DRAFT_PREFILL`, `pcp all_gather phase 0`."""

from __future__ import annotations


def phase_label(group: str, phase) -> str:
    # Phases are the step phases of DESIGN section 5 in every group that logs them (the
    # expert group's forward runs in TARGET, its draft forwards in DRAFT_*). Imported here,
    # on the path that formats a finding, so that a sound replay never loads torch (dp's import).
    from runner_fsm.dp import PHASE_NAMES

    if group in ("dp", "expert") and phase in PHASE_NAMES:
        return PHASE_NAMES[phase]
    return f"phase {phase}"


def label(group: str, op: str, phase) -> str:
    return f"{group} {op} {phase_label(group, phase)}"


def key_label(group: str, key: tuple) -> str:
    """A sequence key (op, phase, shapes) as text."""
    op, phase, shapes = key
    text = f"{op} {phase_label(group, phase)}"
    return text if shapes is None else f"{text} {_shapes_text(shapes)}"


def sequence_label(group: str, keys) -> str:
    return "[" + ", ".join(key_label(group, key) for key in keys) + "]" if keys else "nothing"


def _shapes_text(shapes) -> str:
    if isinstance(shapes, tuple):
        return "[" + ", ".join(_shapes_text(s) for s in shapes) + "]"
    return str(shapes)
