"""Bad input: one clear message naming the job, the field and what is allowed; nothing submitted."""

from __future__ import annotations

import copy
import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO, default_job, job_config
from tula_hpc.config import SCHEMA_PATH, ConfigError, job_settings, load_config, validate_config
from tula_hpc.core.dependencies import LATER_SETTINGS, STAGE_SETTINGS, fingerprint, stage_settings
from tula_hpc.performance.sync_priors import SYNC_PRIORS
from tula_hpc.stages.runner import load_job
from tula_hpc.training.data_check import FASHION_MNIST_FOLDER
from tula_hpc.training.tasks import CausalLM, ImageClassification

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
    (
        "tokens and steps",
        lambda j: j["train"].update(tokens=1000, steps=10),
        ["train.tokens", "train.steps", "both set"],
    ),
    ("tokens without seq_len", lambda j: j["train"].update(tokens=1000), ["train.tokens", "data.seq_len"]),
    ("zero steps", lambda j: j["train"].update(steps=0), ["train.steps", "minimum"]),
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
        lambda j: j["model"].update(name="tula_hpc.training.models:no_such_factory"),
        ["model.name", "no_such_factory"],
    ),
    ("image too small for the model", lambda j: j["model"].update(name="vgg11"), ["data.image_size", "vgg11", "32"]),
    ("search mode", lambda j: j["search"].update(mode="exhaustive"), ["search.mode", "partial, full"]),
    ("milestone past the end", lambda j: j["train"].update(lr_milestones=[40]), ["train.lr_milestones", "40"]),
    ("zero device memory", lambda j: j["resources"].update(device_memory_gb=0), ["resources.device_memory_gb"]),
    ("nodes as list", lambda j: j["search"].update(nodes=[1, 2]), ["search.nodes", "object"]),
    (
        "no bandwidth",
        lambda j: j["search"].update(sync_prior={"inter_node": {"bandwidth_gb_s": 0}}),
        ["search.sync_prior.inter_node.bandwidth_gb_s", "12.5"],
    ),
    (
        "an unknown short sbatch option",
        lambda j: j["resources"].update(slurm={"extra_args": ["-Z 3"]}),
        ["field 'resources.slurm.extra_args': '-Z' is not an sbatch option", "-p"],
    ),
    (
        "an sbatch option the project sets",
        lambda j: j["resources"].update(slurm={"extra_args": ["-c 8"]}),
        ["field 'resources.slurm.extra_args': --cpus-per-task is set by resources.cpus_per_task"],
    ),
    (
        "a variable name no shell takes",
        lambda j: j["resources"].update(slurm={"environment": {"NCCL-IFNAME": "ib0"}}),
        ["resources.slurm.environment", "NCCL-IFNAME"],
    ),
    (
        "a variable the launcher sets",
        lambda j: j["resources"].update(slurm={"environment": {"MASTER_ADDR": "n1"}}),
        ["field 'resources.slurm.environment': MASTER_ADDR is torch.distributed's"],
    ),
    (
        "a Slurm variable",
        lambda j: j["resources"].update(slurm={"environment": {"SLURM_CPUS_PER_TASK": "2"}}),
        ["field 'resources.slurm.environment': SLURM_CPUS_PER_TASK is Slurm's own"],
    ),
    (
        "a value that is not a string",
        lambda j: j["resources"].update(slurm={"environment": {"NCCL_IB_HCA": 5}}),
        ["resources.slurm.environment.NCCL_IB_HCA", "expected string"],
    ),
    (
        "a GPU binding",
        lambda j: j["resources"].update(slurm={"gpu_binding": "socket"}),
        ["resources.slurm.gpu_binding", "node, task"],
    ),
    (
        "a GPU type with a count",
        lambda j: j["resources"].update(slurm={"gpu_type": "a100:2"}),
        ["resources.slurm.gpu_type", "as the site's gres.conf names it"],
    ),
    (
        "a setup line of two",
        lambda j: j["resources"].update(slurm={"setup": ["module load cuda\nmodule load nccl"]}),
        ["resources.slurm.setup.0", "one shell line"],
    ),
    (
        "no memory per GPU",
        lambda j: j["resources"].update(slurm={"mem_per_gpu_gb": 0}),
        ["resources.slurm.mem_per_gpu_gb"],
    ),
    ("a wckey of two words", lambda j: j["resources"].update(slurm={"wckey": "a b"}), ["resources.slurm.wckey"]),
    (
        "ags on lars under adamw",
        lambda j: j["train"].update(optimizer="adamw", strategy="ags", ags={"base": "lars"}),
        ["field 'train.ags.base'", "'lars' under adamw", "decoupled", "allowed: sgd, lrs"],
    ),
    ("an unknown kind to exclude", lambda j: j["train"].update(ags={"exclude": ["heads"]}), ["train.ags.exclude.0"]),
    (
        "a ramp starting above every batch searched",
        lambda j: j["train"].update(batch_schedule="ramp", ramp={"start_batch": 1_000_000}),
        ["field 'train.ramp.start_batch'", "1000000 is above the largest batch searched", "allowed: 1 to"],
    ),
    (
        "a ramp over none of the run",
        lambda j: j["train"].update(batch_schedule="ramp", ramp={"fraction": 0}),
        ["train.ramp.fraction"],
    ),
    (
        "a ramp over more than the run",
        lambda j: j["train"].update(batch_schedule="ramp", ramp={"fraction": 1.5}),
        ["train.ramp.fraction"],
    ),
    (
        "a ramp in a run measured in steps",
        lambda j: j["train"].update(batch_schedule="ramp", steps=100),
        ["field 'train.steps'", "ramp changes its batch", "allowed: train.tokens or train.epochs"],
    ),
    (
        "a ramp under polo",
        lambda j: j["train"].update(batch_schedule="ramp", strategy="polo"),
        ["field 'train.batch_schedule'", "ramp with strategy 'polo'", "allowed: fixed"],
    ),
    (
        "an unknown moments rule",
        lambda j: j["train"].update(adam_moments_on_batch_change="halve"),
        ["train.adam_moments_on_batch_change", "keep, reset"],
    ),
    ("decisions every 0 steps", lambda j: j["train"].update(batch_schedule_every=0), ["train.batch_schedule_every"]),
    ("validation every 0 tokens", lambda j: j["train"].update(val_every_tokens=0), ["train.val_every_tokens"]),
    ("one beta", lambda j: j["train"].update(optimizer="adamw", betas=[0.9]), ["train.betas"]),
    ("a beta of 1", lambda j: j["train"].update(optimizer="adamw", betas=[0.9, 1.0]), ["train.betas.1"]),
    ("no clipping norm", lambda j: j["train"].update(grad_clip=0), ["train.grad_clip"]),
    (
        "an unknown schedule",
        lambda j: j["train"].update(lr_schedule={"kind": "linear"}),
        ["train.lr_schedule.kind", "multistep, cosine"],
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


@pytest.mark.parametrize(
    "train,objective",
    [
        ({"strategy": "lars"}, {}),
        ({"strategy": "polo"}, {}),
        ({"strategy": "adascale"}, {"minimize": "goodput"}),
        ({"strategy": "lbt", "batch_schedule": "adaptive"}, {"minimize": "goodput_cost"}),
    ],
)
def test_the_adam_forms_lamb_polo_adascale_and_the_noise_scales_users_are_valid_under_adamw(train, objective):
    """lars (LAMB), polo and adascale (AdaptDL's form) run under adamw, and so do the goodput objectives and the
    adaptive batch, on the noise scale of the preconditioned gradient."""
    config = job_config(train={"optimizer": "adamw", "warmup_epochs": 1, **train}, objective=objective)
    job = job_settings(validate_config(config), "digits-cnn")
    assert (job.train.optimizer, job.train.strategy) == ("adamw", train["strategy"])


def test_a_ramp_on_one_rank_is_valid_and_starts_at_lr_base_batch_by_default():
    config = job_config()
    config["jobs"]["digits-cnn"]["train"].update(optimizer="adamw", strategy="lrs", batch_schedule="ramp")
    config["jobs"]["digits-cnn"]["search"].update(nodes={"min": 1, "max": 1})
    train = validate_config(config)["jobs"]["digits-cnn"]["train"]
    assert (train["ramp"]["start_batch"], train["ramp"]["fraction"], train["adam_moments_on_batch_change"]) == (
        None,
        0.2,
        "keep",
    )


def test_adamw_with_lrs_and_a_cosine_schedule_is_valid_and_fills_only_the_schedule_defaults():
    config = job_config()
    train = config["jobs"]["digits-cnn"]["train"]
    train.update(optimizer="adamw", strategy="lrs", grad_clip=1.0, lr_schedule={"kind": "cosine"})
    job = job_settings(validate_config(config), "digits-cnn")
    assert (job.train.betas, job.train.eps, job.train.grad_clip) == ((0.9, 0.95), 1e-8, 1.0)
    assert (job.train.lr_schedule.warmup_steps, job.train.lr_schedule.min_lr_ratio) == (0, 0.1)


@pytest.mark.parametrize("stage", sorted(STAGE_SETTINGS))
def test_a_job_that_sets_no_later_setting_keeps_the_fingerprints_it_had_before_they_existed(stage):
    """What each stage depends on, for a job leaving every LATER_SETTINGS key at its earlier value, is what it was
    before those keys existed: its settings with them deleted, as an earlier version's Job.as_dict() had them."""
    settings = default_job().as_dict()
    earlier = copy.deepcopy(settings)
    for name in LATER_SETTINGS:
        *parents, key = name.split(".")
        section = earlier
        for parent in parents:
            section = section[parent]
        del section[key]
    assert stage_settings(settings, stage) == stage_settings(earlier, stage)
    changed = default_job(train={"optimizer": "adamw", "strategy": "lbt", "betas": [0.8, 0.9]}).as_dict()
    if stage in ("train", "profile", "probe_memory"):
        assert stage_settings(changed, stage) != stage_settings(settings, stage)


@pytest.mark.parametrize("name", sorted(LATER_SETTINGS))
def test_the_earlier_value_of_a_later_setting_is_its_schema_default(name):
    jobs = yaml.safe_load(SCHEMA_PATH.read_text())["properties"]["jobs"]["additionalProperties"]
    schema = jobs
    for key in name.split("."):
        schema = schema["properties"][key]
    default = copy.deepcopy(schema["default"])
    for key, sub in schema.get("properties", {}).items():  # an object's defaults are its properties'
        default.setdefault(key, sub["default"])
    assert default == LATER_SETTINGS[name]


def test_default_config_is_valid_and_filled_with_defaults():
    config = validate_config(job_config())
    job = job_settings(config, "digits-cnn")
    assert job.launcher == "local"
    assert job.as_dict()["resources"]["slurm"] == {}
    assert (job.search.batch.min, job.search.batch.max) == (32, 256)


def test_profile_slurm_settings_are_overridden_per_job():
    config = job_config(resources={"slurm": {"partition": "gpu", "extra_args": ["--exclusive"]}})
    config.update(launcher="slurm", slurm={"partition": "debug", "account": "proj1"})
    job = job_settings(validate_config(config), "digits-cnn")
    assert job.as_dict()["resources"]["slurm"] == {
        "partition": "gpu",
        "account": "proj1",
        "extra_args": ["--exclusive"],
    }


def test_a_sites_slurm_settings_are_valid_and_kept():
    site = {
        "wckey": "proj7",
        "gpu_type": "a100",
        "gpu_binding": "task",
        "reservation": "maint",
        "mem_per_gpu_gb": 12,
        "setup": ["module load cuda/12.1"],
        "environment": {"NCCL_SOCKET_IFNAME": "ib0", "GLOO_SOCKET_IFNAME": "ib0", "NCCL_IB_HCA": "mlx5_0"},
        "extra_args": ["-p gpu", "--exclusive", "--wckey="],
    }
    config = _gpu_config(gpus=4, resources={"mem_gb": 4})  # memory per GPU in place of the node's
    config["slurm"] = site
    job = job_settings(validate_config(config), "digits-cnn")
    assert job.as_dict()["resources"]["slurm"] == site


def test_too_little_memory_per_gpu_is_refused():
    from tula_hpc.config import HOST_GB_PER_GPU_RANK

    with pytest.raises(ConfigError) as err:
        validate_config(_gpu_config(gpus=2, resources={"slurm": {"mem_per_gpu_gb": 1}}))
    assert "field 'resources.slurm.mem_per_gpu_gb': 1 GB" in str(err.value)
    assert f"allowed: at least {HOST_GB_PER_GPU_RANK}" in str(err.value)
    validate_config(job_config(resources={"slurm": {"mem_per_gpu_gb": 1}}))  # a CPU job asks per node


@pytest.mark.parametrize(("lag", "error"), [(-1, "minimum"), (601, "allowed: 0 to 600 s"), ("30", "number")])
def test_the_file_system_lag_is_seconds_from_0_to_600(lag, error):
    config = job_config(resources={"slurm": {"file_system_lag_s": lag}})
    with pytest.raises(ConfigError, match=rf"resources.slurm.file_system_lag_s.*{error}|{error}.*file_system_lag_s"):
        validate_config(config)
    job = job_settings(validate_config(job_config(resources={"slurm": {"file_system_lag_s": 5}})), "digits-cnn")
    assert job.resources.slurm.file_system_lag_s == 5


def test_later_files_update_earlier_ones(tmp_path):
    base = tmp_path / "jobs.yaml"
    base.write_text(yaml.safe_dump(job_config()))
    override = tmp_path / "override.yaml"
    override.write_text(yaml.safe_dump({"jobs": {"digits-cnn": {"train": {"epochs": 3, "lr_milestones": []}}}}))
    job = load_job([base, override], "digits-cnn")
    assert job.train.epochs == 3
    assert job.train.lr == job_config()["jobs"]["digits-cnn"]["train"]["lr"]


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


@pytest.mark.spawns
def test_stage_cli_exits_nonzero_and_leaves_results_untouched(tmp_path):
    config_path = tmp_path / "jobs.yaml"
    config_path.write_text(yaml.safe_dump(job_config(train={"epochs": 0})))
    earlier = tmp_path / "memory.json"
    earlier.write_text('{"earlier": true}\n')
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tula_hpc.stages.probe_memory",
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
    job = default_job().as_dict()
    for stage, names in STAGE_SETTINGS.items():
        for name in names:
            value = job
            for key in name.split("."):
                assert isinstance(value, dict) and key in value, f"{stage}: {name} is not a setting"
                value = value[key]
    assert stage_settings(job, "select") == {"objective": job["objective"]}


def _settings(tree: dict, path: tuple = ()):
    """The path of every single setting (a leaf, an empty mapping included) of a job as plain data."""
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            yield from _settings(value, (*path, key))
        else:
            yield (*path, key)


def _changed(settings, path: tuple, value):
    """`settings` (a job, one of its sections or a mapping in it) with the setting at `path` set to `value`,
    unchecked: any setting can take a value of another type."""
    if not path:
        return value
    key, rest = path[0], path[1:]
    if isinstance(settings, dict):
        return {**settings, key: _changed(settings[key], rest, value)}
    return dataclasses.replace(settings, **{key: _changed(getattr(settings, key), rest, value)})


@pytest.mark.parametrize("stage", STAGE_SETTINGS)
def test_a_fingerprint_changes_with_every_setting_in_its_stage_table_and_no_other(stage):
    """A profile or checkpoint is reused exactly when nothing its stage depends on changed."""
    job = default_job()
    table = [tuple(name.split(".")) for name in STAGE_SETTINGS[stage]]
    for path in _settings(job.as_dict()):
        changed = _changed(job, path, "changed")
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


FACTORIES = "tests.unit.factories"  # model factories as users write them
BAD_MODELS = [
    ("factory raises", {"name": f"{FACTORIES}:raises"}, "model.name", ["RuntimeError", "no weights for this many"]),
    ("not a module", {"name": f"{FACTORIES}:not_a_module"}, "model.name", ["returned dict", "nn.Module"]),
    ("not callable", {"name": f"{FACTORIES}:NOT_CALLABLE"}, "model.name", ["not callable"]),
    ("argument we cannot give", {"name": f"{FACTORIES}:with_width"}, "model.name", ["'width'", "model.kwargs"]),
    (
        "kwargs the factory does not take",
        {"name": f"{FACTORIES}:classes_and_channels", "kwargs": {"depth": 3}},
        "model.kwargs",
        ["depth", "accepts: none"],
    ),
    ("kwargs of a built-in", {"name": "tiny_cnn", "kwargs": {"depth": 3}}, "model.kwargs", ["depth"]),
    (
        "kwargs repeating the data shape",
        {"name": f"{FACTORIES}:classes_and_channels", "kwargs": {"in_channels": 3}},
        "model.kwargs",
        ["in_channels", "from the data set"],
    ),
    (
        "kwargs a torchvision network refuses",
        {"name": "torchvision.models:resnet34", "kwargs": {"depth": 3}},
        "model.kwargs",
        ["unexpected keyword argument 'depth'"],
    ),
    ("images too small for it", {"name": f"{FACTORIES}:fixed_input"}, "data.image_size", ["8x8 images of 1 channel"]),
    ("logits of the wrong shape", {"name": f"{FACTORIES}:ignores_classes"}, "model.name", ["(2, 1000)", "(2, 10)"]),
    ("vgg by path on 8 pixels", {"name": "torchvision.models:vgg11"}, "data.image_size", ["torchvision.models:vgg11"]),
]


@pytest.mark.parametrize("label, model, field, fragments", BAD_MODELS, ids=[c[0] for c in BAD_MODELS])
def test_a_model_that_does_not_build_for_the_data_names_the_job_and_the_field(label, model, field, fragments):
    with pytest.raises(ConfigError) as err:
        validate_config(job_config(model=model))
    message = str(err.value)
    assert message.startswith(f"job 'digits-cnn': field '{field}': "), message
    for fragment in fragments:
        assert fragment in message, f"{label}: {fragment!r} missing from {message!r}"


@pytest.mark.parametrize(
    "model",
    [
        {"name": f"{FACTORIES}:with_image_size"},
        {"name": f"{FACTORIES}:with_width", "kwargs": {"width": 8}},
        {"name": "torchvision.models:resnet34"},
        {"name": "resnet18", "kwargs": {"zero_init_residual": True}},
    ],
)
def test_factories_and_torchvision_builders_that_build_for_the_data_are_valid(model):
    assert default_job(model=model).as_dict()["model"] == {"kwargs": {}, **model}


@pytest.mark.spawns
def test_validating_a_built_in_model_leaves_torch_unimported():
    """Validation runs in the Snakemake process: importing torch there would cost seconds on every run."""
    check = "import sys, tula_hpc.config as c; c.load_config(['config/jobs.yaml']); print(*sys.modules)"
    modules = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, cwd=REPO, check=True)
    assert "torch" not in modules.stdout.split()


