"""Plain data (what YAML and JSON hold) to frozen dataclasses and back, by the dataclasses' type hints: the one way
a job's settings (job.py) and the files stages hand each other (records.py) become typed."""

from __future__ import annotations

import copy
import dataclasses
import typing
from typing import Any, TypeVar

T = TypeVar("T")


def optional(default: Any = None) -> Any:
    """A field the writer may leave out: absent from the plain data when it is None, as it was absent before."""
    return dataclasses.field(default=default, metadata={"optional": True})


def _left_out(value: Any, spec: dataclasses.Field) -> bool:
    return spec.metadata.get("optional", False) and getattr(value, spec.name) is None


def _is_tuple(hint: Any) -> bool:
    return typing.get_origin(hint) is tuple or any(typing.get_origin(arg) is tuple for arg in typing.get_args(hint))


def dataclass_of(hint: Any) -> type | None:
    """The dataclass a hint names, itself or in an optional field's `Kind | None`."""
    if dataclasses.is_dataclass(hint):
        return hint
    kinds = [arg for arg in typing.get_args(hint) if dataclasses.is_dataclass(arg)]
    return kinds[0] if kinds else None


def from_plain(kind: type[T], data: dict, where: str) -> T:
    """The dataclass `kind` from `data`, nested dataclasses and tuples by the hints; a missing or unknown key is a
    KeyError naming it (`where`: the dotted place of `data`, for the message)."""
    hints = typing.get_type_hints(kind)
    names = {spec.name for spec in dataclasses.fields(kind)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise KeyError(f"{where}: unknown field(s) {', '.join(unknown)}")
    values = {}
    for spec in dataclasses.fields(kind):
        if spec.name not in data:
            if spec.default is dataclasses.MISSING:
                raise KeyError(f"{where}: field '{spec.name}' is missing")
            continue
        value, hint = data[spec.name], hints[spec.name]
        if (nested := dataclass_of(hint)) and value is not None:
            value = from_plain(nested, value, f"{where}.{spec.name}" if where else spec.name)
        elif isinstance(value, list) and _is_tuple(hint):
            value = tuple(value)
        else:
            value = copy.deepcopy(value)
        values[spec.name] = value
    return kind(**values)


def to_plain(value: Any) -> Any:
    """`value` as JSON's types: dataclasses as dicts (an optional field left out when None), tuples as lists."""
    if dataclasses.is_dataclass(value):
        return {f.name: to_plain(getattr(value, f.name)) for f in dataclasses.fields(value) if not _left_out(value, f)}
    if isinstance(value, tuple | list):
        return [to_plain(item) for item in value]
    if isinstance(value, dict):
        return {key: to_plain(item) for key, item in value.items()}
    return value


def deep_update(base: dict, changes: dict) -> dict:
    """`base` with `changes` merged in key by key, as Snakemake merges config files; returns `base`."""
    for key, value in changes.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            deep_update(base[key], value)
        else:
            base[key] = copy.deepcopy(value)
    return base
