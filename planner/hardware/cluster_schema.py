"""The cluster.yaml file schema (pydantic), its YAML loader and its error messages.

``ClusterFile`` is the top level of the file; every model forbids unknown keys and every
quantity key carries its unit. ``UniqueKeyLoader`` is a YAML SafeLoader that rejects a
key repeated in one mapping; ``yaml_problem`` and ``pydantic_message`` turn a parse or
validation error into one line (the key path such as ``nodes[1].devices[0].memory_gb``,
the problem, what is allowed). ``cluster.py`` turns a validated ``ClusterFile`` into a
``Cluster``.
"""

from __future__ import annotations

import difflib
import ipaddress
import re
from enum import StrEnum
from typing import Annotated, Any, get_args, get_origin

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    model_validator,
)

from hplan.planner.hardware.catalog import DeviceClass

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
_LABEL_RE = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?$")


def check_name(value: str) -> str:
    """A node or cluster name: 1-63 letters, digits, ``-``, ``_`` or ``.`` (ValueError)."""
    if not _NAME_RE.match(value):
        raise ValueError(
            f"{value!r} is not a valid name; use 1-63 letters, digits, '-', '_' or '.', "
            "starting with a letter or digit"
        )
    return value


def _check_host(value: str) -> str:
    """Accept an IPv4/IPv6 address or an RFC 1123 host name; nothing else gets through."""
    if "%" not in value:
        try:
            ipaddress.ip_address(value)
            return value
        except ValueError:
            pass
    labels = value.split(".")
    ok = 0 < len(value) <= 253 and all(_LABEL_RE.match(label) for label in labels)
    if ok and all(label.isdigit() for label in labels):
        ok = False  # looks like an IPv4 address but is not a valid one
    if not ok:
        raise ValueError(
            f"{value!r} is not a host name or IP address; use an RFC 1123 name "
            "(letters, digits, '-', dot-separated) or an IPv4/IPv6 address"
        )
    return value


def _number_to_str(value: Any) -> Any:
    """YAML reads ``type: 3090`` as an integer; device names may be bare model numbers."""
    return str(value) if isinstance(value, int) and not isinstance(value, bool) else value