# --- data sets checked before anything is submitted (tula_hpc.training.data_check) ---------------------------

FASHION_FILES = ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz", "t10k-images-idx3-ubyte.gz")


def _fashion_folder(tmp_path, damage: str) -> str:
    """Debian's Fashion-MNIST folder copied, its test labels left out or cut short."""
    debian = FASHION_MNIST_FOLDER
    folder = tmp_path / "fashion"
    folder.mkdir()
    for name in FASHION_FILES:
        (folder / name).write_bytes((debian / name).read_bytes())
    if damage == "truncated":
        (folder / "t10k-labels-idx1-ubyte.gz").write_bytes((debian / "t10k-labels-idx1-ubyte.gz").read_bytes()[:3000])
    return str(folder)


BAD_DATA = [
    ("fashion file missing", "fashion_mnist", "missing", "data.root", ["t10k-labels-idx1-ubyte.gz", "missing"]),
    ("fashion file truncated", "fashion_mnist", "truncated", "data.root", ["t10k-labels", "truncated"]),
    ("callable shapes", "tests.unit.user_datasets:flat_images", None, "data.name", ["(channels, height, width)"]),
    ("callable labels", "tests.unit.user_datasets:label_outside", None, "data.name", ["label 3", "3 classes"]),
]


@pytest.mark.parametrize("label, name, damage, field, fragments", BAD_DATA, ids=[c[0] for c in BAD_DATA])
def test_bad_data_names_the_job_and_the_field(label, name, damage, field, fragments, tmp_path):
    root = _fashion_folder(tmp_path, damage) if damage else None
    path = tmp_path / "jobs.yaml"
    path.write_text(yaml.safe_dump(job_config(data={"name": name, "root": root})))
    with pytest.raises(ConfigError) as err:
        load_config([path])
    message = str(err.value)
    assert f"job 'digits-cnn': field '{field}': " in message, message
    for fragment in fragments:
        assert fragment in message, f"{label}: {fragment!r} missing from {message!r}"


