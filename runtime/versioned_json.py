"""Parse a versioned JSON file (plan, profile, link matrix) into its pydantic-checked type."""

from __future__ import annotations

import json
from typing import TypeVar

from pydantic import TypeAdapter, ValidationError

from hplan.runtime.errors import ConfigError

__all__ = ["parse_versioned"]

_T = TypeVar("_T")


def parse_versioned(
    text: str, adapter: TypeAdapter[_T], *, what: str, source: str, version: int, fix: str
) -> _T:
    """Validate JSON ``text`` whose ``schema_version`` must equal ``version``.

    Args:
        what: how messages name the file ("profile", "bandwidth file").
        source: the file's path, for messages.
        fix: what the user should do, appended to every message.

    Raises:
        ConfigError: not JSON, another schema version, unknown keys or wrong types; one
            line naming the file and the first bad field.
    """
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{what} {source!r} is not valid JSON ({exc}); {fix}") from None
    found = data.get("schema_version") if isinstance(data, dict) else None
    if found is None:
        raise ConfigError(
            f"{source!r} is not an hplan {what} (a JSON object with a schema_version); {fix}"
        )
    if found != version:
        raise ConfigError(
            f"{what} {source!r} has schema_version {found!r}, this hplan reads {version}; {fix}"
        )
    try:
        return adapter.validate_python(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise ConfigError(f"{what} {source!r} field {where!r}: {first['msg']}; {fix}") from None
