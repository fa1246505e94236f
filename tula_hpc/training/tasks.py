"""Training tasks: the one object every stage asks about the work a model is trained for (probe, profile, train,
evaluate, report), so that no stage branches on a task's name.

A task checks a sample; makes a batch of the data's shape on a device (memory probes, trials, the model check on
the meta device); calls the model on a batch; computes the loss as a mean together with the count of what it
averages (images, or the tokens that count), so that gradient accumulation and AGS's reference sub-batch weight
their slices exactly; and computes metrics as sums and counts, which DDP ranks add, each with its direction and
unit. Built in: `image_classification` and `causal_lm`; a user's own is `package.module:callable` returning a Task.

A batch is a pair (inputs, targets) or a dict of tensors (`input_ids`, `attention_mask`, `labels`, as Hugging Face
collators make); the helpers below slice, split and move either kind. A model may return a tensor, a tuple (its
first item the logits) or an object with `logits` (as Hugging Face models do); its own `loss` is not used: the
task's loss is the one whose count is known.
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_flatten, tree_map

from tula_hpc.training.data_check import IMAGE_SHAPE_KEYS, TEXT_SHAPE_KEYS, kind_of

if TYPE_CHECKING:
    from torch import nn

    from tula_hpc.core.job import Job

IGNORE_INDEX = -100  # a target that does not count (padding), as torch's cross_entropy and Hugging Face mark it


class TaskError(ValueError):
    """A sample, a model's output or a user's task does not fit the task; `field` is the setting to change."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class Metric:
    """A score as reports print it: its words, whether higher is better, and its unit ("" for a share)."""

    label: str
    higher_is_better: bool
    unit: str = ""


# --- batches: a pair or a dict of tensors, alike for every task --------------------------------------------------


def batch_size(batch) -> int:
    """The samples in a batch: the length of its first tensor."""
    return len(tree_flatten(batch)[0][0])


def select(batch, index: torch.Tensor):
    """The samples `index` (a boolean mask or positions) of a batch, of the same kind."""
    return tree_map(lambda t: t[index.to(t.device)], batch)


def split(batch, parts: int) -> list:
    """A batch in at most `parts` consecutive slices of nearly equal size (torch.tensor_split's), none empty."""
    leaves, spec = tree_flatten(batch)
    pieces = [leaf.tensor_split(parts) for leaf in leaves]
    slices = [spec.unflatten(list(piece)) for piece in zip(*pieces)]
    return [part for part in slices if batch_size(part)]


def to_device(batch, device: torch.device):
    """A batch on `device`, copied without waiting (from the pinned memory a GPU rank's loader asks for)."""
    return tree_map(lambda t: t.to(device, non_blocking=True), batch)


