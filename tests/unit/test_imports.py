"""The package's import structure: stage modules import shared modules, never each other; no cycles anywhere.

Imports inside functions count too: a deferred import hides a cycle, it does not remove it.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from tula_hpc.cli import STAGES

PACKAGE = Path(__file__).resolve().parents[2] / "tula_hpc"
STAGE_MODULES = {module.rsplit(".", 1)[1] for module in STAGES.values()}


def package_imports(source: str) -> set[str]:
    """Modules of tula_hpc that `source` (a module of tula_hpc) imports, anywhere in it."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            found |= {node.module.split(".")[0]} if node.module else {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tula_hpc."):
            found.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".")[1] for a in node.names if a.name.startswith("tula_hpc.")}
    return found


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    modules = {path.stem: path for path in package.glob("*.py") if path.stem != "__init__"}
    return {name: package_imports(path.read_text()) & set(modules) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every import cycle, each once, as the path that closes it."""
    found, done = [], set()

    def visit(node: str, path: list[str]) -> None:
        if node in path:
            cycle = path[path.index(node) :]
            if frozenset(cycle) not in done:
                done.add(frozenset(cycle))
                found.append(cycle + [node])
            return
        for nxt in sorted(graph.get(node, ())):
            visit(nxt, path + [node])

    for start in sorted(graph):
        visit(start, [])
    return found


def test_the_stage_list_names_real_modules():
    assert STAGE_MODULES <= set(import_graph()), STAGE_MODULES - set(import_graph())
    assert len(STAGE_MODULES) == 8


def test_no_stage_module_imports_another():
    graph = import_graph()
    offenders = {stage: sorted(graph[stage] & STAGE_MODULES) for stage in STAGE_MODULES if graph[stage] & STAGE_MODULES}
    assert not offenders, f"stage modules importing stage modules: {offenders}"


def test_no_import_cycles():
    assert not cycles(import_graph())


def test_the_checks_see_deferred_imports_and_cycles():
    source = "import os\nfrom . import launch\ndef f():\n    from .train import x\n    import tula_hpc.probe_memory\n"
    assert package_imports(source) == {"launch", "train", "probe_memory"}
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


# The stages that plan, profile (they only submit the timed steps), fit, choose and report run where Snakemake runs,
# often a login node: torch costs them seconds per stage (5-6 s a stage with CUDA's libraries, issue 39).
LOGIN_NODE_STAGES = ("plan", "profiling", "fit_model", "selection", "report")


def test_the_stages_that_run_on_the_login_node_import_no_torch():
    check = f"import sys; import {', '.join(f'tula_hpc.{m}' for m in LOGIN_NODE_STAGES)}; print(*sys.modules)"
    modules = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, check=True)
    assert "torch" not in modules.stdout.split()
    assert {f"tula_hpc.{m}" for m in LOGIN_NODE_STAGES} <= set(modules.stdout.split())
