"""Versioned JSON files (plan, profile, link matrix, emulation record): their record types
and their parser.

Every type of such a file is a :func:`record`: a frozen, slotted, keyword-only dataclass
that pydantic validates strictly (unknown keys rejected). ``record`` is declared with
``typing.dataclass_transform``, so type checkers check every constructor call and
``dataclasses.replace`` of these types field by field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TypeVar, dataclass_transform

from pydantic import ConfigDict, TypeAdapter, ValidationError

from hplan.runtime.contract.errors import ConfigError

__all__ = ["parse_versioned", "record"]

_T = TypeVar("_T")
_STRICT = ConfigDict(extra="forbid", revalidate_instances="always")


_PLAN_KEYS = frozenset({"schema_version", "model", "units", "cuts", "cluster", "ranks", "report"})
"""Top-level keys every ``plan.json`` has (``contract.plan.Plan``), and no other file."""


def _plan_kind(data: object) -> str | None:
    """``"plan"`` when ``data`` is a parsed ``plan.json``, else None: so a plan given where
    another file belongs (``--profile plan.json``) is named as a plan, not reported as that
    file with the wrong schema version."""
    if isinstance(data, dict) and data.keys() >= _PLAN_KEYS:
        return "plan"
    return None


@dataclass_transform(frozen_default=True, kw_only_default=True)
def record(cls: type[_T]) -> type[_T]:
    """Make ``cls`` a file record: ``@dataclass(frozen=True, slots=True, kw_only=True)``
    whose pydantic validation forbids unknown keys and checks an instance again, field by
    field, when it is validated (so ``verify()`` can check a record built in Python)."""
    cls.__pydantic_config__ = _STRICT  # type: ignore[attr-defined]
    return dataclass(frozen=True, slots=True, kw_only=True)(cls)


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
    other = _plan_kind(data)
    if other is not None and other != what:
        raise ConfigError(f"{source!r} is a {other}, not a {what}: give a {what} here ({fix})")
    found = data.get("schema_version") if isinstance(data, dict) else None
    if found is None:
        raise ConfigError(
            f"{source!r} is not an hplan {what} (a JSON object with a schema_version); {fix}"
        )
    shown = json.dumps(found)
    if isinstance(found, bool) or not isinstance(found, int):
        if isinstance(found, (str, float)) and str(found).strip() in (str(version), f"{version}.0"):
            raise ConfigError(
                f"{what} {source!r} has schema_version {shown}; write the integer {version} "
                f"(no quotes, no decimals), or {fix}"
            )
        raise ConfigError(f"{what} {source!r} has schema_version {shown}, not an integer; {fix}")
    if found > version:
        raise ConfigError(
            f"{what} {source!r} has schema_version {found}, from a newer hplan (this one "
            f"reads {version}); upgrade hplan, or {fix}"
        )
    if found != version:
        raise ConfigError(
            f"{what} {source!r} has schema_version {found}, this hplan reads {version}; {fix}"
        )
    try:
        return adapter.validate_python(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise ConfigError(f"{what} {source!r} field {where!r}: {first['msg']}; {fix}") from None