def test_fashion_mnist_from_debians_folder_and_a_data_set_callable_are_valid():
    assert default_job(data={"name": "fashion_mnist", "image_size": 28}).data.root is None
    assert default_job(data={"name": "tests.unit.user_datasets:counted", "kwargs": {"n": 20}}).data.kwargs


BAD_SYNTHETIC = [
    ("unknown key", {"colour": 3}, ["'colour'", "channels, classes, size"]),
    ("one class", {"classes": 1}, ["classes", "at least 2", "got 1"]),
    ("no channels", {"channels": 0}, ["channels", "at least 1", "got 0"]),
    ("size as a number with a fraction", {"size": 1000.5}, ["size", "whole number", "1000.5"]),
    ("size as a boolean", {"size": True}, ["size", "whole number", "True"]),
]


@pytest.mark.parametrize("label, kwargs, fragments", BAD_SYNTHETIC, ids=[c[0] for c in BAD_SYNTHETIC])
def test_bad_synthetic_kwargs_name_the_job_and_the_field(label, kwargs, fragments):
    with pytest.raises(ConfigError) as err:
        validate_config(job_config(data={"name": "synthetic", "kwargs": kwargs}))
    message = str(err.value)
    assert "job 'digits-cnn': field 'data.kwargs': " in message, message
    for fragment in fragments:
        assert fragment in message, f"{label}: {fragment!r} missing from {message!r}"


