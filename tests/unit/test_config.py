"""Bad input: one clear message naming the job, the field and what is allowed; nothing submitted."""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import yaml

from tests.conftest import REPO, default_job, job_config
from tula_hpc.config import (
    STAGE_SETTINGS,
    ConfigError,
    fingerprint,
    job_settings,
    load_config,
    stage_settings,
    validate_config,
)
from tula_hpc.performance import DEFAULT_SYNC_PRIOR
from tula_hpc.stage import load_job

BAD_CASES = [
    ("unknown model", lambda j: j["model"].update(name="resnet1000"), ["model.name", "resnet18"]),
    ("unknown dataset", lambda j: j["data"].update(name="mnist"), ["data.name", "mnist", "cifar10"]),
    ("missing data root", lambda j: j["data"].update(name="cifar10", image_size=32), ["data.root", "cifar10"]),
    (
        "data root not a folder",
        lambda j: j["data"].update(name="cifar10", root="/nonexistent/cifar", image_size=32),
        ["data.root", "/nonexistent/cifar", "does not exist"],
    ),
    ("batch min above max", lambda j: j["search"]["batch"].update(min=512, max=64), ["search.batch", "512", "64"]),
    ("nodes min above max", lambda j: j["search"]["nodes"].update(min=4, max=2), ["search.nodes", "4", "2"]),
    ("zero epochs", lambda j: j["train"].update(epochs=0), ["train.epochs", "minimum"]),
    ("negative epochs", lambda j: j["train"].update(epochs=-3), ["train.epochs", "-3"]),
    ("epochs as text", lambda j: j["train"].update(epochs="ten"), ["train.epochs", "'ten'", "integer"]),
    ("lr as text", lambda j: j["train"].update(lr="fast"), ["train.lr", "number"]),
    ("unknown key", lambda j: j["train"].update(epoch=3), ["train", "'epoch'", "epochs"]),
    (
        "unknown precision",
        lambda j: j["train"].update(precision="fp8"),
        ["train.precision", "'fp8'", "fp32, bf16, fp16"],
    ),
    ("channels_last as text", lambda j: j["train"].update(channels_last="yes"), ["train.channels_last", "boolean"]),
    ("unknown section", lambda j: j.update(extras={}), ["'extras'", "allowed keys"]),
    ("unknown objective", lambda j: j["objective"].update(minimize="accuracy"), ["objective.minimize", "knee"]),
    (
        "module:callable that does not import",
        lambda j: j["model"].update(name="no_such_pkg.models:make"),
        ["model.name", "no_such_pkg.models:make", "does not import"],
    ),
    (
        "callable missing from module",
        lambda j: j["model"].update(name="tula_hpc.models:no_such_factory"),
        ["model.name", "no_such_factory"],
    ),
    ("image too small for the model", lambda j: j["model"].update(name="vgg11"), ["data.image_size", "vgg11", "32"]),
    ("search mode", lambda j: j["search"].update(mode="exhaustive"), ["search.mode", "partial, full"]),
    ("milestone past the end", lambda j: j["train"].update(lr_milestones=[40]), ["train.lr_milestones", "40"]),
    ("zero device memory", lambda j: j["resources"].update(device_memory_gb=0), ["resources.device_memory_gb"]),
    ("nodes as list", lambda j: j["search"].update(nodes=[1, 2]), ["search.nodes", "object"]),
    (
        "no bandwidth",
        lambda j: j["search"]["sync_prior"]["inter_node"].update(bandwidth_gb_s=0),
        ["search.sync_prior.inter_node.bandwidth_gb_s", "12.5"],
    ),
]


@pytest.mark.parametrize("label, mutate, expected", BAD_CASES, ids=[c[0] for c in BAD_CASES])
def test_bad_input_names_job_field_and_allowed(label, mutate, expected):
    config = job_config()
    mutate(config["jobs"]["digits-cnn"])
    with pytest.raises(ConfigError) as err:
        validate_config(config)
    message = str(err.value)
    assert "job 'digits-cnn'" in message or "'extras'" in message
    for fragment in expected:
        assert fragment in message, f"{label}: {fragment!r} missing from {message!r}"


def test_default_config_is_valid_and_filled_with_defaults():
    config = validate_config(job_config())
    job = job_settings(config, "digits-cnn")
    assert job["launcher"] == "local"
    assert job["resources"]["slurm"] == {}
    assert job["search"]["batch"] == {"min": 32, "max": 256}


def test_sync_priors_left_out_are_the_schema_defaults_the_performance_model_also_uses():
    config = job_config()
    del config["jobs"]["digits-cnn"]["search"]["sync_prior"]
    assert job_settings(validate_config(config), "digits-cnn")["search"]["sync_prior"] == DEFAULT_SYNC_PRIOR


