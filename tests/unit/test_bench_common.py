"""bench/common.py: bench jobs are the workflow's job with changes, validated; result files carry provenance."""

from __future__ import annotations

import json

import pytest
from tula_bench import common

from tests.unit.test_imports import import_graph, modules
from tula_hpc.config import ConfigError


def test_changes_merge_key_by_key_into_the_default_job():
    default = common.bench_job()
    job = common.bench_job(
        as_name="bench-x", launcher="slurm", search={"nodes": {"max": 1}}, model={"name": "resnet18"}
    )
    assert job.name == "bench-x" and job.launcher == "slurm"
    assert (job.search.nodes.min, job.search.nodes.max) == (default.search.nodes.min, 1)
    assert job.model.name == "resnet18"
    assert job.train == default.train


def test_a_bench_job_leaves_the_next_one_alone():
    default = common.bench_job()
    common.bench_job(train={"epochs": 12, "lr_milestones": [9]}, search={"nodes": {"max": 1}})
    assert common.bench_job() == default


@pytest.mark.parametrize(
    "sections, field",
    [({"search": {"stepz": 3}}, "search"), ({"train": {"epochs": 3}}, "train.lr_milestones")],
)
def test_a_bad_bench_setting_fails_naming_the_field(sections, field):
    with pytest.raises(ConfigError, match=f"field '{field}'"):
        common.bench_job(**sections)


def test_a_bench_config_is_a_valid_jobs_file_of_one_job():
    config = common.bench_config(as_name="bench-y", train={"epochs": 12, "lr_milestones": [9]})
    assert list(config["jobs"]) == ["bench-y"]
    assert config["jobs"]["bench-y"]["train"]["epochs"] == 12


@pytest.mark.spawns
def test_a_result_file_starts_with_commit_processor_and_settings(tmp_path):
    out = tmp_path / "result.json"
    common.write_result(out, {"rounds": 3}, {"figure": 1.5})
    result = json.loads(out.read_text())
    assert list(result)[:2] == ["provenance", "settings"]
    assert len(result["provenance"]["git_commit"]) == 40
    assert result["provenance"]["processor"]
    assert result["settings"] == {"rounds": 3} and result["figure"] == 1.5


def test_a_folder_digests_as_its_files_without_caches_or_results_and_any_change_shows(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "REPO", tmp_path)
    for name in ("code/a.py", "code/sub/b.py", "code/__pycache__/a.pyc", "bench/results/r.json", "bench/x.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(name)
    files = ["code/a.py", "code/sub/b.py"]
    assert common.files_digest(["code"]) == common.files_digest(files)
    before = common.files_digest(["code", "bench"], {"s": 1})
    (tmp_path / "code/__pycache__/a.pyc").write_text("other")
    (tmp_path / "bench/results/r.json").write_text("other")
    assert common.files_digest(["code", "bench"], {"s": 1}) == before
    assert common.files_digest(["code", "bench"], {"s": 2}) != before
    (tmp_path / "code/sub/b.py").write_text("changed")
    assert common.files_digest(["code", "bench"], {"s": 1}) != before


def test_a_path_that_is_not_there_is_an_error_not_an_empty_digest(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "REPO", tmp_path)
    (tmp_path / "code.py").write_text("x")
    with pytest.raises(FileNotFoundError, match="'moved.py'"):
        common.files_digest(["code.py", "moved.py"])


def test_stage_code_holds_every_module_the_stages_import():
    """Whatever the train and evaluate stages import, however deep, lies under stage_code's paths; the other stages
    and the command line do not."""
    graph = import_graph()
    reached, todo = set(), ["stages.train", "stages.evaluate"]
    while todo:
        module = todo.pop()
        if module not in reached:
            reached.add(module)
            todo += graph[module]
    paths = common.stage_code("train", "evaluate")
    files = {p for p in paths if p.endswith(".py")}
    folders = [p + "/" for p in paths if not p.endswith(".py")]
    found = modules()
    for module in reached:
        path = found[module].relative_to(common.REPO).as_posix()
        assert path in files or any(path.startswith(f) for f in folders), path
    assert all((common.REPO / p).exists() for p in paths)
    assert not {"tula_hpc/stages/select.py", "tula_hpc/cli.py"} & set(paths)


def test_a_recorded_case_is_never_rewritten(tmp_path):
    first = common.new_case_path(tmp_path, "NVIDIA H100 80GB HBM3", "resnet18_32_fp32")
    assert first.name.startswith("nvidia-h100-80gb-hbm3-2") and first.name.endswith("-resnet18_32_fp32.json")
    first.write_text("{}")
    second = common.new_case_path(tmp_path, "NVIDIA H100 80GB HBM3", "resnet18_32_fp32")
    assert second != first and second.name.endswith("-resnet18_32_fp32-2.json")


def _smoke_parser():
    parser = common.bench_parser("A bench.", "a_bench.json")
    parser.add_argument("--smoke", action="store_true")
    return parser


def test_a_smoke_run_must_name_its_out_so_bench_results_stay_untouched(tmp_path):
    with pytest.raises(SystemExit):
        common.parse_bench_args(_smoke_parser(), ["--smoke"])
    with pytest.raises(SystemExit):
        common.parse_bench_args(_smoke_parser(), ["--smoke", "--out", str(common.RESULTS / "a_bench.json")])
    args = common.parse_bench_args(_smoke_parser(), ["--smoke", "--out", str(tmp_path / "a.json")])
    assert args.smoke and args.out == tmp_path / "a.json"
    assert not common.parse_bench_args(_smoke_parser(), []).smoke  # a full run writes bench/results/ as before


def test_a_smoke_scratch_folder_is_fresh_and_goes_when_the_run_ends(monkeypatch):
    at_exit = []
    monkeypatch.setattr(common.atexit, "register", lambda fn, *args, **kw: at_exit.append((fn, args, kw)))
    first, second = common.smoke_scratch("bench"), common.smoke_scratch("bench")
    assert first != second and first.is_dir() and not any(first.iterdir())
    for fn, args, kw in at_exit:
        fn(*args, **kw)
    assert not first.exists() and not second.exists()