def test_synthetic_data_of_a_given_shape_is_valid_and_a_model_is_built_for_it():
    kwargs = {"channels": 3, "classes": 100, "size": 1000}
    assert default_job(data={"name": "synthetic", "kwargs": kwargs}).data.kwargs == kwargs
    assert default_job(data={"name": "synthetic"}).data.kwargs == {}  # SYNTHETIC_DEFAULTS
    data = {"name": "synthetic", "kwargs": kwargs}
    with pytest.raises(ConfigError, match=r"field 'model.name': .* expected logits of shape \(2, 100\)"):
        validate_config(job_config(model={"name": f"{FACTORIES}:ignores_classes"}, data=data))


@pytest.mark.parametrize("data", [{"name": "fashion_mnist", "damage": "truncated"}, {"name": BAD_DATA[3][1]}])
@pytest.mark.spawns
def test_a_stage_stops_on_bad_data_before_submitting_and_leaves_results_untouched(data, tmp_path):
    root = _fashion_folder(tmp_path, data["damage"]) if "damage" in data else None
    config_path = tmp_path / "jobs.yaml"
    config_path.write_text(yaml.safe_dump(job_config(data={"name": data["name"], "root": root})))
    results = tmp_path / "results" / "digits-cnn"
    results.mkdir(parents=True)
    (results / "memory.json").write_text('{"earlier": true}\n')
    command = [
        sys.executable,
        "-m",
        "tula_hpc.stages.probe_memory",
        "--config",
        str(config_path),
        "--job",
        "digits-cnn",
    ]
    command += ["--out", str(results / "memory.json")]
    env = {**os.environ, "PYTHONPATH": str(REPO)}  # the callable's module, from this checkout
    proc = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, env=env)
    assert proc.returncode == 2, proc.stderr
    assert "job 'digits-cnn': field 'data." in proc.stderr and "Traceback" not in proc.stderr
    assert [p.name for p in results.iterdir()] == ["memory.json"]
    assert (results / "memory.json").read_text() == '{"earlier": true}\n'
    assert not (tmp_path / "work").exists(), "nothing may be submitted, nor any data cached, for bad data"


