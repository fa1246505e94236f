"""Plain data to frozen dataclasses and back, by the type hints."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from tula_hpc.core.plain_data import deep_update, from_plain, optional, to_plain


@dataclass(frozen=True)
class Inner:
    sizes: tuple[int, ...]
    rows: list[dict]


@dataclass(frozen=True)
class Outer:
    inner: Inner
    kwargs: dict
    note: str | None = optional()


def test_nested_sections_and_tuples_follow_the_hints_and_come_back_as_plain_data():
    plain = {"inner": {"sizes": [1, 2], "rows": [{"a": 1}]}, "kwargs": {"k": [3]}}
    value = from_plain(Outer, plain, "outer")
    assert value.inner.sizes == (1, 2) and value.inner.rows == [{"a": 1}] and value.note is None
    assert to_plain(value) == plain


def test_the_plain_data_is_copied_not_shared():
    plain = {"inner": {"sizes": [1], "rows": [{"a": 1}]}, "kwargs": {"k": [3]}}
    value = from_plain(Outer, plain, "outer")
    plain["kwargs"]["k"].append(4)
    plain["inner"]["rows"][0]["a"] = 2
    assert value.kwargs == {"k": [3]} and value.inner.rows == [{"a": 1}]


def test_an_optional_field_given_is_kept():
    assert to_plain(Outer(Inner((), []), {}, note="x"))["note"] == "x"


def test_a_missing_or_unknown_key_names_its_place():
    with pytest.raises(KeyError, match=r"outer.inner: field 'rows' is missing"):
        from_plain(Outer, {"inner": {"sizes": []}, "kwargs": {}}, "outer")
    with pytest.raises(KeyError, match=r"outer: unknown field\(s\) extra"):
        from_plain(Outer, {"inner": {"sizes": [], "rows": []}, "kwargs": {}, "extra": 1}, "outer")


def test_deep_update_merges_key_by_key_and_copies_what_it_takes():
    changes = {"train": {"ags": {"delta": 0.25}, "milestones": [3]}}
    merged = deep_update({"train": {"ags": {"delta": 0.5, "base": "sgd"}, "epochs": 3}}, changes)
    assert merged == {"train": {"ags": {"delta": 0.25, "base": "sgd"}, "epochs": 3, "milestones": [3]}}
    changes["train"]["milestones"].append(4)
    assert merged["train"]["milestones"] == [3]
