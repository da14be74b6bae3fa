"""What every ``hplan`` command shares: the stderr console and option parsers."""

from __future__ import annotations

from enum import StrEnum
from typing import Any, Generic, TypeVar

import click
from rich.console import Console

from hplan.runtime.contract.errors import ConfigError

_E = TypeVar("_E", bound=StrEnum)

stderr = Console(stderr=True, highlight=False, soft_wrap=True)
"""Human output of every command (machine output, ``--json``, goes to stdout)."""


def parse_sizes(text: str | None) -> tuple[int, ...] | None:
    """``--micro-batch-sizes``: None when not given; otherwise comma-separated integers >= 1,
    sorted and distinct (``"4,1,2"`` -> ``(1, 2, 4)``).

    Raises:
        ConfigError: an empty item, a non-integer or a size below 1.
    """
    if text is None:
        return None
    items = [x.strip() for x in text.split(",")]
    if not all(items):
        raise ConfigError(
            f"--micro-batch-sizes {text!r} has an empty item; give integers like 1,2,4"
        )
    try:
        sizes = tuple(sorted({int(x) for x in items}))
    except ValueError:
        raise ConfigError(f"--micro-batch-sizes {text!r} must be integers like 1,2,4") from None
    if sizes[0] < 1:
        raise ConfigError(f"--micro-batch-sizes {text!r} must be integers >= 1, like 1,2,4")
    return sizes


class EnumChoice(click.Choice, Generic[_E]):  # type: ignore[type-arg]
    """A click choice of ``kind``'s values (case-insensitive) that gives the member itself,
    so that a policy is an enum from the command line on (``--zero never`` ->
    ``Policy.NEVER``). ``--help`` lists the values, not the member names."""

    def __init__(self, kind: type[_E]) -> None:
        super().__init__([m.value for m in kind], case_sensitive=False)
        self.kind = kind

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> _E:
        if isinstance(value, self.kind):
            return value
        return self.kind(super().convert(value, param, ctx))
