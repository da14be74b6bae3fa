"""What every ``hplan`` command shares: the stderr console and option parsers."""

from __future__ import annotations

from rich.console import Console

from hplan.runtime.contract.errors import ConfigError

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
