"""One registry per concept the job schema names: the schema's enum (or the names its pattern allows beside a
user's package.module:callable) lists exactly the names the code's registry holds, so a name added in one place
and not the other fails here rather than in a user's job."""

from __future__ import annotations

import dataclasses
import re

import pytest
import yaml

from tests.conftest import default_job
from tula_hpc import config
from tula_hpc.config import SCHEMA_PATH
from tula_hpc.core import job
from tula_hpc.performance import choice, pricing
from tula_hpc.training import datasets, lr_schedule, models, strategies


def job_field(*path: str) -> dict:
    """The schema of a job's field, e.g. ("train", "strategy")."""
    node = yaml.safe_load(SCHEMA_PATH.read_text())["properties"]["jobs"]["additionalProperties"]
    for key in path:
        node = node["properties"][key]
    return node


def builtin_names(pattern: str) -> set[str]:
    """The literal names of a pattern `^(a|b|...|<a user's package.module:callable>)$`."""
    alternatives = re.fullmatch(r"\^\((.*)\)\$", pattern).group(1).split("|")
    return {name for name in alternatives if re.fullmatch(r"[a-z0-9_]+", name)}


def pricing_names() -> set[str]:
    objective = dataclasses.replace(
        default_job().objective, price_per_node_hour=1.0, price_per_gb_hour=1.0, charge_factors={"default": 1.0}
    )
    memory = {"fit": {"intercept_bytes": 1, "slope_bytes_per_sample": 1}}
    return set(pricing.costs(3600.0, 1, 1, 1, objective, memory, None))


@pytest.mark.parametrize(
    ("path", "registry"),
    [
        (("model", "name"), lambda: set(models.BUILTINS)),
        (("data", "name"), lambda: set(datasets.DATA_SETS)),
        (("train", "strategy"), lambda: set(strategies.BUILDERS)),
        (("objective", "minimize"), lambda: set(choice.GOALS)),
        (("objective", "pricing"), pricing_names),
    ],
)
def test_the_schema_names_exactly_what_the_registry_holds(path, registry):
    field = job_field(*path)
    named = set(field["enum"]) if "enum" in field else builtin_names(field["pattern"])
    assert named == registry(), f"{'.'.join(path)}: schema {sorted(named)}, code {sorted(registry())}"


def test_table_ones_strategies_are_registered():
    assert set(strategies.STRATEGIES) <= set(strategies.BUILDERS)


def test_every_builtin_image_model_has_its_smallest_image_and_no_other_name_does():
    """config.MIN_IMAGE_SIZE checks a built-in's images without importing torch: a table per image model name; gpt
    (token data) is built and run by check_model instead."""
    assert set(config.MIN_IMAGE_SIZE) == set(models.BUILTINS) - {"gpt"}


def test_the_recipes_that_warm_up_are_strategies_and_every_strategy_has_a_rate_rule_per_optimiser():
    assert job.WARMUP_RECIPES <= set(strategies.BUILDERS)
    assert set(lr_schedule.RATE_RULES) == set(strategies.BUILDERS)
    optimizers = set(job_field("train", "optimizer")["enum"])
    assert all(set(rules) == optimizers for rules in lr_schedule.RATE_RULES.values())