def test_profile_slurm_settings_are_overridden_per_job():
    config = job_config(resources={"slurm": {"partition": "gpu", "extra_args": ["--exclusive"]}})
    config.update(launcher="slurm", slurm={"partition": "debug", "account": "proj1"})
    job = job_settings(validate_config(config), "digits-cnn")
    assert job["resources"]["slurm"] == {"partition": "gpu", "account": "proj1", "extra_args": ["--exclusive"]}


def test_later_files_update_earlier_ones(tmp_path):
    base = tmp_path / "jobs.yaml"
    base.write_text(yaml.safe_dump(job_config()))
    override = tmp_path / "override.yaml"
    override.write_text(yaml.safe_dump({"jobs": {"digits-cnn": {"train": {"epochs": 3, "lr_milestones": []}}}}))
    job = load_job([base, override], "digits-cnn")
    assert job["train"]["epochs"] == 3
    assert job["train"]["lr"] == job_config()["jobs"]["digits-cnn"]["train"]["lr"]


def test_unknown_job_lists_defined_ones(tmp_path):
    path = tmp_path / "jobs.yaml"
    path.write_text(yaml.safe_dump(job_config()))
    with pytest.raises(ConfigError, match="job 'nope' is not defined; defined jobs: digits-cnn"):
        load_job([path], "nope")


def test_missing_and_malformed_files_are_named(tmp_path):
    with pytest.raises(ConfigError, match="missing.yaml: file not found"):
        load_config([tmp_path / "missing.yaml"])
    broken = tmp_path / "broken.yaml"
    broken.write_text("jobs: [unclosed\n")
    with pytest.raises(ConfigError, match="broken.yaml: not valid YAML"):
        load_config([broken])


def test_stage_cli_exits_nonzero_and_leaves_results_untouched(tmp_path):
    config_path = tmp_path / "jobs.yaml"
    config_path.write_text(yaml.safe_dump(job_config(train={"epochs": 0})))
    earlier = tmp_path / "memory.json"
    earlier.write_text('{"earlier": true}\n')
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tula_hpc.memory",
            "--config",
            str(config_path),
            "--job",
            "digits-cnn",
            "--out",
            str(earlier),
            "--work-dir",
            str(tmp_path / "work"),
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert proc.returncode == 2
    assert "job 'digits-cnn': field 'train.epochs'" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert earlier.read_text() == '{"earlier": true}\n'
    assert not (tmp_path / "work").exists(), "nothing may be submitted for an invalid config"


def test_every_stage_dependency_names_a_real_setting():
    job = default_job()
    for stage, names in STAGE_SETTINGS.items():
        for name in names:
            value = job
            for key in name.split("."):
                assert isinstance(value, dict) and key in value, f"{stage}: {name} is not a setting"
                value = value[key]
    assert stage_settings(job, "select") == {"objective": job["objective"]}


def _settings(tree: dict, path: tuple = ()):
    """The path of every single setting (a leaf, an empty mapping included) of a job."""
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            yield from _settings(value, (*path, key))
        else:
            yield (*path, key)


@pytest.mark.parametrize("stage", STAGE_SETTINGS)
def test_a_fingerprint_changes_with_every_setting_in_its_stage_table_and_no_other(stage):
    """A profile or checkpoint is reused exactly when nothing its stage depends on changed."""
    job = default_job()
    table = [tuple(name.split(".")) for name in STAGE_SETTINGS[stage]]
    for path in _settings(job):
        changed = copy.deepcopy(job)
        section = changed
        for key in path[:-1]:
            section = section[key]
        section[path[-1]] = "changed"
        depends = any(path[: len(name)] == name for name in table)
        assert (fingerprint(changed, stage) != fingerprint(job, stage)) == depends, ".".join(path)


def test_a_profile_depends_on_the_step_profiled_not_on_how_many_are_run_or_their_price():
    job = default_job()
    more_epochs = default_job(train={"epochs": 31})
    assert fingerprint(more_epochs, "profile") == fingerprint(job, "profile")
    assert fingerprint(more_epochs, "fit_model") != fingerprint(job, "fit_model")  # epochs change T
    assert fingerprint(default_job(train={"strategy": "lars"}), "profile") != fingerprint(job, "profile")
    assert fingerprint(default_job(objective={"minimize": "cost"}), "profile") == fingerprint(job, "profile")


def test_the_step_precision_reruns_memory_probing_profiling_and_training():
    job = default_job()
    for change in ({"precision": "bf16"}, {"channels_last": True}):
        changed = default_job(train=change)
        for stage in ("probe_memory", "profile", "adapt", "train"):
            assert fingerprint(changed, stage) != fingerprint(job, stage), (change, stage)
        assert fingerprint(changed, "fit_model") == fingerprint(job, "fit_model")


def test_the_rules_read_the_same_table():
    rules = "".join(path.read_text() for path in (REPO / "workflow" / "rules").glob("*.smk"))
    assert 'settings("' in rules and "STEP_SETTINGS" not in rules
    for stage in STAGE_SETTINGS:
        if stage != "report":
            assert f'settings("{stage}")' in rules, stage
