"""The emulation record: how a rehearsal stood in for the plan's hardware.

``hplan rehearse`` writes ``<metrics_dir>/emulation.json`` before its ranks start; the
ranks read their stragglers' slowdowns from it, and ``hplan calibrate`` reads the time
scale to turn the measured seconds back into seconds of the plan's hardware. One JSON
object, versioned like every hplan file.

This module does not import torch.
"""

from __future__ import annotations

import json
from dataclasses import field
from functools import cache
from pathlib import Path
from typing import Annotated, Final, Literal

from pydantic import Field, TypeAdapter

from hplan.runtime.contract.errors import ConfigError
from hplan.runtime.contract.versioned_file import parse_versioned, record

EMULATION_FILE: Final = "emulation.json"
"""The record's name inside a rehearsal's metrics folder."""
EMULATION_SCHEMA_VERSION: Final = 1


PositiveFactor = Annotated[float, Field(gt=0, allow_inf_nan=False)]


@record
class EmulationRecord:
    """One rehearsal's emulation settings (the defaults: no emulation)."""

    schema_version: Literal[1] = EMULATION_SCHEMA_VERSION
    dilation: Annotated[float, Field(ge=1, allow_inf_nan=False)] = 1.0
    """Global time-dilation factor that made the ranks' CPU demand fit the cores."""
    time_scale: PositiveFactor = 1.0
    """Emulated seconds per second of the plan's hardware."""
    slowdown: dict[str, PositiveFactor] = field(default_factory=dict)
    """Emulated stragglers: cluster device name -> factor its compute was slowed by."""

    def save(self, metrics_dir: Path) -> Path:
        """Write the record into ``metrics_dir``; return its path."""
        path = metrics_dir / EMULATION_FILE
        data = _adapter().dump_python(self, mode="json")
        path.write_text(json.dumps(data, indent=2, allow_nan=False) + "\n", encoding="utf-8")
        return path

    @staticmethod
    def load(metrics_dir: Path | None) -> EmulationRecord | None:
        """The record in ``metrics_dir``; None when there is none (not a rehearsal).

        A record without ``schema_version`` (hplan before it had one) reads as version 1.

        Raises:
            ConfigError: the file is not an emulation record (one line naming the field).
        """
        path = None if metrics_dir is None else metrics_dir / EMULATION_FILE
        if path is None or not path.is_file():
            return None
        try:
            text = path.read_text(encoding="utf-8")
            data = json.loads(text)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"{path}: not a rehearsal's emulation record ({exc})") from None
        if isinstance(data, dict) and "schema_version" not in data:
            text = json.dumps({"schema_version": EMULATION_SCHEMA_VERSION, **data})
        return parse_versioned(
            text,
            _adapter(),
            what="emulation record",
            source=str(path),
            version=EMULATION_SCHEMA_VERSION,
            fix="rehearse again with this hplan (`hplan rehearse --metrics-dir`)",
        )


@cache
def _adapter() -> TypeAdapter[EmulationRecord]:
    return TypeAdapter(EmulationRecord)
