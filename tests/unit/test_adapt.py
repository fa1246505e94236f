"""Stage adapt: the profiles beyond the plan (adaptive search's and those that confirm the choice), each kept under
its node shape's name, and the `tula-hpc profile --adaptive` alias the adapt rule calls it by."""

import json

import pytest
import yaml

from tests.conftest import job_config
from tests.unit.profile_runs import gpu_job, record_launches, write_plan
from tula_hpc import cli
from tula_hpc.cluster import launch
from tula_hpc.core.errors import StageError
from tula_hpc.performance import prediction
from tula_hpc.stages import adapt as adapting


def test_adaptive_search_keeps_each_node_shape_under_its_own_name(tmp_path, monkeypatch):
    candidates = [{"nodes": 2, "gpus_per_node": g, "batch": 64, "per_device_batch": 64 // (2 * g)} for g in (4, 2)]
    plan = write_plan(tmp_path / "plan.json", candidates)
    planned = tmp_path / "N2_B64.json"
    planned.write_text(json.dumps({"nodes": 2, "gpus_per_node": 4, "global_batch": 64, "world_size": 8}))

    def search(grid, initial, measure, row_of, *settings):
        profiles = [measure(c) for c in grid]
        assert [row_of(c) for c in grid] == [[8, 8, 4], [4, 16, 2]]
        return {"profiled": grid, "profiles": profiles, "history": [], "discrepancy_per_octave": 0.02, "stopped": "-"}

    monkeypatch.setattr(adapting, "adaptive_search", search)
    launched = record_launches(monkeypatch)
    job = gpu_job().updated(search={"mode": "adaptive", "confirm": 0})
    manifest = adapting.adapt(job, plan, None, [planned], tmp_path / "adaptive.json", tmp_path / "work")
    assert [(spec.nodes, spec.tasks_per_node) for spec, _, _ in launched] == [(2, 2)]  # the planned one is read
    assert (tmp_path / "work" / "adaptive" / "N2_G2_B64.json").exists()
    assert [record["gpus_per_node"] for record in manifest["added"]] == [2]


def test_partial_search_confirms_its_choice_by_measuring_the_best_and_its_rivals(tmp_path, monkeypatch):
    """The model takes 2 nodes at B=64 for the fastest; measured, it is slower than predicted, so the rival at B=128
    (within the band) is measured next and chosen; then no unmeasured rival can win and the search stops."""
    truth = {(1, 64): 10.0, (2, 64): 12.0, (2, 128): 9.0}
    believed = {(1, 64): 10.0, (2, 64): 8.0, (2, 128): 9.5}
    candidates = [
        {"nodes": n, "gpus_per_node": 4, "batch": b, "per_device_batch": b // (4 * n)} for n, b in sorted(truth)
    ]
    launched = []

    def run(fn, kwargs, spec, folder, name):
        launched.append((spec.nodes, kwargs["global_batch"]))
        step = truth[(spec.nodes, kwargs["global_batch"])]
        return {"global_batch": kwargs["global_batch"], "median": {"step_s": step}}, None

    def fit_and_predict(job, profiles, grid, train_samples, memory, settings):
        measured = {(p["nodes"], p["global_batch"]): p["median"]["step_s"] for p in profiles}
        rows = []
        for c in grid:
            key = (c["nodes"], c["batch"])
            step = measured.get(key, believed[key])
            rows.append(
                {**c, "step_s": step, "time_s": step, "cost": step * c["nodes"], "profiled": key in measured}
                | {"rel_uncertainty": 0.01 if key in measured else 0.2}
            )
        return None, [], 0.0, rows

    monkeypatch.setattr(launch, "run_or_out_of_memory", run)
    monkeypatch.setattr(prediction, "fit_and_predict", fit_and_predict)  # the stage imports it where it fits
    plan = write_plan(tmp_path / "plan.json", candidates)
    plan.write_text(json.dumps({**json.loads(plan.read_text()), "dataset": {"train": 1000}}))
    planned = tmp_path / "N1_B64.json"
    planned.write_text(json.dumps({"nodes": 1, "gpus_per_node": 4, "global_batch": 64, "median": {"step_s": 10.0}}))
    (tmp_path / "memory.json").write_text("{}")
    job = gpu_job().updated(search={"mode": "partial", "confirm": 3}, objective={"minimize": "time"})
    manifest = adapting.adapt(job, plan, tmp_path / "memory.json", [planned], tmp_path / "a.json", tmp_path / "w")
    assert launched == [(2, 64), (2, 128)]
    confirm = manifest["confirm"]
    assert [(p["nodes"], p["batch"], p["role"]) for p in confirm["profiles"]] == [(2, 64, "best"), (2, 128, "best")]
    assert confirm["chosen"] == {"nodes": 2, "gpus_per_node": 4, "batch": 128}
    assert confirm["stopped"] == "no unmeasured rival can still win within its band"
    assert len(manifest["added"]) == 2 and json.loads((tmp_path / "a.json").read_text())["confirm"] == confirm
    with pytest.raises(StageError, match="needs memory.json"):
        adapting.adapt(job, plan, None, [planned], tmp_path / "a.json", tmp_path / "w")


def test_profile_adaptive_runs_the_adapt_stage_as_the_adapt_rule_calls_it(tmp_path, monkeypatch):
    """The rule's command is kept (Snakemake reruns a rule whose command changed): `profile --adaptive` is `adapt`."""
    called = []
    monkeypatch.setattr(adapting, "adapt", lambda *args: called.append(args) or {})
    config = tmp_path / "jobs.yaml"
    config.write_text(yaml.safe_dump(job_config()))
    paths = {name: tmp_path / f"{name}.json" for name in ("plan", "memory", "N1_B64", "N2_B64", "adaptive")}
    common = ["--config", str(config), "--job", "digits-cnn", "--work-dir", str(tmp_path / "work")]
    common += ["--plan", str(paths["plan"]), "--profiles", str(paths["N1_B64"]), str(paths["N2_B64"])]
    common += ["--memory", str(paths["memory"]), "--out", str(paths["adaptive"])]
    assert cli.main(["profile", *common[:6], "--adaptive", *common[6:]]) == 0
    assert cli.main(["adapt", *common]) == 0
    assert (
        called[0][1:]
        == called[1][1:]
        == (
            paths["plan"],
            paths["memory"],
            [paths["N1_B64"], paths["N2_B64"]],
            paths["adaptive"],
            tmp_path / "work",
        )
    )
    with pytest.raises(SystemExit, match="2"):  # without --adaptive, profile wants its one configuration
        cli.main(["profile", *common])
