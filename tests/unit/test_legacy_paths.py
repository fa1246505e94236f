"""Work started before the folders (issue 43) goes on after them: a stage job's pickle names its function by the old
module path, and a checkpoint written then resumes now."""

import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tula_hpc
from tests.conftest import default_job
from tula_hpc import _legacy_paths
from tula_hpc.core.job import Job
from tula_hpc.training.trainer import train_worker

BEFORE = Path(__file__).parent / "data" / "checkpoint_before_folders.pt"  # one epoch of ags, written before the move


def test_a_pickle_naming_old_module_paths_loads_the_moved_objects():
    """submitit pickles a job's function and arguments by reference (protocol 0's GLOBAL opcode spells it out)."""
    for old, name, moved in [("train", "train_worker", train_worker), ("job", "Job", Job)]:
        assert pickle.loads(f"ctula_hpc.{old}\n{name}\n.".encode()) is moved
    for old, new in _legacy_paths.MOVED_MODULES.items():
        assert __import__(f"tula_hpc.{old}", fromlist=["_"]) is __import__(f"tula_hpc.{new}", fromlist=["_"])


def test_every_moved_name_loads_from_its_old_module_as_the_object_it_became():
    for module, names in _legacy_paths.MOVED_NAMES.items():
        for name, home in names.items():
            assert pickle.loads(f"c{module}\n{name}\n.".encode()) is getattr(__import__(home, fromlist=["_"]), name)


def test_a_name_that_never_lived_in_a_module_is_still_an_attribute_error():
    import tula_hpc.stages.train as train_stage

    with pytest.raises(AttributeError, match="no_such_name"):
        train_stage.no_such_name  # noqa: B018


@pytest.mark.spawns
def test_a_stage_module_with_moved_names_still_runs_as_a_script():
    """`python -m tula_hpc.stages.train` runs the module as __main__, which no pickle names."""
    for stage in _legacy_paths.MOVED_NAMES:
        if stage.startswith("tula_hpc.stages."):
            ran = subprocess.run([sys.executable, "-m", stage, "--help"], capture_output=True, text=True)
            assert ran.returncode == 0 and "usage" in ran.stdout, ran.stderr[-2000:]


def test_the_old_paths_go_with_release_0_2():
    """The removal condition _legacy_paths states: 0.2 does not resume 0.1's unfinished work."""
    version = tuple(int(part) for part in tula_hpc.__version__.split(".")[:2])
    assert version < _legacy_paths.REMOVED_IN, "release 0.2 removes tula_hpc/_legacy_paths.py and its uses"


def test_a_checkpoint_written_before_the_move_resumes(tmp_path):
    checkpoint = tmp_path / "checkpoint.pt"
    checkpoint.write_bytes(BEFORE.read_bytes())
    job = default_job(train=dict(strategy="ags", epochs=1, lr_milestones=[]))  # the settings it was written under
    summary = train_worker(job, 256, str(checkpoint), str(tmp_path / "model.pt"), str(tmp_path / "metrics.jsonl"))
    assert summary["resumed_from_epoch"] == 1 and summary["epochs"] == 1
    saved = torch.load(BEFORE, weights_only=False)["model"]
    trained = torch.load(tmp_path / "model.pt", weights_only=False)["model"]
    assert all(torch.equal(saved[k], trained[k]) for k in saved)