Name = Annotated[str, Field(strict=True), AfterValidator(check_name)]
Host = Annotated[str, Field(strict=True), AfterValidator(_check_host)]
StrictPositive = Annotated[float, Field(strict=True, gt=0, allow_inf_nan=False)]
"""A finite YAML number > 0 (``"24"`` and ``true`` are refused; ``contract.plan.Positive``
is the plan's, which is not strict)."""
StrictNonNegative = Annotated[float, Field(strict=True, ge=0, allow_inf_nan=False)]
"""A finite YAML number >= 0, strict like :data:`StrictPositive`."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _one_of(entry: BaseModel, *keys: str, required: bool = True) -> None:
    given = [k for k in keys if getattr(entry, k) is not None]
    if len(given) > 1 or (required and not given):
        raise ValueError(f"give exactly one of {', '.join(keys)}")


class LinkEntry(_Strict):
    bandwidth_gb_per_s: StrictPositive | None = None
    bandwidth_gbit_per_s: StrictPositive | None = None
    latency_us: StrictNonNegative | None = None

    @model_validator(mode="after")
    def _one_bandwidth(self) -> LinkEntry:
        _one_of(self, "bandwidth_gb_per_s", "bandwidth_gbit_per_s")
        return self


class PairLinkEntry(LinkEntry):
    nodes: tuple[Name, Name]


class MatrixLevel(StrEnum):
    NODES = "nodes"
    DEVICES = "devices"


class MatrixEntry(_Strict):
    of: MatrixLevel
    bandwidth_gb_per_s: list[list[StrictNonNegative]] | None = None
    bandwidth_gbit_per_s: list[list[StrictNonNegative]] | None = None
    latency_us: StrictNonNegative | None = None

    @model_validator(mode="after")
    def _one_bandwidth(self) -> MatrixEntry:
        _one_of(self, "bandwidth_gb_per_s", "bandwidth_gbit_per_s")
        return self


class LinksEntry(_Strict):
    inter_node: LinkEntry | None = None
    pairs: list[PairLinkEntry] = Field(default_factory=list)
    matrix: MatrixEntry | None = None

    @model_validator(mode="after")
    def _matrix_alone(self) -> LinksEntry:
        if self.matrix is not None and (self.inter_node is not None or self.pairs):
            raise ValueError("give either matrix or inter_node/pairs, not both")
        return self


class DeviceEntry(_Strict):
    type: Annotated[str, BeforeValidator(_number_to_str), Field(strict=True)] | None = None
    custom: Name | None = None
    count: Annotated[int, Field(strict=True, ge=1, le=1024)] = 1
    memory_gb: StrictPositive | None = None
    memory_gib: StrictPositive | None = None
    peak_tflops: StrictPositive | None = None
    memory_bandwidth_gb_per_s: StrictPositive | None = None
    device_class: DeviceClass | None = None
    consumer_card: bool | None = None

    @model_validator(mode="after")
    def _consistent(self) -> DeviceEntry:
        _one_of(self, "type", "custom")
        _one_of(self, "memory_gb", "memory_gib", required=False)
        if self.type is not None and (
            self.device_class is not None or self.consumer_card is not None
        ):
            raise ValueError("device_class and consumer_card are only for `custom` devices")
        explicit = (self.peak_tflops, self.memory_bandwidth_gb_per_s)
        has_memory = self.memory_gb is not None or self.memory_gib is not None
        if self.custom is not None and (None in explicit or not has_memory):
            raise ValueError(
                "a `custom` device needs memory_gb (or memory_gib), peak_tflops and "
                "memory_bandwidth_gb_per_s"
            )
        return self


def _check_interface(value: str) -> str:
    """A Linux network interface name: 1-15 characters, no '/', ':', whitespace."""
    if not _INTERFACE_RE.match(value):
        raise ValueError(
            f"{value!r} is not a network interface name; use the name `ip link` shows "
            "(1-15 letters, digits, '-', '_' or '.', e.g. eth1, ib0, enp3s0f1)"
        )
    return value


_INTERFACE_RE = re.compile(r"^[A-Za-z0-9_.-]{1,15}$")
Interface = Annotated[str, Field(strict=True), AfterValidator(_check_interface)]


class NvlinkAll(StrEnum):
    """``nvlink: all`` (every pair of the node's cards, NVSwitch or an NVLink mesh) or
    ``nvlink: none`` (no pair, whatever the catalog says)."""

    ALL = "all"
    NONE = "none"


NvlinkGroup = Annotated[list[Annotated[int, Field(strict=True, ge=0)]], Field(min_length=2)]


def _check_nvlink(value: object) -> object:
    """``all``, ``none`` or a list of groups of two or more local device indices, else one
    line naming the value and the forms (before pydantic's union reports its internals)."""
    if value is None or value in ("all", "none"):
        return value
    groups_ok = isinstance(value, list) and all(
        isinstance(g, list)
        and len(g) >= 2
        and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in g)
        for g in value
    )
    if not groups_ok:
        raise ValueError(
            f"{value!r} is not an nvlink value: write `all`, `none`, or groups of two or "
            "more local device indices, such as [[0, 1], [2, 3]]"
        )
    return value


class NodeEntry(_Strict):
    name: Name
    host: Host
    devices: list[DeviceEntry] = Field(min_length=1)
    intra_node_link: LinkEntry | None = None
    interface: Interface | None = None
    """The network interface the node's ranks talk over (gloo and NCCL); default: the one
    that holds ``host``."""
    host_memory_gb: StrictPositive | None = None
    """The node's host (CPU) memory in GB (10^9 bytes), what optimizer-state offload may
    fill; default: assumed (``contract.memory.HOST_MEMORY_PER_DEVICE_MEMORY``)."""
    nvlink: Annotated[NvlinkAll | list[NvlinkGroup] | None, BeforeValidator(_check_nvlink)] = None
    """Which of the node's cards NVLink joins: ``all``, ``none``, or groups of local device
    indices (``[[0, 1], [2, 3]]``: two bridged pairs; every pair inside a group is joined);
    default: ``all`` where every card is an SXM part of the catalog, else none."""
    nvlink_gb_per_s: StrictPositive | None = None
    """NVLink bandwidth per direction between two joined cards, GB/s; default: the
    catalog's figure for the part."""


class ClusterFile(_Strict):
    """Top level of cluster.yaml."""

    name: Name | None = None
    nodes: list[NodeEntry] = Field(min_length=1)
    links: LinksEntry = Field(default_factory=LinksEntry)


# ----------------------------------------------------------------------------- YAML and errors
class UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that rejects a key repeated in one mapping (PyYAML keeps the last)."""


def _construct_unique_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node)  # type: ignore[no-untyped-call]
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r}; keep one", key_node.start_mark
            )
        seen.add(key)
    return loader.construct_mapping(node)


UniqueKeyLoader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_unique_mapping
)


def yaml_problem(exc: yaml.YAMLError) -> str:
    """The problem and its place (``... at line 3, column 5``) of a YAML parse error."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return f"{problem}{where}"


def pydantic_message(exc: ValidationError) -> str:
    """One line for the first validation error: key path, problem, what is allowed.

    An unknown key is reported before any other error: a misspelt key (``devcies:``) also
    makes the key it was meant to be missing, and the misspelling is the thing to fix.
    """
    errors = exc.errors(include_url=False)
    error = next((e for e in errors if e["type"] == "extra_forbidden"), errors[0])
    loc = error["loc"]
    path = _key_path(loc)
    kind = error["type"]
    if kind == "extra_forbidden":
        model = _model_at(loc[:-1])
        if model is None:
            return f"{path}: unknown key; see examples/clusters/README.md for the keys"
        close = difflib.get_close_matches(str(loc[-1]), list(model.model_fields), n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        return f"{path}: unknown key; {hint}allowed keys here: {', '.join(model.model_fields)}"
    if not loc:
        return (
            "(top level): the file must be a mapping with a `nodes:` list (see examples/clusters/)"
        )
    if kind == "missing":
        return f"{path}: required key is missing; add it (examples/clusters/README.md has the keys)"
    message = str(error["msg"]).removeprefix("Value error, ")
    if kind == "value_error":
        return f"{path}: {message}"
    shown = repr(error.get("input"))
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    return f"{path}: {message} (got {shown}); change it in the cluster file"


def _key_path(loc: tuple[int | str, ...]) -> str:
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text or "(top level)"


def _model_at(loc: tuple[int | str, ...]) -> type[BaseModel] | None:
    """The schema model that describes the mapping at ``loc`` (list indices skipped)."""
    model: type[BaseModel] | None = ClusterFile
    for part in loc:
        if isinstance(part, int) or model is None:
            continue
        field = model.model_fields.get(part)
        model = _model_in(field.annotation) if field is not None else None
    return model


def _model_in(annotation: Any) -> type[BaseModel] | None:
    if get_origin(annotation) is None and isinstance(annotation, type):
        return annotation if issubclass(annotation, BaseModel) else None
    for arg in get_args(annotation):
        found = _model_in(arg)
        if found is not None:
            return found
    return None
