"""The package's import structure: its folders import one way (LAYERS), stage modules never import each other, and
no module's imports close a cycle.

Imports inside functions count too: a deferred import hides a cycle or a wrong direction, it does not remove it.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tula_hpc.cli import STAGES

PACKAGE = Path(__file__).resolve().parents[2] / "tula_hpc"
# Bottom to top: a module may import its own folder and those before it (README.md, "Layout"). config.py and cli.py
# are single modules at the package's top; _legacy_paths (old import paths, imported by the package's __init__)
# imports none of it.
LAYERS = (
    "_legacy_paths",
    "core",
    "cluster",
    "memory",
    "training",
    "profiling",
    "performance",
    "reporting",
    "config",
    "stages",
    "cli",
)
STAGE_MODULES = {module.removeprefix("tula_hpc.") for module in STAGES.values()}
RUNNER = "stages.runner"  # what every stage shares; not a stage


def modules(package: Path = PACKAGE) -> dict[str, Path]:
    """Every module of the package by its dotted name below tula_hpc (a folder's __init__ by the folder's)."""
    found = {}
    for path in package.rglob("*.py"):
        parts = path.relative_to(package).with_suffix("").parts
        parts = parts[:-1] if parts[-1] == "__init__" else parts
        if parts:
            found[".".join(parts)] = path
    return found


def package_imports(source: str, known: set[str]) -> set[str]:
    """The modules of tula_hpc (dotted below it, among `known`) that `source` imports, anywhere in it."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tula_hpc"):
            base = node.module.removeprefix("tula_hpc").lstrip(".")
            for alias in node.names:
                name = f"{base}.{alias.name}" if base else alias.name
                found.add(name if name in known else base)
        elif isinstance(node, ast.Import):
            found |= {a.name.removeprefix("tula_hpc.") for a in node.names if a.name.startswith("tula_hpc.")}
        elif isinstance(node, ast.ImportFrom) and node.level:
            relative = "." * node.level + (node.module or "")
            raise AssertionError(f"a relative import ({relative}): the house imports tula_hpc.* by name")
    return found & known


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    found = modules(package)
    return {name: package_imports(path.read_text(), set(found)) - {name} for name, path in found.items()}


def layer(module: str) -> int:
    return LAYERS.index(module.split(".")[0])


