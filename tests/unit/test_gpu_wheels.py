"""scripts/gpu_wheels.py: which requirements the GPU machine's wheels must meet, read from wheels' metadata."""

from __future__ import annotations

import importlib.util
import zipfile
from pathlib import Path

import numpy as np
from packaging.requirements import Requirement
from packaging.version import Version

PATH = Path(__file__).resolve().parents[2] / "scripts" / "gpu_wheels.py"
spec = importlib.util.spec_from_file_location("gpu_wheels", PATH)
gpu_wheels = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_wheels)


def test_requirements_are_read_for_python_3_12_on_linux_with_the_extras_asked_for():
    assert gpu_wheels.needed(Requirement("rpds-py>=0.25"), set())
    assert gpu_wheels.needed(Requirement('typing-extensions>=4.4; python_version < "3.13"'), set())
    assert not gpu_wheels.needed(Requirement('tomli; python_version < "3.11"'), set())
    assert not gpu_wheels.needed(Requirement('pywin32; sys_platform == "win32"'), set())
    assert not gpu_wheels.needed(Requirement('pysocks; extra == "socks"'), set())
    assert gpu_wheels.needed(Requirement('pysocks; extra == "socks"'), {"socks"})


def test_a_wheel_names_itself_and_its_requirements_in_its_metadata(tmp_path):
    path = tmp_path / "demo-1.2.0-py3-none-any.whl"
    metadata = (
        "Metadata-Version: 2.1\nName: Demo_Pkg\nVersion: 1.2.0\nLicense: MIT\n  continued: not a field\n"
        "Requires-Dist: numpy>=1.24\nRequires-Dist: pysocks; extra == 'socks'\n\nRequires-Dist: in the description\n"
    )
    with zipfile.ZipFile(path, "w") as wheel:
        wheel.writestr("demo_pkg-1.2.0.dist-info/METADATA", metadata)
    name, version, requires = gpu_wheels.wheel_metadata(path)
    assert (name, version) == ("demo-pkg", Version("1.2.0"))
    assert [str(r) for r in requires] == ["numpy>=1.24", 'pysocks; extra == "socks"']


def test_every_requirement_must_be_carried_at_a_matching_version_or_be_on_the_image(monkeypatch):
    monkeypatch.setattr(gpu_wheels, "roots", lambda image: [Requirement("snakemake")])
    have = {
        "snakemake": (
            Version("9.27.1"),
            [Requirement("yte>=1.5.5"), Requirement("pyyaml"), Requirement("dpath<3")],
            None,
        ),
        "yte": (Version("1.9.4"), [Requirement("dpath>=2.1")], None),
        "dpath": (Version("3.0.0"), [], None),
    }
    missing, mismatched, on_image = gpu_wheels.unmet(have, image={"pyyaml"})
    assert missing == [] and on_image == {"pyyaml"}
    assert mismatched == ["snakemake needs dpath<3, carried dpath 3.0.0"]
    missing, _, _ = gpu_wheels.unmet(have, image=set())
    assert [str(r) for r in missing] == ["pyyaml"]


def test_a_wheel_compiled_for_another_python_is_refused(monkeypatch):
    have = {
        "pure": (Version("1"), [], Path("pure-1.0-py3-none-any.whl")),
        "ours": (Version("1"), [], Path("ours-1.0-cp312-cp312-manylinux_2_17_x86_64.manylinux2014_x86_64.whl")),
        "here": (Version("1"), [], Path("here-1.0-cp311-cp311-manylinux_2_17_x86_64.whl")),
        "mac": (Version("1"), [], Path("mac-1.0-cp312-cp312-macosx_11_0_arm64.whl")),
    }
    monkeypatch.setitem(gpu_wheels.TARGET, "python_version", "3.12")
    assert gpu_wheels.unsupported(have) == ["here-1.0-cp311-cp311-manylinux_2_17_x86_64.whl", have["mac"][2].name]
    monkeypatch.setitem(gpu_wheels.TARGET, "python_version", "3.11")
    assert "here-1.0-cp311-cp311-manylinux_2_17_x86_64.whl" not in gpu_wheels.unsupported(have)


def test_the_image_stand_in_links_this_pythons_installs_of_the_images_packages_only(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_wheels, "image_packages", lambda: {"numpy"})
    gpu_wheels.image(tmp_path / "image")
    links = {path.name for path in (tmp_path / "image").iterdir()}
    assert "numpy" in links and not any(name.startswith(("snakemake", "submitit")) for name in links)
    assert (tmp_path / "image" / "numpy").resolve() == Path(np.__file__).resolve().parent