def test_a_model_is_built_for_the_classes_of_its_data_set(tmp_path):
    from PIL import Image

    for split in ("train", "val"):
        for name in ("cat", "dog", "fox"):
            (tmp_path / split / name).mkdir(parents=True)
            Image.new("RGB", (8, 8)).save(tmp_path / split / name / "0.png")
    data = {"name": "imagefolder", "root": str(tmp_path), "image_size": 8}
    with pytest.raises(ConfigError, match=r"field 'model.name': .* expected logits of shape \(2, 3\)"):
        validate_config(job_config(model={"name": f"{FACTORIES}:ignores_classes"}, data=data))


def test_targets_name_the_jobs_to_run_and_an_unknown_one_is_refused(tmp_path):
    config = job_config()
    config["targets"] = ["digits-cnn"]
    (tmp_path / "jobs.yaml").write_text(yaml.safe_dump(config))
    assert load_config([tmp_path / "jobs.yaml"])["targets"] == ["digits-cnn"]
    config["targets"] = ["fashion"]
    (tmp_path / "jobs.yaml").write_text(yaml.safe_dump(config))
    with pytest.raises(ConfigError, match=r"field 'targets': 'fashion' name no job; allowed: digits-cnn"):
        load_config([tmp_path / "jobs.yaml"])


