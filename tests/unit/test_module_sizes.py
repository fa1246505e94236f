"""The house's sizes (the developers' guide: a function past 80 lines or a module past 600 is split by what it is
about): no function over 80 lines in the package or bench; no module over 450 lines unless it is one concept, named
here with why; every stage module thin (about 150 lines: reading its inputs, calling the shared pieces, writing)."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LONGEST_FUNCTION = 80
LONGEST_MODULE = 450
HOUSE_LIMIT = 600  # past it even one concept is split
LONGEST_STAGE = 160
ONE_CONCEPT = {  # module -> the one concept it holds, which a split would tear apart
    "tula_hpc/training/ags.py": "Adaptive Gradient Scaling: its statistics, gate and scaled step",
    "tula_hpc/performance/estimator.py": "the performance model as a scikit-learn estimator",
    "tula_hpc/profiling/step_timing.py": "a profile's timed steps and their split into data, compute, sync",
    "bench/tula_bench/trace_accuracy.py": "the GPU-trace accuracy benchmark: replay, fit, score",
    "bench/tula_bench/generalization_fmnist.py": "the Table I protocol on Fashion-MNIST: cells, tuning, test, figures",
    "bench/tula_bench/perf_accuracy.py": "the CPU performance-model accuracy benchmark: measure, fit, score",
    "bench/tula_bench/lm_large_batch.py": "the language-model large-batch protocol: arms, cells, figures",
    "tula_hpc/training/trainer.py": "the training loop read top to bottom: set-up, resume, epochs, batch changes",
}


def sources() -> list[Path]:
    return sorted([*(REPO / "tula_hpc").rglob("*.py"), *(REPO / "bench").rglob("*.py")])


def long_functions(path: Path, limit: int = LONGEST_FUNCTION) -> list[str]:
    tree = ast.parse(path.read_text())
    return [
        f"{node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno - node.lineno + 1 > limit
    ]


def lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def test_no_function_is_over_80_lines():
    assert {str(p.relative_to(REPO)): f for p in sources() if (f := long_functions(p))} == {}


def test_no_module_is_over_450_lines_unless_it_is_one_concept_and_none_over_600():
    long = {str(p.relative_to(REPO)): lines(p) for p in sources() if lines(p) > LONGEST_MODULE}
    assert set(long) <= set(ONE_CONCEPT), {k: v for k, v in long.items() if k not in ONE_CONCEPT}
    assert max(long.values(), default=0) <= HOUSE_LIMIT, long


def test_every_stage_module_is_thin():
    stages = (REPO / "tula_hpc" / "stages").glob("*.py")
    assert {p.name: lines(p) for p in stages if lines(p) > LONGEST_STAGE} == {}


def test_a_long_function_is_found(tmp_path):
    planted = tmp_path / "long.py"
    planted.write_text("def short():\n    pass\n\n\ndef long():\n" + "    x = 1\n" * 80)
    assert long_functions(planted) == ["long (81 lines)"]
