"""The typed view of a job: every field of the schema has a typed home and the reverse, and the view is the job's
settings unchanged (so fingerprints and files read as before)."""

from __future__ import annotations

import dataclasses
import json
import typing

import pytest
import yaml

from tests.conftest import default_job
from tula_hpc.config import SCHEMA_PATH
from tula_hpc.core.job import Job
from tula_hpc.core.plain_data import dataclass_of

# Set by config.job_settings beside the schema's job fields.
JOB_ONLY_FIELDS = {"name", "launcher"}


def schema_job() -> dict:
    return yaml.safe_load(SCHEMA_PATH.read_text())["properties"]["jobs"]["additionalProperties"]


def mismatches(schema: dict, kind: type, where: str) -> list[str]:
    """Where the schema's properties and the dataclass's fields differ, recursively."""
    hints = typing.get_type_hints(kind)
    fields = {spec.name for spec in dataclasses.fields(kind)} - (JOB_ONLY_FIELDS if kind is Job else set())
    named = set(schema["properties"])
    found = [f"{where}.{name}: in the schema, no field" for name in sorted(named - fields)]
    found += [f"{where}.{name}: a field, not in the schema" for name in sorted(fields - named)]
    for name in sorted(named & fields):
        sub, hint = schema["properties"][name], hints[name]
        if "properties" in sub:
            if nested := dataclass_of(hint):
                found += mismatches(sub, nested, f"{where}.{name}")
            else:
                found.append(f"{where}.{name}: an object with properties in the schema, {hint} here")
        elif dataclass_of(hint):
            found.append(f"{where}.{name}: free-form in the schema, a dataclass here")
    return found


def test_every_schema_field_has_a_typed_home_and_the_reverse():
    assert mismatches(schema_job(), Job, "job") == []


def test_the_check_finds_a_field_the_view_lacks_and_one_the_schema_lacks():
    schema = schema_job()
    schema["properties"]["train"]["properties"]["new_knob"] = {"type": "integer"}
    del schema["properties"]["objective"]["properties"]["budget"]
    assert mismatches(schema, Job, "job") == [
        "job.objective.budget: a field, not in the schema",
        "job.train.new_knob: in the schema, no field",
    ]


def test_the_view_holds_the_settings_unchanged():
    job = default_job()
    plain = job.as_dict()
    assert Job.from_dict(plain) == job
    assert json.loads(json.dumps(plain)) == plain
    assert job.train.epochs == plain["train"]["epochs"]
    assert job.search.nodes.max == plain["search"]["nodes"]["max"]
    assert job.resources.memory_probe_batches == tuple(plain["resources"]["memory_probe_batches"])


def test_a_slurm_key_left_out_stays_out_and_one_given_is_kept():
    job = default_job(resources={"slurm": {"partition": "gpu"}})
    assert job.resources.slurm.partition == "gpu" and job.resources.slurm.account is None
    assert job.as_dict()["resources"]["slurm"] == {"partition": "gpu"}


def test_the_view_is_frozen_and_updated_returns_a_changed_copy():
    job = default_job()
    with pytest.raises(dataclasses.FrozenInstanceError):
        job.train.epochs = 1  # type: ignore[misc]
    changed = job.updated(train={"epochs": 1, "ags": {"delta": 0.25}})
    assert (changed.train.epochs, changed.train.ags.delta) == (1, 0.25)
    assert changed.train.ags.small_batch == job.train.ags.small_batch
    assert job.train.epochs != 1


def test_an_unknown_or_missing_field_is_named():
    plain = default_job().as_dict()
    plain["train"]["epoch"] = 3
    with pytest.raises(KeyError, match=r"train: unknown field\(s\) epoch"):
        Job.from_dict(plain)
    del plain["train"]["epoch"], plain["search"]["nodes"]["max"]
    with pytest.raises(KeyError, match=r"search.nodes: field 'max' is missing"):
        Job.from_dict(plain)