def against_the_direction(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Imports of a later folder (LAYERS), and of one stage by another."""
    wrong = [(a, b) for a, targets in graph.items() for b in targets if layer(b) > layer(a)]
    wrong += [(a, b) for a in STAGE_MODULES for b in graph.get(a, ()) if b in STAGE_MODULES]
    return sorted(wrong)


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


def test_every_module_lives_in_a_layer_and_the_stage_list_names_real_modules():
    graph = import_graph()
    assert {name.split(".")[0] for name in graph} == set(LAYERS)
    assert STAGE_MODULES <= set(graph), STAGE_MODULES - set(graph)
    assert len(STAGE_MODULES) == 9 and all(m.startswith("stages.") for m in STAGE_MODULES)


def test_imports_run_one_way_between_folders_and_no_stage_imports_another():
    assert not against_the_direction(import_graph())


def test_no_import_cycles():
    assert not cycles(import_graph())


def test_a_planted_wrong_import_is_found(tmp_path):
    """The check fails on an import against the direction: the real package with one wrong line added, deferred."""
    planted = tmp_path / "tula_hpc"
    shutil.copytree(PACKAGE, planted, ignore=shutil.ignore_patterns("__pycache__", "csrc"))
    job = planted / "core" / "job.py"
    job.write_text(job.read_text() + "\n\ndef late():\n    from tula_hpc.training.datasets import load_splits\n")
    evaluate = planted / "stages" / "evaluate.py"
    evaluate.write_text(evaluate.read_text() + "\nimport tula_hpc.stages.train\n")
    assert against_the_direction(import_graph(planted)) == [
        ("core.job", "training.datasets"),
        ("stages.evaluate", "stages.train"),
    ]


def test_the_checks_see_deferred_imports_and_cycles():
    known = {"cluster", "cluster.launch", "stages.train", "stages.probe_memory", "core.job"}
    source = (
        "import os\nfrom tula_hpc.cluster import launch\ndef f():\n    from tula_hpc.stages.train import x\n"
        "    import tula_hpc.stages.probe_memory\n"
    )
    assert package_imports(source, known) == {"cluster.launch", "stages.train", "stages.probe_memory"}
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


BENCH = PACKAGE.parent / "bench"
LIBRARY = "tula_bench"  # bench/tula_bench: the measuring code; bench/*.py: one command line each, calling it


def bench_modules(bench: Path = BENCH) -> dict[str, Path]:
    """bench's scripts by file name ("gpu_check") and its library's modules by dotted name ("tula_bench.common")."""
    found = {path.stem: path for path in bench.glob("*.py")}
    for path in (bench / LIBRARY).glob("*.py"):
        found[LIBRARY if path.stem == "__init__" else f"{LIBRARY}.{path.stem}"] = path
    return found


def bench_imports(source: str, known: set[str]) -> set[str]:
    """The bench modules (among `known`) that `source` imports, anywhere in it: a script by its bare name (as the
    scripts once imported each other) or as bench.<name>, the library by tula_bench.<module>."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            base = node.module.removeprefix("bench.")
            found |= {f"{base}.{alias.name}" for alias in node.names} | {base}
        elif isinstance(node, ast.Import):
            found |= {alias.name.removeprefix("bench.") for alias in node.names}
    return found & known


def bench_graph(bench: Path = BENCH) -> dict[str, set[str]]:
    found = bench_modules(bench)
    return {name: bench_imports(path.read_text(), set(found)) - {name, LIBRARY} for name, path in found.items()}


def bench_against_the_direction(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """A script imported by anything (the library or another script): scripts sit above the library, side by side."""
    return sorted((a, b) for a, targets in graph.items() for b in targets if not b.startswith(LIBRARY))


def test_bench_imports_run_from_its_scripts_to_its_library_only():
    graph = bench_graph()
    assert {name for name in graph if not name.startswith(LIBRARY)} >= {"gpu_check", "steady_truth", "whole_run"}
    assert not bench_against_the_direction(graph)


def test_bench_has_no_import_cycles():
    assert not cycles(bench_graph())


def test_the_package_imports_nothing_of_bench():
    known = set(bench_modules())
    assert not {name: hits for name, path in modules().items() if (hits := bench_imports(path.read_text(), known))}


def test_a_planted_script_import_in_bench_is_found(tmp_path):
    """The check fails on a script imported by the library (deferred) and by another script, and sees the cycle a
    library module closes."""
    planted = tmp_path / "bench"
    shutil.copytree(BENCH, planted, ignore=shutil.ignore_patterns("__pycache__", "results", "data"))
    common = planted / LIBRARY / "common.py"
    common.write_text(common.read_text() + "\n\ndef late():\n    import gpu_check\n")
    chaos = planted / "chaos.py"
    chaos.write_text(chaos.read_text() + "\nfrom bench.whole_run import main as whole\n")
    # steady_truth imports common: common importing it closes a cycle
    common.write_text(common.read_text() + "\n\ndef later():\n    from tula_bench import steady_truth\n")
    graph = bench_graph(planted)
    assert bench_against_the_direction(graph) == [("chaos", "whole_run"), ("tula_bench.common", "gpu_check")]
    assert ["tula_bench.common", "tula_bench.steady_truth", "tula_bench.common"] in cycles(graph)


def private_names_crossed(source: str) -> list[str]:
    """`_name`s that `source` takes from a module of tula_hpc or tula_bench: by import, or as an attribute of a module
    it imported (dunders aside). A name private to its module is used there alone; one that serves others is public."""
    ours = ("tula_hpc", LIBRARY)
    crossed, module_aliases = [], set()
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(ours):
            crossed += [f"{node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
            module_aliases |= {a.asname or a.name for a in node.names}
        elif isinstance(node, ast.Import):
            module_aliases |= {(a.asname or a.name).split(".")[0] for a in node.names if a.name.startswith(ours)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            if isinstance(node.value, ast.Name) and node.value.id in module_aliases:
                crossed.append(f"{node.value.id}.{node.attr}")
    return crossed


def test_no_module_of_the_package_or_bench_uses_another_ones_private_names():
    sources = {**modules(), **bench_modules()}
    assert {name: hits for name, path in sources.items() if (hits := private_names_crossed(path.read_text()))} == {}


def test_a_private_name_taken_across_modules_is_found():
    source = (
        "from tula_hpc.profiling.memory_probes import _build, probe_device\nfrom tula_bench import common\n"
        "common._processor()\nprobe_device.__name__\n"
    )
    assert private_names_crossed(source) == ["tula_hpc.profiling.memory_probes._build", "common._processor"]


# Every stage runs where Snakemake runs, often a login node: those that measure, train or evaluate only submit their
# workers, by name (launch.Worker), and wait. torch costs a stage seconds (5-6 s a stage with CUDA's libraries, issue
# 39); the workers import it where they run.
LOGIN_NODE_STAGES = tuple(
    f"stages.{name}"
    for name in ("probe_memory", "plan", "profile", "adapt", "fit_model", "select", "train", "evaluate", "report")
)


@pytest.mark.spawns
def test_the_stages_that_run_on_the_login_node_import_no_torch():
    check = f"import sys; import {', '.join(f'tula_hpc.{m}' for m in LOGIN_NODE_STAGES)}; print(*sys.modules)"
    loaded = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, check=True)
    assert "torch" not in loaded.stdout.split()
    assert "kneed" not in loaded.stdout.split()  # scipy.signal with it: imported where a choice is made
    assert {f"tula_hpc.{m}" for m in LOGIN_NODE_STAGES} <= set(loaded.stdout.split())


@pytest.mark.spawns
def test_the_stages_that_fit_nothing_start_without_scikit_learn():
    """Planning, a planned profile job, training at a fixed batch, evaluating and reporting fit nothing: scikit-learn
    (a second to import) stays out until a fit is made (the adapt rule's, an adaptive batch schedule's)."""
    for stage in ("plan", "profile", "train", "evaluate", "report"):
        check = f"import sys; import tula_hpc.stages.{stage}; print(*sys.modules)"
        loaded = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, check=True)
        assert "sklearn" not in loaded.stdout.split() and f"tula_hpc.stages.{stage}" in loaded.stdout.split()


@pytest.mark.spawns
def test_a_memory_probes_process_starts_without_scikit_learn():
    """A probe in a fresh process (CPU jobs: every probe and trial) records parts the stage fits; it fits nothing."""
    check = "import sys; import tula_hpc.profiling.memory_probes; print(*sys.modules)"
    loaded = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, check=True)
    assert "sklearn" not in loaded.stdout.split() and "tula_hpc.profiling.memory_probes" in loaded.stdout.split()
