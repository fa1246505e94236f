"""The task contract: batches of either kind sliced and moved alike, losses as means with their counts, metrics as
sums that add over batches, the words reports use, and users' tasks by import path, good and bad."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from tests.unit.test_config import job_refusal, text_job
from tula_hpc.config import job_settings, validate_config
from tula_hpc.training.tasks import (
    IGNORE_INDEX,
    CausalLM,
    ImageClassification,
    TaskError,
    batch_size,
    build_task,
    logits_of,
    select,
    split,
)


@dataclass
class ModelOutput:
    """A stand-in for a Hugging Face model's output (transformers is no dependency)."""

    logits: torch.Tensor
    loss: torch.Tensor | None = None


def test_pairs_and_dicts_are_sliced_split_and_counted_alike():
    ids = torch.arange(24).view(6, 4)
    for batch in ([ids, ids + 1], {"input_ids": ids, "labels": ids}):
        assert batch_size(batch) == 6
        assert [batch_size(part) for part in split(batch, 4)] == [2, 2, 1, 1]
        picked = select(batch, torch.tensor([True, False, True, False, False, False]))
        assert type(picked) is type(batch) and batch_size(picked) == 2
    assert [batch_size(part) for part in split([ids[:1], ids[:1]], 3)] == [1]  # no empty slice


def test_logits_are_found_in_a_tensor_a_tuple_or_an_output_object():
    logits = torch.randn(2, 3)
    for output in (logits, (logits, "aux"), ModelOutput(logits), {"logits": logits}):
        assert logits_of(output) is logits
    with pytest.raises(TaskError, match="expected logits"):
        logits_of("text")


def test_a_language_models_loss_averages_the_tokens_that_count_and_says_how_many():
    task = CausalLM()
    logits = torch.zeros(2, 3, 5)  # uniform: ln 5 nats a token
    targets = torch.tensor([[1, 2, IGNORE_INDEX], [0, IGNORE_INDEX, IGNORE_INDEX]])
    loss, count = task.loss(logits, [torch.zeros(2, 3, dtype=torch.long), targets])
    assert count == 3 and loss.item() == pytest.approx(math.log(5))
    # A dict's labels line up with its input_ids: the next position's label is the target; the last has none.
    labels = torch.tensor([[7, 1, 2], [7, 0, IGNORE_INDEX]])
    batch = {"input_ids": torch.zeros(2, 3, dtype=torch.long), "labels": labels}
    assert task.count(batch) == 3 and task.loss(ModelOutput(logits), batch)[1] == 3


def test_metrics_are_sums_whose_values_give_perplexity_and_bits():
    task = CausalLM(token_unit="character")
    logits = torch.zeros(1, 4, 2)
    logits[0, :, 1] = 10.0  # predicts token 1 everywhere
    batch = [torch.zeros(1, 4, dtype=torch.long), torch.tensor([[1, 1, 0, 1]])]
    sums = {name: (float(total), float(count)) for name, (total, count) in task.metric_sums(logits, batch).items()}
    values = task.metric_values(sums)
    assert values["token_accuracy"] == 0.75
    assert values["perplexity"] == pytest.approx(math.exp(values["loss"]))
    assert values["bits"] == pytest.approx(values["loss"] / math.log(2))
    assert task.metrics["bits"].label == "bits per character" and not task.metrics["loss"].higher_is_better


def test_image_classification_scores_top1_and_checks_its_output():
    task = ImageClassification()
    shape = {"num_classes": 3, "in_channels": 1, "image_size": 4}
    batch = task.example_batch(shape, 5, "cpu", torch.Generator().manual_seed(0))
    assert batch[0].shape == (5, 1, 4, 4) and task.count(batch) == 5
    logits = torch.nn.functional.one_hot(batch[1], 3).float()
    sums = task.metric_sums(logits, batch)
    assert task.metric_values({k: (float(s), float(c)) for k, (s, c) in sums.items()})["accuracy"] == 1.0
    with pytest.raises(TaskError, match=r"expected logits of shape \(5, 3\)"):
        task.check_output(torch.zeros(5, 4), shape, 5)


def test_a_users_task_is_built_by_import_path_with_its_kwargs():
    task = build_task("tests.unit.user_tasks:weighted_tokens", {"token_unit": "word"})
    assert task.metrics["bits"].label == "bits per word"
    with pytest.raises(TaskError, match="expected a tula_hpc Task"):
        build_task("tests.unit.user_tasks:not_a_task")
    with pytest.raises(TaskError, match="does not import"):
        build_task("tests.unit.user_tasks:missing")


def test_a_task_whose_loss_returns_no_count_is_refused_at_validation():
    message = job_refusal(text_job(task={"name": "tests.unit.user_tasks:loss_without_count"}))
    assert message.startswith("job 'digits-cnn': field 'task.name': "), message
    assert "expected (mean loss, count of what it averages)" in message
    job = job_settings(validate_config(text_job(task={"name": "tests.unit.user_tasks:weighted_tokens"})), "digits-cnn")
    assert job.task.name == "tests.unit.user_tasks:weighted_tokens"