# --- what a GPU job needs (issue 24): sync priors by device, host memory, this machine's GPUs ---------------------


def _gpu_config(launcher: str = "slurm", gpus: int = 1, **sections) -> dict:
    """The default job on `gpus` GPUs per node with enough host memory, under `launcher`."""
    resources = {"gpus_per_node": gpus, "mem_gb": 16 * gpus, **sections.pop("resources", {})}
    return {**job_config(resources=resources, **sections), "launcher": launcher}


def test_sync_priors_left_out_are_chosen_by_device_and_a_figure_written_replaces_its_presets():
    """config/jobs.yaml writes none: a CPU job gets gloo's, a GPU job NCCL's, each from the one table."""
    assert "sync_prior" not in job_config()["jobs"]["digits-cnn"]["search"]
    assert default_job().as_dict()["search"]["sync_prior"] == SYNC_PRIORS["cpu"]
    gpu = job_settings(validate_config(_gpu_config()), "digits-cnn")
    assert gpu.as_dict()["search"]["sync_prior"] == SYNC_PRIORS["gpu"]
    mine = job_settings(
        validate_config(_gpu_config(search={"sync_prior": {"inter_node": {"bandwidth_gb_s": 25}}})), "digits-cnn"
    ).as_dict()["search"]["sync_prior"]
    assert mine == {**SYNC_PRIORS["gpu"], "inter_node": {**SYNC_PRIORS["gpu"]["inter_node"], "bandwidth_gb_s": 25}}


def test_the_snakefile_and_a_stage_see_the_same_filled_priors_and_fingerprint():
    """The Snakefile validates with validate_config, then snakemake.utils.validate against the same schema (which
    fills its own defaults); a stage loads the files through load_config. Rules and fingerprints agree."""
    from snakemake.utils import validate

    config = _gpu_config()
    validate_config(config)
    validate(config, str(REPO / "workflow" / "schemas" / "jobs.schema.yaml"))
    snakefile_job = config["jobs"]["digits-cnn"]
    stage_job = job_settings(validate_config(_gpu_config()), "digits-cnn")
    assert stage_settings(snakefile_job, "fit_model")["search.sync_prior"] == SYNC_PRIORS["gpu"]
    assert stage_settings(snakefile_job, "fit_model") == stage_settings(stage_job.as_dict(), "fit_model")
    assert fingerprint(default_job(), "fit_model") != fingerprint(stage_job, "fit_model")


@pytest.mark.parametrize(
    "sync_prior",
    [SYNC_PRIORS["cpu"], {"intra_node": {"bandwidth_gb_s": 0.5}, "inter_node": {"bandwidth_gb_s": 1}}],
    ids=["the CPU preset", "bandwidths at gloo's level"],
)
def test_a_gpu_job_with_gloos_sync_priors_is_refused(sync_prior):
    with pytest.raises(ConfigError) as err:
        validate_config(_gpu_config(search={"sync_prior": sync_prior}))
    message = str(err.value)
    assert message.startswith("job 'digits-cnn': field 'search.sync_prior': "), message
    for fragment in ("gloo's", "resources.gpus_per_node: 1", "leave search.sync_prior out", "100 GB/s"):
        assert fragment in message, message
    # A slow network alone is a GPU cluster's own figure, and a CPU job may write gloo's.
    validate_config(_gpu_config(search={"sync_prior": {"inter_node": {"bandwidth_gb_s": 0.125}}}))
    validate_config(job_config(search={"sync_prior": SYNC_PRIORS["cpu"]}))


