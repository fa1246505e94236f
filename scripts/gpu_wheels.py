"""The wheels `make gpu-check` needs on the GPU machine, which has its own python3 and torch but no network.

  download  (here, `make gpu-wheels`): every runtime dependency of tula-hpc (pyproject.toml) that the GPU image
            lacks (scripts/gpu-image-packages.txt), with everything those need in turn, as wheels for CPython 3.12
            on manylinux x86_64, into .whl/; versions as envs/requirements.txt resolved them here (the .venv).
            Then `verify`.
  verify    every requirement of every wheel in .whl/ (markers read for that Python) is met by another wheel
            there or is on the image; one version of each; the whole set well under what a device call carries.
  check     (there, scripts/gpu-python.sh, after installing the wheels): the carried packages' requirements
            against the versions this Python has. The image's versions are not known here, so this is where a
            mismatch shows; it warns and never fails.
  image     (here, scripts/gpu_dry_run.sh) a folder of links to this Python's installs of the image's packages
            (torch, numpy, ...): on a fresh venv's path it stands in for the GPU image.
  size      what a device call carries: the working tree, .whl and .data, against its 64 MiB.

--python and --wheels download and verify the same pins for another CPython into another folder: the dry run's
interpreter here is 3.11, which cannot load the 3.12 set's compiled wheels.

torch and torchvision are never carried: the check runs on the image's own build (pyproject.toml's ranges
allow it; envs/requirements.txt's exact pins are for the .venv only).
"""

from __future__ import annotations

import argparse
import email.parser
import importlib.metadata
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.tags import compatible_tags, cpython_tags
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

REPO = Path(__file__).resolve().parents[1]
WHEELS = REPO / ".whl"
IMAGE_PACKAGES = Path(__file__).resolve().parent / "gpu-image-packages.txt"
# A device call carries 64 MiB in all: the working tree, Fashion-MNIST's 29.5 MiB in .data (make gpu-data) and these.
CARRY_BYTES = 64 * 2**20
MAX_BYTES = 32 * 2**20
# Carried although the image has it: pydantic (snakemake's sqlmodel) imports names from typing_extensions that a
# torch image may predate, and a newer typing_extensions keeps every older name.
ALSO_CARRY = ("typing-extensions",)
TARGET = {
    **default_environment(),
    "python_version": "3.12",
    "python_full_version": "3.12.3",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "os_name": "posix",
}
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64")
PLATFORMS += ("manylinux2014_x86_64", "manylinux_2_5_x86_64", "manylinux1_x86_64")


def use(python: str, wheels: Path) -> None:
    """Download and verify for CPython `python` into `wheels` instead (markers, tags and pip's target follow)."""
    global WHEELS
    WHEELS = wheels.resolve()
    TARGET.update(python_version=python, python_full_version=f"{python}.0")


def image_packages() -> set[str]:
    lines = IMAGE_PACKAGES.read_text().splitlines()
    return {canonicalize_name(line) for line in lines if line.strip() and not line.startswith("#")}


def needed(requirement: Requirement, extras: set[str]) -> bool:
    """Whether a wheel requested with `extras` needs `requirement` on the target Python."""
    if requirement.marker is None:
        return True
    return any(requirement.marker.evaluate({**TARGET, "extra": extra}) for extra in extras | {""})


