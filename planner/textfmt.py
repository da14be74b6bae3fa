"""Small pure formatting helpers for hplan's human text (summaries, DOT labels, scripts).

Durations pick s or ms (byte sizes and link speeds are ``contract.quantities``'s, which the
runtime shares); unit lists collapse numbered runs (``blocks.0-blocks.3``); long lines
break between phrases (:func:`wrap_phrases`).
"""

from __future__ import annotations

import re
import textwrap
from collections.abc import Sequence

from hplan.runtime.contract.plan import CutSpec, RankPlan, microbatch_sizes
from hplan.runtime.contract.quantities import MS_PER_S

_NUMBERED = re.compile(r"^(?P<prefix>.*)\.(?P<idx>\d+)$")


def format_seconds(time_s: float) -> str:
    """Human duration: ``0.5203 -> "0.520 s"``, ``0.0123 -> "12.3 ms"``."""
    if abs(time_s) >= 1.0:
        return f"{time_s:.2f} s"
    if abs(time_s) >= 0.1:
        return f"{time_s:.3f} s"
    return f"{time_s * MS_PER_S:.1f} ms"


def compact_units(units: Sequence[str]) -> str:
    """Units with runs of numbered siblings collapsed.

    Example: ``("tok_emb", "blocks.0", "blocks.1", "blocks.2", "lm_head")`` ->
    ``"tok_emb, blocks.0-blocks.2, lm_head"``. See :func:`compact_unit_groups`.
    """
    return ", ".join(compact_unit_groups(units))


def stage_units(units: Sequence[str], *, total: int) -> str:
    """A stage's contiguous units in a few characters.

    ``all 8 units`` when the stage holds the whole model; one name, or a numbered run
    (``blocks.0-blocks.3``); otherwise ``first…last (n)``.
    """
    if len(units) == total and total > 1:
        return f"all {total} units"
    groups = compact_unit_groups(units)
    if len(groups) <= 2:
        return ", ".join(groups)
    return f"{units[0]}…{units[-1]} ({len(units)})"


def compact_unit_groups(units: Sequence[str]) -> list[str]:
    """Units as groups: a run of consecutive numbered siblings becomes ``first-last``.

    Only consecutive indices under the same prefix form a run (``blocks.0``, ``blocks.1``);
    a run of one stays a single name.
    """
    groups: list[list[str]] = []
    for name in units:
        if groups and _continues_run(groups[-1][-1], name):
            groups[-1].append(name)
        else:
            groups.append([name])
    return [g[0] if len(g) == 1 else f"{g[0]}-{g[-1]}" for g in groups]


def _continues_run(previous: str, name: str) -> bool:
    prev_match, match = _NUMBERED.match(previous), _NUMBERED.match(name)
    if prev_match is None or match is None:
        return False
    same_prefix = prev_match["prefix"] == match["prefix"]
    return same_prefix and int(match["idx"]) == int(prev_match["idx"]) + 1


def batch_share(rank: RankPlan) -> str:
    """A replica's batch share as samples and micro-batches.

    ``24 (4×6)``: 24 samples in 6 micro-batches of 4. ``16 (3×5+1)``: 16 samples in 5
    micro-batches of 3 and one of 1 (see :func:`hplan.runtime.contract.plan.microbatch_sizes`).
    ``1389 (695+694)``: one micro-batch of 695 and one of 694.
    """
    sizes = microbatch_sizes(rank.num_samples, rank.micro_batch_size)
    full = sum(1 for s in sizes if s == rank.micro_batch_size)
    rest = "" if len(sizes) == full else f"+{sizes[-1]}"
    times = "" if full == 1 and rest else f"×{full}"
    return f"{rank.num_samples} ({rank.micro_batch_size}{times}{rest})"


def boundary_bytes(cut: CutSpec, micro_batch_size: int) -> int:
    """Bytes sent forward across ``cut`` for one micro-batch of ``micro_batch_size`` samples.

    Sums every tensor of the cut (activations, masks, position ids), each at its concrete
    shape ``TensorSpec.shape_for(micro_batch_size)``.

    Raises:
        PlanFileError: a tensor has a dtype that ``plan.DTYPE_BYTES`` does not know.
    """
    return sum(tensor.num_bytes(micro_batch_size) for tensor in cut.tensors)


def count(number: int, noun: str) -> str:
    """``count(1, "rank") -> "1 rank"``, ``count(3, "rank") -> "3 ranks"``."""
    return f"{number} {noun}" + ("" if number == 1 else "s")


def percent(fraction: float) -> str:
    """``percent(0.636) -> "63.6%"``."""
    return f"{100.0 * fraction:.1f}%"


# --------------------------------------------------------------------------- wrapping
_PHRASE_BREAKS = re.compile(r"(?<=; )|(?<=: )|(?<=, )|(?<= · )|(?= — )")
"""Where a long line may break: after ``; ``, ``: ``, ``, `` and `` · ``, before `` — ``."""


def wrap_phrases(text: str, width: int, *, breaks: re.Pattern[str] = _PHRASE_BREAKS) -> list[str]:
    """Lines of at most ``width`` columns, broken between phrases rather than inside one.

    Phrases end at ``; ``, ``: ``, ``, `` or `` · ``, or before `` — ``; lines are filled
    greedily; ``breaks`` (a pattern of zero-width split points) may choose other places.
    A phrase longer than ``width`` is broken at spaces instead (a word longer than
    ``width`` stays whole). ``"a · b"`` with width 3 -> ``["a ·", "b"]``.
    """
    lines: list[str] = []
    current = ""
    for phrase in breaks.split(text):
        candidate = current + phrase
        if not current or len(candidate.rstrip()) <= width or len(phrase.strip()) > width:
            current = candidate
            continue
        wrapped = _wrap_words(current, width)
        lines.extend(wrapped[:-1])
        last = wrapped[-1] + current[len(current.rstrip()) :]
        if len((last + phrase).rstrip()) <= width:
            current = last + phrase
        else:
            lines.append(wrapped[-1])
            current = phrase.lstrip()
    lines.extend(_wrap_words(current, width))
    return lines


def _wrap_words(text: str, width: int) -> list[str]:
    text = text.rstrip()
    if len(text) <= width:
        return [text]
    return textwrap.wrap(text, width, break_long_words=False, break_on_hyphens=False)