def test_a_gpu_job_without_host_memory_for_each_rank_is_refused():
    from tula_hpc.config import HOST_GB_PER_GPU_RANK

    with pytest.raises(ConfigError) as err:
        validate_config(_gpu_config(gpus=4, resources={"mem_gb": 4}))
    message = str(err.value)
    assert message.startswith("job 'digits-cnn': field 'resources.mem_gb': 4 GB"), message
    assert "4 GPU ranks (resources.gpus_per_node)" in message
    assert f"allowed: at least {4 * HOST_GB_PER_GPU_RANK}" in message
    validate_config(_gpu_config(gpus=4, resources={"mem_gb": 4 * HOST_GB_PER_GPU_RANK}))
    validate_config(job_config(resources={"mem_gb": 0.5}))  # CPU jobs: as before


def _no_cuda(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


def _gpus_here(monkeypatch, count: int):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


def test_a_local_gpu_job_is_refused_at_once_where_cuda_is_unusable(monkeypatch):
    import socket

    import torch

    _no_cuda(monkeypatch)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "7")
    with pytest.raises(ConfigError) as err:
        validate_config(_gpu_config("local"))
    message = str(err.value)
    assert message.startswith("job 'digits-cnn': field 'resources.gpus_per_node': "), message
    for fragment in (f"CUDA {torch.version.cuda}", "NVIDIA driver", "CUDA_VISIBLE_DEVICES='7'", socket.gethostname()):
        assert fragment in message, message
    assert "allowed: 0 (CPU only)" in message and "slurm launcher" in message


def test_a_slurm_gpu_job_is_not_refused_for_the_login_nodes_lack_of_cuda(monkeypatch):
    """The ranks check their own node's GPUs (distributed.init_distributed); validation asks no CUDA here."""
    import tula_hpc.config as config_module

    def ask(*_):
        raise AssertionError("validation of a Slurm job asked this machine's CUDA")

    monkeypatch.setattr(config_module, "usable_gpus", ask)
    job = job_settings(validate_config(_gpu_config("slurm", gpus=4)), "digits-cnn")
    assert job.resources.gpus_per_node == 4 and job.launcher == "slurm"


def test_a_local_gpu_job_needing_more_gpus_than_this_machine_has_is_refused(monkeypatch):
    """search.nodes.max 2 on one GPU would put the N=2 profile's two NCCL ranks on one card."""
    _gpus_here(monkeypatch, 1)
    with pytest.raises(ConfigError) as err:
        validate_config(_gpu_config("local"))
    message = str(err.value)
    assert message.startswith("job 'digits-cnn': field 'search.nodes.max': 2 nodes x 1 GPU(s)"), message
    assert "resources.gpus_per_node" in message and "which has 1" in message
    assert "allowed: search.nodes.max x resources.gpus_per_node at most 1" in message
    validate_config(_gpu_config("local", search={"nodes": {"min": 1, "max": 1}}))
    _gpus_here(monkeypatch, 4)
    validate_config(_gpu_config("local", gpus=2))
    with pytest.raises(ConfigError, match="at most 4"):
        validate_config(_gpu_config("local", gpus=4))


@pytest.mark.spawns
def test_a_stage_stops_on_a_local_gpu_job_without_cuda_before_submitting(tmp_path):
    """CUDA_VISIBLE_DEVICES naming no GPU makes CUDA unusable on any machine."""
    config_path = tmp_path / "jobs.yaml"
    config_path.write_text(yaml.safe_dump(_gpu_config("local")))
    command = [
        sys.executable,
        "-m",
        "tula_hpc.stages.probe_memory",
        "--config",
        str(config_path),
        "--job",
        "digits-cnn",
    ]
    command += ["--launcher", "local", "--out", str(tmp_path / "memory.json")]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, env=env)
    assert proc.returncode == 2, proc.stderr
    assert "job 'digits-cnn': field 'resources.gpus_per_node'" in proc.stderr and "Traceback" not in proc.stderr
    assert "CUDA_VISIBLE_DEVICES=''" in proc.stderr
    assert not (tmp_path / "work").exists() and not (tmp_path / "memory.json").exists()


# --- GPUs per node as a choice (issue 25) -------------------------------------------------------------------------


def test_gpus_per_node_defaults_to_the_nodes_own_and_a_half_given_range_fills_the_other_end():
    assert default_job().as_dict()["search"]["gpus_per_node"] == {"min": 0, "max": 0}  # CPU jobs: one process per node
    job = job_settings(validate_config(_gpu_config(gpus=4)), "digits-cnn")
    assert job.as_dict()["search"]["gpus_per_node"] == {"min": 4, "max": 4}
    job = job_settings(validate_config(_gpu_config(gpus=4, search={"gpus_per_node": {"min": 1}})), "digits-cnn")
    assert job.as_dict()["search"]["gpus_per_node"] == {"min": 1, "max": 4}
    assert stage_settings(job.as_dict(), "plan")["search.gpus_per_node"] == {"min": 1, "max": 4}


