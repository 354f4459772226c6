"""The vLLM releases this package was checked against, and how a table that differs between them
is chosen.

Every vLLM name, signature and pinned source digest the worker relies on sits in a table (the
schema's, the DP hooks', the PCP manager's, the pins of the two changes of vLLM behaviour). Where
a release moved something, the table is a mapping from release to that release's table, and
`pick` chooses by the installed release. The same tables are read by the start-up checks (on the
imported vLLM) and by `runner-fsm vllm-check` (on a vLLM source tree): one table, two users.

A release not in `KNOWN` stops the worker at start-up (`gate`), unless the user sets
`RUNNER_FSM_VLLM_UNCHECKED=1`: the run then goes on with the tables of the newest known release
not newer than it, and every change of vLLM behaviour whose pins cannot be verified turned off
(each one says so in the `job` record, and the gate on stderr).
"""

from __future__ import annotations

import os
import re
import sys
from typing import Mapping, TypeVar

from runner_fsm.integrations.vllm.common.errors import VLLMSchemaError

KNOWN = ("0.32.0", "0.33.0")  # checked against each one's released source (`runner-fsm vllm-check`)
UNCHECKED_ENV = "RUNNER_FSM_VLLM_UNCHECKED"

T = TypeVar("T")


class VLLMVersionError(VLLMSchemaError):
    """The installed vLLM is a release this package was not checked against."""


def release(version: str) -> str:
    """The release a version string names: "0.33.0+cu129" and "0.33.0.dev12" are "0.33.0"."""
    match = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version)
    if match is None:
        return version
    major, minor, patch = match.groups()
    return f"{major}.{minor}.{patch or 0}"


def _key(version: str) -> tuple[int, ...]:
    rel = release(version)
    return tuple(int(part) for part in rel.split(".")) if re.fullmatch(r"[\d.]+", rel) else (0,)


def known(version: str) -> bool:
    return release(version) in KNOWN


def pick(tables: Mapping[str, T], version: str) -> T:
    """The table for `version`'s release; for a release with none of its own (an unchecked vLLM
    run under the override), the newest not newer than it, else the oldest."""
    rel = release(version)
    if rel in tables:
        return tables[rel]
    older = [v for v in tables if _key(v) <= _key(rel)]
    return tables[max(older, key=_key) if older else min(tables, key=_key)]


def nearest(version: str) -> str:
    """The known release whose tables serve `version` (its own where known: `pick`)."""
    return pick({v: v for v in KNOWN}, version)


def unchecked_allowed(environ: Mapping[str, str] | None = None) -> bool:
    value = (os.environ if environ is None else environ).get(UNCHECKED_ENV, "")
    return value.strip().lower() not in ("", "0", "false", "no")


def gate(version: str, environ: Mapping[str, str] | None = None, *, stderr=None) -> dict | None:
    """At the worker's start: None for a known release; `VLLMVersionError` for another, unless
    the override is set, then what the run does about it (for the `job` record, also on stderr)."""
    if known(version):
        return None
    if not unchecked_allowed(environ):
        raise VLLMVersionError(
            f"runner_fsm was checked against vLLM {', '.join(KNOWN)}; the installed vLLM is {version}."
            f" `runner-fsm vllm-check --installed` lists what holds and what moved in it. To run anyway,"
            f" with every change of vLLM behaviour that cannot be verified turned off:"
            f" {UNCHECKED_ENV}=1")
    tables = nearest(version)
    note = {"version": version, "known": list(KNOWN), "tables": tables,
            "override": f"{UNCHECKED_ENV}=1",
            "turned_off": ["draft_dp_sync (pinned to a checked release)",
                           "fast_pcp_layout (pinned to a checked release)"]}
    print(f"runner_fsm: vLLM {version} is not a release this package was checked against"
          f" ({', '.join(KNOWN)}); running anyway ({UNCHECKED_ENV} is set) with vLLM {tables}'s tables;"
          f" turned off: {', '.join(note['turned_off'])}", file=stderr or sys.stderr, flush=True)
    return note