def logits_of(output) -> torch.Tensor:
    """The logits of what a model returned: a tensor, the first item of a tuple, or an object's `logits`."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    logits = output.get("logits") if isinstance(output, dict) else getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    raise TaskError("model.name", f"the model returned {type(output).__name__}; expected logits, a tuple or .logits")


class Task:
    """What every stage asks of a task; a subclass says how for its data and models.

    `metrics` names each score `metric_sums` returns (the test report's `test_<name>`, training's `val_<name>`),
    `headline` the one reports lead with. `shape` below is the data's (datasets.data_shape: the keyword arguments a
    model is built with)."""

    name: str
    metrics: dict[str, Metric]
    headline: str
    sample_noun: str  # one sample, in the report's words: "image", "window"
    beside_headline: tuple[str, ...] | None = None  # metrics the report prints after the headline; None: all others
    shape_keys: tuple[str, ...] = ()  # what the task reads of the data's shape: a data set without them cannot serve
    reads = "data sets of any shape"  # the data sets that give shape_keys, in words, for the refusal that lacks them

    def check_shape(self, shape: dict, data_name: str) -> None:
        """Raise TaskError unless the data's shape holds the keys this task reads."""
        missing = [key for key in self.shape_keys if key not in shape]
        if missing:
            raise TaskError(
                "task.name",
                f"data set '{data_name}' gives no {', '.join(missing)} (its shape: {', '.join(shape) or 'none'}); "
                f"allowed: {self.name} reads {self.reads}",
            )

    def check_sample(self, sample, shape: dict) -> None:
        """Raise TaskError unless `sample` (one item of a data set) fits this task and the data's shape."""
        raise NotImplementedError

    def example_batch(self, shape: dict, size: int, device, generator: torch.Generator | None = None):
        """`size` random samples of the data's shape, made on `device` (the meta device too): what memory probes,
        step-time trials and the model check run on; a step's memory and time do not depend on the values."""
        raise NotImplementedError

    def forward(self, net: nn.Module, batch):
        """The model's output on a batch."""
        raise NotImplementedError

    def count(self, batch) -> torch.Tensor:
        """How many things the loss averages over in `batch` (a tensor on the batch's device: no sync)."""
        raise NotImplementedError

    def loss(self, output, batch) -> tuple[torch.Tensor, torch.Tensor]:
        """(the mean loss over what counts in the batch, that count)."""
        raise NotImplementedError

    def metric_sums(self, output, batch) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Each metric's (sum, count) over the batch: sums add over batches and ranks, `metric_values` divides."""
        raise NotImplementedError

    def check_output(self, output, shape: dict, size: int) -> None:
        """Raise TaskError unless a model's output for `size` example samples fits this task."""
        raise NotImplementedError

    def describe(self, shape: dict) -> str:
        """The data's samples in words, for messages: "32x32 images of 3 channel(s)"."""
        raise NotImplementedError

    def metric_values(self, sums: dict[str, tuple[float, float]]) -> dict[str, float]:
        """Each metric's value from its summed (sum, count)."""
        return {name: total / max(count, 1) for name, (total, count) in sums.items()}

    def loss_of(self, net: nn.Module, batch) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean loss, count) of the model on a batch: what a step differentiates."""
        return self.loss(self.forward(net, batch), batch)


class ImageClassification(Task):
    """Images (C, H, W) with an integer class each: cross-entropy per image, top-1 accuracy (today's behaviour)."""

    name = "image_classification"
    metrics = {"accuracy": Metric("top-1 accuracy", True), "loss": Metric("loss", False, "nats per image")}
    headline = "accuracy"
    sample_noun = "image"
    beside_headline = ()  # the test loss stays in eval.json; the report reads as it always has
    shape_keys = IMAGE_SHAPE_KEYS
    reads = (
        "image data sets: digits, fashion_mnist, cifar10, cifar100, imagefolder, synthetic without data.kwargs vocab, "
        "or a callable returning (image, label) pairs"
    )

    def check_sample(self, sample, shape: dict) -> None:
        if not isinstance(sample, (tuple, list)) or len(sample) != 2:
            raise TaskError("data.name", f"is {kind_of(sample)}; expected a pair (image, label)")
        image, label = sample
        if not isinstance(image, torch.Tensor) or image.dtype != torch.float32 or image.dim() != 3:
            raise TaskError(
                "data.name", f"the image is {kind_of(image)}; expected a float32 tensor (channels, height, width)"
            )
        channels = shape.get("in_channels")
        if channels is not None and image.shape[0] != channels:
            raise TaskError(
                "data.name", f"the image has {image.shape[0]} channel(s), the first training image {channels}"
            )
        size = shape.get("image_size")
        if size is not None and tuple(image.shape[1:]) != (size, size):
            raise TaskError(
                "data.image_size", f"the image is {image.shape[1]}x{image.shape[2]}, data.image_size is {size}"
            )
        is_int = isinstance(label, int) and not isinstance(label, bool)
        if not (is_int or torch.is_tensor(label) and label.dtype == torch.int64 and label.dim() == 0):
            raise TaskError("data.name", f"the label is {label!r}; expected an int or a 0-dim int64 tensor")
        classes = shape["num_classes"]
        if not 0 <= int(label) < classes:
            raise TaskError("data.name", f"label {int(label)} lies outside the {classes} classes 0..{classes - 1}")

    def example_batch(self, shape: dict, size: int, device, generator=None):
        side = shape["image_size"]
        images = torch.randn((size, shape["in_channels"], side, side), generator=generator, device=device)
        labels = torch.randint(0, shape["num_classes"], (size,), generator=generator, device=device)
        return [images, labels]

    def forward(self, net, batch):
        return net(batch[0])

    def describe(self, shape: dict) -> str:
        side = shape["image_size"]
        return f"{side}x{side} images of {shape['in_channels']} channel(s)"

    def count(self, batch) -> torch.Tensor:
        return torch.tensor(len(batch[1]), device=batch[1].device)

    def loss(self, output, batch):
        targets = batch[1]
        return F.cross_entropy(logits_of(output), targets), self.count(batch)

    def metric_sums(self, output, batch):
        logits, targets = logits_of(output), batch[1]
        count = self.count(batch)
        return {
            "accuracy": ((logits.argmax(1) == targets).sum(), count),
            "loss": (F.cross_entropy(logits.float(), targets, reduction="sum"), count),
        }

    def check_output(self, output, shape: dict, size: int) -> None:
        classes = shape["num_classes"]
        logits = logits_of(output)
        if logits.shape != (size, classes):
            raise TaskError(
                "model.name",
                f"returns {tuple(logits.shape)} for {size} images; expected logits of shape ({size}, {classes}), "
                "num_classes from the data set",
            )


class CausalLM(Task):
    """Next-token prediction over windows of data.seq_len tokens: cross-entropy per token that counts, perplexity,
    bits per character (or token), token accuracy.

    A pair batch (x, y) holds targets already shifted (y[t] follows x[t], nanoGPT's way); a dict batch holds
    `input_ids` and `labels` aligned as Hugging Face's do, shifted here, with IGNORE_INDEX for what does not count.
    `token_unit` names a token in the report ("character" for character tokens)."""

    name = "causal_lm"
    headline = "loss"
    sample_noun = "window"
    shape_keys = TEXT_SHAPE_KEYS
    reads = (
        "text data sets: shakespeare, tokens, synthetic with data.kwargs vocab, or a callable returning token windows"
    )

    def __init__(self, token_unit: str = "token"):
        self.token_unit = token_unit
        self.metrics = {
            "loss": Metric("loss", False, f"nats per {token_unit}"),
            "perplexity": Metric("perplexity", False, f"per {token_unit}"),
            "bits": Metric(f"bits per {token_unit}", False, "bits"),
            "token_accuracy": Metric("next-token accuracy", True),
        }

    def check_sample(self, sample, shape: dict) -> None:
        tokens = sample.get("input_ids") if isinstance(sample, dict) else sample
        if isinstance(sample, dict) and tokens is None:
            raise TaskError("data.name", f"is a dict of {sorted(sample)}; expected input_ids (and labels)")
        parts = [tokens] if isinstance(sample, dict) else list(sample) if isinstance(sample, (tuple, list)) else []
        if isinstance(sample, (tuple, list)) and len(sample) != 2 or not parts:
            raise TaskError("data.name", f"is {kind_of(sample)}; expected a pair (tokens, next tokens) or a dict")
        for part in parts:
            if not torch.is_tensor(part) or part.dtype not in (torch.int64, torch.int32) or part.dim() != 1:
                raise TaskError(
                    "data.name", f"the tokens are {kind_of(part)}; expected a 1-D int64 tensor of token ids"
                )
            if len(part) != shape["seq_len"]:
                raise TaskError(
                    "data.seq_len", f"a sample holds {len(part)} tokens, data.seq_len is {shape['seq_len']}"
                )
            vocab, counted = shape["vocab_size"], part[part != IGNORE_INDEX]
            if len(counted) and (counted.min() < 0 or counted.max() >= vocab):
                raise TaskError(
                    "data.kwargs.vocab_size",
                    f"token id {int(counted.max())} lies outside the vocabulary of {vocab} ids 0..{vocab - 1}",
                )

    def example_batch(self, shape: dict, size: int, device, generator=None):
        tokens = torch.randint(0, shape["vocab_size"], (size, shape["seq_len"] + 1), generator=generator, device=device)
        return [tokens[:, :-1], tokens[:, 1:]]

    def forward(self, net, batch):
        if isinstance(batch, dict):
            return net(**{key: value for key, value in batch.items() if key != "labels"})
        return net(batch[0])

    def _targets(self, batch) -> torch.Tensor:
        if isinstance(batch, dict):
            labels = batch.get("labels", batch["input_ids"])
            return F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)  # the last position has no next token
        return batch[1]

    def count(self, batch) -> torch.Tensor:
        return (self._targets(batch) != IGNORE_INDEX).sum()

    def _summed_loss(self, output, batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits, targets = logits_of(output), self._targets(batch)
        flat = logits.reshape(-1, logits.shape[-1]).float()
        total = F.cross_entropy(flat, targets.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum")
        return total, self.count(batch), logits

    def loss(self, output, batch):
        total, count = self._summed_loss(output, batch)[:2]
        return total / count.clamp(min=1), count

    def metric_sums(self, output, batch):
        total, count, logits = self._summed_loss(output, batch)
        targets = self._targets(batch)
        correct = ((logits.argmax(-1) == targets) & (targets != IGNORE_INDEX)).sum()
        return {"loss": (total, count), "token_accuracy": (correct, count)}

    def metric_values(self, sums):
        values = super().metric_values(sums)
        values["perplexity"] = math.exp(min(values["loss"], 700.0))
        values["bits"] = values["loss"] / math.log(2)
        return values

    def check_output(self, output, shape: dict, size: int) -> None:
        expected = (size, shape["seq_len"], shape["vocab_size"])
        logits = logits_of(output)
        if tuple(logits.shape) != expected:
            raise TaskError(
                "model.name",
                f"returns {tuple(logits.shape)} for {size} windows of {shape['seq_len']} tokens; expected logits of "
                f"shape {expected}, vocab_size from the data set",
            )

    def describe(self, shape: dict) -> str:
        return f"windows of {shape['seq_len']} tokens of a {shape['vocab_size']}-id vocabulary"


BUILTIN_TASKS = {"image_classification": ImageClassification, "causal_lm": CausalLM}


def build_task(name: str, kwargs: dict | None = None, **data_facts) -> Task:
    """The task `name` (a built-in or `package.module:callable` returning a Task) with `kwargs` (task.kwargs);
    `data_facts` are what the data set tells a built-in task (causal_lm's token_unit)."""
    kwargs = kwargs or {}
    if name in BUILTIN_TASKS:
        factory = BUILTIN_TASKS[name]
        return factory(**kwargs, **data_facts) if factory is CausalLM else factory(**kwargs)
    module_name, _, attr = name.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError) as err:
        raise TaskError("task.name", f"'{name}' does not import ({err}); expected package.module:callable") from None
    try:
        task = factory(**kwargs)
    except Exception as err:  # the user's code: whatever it raises is theirs to read
        raise TaskError("task.name", f"'{name}' raised {type(err).__name__}: {err}") from None
    if not isinstance(task, Task):
        raise TaskError("task.name", f"'{name}' returned {type(task).__name__}; expected a tula_hpc Task")
    return task


def job_task(job: Job) -> Task:
    """The job's task, told what its data set says of its tokens."""
    from tula_hpc.training.text import token_unit

    name = job.task.name
    facts = {"token_unit": token_unit(job.data)} if name == "causal_lm" else {}
    return build_task(name, job.task.kwargs, **facts)


def check_loss(task: Task, output, batch) -> None:
    """Raise TaskError unless the task's loss is a (mean, count) pair of scalars: a loss without its count cannot
    weight micro-batches or AGS's reference sub-batch."""
    answer = task.loss(output, batch)
    if not (isinstance(answer, tuple) and len(answer) == 2 and all(torch.is_tensor(part) for part in answer)):
        raise TaskError(
            "task.name",
            f"task '{task.name}': its loss returned {kind_of(answer)}; expected (mean loss, count of what it averages)",
        )
    if any(part.dim() != 0 for part in answer):
        raise TaskError("task.name", f"task '{task.name}': its loss and count must be scalars")
