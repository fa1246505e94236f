"""Each folder's docstring is its table of contents: it names every module the folder holds, and every module it
names exists (a docstring naming a `rows.py` that is not there, or leaving out three modules, misleads a newcomer)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "tula_hpc"
NAMED = re.compile(r"(?<![\w/.])([a-z_][a-z0-9_]*)\.py\b")  # a module of this folder: `name.py`, no folder before it
NAMED_ELSEWHERE = re.compile(r"\b([a-z_][a-z0-9_]*)/([a-z_][a-z0-9_]*)\.py\b")  # `folder/name.py`


def folders(package: Path = PACKAGE) -> list[Path]:
    return sorted(init.parent for init in package.rglob("__init__.py"))


def contents_gaps(folder: Path) -> tuple[set[str], set[str]]:
    """(modules the folder holds that its docstring leaves out, modules it names that the folder lacks)."""
    docstring = ast.get_docstring(ast.parse((folder / "__init__.py").read_text())) or ""
    held = {path.stem for path in folder.glob("*.py") if path.name != "__init__.py"}
    named = set(NAMED.findall(docstring))
    missing_elsewhere = {
        f"{where}/{name}.py"
        for where, name in NAMED_ELSEWHERE.findall(docstring)
        if not (folder.parent / where / f"{name}.py").exists() and not (folder / where / f"{name}.py").exists()
    }
    return held - named, (named - held) | missing_elsewhere


def test_every_folder_docstring_names_exactly_the_modules_its_folder_holds():
    gaps = {folder.name: contents_gaps(folder) for folder in folders() if folder != PACKAGE}
    assert {name: gap for name, gap in gaps.items() if gap != (set(), set())} == {}


def test_a_docstring_that_leaves_out_a_module_or_names_a_missing_one_is_caught(tmp_path):
    folder = tmp_path / "pkg" / "things"
    folder.mkdir(parents=True)
    (folder / "__init__.py").write_text('"""Things: the model (model.py), its rows (rows.py), see other/fit.py."""\n')
    for name in ("model", "fitting"):
        (folder / f"{name}.py").write_text("")
    assert contents_gaps(folder) == ({"fitting"}, {"rows", "other/fit.py"})