@pytest.mark.parametrize(
    ("gpus", "shape", "allowed"),
    [
        (4, {"min": 0, "max": 2}, "allowed: 1 <= min <= max <= 4"),
        (4, {"min": 1, "max": 8}, "allowed: 1 <= min <= max <= 4"),
        (4, {"min": 3, "max": 2}, "allowed: 1 <= min <= max <= 4"),
        (0, {"min": 1, "max": 2}, "allowed: {min: 0, max: 0}, or leave it out"),
    ],
    ids=["no GPU on a GPU job", "more than the node has", "min above max", "GPUs on a CPU job"],
)
def test_gpus_per_node_outside_the_node_is_refused(gpus, shape, allowed):
    config = (
        _gpu_config(gpus=gpus, search={"gpus_per_node": shape}) if gpus else job_config(search={"gpus_per_node": shape})
    )
    with pytest.raises(ConfigError) as err:
        validate_config(config)
    message = str(err.value)
    assert message.startswith(
        f"job 'digits-cnn': field 'search.gpus_per_node': {{min: {shape['min']}, max: {shape['max']}}}"
    ), message
    assert allowed in message and "resources.gpus_per_node" in message, message


def test_every_example_job_file_validates_as_snakemake_merges_it_into_the_jobs_file():
    """config/examples/*.yaml are run with --configfile over config/jobs.yaml: each must stay valid as the schema
    and the checks move, its targets naming its own jobs."""
    config_dir = Path(__file__).resolve().parents[2] / "config"
    examples = sorted((config_dir / "examples").glob("*.yaml"))
    assert {path.stem for path in examples} >= {"fashion-mnist", "dry-run"}
    for example in examples:
        config = load_config([config_dir / "jobs.yaml", example])
        assert config["targets"] == list(yaml.safe_load(example.read_text())["jobs"])
        for name in config["targets"]:
            assert job_settings(config, name).name == name


# --- the task against the data: its shape keys, a user's token windows, the model's context ------------------------

GPT = {"name": "gpt", "kwargs": {"layers": 1, "heads": 2, "width": 16}}
TOKEN_WINDOWS = {"name": "tests.unit.user_datasets:token_pairs", "seq_len": 8}


def text_job(**sections) -> dict:
    """A causal_lm job (a small GPT under adamw) with `sections` changed key by key."""
    train = {"optimizer": "adamw", "strategy": "lbt", "lr_schedule": {"kind": "cosine", "warmup_steps": 1}}
    return job_config(
        **({"task": {"name": "causal_lm"}, "model": GPT, "data": TOKEN_WINDOWS, "train": train} | sections)
    )


def job_refusal(config: dict) -> str:
    with pytest.raises(ConfigError) as err:
        validate_config(config)
    message = str(err.value)
    assert "\n" not in message
    return message


def test_a_callable_of_token_windows_validates_for_causal_lm():
    for data in (TOKEN_WINDOWS, {**TOKEN_WINDOWS, "name": "tests.unit.user_datasets:token_dicts"}):
        job = job_settings(validate_config(text_job(data=data)), "digits-cnn")
        assert (job.task.name, job.data.seq_len) == ("causal_lm", 8)


TASK_AGAINST_DATA = [
    ("causal_lm on images", text_job(data={"name": "digits"}), "num_classes, in_channels, image_size", CausalLM),
    (
        "image_classification on text",
        job_config(data={"name": "synthetic", "kwargs": {"vocab": 50}, "seq_len": 16}),
        "vocab_size, seq_len",
        ImageClassification,
    ),
    (
        "image_classification on a callable of token windows",
        job_config(data=TOKEN_WINDOWS),
        "vocab_size, seq_len",
        ImageClassification,
    ),
]


@pytest.mark.parametrize("label, config, given, task", TASK_AGAINST_DATA, ids=[c[0] for c in TASK_AGAINST_DATA])
def test_a_task_whose_shape_keys_the_data_lacks_is_refused(label, config, given, task):
    message = job_refusal(config)
    assert message.startswith("job 'digits-cnn': field 'task.name': data set '"), message
    assert f"(its shape: {given}); allowed: {task.name} reads {task.reads}" in message, message


def test_causal_lm_names_the_data_sets_it_reads():
    assert CausalLM.reads == (
        "text data sets: shakespeare, tokens, synthetic with data.kwargs vocab, or a callable returning token windows"
    )


def test_token_windows_that_do_not_fit_causal_lm_are_refused_at_validation():
    outside = job_refusal(text_job(data={**TOKEN_WINDOWS, "name": "tests.unit.user_datasets:token_outside"}))
    assert outside.startswith("job 'digits-cnn': field 'data.kwargs.vocab_size': ") and "token id 11" in outside
    short = job_refusal(text_job(data={**TOKEN_WINDOWS, "kwargs": {"seq_len": 6}}))
    assert short.startswith("job 'digits-cnn': field 'data.seq_len': ") and "holds 6 tokens" in short


def test_data_seq_len_beyond_a_user_models_context_is_refused():
    model = {"name": f"{FACTORIES}:short_context", "kwargs": {"context": 4}}
    message = job_refusal(text_job(model=model))
    assert message.startswith("job 'digits-cnn': field 'data.seq_len': 8 tokens exceed the context of "), message
    assert "allowed: at most 4" in message
    validate_config(text_job(model={**model, "kwargs": {"context": 8}}))
