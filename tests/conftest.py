"""Shared fixtures: the repository root and a tiny job configuration for fast real runs."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def repo() -> Path:
    return REPO


@pytest.fixture
def default_config() -> dict:
    return yaml.safe_load((REPO / "config" / "jobs.yaml").read_text())


def tiny_job_config() -> dict:
    """The default digits job, shortened so that the whole DAG takes about a minute."""
    config = yaml.safe_load((REPO / "config" / "jobs.yaml").read_text())
    job = config["jobs"]["digits-cnn"]
    job["train"].update(epochs=12, lr_milestones=[9])
    job["search"].update(warmup_steps=2, steps=4)
    return config
