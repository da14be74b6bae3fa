"""That every rank runs the same job, checked once before any tensor moves.

Once every rank has built its stage, the ranks gather each other's :class:`JobIdentity` (the
plan digest, ``Plan.digest``: what to run, the report excluded; the model file's sha256; the
run settings; and whether the build failed); a rank that could not build, or whose plan,
model or settings differ (a stale ``plan.json`` on one node, another ``--steps``) is named,
with its node, in one line on every rank. With the same plan on both ends, the sender's
check of every boundary tensor against the plan (``comm.check_boundary_tensors``) is a check
against what the receiver expects, so no payload needs a header.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from hplan.runtime.contract.errors import ConfigError, PeerFailureError, error_reason
from hplan.runtime.contract.plan import Plan

__all__ = ["JobIdentity", "check_same_job"]


@dataclass(frozen=True)
class JobIdentity:
    """What one rank runs, as compared by :func:`check_same_job`."""

    plan_digest: str
    """``Plan.digest()`` of its plan.json."""
    plan_sections: Mapping[str, str]
    """``Plan.section_digests()``: which parts differ, when the digests do."""
    model_sha256: str | None
    """sha256 of its model file (None: the file could not be read)."""
    settings: Mapping[str, Any]
    """The run options every rank must share (``RunOptions.settings``), picklable values."""
    failure: str | None = None
    """Why this rank cannot run (its build failed: another model, a missing file ...), in
    one line; None when it built."""


def check_same_job(plan: Plan, rank: int, mine: JobIdentity) -> None:
    """Check that every rank built its stage and runs this plan, the same model file and
    the same settings (a collective over the whole job, before any tensor moves).

    Raises:
        ConfigError: on every rank, naming the ranks and nodes that could not build their
            stage (with their reason), or whose plan, model file or settings differ from
            rank 0's.
        PeerFailureError: a peer failed during the exchange.
    """
    gathered: list[Any] = [None] * plan.world_size
    try:
        dist.all_gather_object(gathered, (rank, plan.ranks[rank].node, mine))
    except RuntimeError as exc:
        raise PeerFailureError(
            f"rank {rank}: a peer failed while the ranks compared their plans: "
            f"{error_reason(exc)}; check the other ranks' logs"
        ) from None
    failed = [(r, node, seen.failure) for r, node, seen in gathered if seen.failure]
    if failed:
        r, node, reason = failed[0]
        more = f" (and {len(failed) - 1} other ranks)" if len(failed) > 1 else ""
        raise ConfigError(f"rank {r} (node {node}) cannot run{more}: {reason}")
    _, node0, reference = gathered[0]
    differing: dict[str, list[str]] = {}
    for r, node, seen in gathered[1:]:
        for what in _differences(reference, seen):
            differing.setdefault(what, []).append(f"rank {r} (node {node})")
    if not differing:
        return
    what, who = next(iter(differing.items()))
    raise ConfigError(
        f"{', '.join(who)} run{'s' if len(who) == 1 else ''} another {what} than rank 0 (node "
        f"{node0}): give every node the same out/ folder from one `hplan solve`, the same "
        "model file and the same options"
    )


def _differences(reference: JobIdentity, seen: JobIdentity) -> list[str]:
    """What ``seen`` runs otherwise than ``reference``, as the user would name it."""
    found = []
    if seen.plan_digest != reference.plan_digest:
        sections = [
            key
            for key in sorted(set(seen.plan_sections) | set(reference.plan_sections))
            if seen.plan_sections.get(key) != reference.plan_sections.get(key)
        ]
        found.append(f"plan.json (its {', '.join(sections) or 'fields'} differ)")
    if seen.model_sha256 != reference.model_sha256:
        found.append("model file")
    keys = sorted(set(seen.settings) | set(reference.settings))
    options = [k for k in keys if seen.settings.get(k) != reference.settings.get(k)]
    if options:
        found.append(", ".join(f"--{k.replace('_', '-')}" for k in options))
    return found
