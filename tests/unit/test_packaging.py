"""pyproject.toml declares ranges (a cluster's own torch or Python must install); envs/requirements.txt locks them."""

import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
DECLARED = [Requirement(r) for r in PROJECT["dependencies"]] + [
    Requirement(r) for group in PROJECT["optional-dependencies"].values() for r in group
]


def _lock() -> dict[str, Requirement]:
    lines = (ROOT / "envs" / "requirements.txt").read_text().splitlines()
    reqs = [Requirement(line.split("#")[0]) for line in lines if line.split("#")[0].strip()]
    return {canonicalize_name(r.name): r for r in reqs}


def test_declared_dependencies_are_ranges_not_pins():
    pinned = [str(r) for r in DECLARED if any(s.operator in ("==", "===") for s in r.specifier)]
    assert pinned == []
    assert all(r.specifier for r in DECLARED), "every dependency states the oldest version the code supports"


def test_python_3_12_may_install():
    supported = SpecifierSet(PROJECT["requires-python"])
    assert "3.11" in supported and "3.12" in supported


def test_every_declared_package_is_locked_exactly_within_its_range():
    lock = _lock()
    for req in DECLARED:
        pin = lock.get(canonicalize_name(req.name))
        assert pin is not None, f"{req.name} is missing from envs/requirements.txt"
        (spec,) = pin.specifier
        assert spec.operator == "==", f"{pin} is not an exact pin"
        assert req.specifier.contains(spec.version), f"lock {pin} is outside the declared {req}"