def wheel_metadata(path: Path) -> tuple[str, Version, list[Requirement]]:
    """(name, version, requirements) from a wheel's METADATA."""
    with zipfile.ZipFile(path) as wheel:
        text = next(wheel.read(n).decode() for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
    fields = email.parser.HeaderParser().parsestr(text)
    requires = [Requirement(r) for r in fields.get_all("Requires-Dist", [])]
    return canonicalize_name(fields["Name"]), Version(fields["Version"]), requires


def carried() -> dict[str, tuple[Version, list[Requirement], Path]]:
    found: dict[str, tuple[Version, list[Requirement], Path]] = {}
    for path in sorted(WHEELS.glob("*.whl")):
        name, version, requires = wheel_metadata(path)
        if name in found:
            raise SystemExit(f"{WHEELS}: two versions of {name} ({found[name][2].name}, {path.name}): keep one")
        found[name] = (version, requires, path)
    return found


def installed_versions() -> dict[str, str]:
    """Name -> version of what this Python imports (the first of each on sys.path): here the .venv, which holds
    envs/requirements.txt as pip resolved it, the versions tested here."""
    found: dict[str, str] = {}
    for dist in importlib.metadata.distributions():
        found.setdefault(canonicalize_name(dist.metadata["Name"]), dist.version)
    return found


def roots(image: set[str]) -> list[Requirement]:
    """tula-hpc's runtime dependencies that the image lacks, and ALSO_CARRY."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    wanted = [Requirement(r) for r in project["dependencies"]] + [Requirement(n) for n in ALSO_CARRY]
    return [r for r in wanted if canonicalize_name(r.name) not in image or canonicalize_name(r.name) in ALSO_CARRY]


def requested_extras(have: dict, image: set[str]) -> dict[str, set[str]]:
    """The extras each carried package is asked for, by tula-hpc or by another carried package."""
    extras = {canonicalize_name(r.name): set(r.extras) for r in roots(image)}
    while True:
        before = {name: set(e) for name, e in extras.items()}
        for name, (_, requires, _) in have.items():
            for requirement in requires:
                if needed(requirement, extras.get(name, set())):
                    extras.setdefault(canonicalize_name(requirement.name), set()).update(requirement.extras)
        if extras == before:
            return extras


def unmet(have: dict, image: set[str]) -> tuple[list[Requirement], list[str], set[str]]:
    """(requirements neither carried nor on the image, carried versions that miss a specifier, names met by the
    image) over tula-hpc's roots and every carried wheel's requirements."""
    extras = requested_extras(have, image)
    wanted = [("tula-hpc", r) for r in roots(image)]
    wanted += [
        (name, r) for name, (_, requires, _) in have.items() for r in requires if needed(r, extras.get(name, set()))
    ]
    missing, mismatched, on_image = [], [], set()
    for who, requirement in wanted:
        name = canonicalize_name(requirement.name)
        if name in have:
            if not requirement.specifier.contains(have[name][0], prereleases=True):
                mismatched.append(f"{who} needs {requirement}, carried {name} {have[name][0]}")
        elif name in image and name not in ALSO_CARRY:
            on_image.add(name)
        else:
            missing.append(requirement)
    return missing, mismatched, on_image


def pip_download(specs: list[str]) -> None:
    """Wheels for the target Python; a release published only as source is built here, if it is pure Python."""
    platforms = [arg for platform in PLATFORMS for arg in ("--platform", platform)]
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check", "--no-deps"]
    python = TARGET["python_version"]
    cmd += ["--only-binary=:all:", "--python-version", python, "--implementation", "cp", *platforms]
    if subprocess.run([*cmd, "-d", str(WHEELS), *specs], capture_output=True).returncode == 0:
        return
    for spec in specs:
        if subprocess.run([*cmd, "-d", str(WHEELS), spec], capture_output=True).returncode == 0:
            continue
        before = set(WHEELS.glob("*.whl"))
        wheel = [sys.executable, "-m", "pip", "wheel", "--quiet", "--disable-pip-version-check", "--no-deps"]
        subprocess.run([*wheel, "--no-binary=:all:", "-w", str(WHEELS), spec], check=True)
        built = set(WHEELS.glob("*.whl")) - before
        if not all(path.name.endswith("-none-any.whl") for path in built):
            raise SystemExit(f"{spec} has no wheel for CPython {python} and builds only for this machine: {built}")
        print(f"built {', '.join(path.name for path in built)} from its source release", flush=True)


def download() -> None:
    """The closure over Requires-Dist, one breadth of it per pip call, pinned where the .venv pins."""
    image, here = image_packages(), installed_versions()
    WHEELS.mkdir(exist_ok=True)
    for old in WHEELS.glob("*.whl"):
        old.unlink()
    while missing := unmet(carried(), image)[0]:
        specs = set()
        for requirement in missing:
            name, pinned = canonicalize_name(requirement.name), here.get(canonicalize_name(requirement.name))
            if pinned and requirement.specifier.contains(pinned, prereleases=True):
                specs.add(f"{name}=={pinned}")
            else:  # not in the .venv (needed only on 3.12, say): the newest release that satisfies it
                specs.add(f"{name}{requirement.specifier}")
        print(f"downloading {', '.join(sorted(specs))}", flush=True)
        pip_download(sorted(specs))
    verify()


def verify() -> None:
    """Every requirement of every carried wheel is met by a carried wheel or by the image; the set is small."""
    image, have = image_packages(), carried()
    missing, problems, on_image = unmet(have, image)
    problems += [f"{r} is neither carried nor on the image" for r in missing]
    problems += [f"{name}: no tag of CPython {TARGET['python_version']} on x86_64 Linux" for name in unsupported(have)]
    size = sum(path.stat().st_size for *_, path in have.values())
    if size > MAX_BYTES:
        problems.append(f"{size / 2**20:.1f} MiB of wheels: more than {MAX_BYTES / 2**20:.0f} MiB")
    if problems:
        raise SystemExit("gpu wheels incomplete:\n  " + "\n  ".join(problems))
    print(
        f"{len(have)} wheels for CPython {TARGET['python_version']}, {size / 2**20:.1f} MiB in {WHEELS}: every "
        "requirement is met by them or by the image "
        f"({', '.join(sorted(on_image))}; the image's versions are checked there: scripts/gpu_wheels.py check)"
    )


def unsupported(have: dict) -> list[str]:
    """Carried wheels that the target CPython on PLATFORMS cannot install (a wheel built here for this Python)."""
    version = tuple(int(part) for part in TARGET["python_version"].split("."))
    accepted = {*cpython_tags(version, platforms=PLATFORMS), *compatible_tags(version, platforms=PLATFORMS)}
    return [path.name for *_, path in have.values() if not parse_wheel_filename(path.name)[3] & accepted]


def image(folder: Path) -> None:
    """Links to this Python's installs of the image's packages, each top-level file or folder of each of them."""
    wanted = image_packages()
    folder.mkdir(parents=True, exist_ok=True)
    for dist in importlib.metadata.distributions():
        if canonicalize_name(dist.metadata["Name"]) not in wanted:
            continue
        for top in {Path(file).parts[0] for file in dist.files or []} - {"..", "__pycache__"}:
            source, link = Path(dist.locate_file(top)), folder / top
            if source.exists() and not link.exists():
                link.symlink_to(source)


def carried_size() -> None:
    """The bytes a device call carries: tracked and untracked-not-ignored files, then .whl and .data."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    tree = sum((REPO / name.decode()).stat().st_size for name in listed if name and (REPO / name.decode()).is_file())
    parts = {"working tree": tree}
    for folder in (".whl", ".data"):
        parts[folder] = sum(path.stat().st_size for path in (REPO / folder).rglob("*") if path.is_file())
    total = sum(parts.values())
    shown = ", ".join(f"{name} {size / 2**20:.1f} MiB" for name, size in parts.items())
    print(f"a device call carries {total / 2**20:.1f} MiB of {CARRY_BYTES / 2**20:.0f} MiB: {shown}")
    if total > CARRY_BYTES:
        raise SystemExit("more than a device call carries")


def check(site: Path) -> None:
    """Warn about each requirement of a package installed in `site` that what this Python imports does not meet."""
    here = installed_versions()
    for dist in importlib.metadata.distributions(path=[str(site)]):
        for text in dist.requires or []:
            requirement = Requirement(text)
            if requirement.marker is not None and not requirement.marker.evaluate(
                {**default_environment(), "extra": ""}
            ):
                continue
            found = here.get(canonicalize_name(requirement.name))
            if found is None or not requirement.specifier.contains(found, prereleases=True):
                print(
                    f"gpu-check: warning: {dist.metadata['Name']} {dist.version} needs {requirement}; "
                    f"found {found or 'none'}",
                    file=sys.stderr,
                )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=("download", "verify", "check", "image", "size"))
    parser.add_argument("--site", type=Path, help="check: the folder the wheels were installed into")
    parser.add_argument("--into", type=Path, help="image: the folder of links")
    parser.add_argument("--python", default=TARGET["python_version"], help="download, verify: for this CPython")
    parser.add_argument("--wheels", type=Path, default=WHEELS, help="download, verify: into this folder")
    args = parser.parse_args()
    use(args.python, args.wheels)
    actions = {"check": lambda: check(args.site), "image": lambda: image(args.into), "size": carried_size}
    actions.get(args.action, {"download": download, "verify": verify}.get(args.action))()


if __name__ == "__main__":
    main()
