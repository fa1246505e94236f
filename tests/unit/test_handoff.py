"""handoff.py: the train stage's hand-off holds exactly the loop's arguments (but the failure folder the launcher
adds), is frozen, pickles into a job, and reaches `train_worker` whole; a job pickled with the old dict still runs."""

import dataclasses
import inspect
import pickle

import pytest

from tests.conftest import default_job
from tula_hpc.cluster import launch
from tula_hpc.training import trainer
from tula_hpc.training.handoff import TrainHandoff

HANDOFF = TrainHandoff(
    job=default_job(),
    global_batch=128,
    checkpoint_path="work/digits-cnn/train/checkpoint.pt",
    model_path="/abs/results/digits-cnn/train/model.pt",
    metrics_path="work/digits-cnn/train/metrics.jsonl",
    loop_log_path="work/digits-cnn/train/loop_time.jsonl",
    accumulation=2,
    selected_batch=256,
)
KEYWORDS = {field.name: getattr(HANDOFF, field.name) for field in dataclasses.fields(HANDOFF)}


def test_the_handoff_is_the_workers_arguments_but_the_failure_folder():
    parameters = set(inspect.signature(trainer.train_worker).parameters)
    assert {field.name for field in dataclasses.fields(TrainHandoff)} == parameters - {"failure_dir"}


def test_the_handoff_is_frozen_and_pickles_into_a_job():
    with pytest.raises(dataclasses.FrozenInstanceError):
        HANDOFF.global_batch = 64
    assert pickle.loads(pickle.dumps(HANDOFF)) == HANDOFF


def test_the_stages_worker_gives_the_loop_every_field_and_the_failure_folder(monkeypatch):
    called = []
    monkeypatch.setattr(trainer, "train_worker", lambda **kwargs: called.append(kwargs) or {"epochs": 1})
    worker = launch.Worker("tula_hpc.training.trainer", "train_handed_off")
    assert worker(handoff=HANDOFF, failure_dir="work/failures/1") == {"epochs": 1}
    assert called == [{**KEYWORDS, "failure_dir": "work/failures/1"}]


def test_a_job_pickled_with_the_old_dict_still_reaches_the_loop():
    """Before the hand-off was typed, the job held Worker(trainer, train_worker) and its eleven keywords."""
    old = pickle.loads(pickle.dumps(launch.Worker("tula_hpc.training.trainer", "train_worker")))
    inspect.signature(old.load()).bind(**KEYWORDS, failure_dir="work/failures/1")  # accepted as it was
