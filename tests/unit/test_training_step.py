"""The training step every stage runs on any task's batch, and scoring that counts every sample once."""

import copy
import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.conftest import default_job, run_on_two_ranks
from tula_hpc.cluster.distributed import Context
from tula_hpc.training.precision import Precision
from tula_hpc.training.preemption import REQUEUE_SIGNAL, StopRequests
from tula_hpc.training.step import accumulate_gradients, build_for_job, evaluate_metrics, loop_step, training_step
from tula_hpc.training.strategies import build_strategy
from tula_hpc.training.tasks import IGNORE_INDEX, CausalLM, ImageClassification

IMAGES = ImageClassification()  # cross-entropy on a pair batch (inputs, classes)


def test_accumulated_slices_take_the_same_step_as_the_whole_batch():
    job = default_job(train={"strategy": "lbt"})
    torch.manual_seed(0)
    x, y = torch.randn(50, 1, 8, 8), torch.randint(0, 10, (50,))
    template = nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 10))
    weights, losses = [], []
    for slices in (1, 4):
        model = copy.deepcopy(template)
        strategy = build_strategy(model, job.train, 50, 1)
        losses.append(training_step(model, strategy, IMAGES, [x, y], slices))
        weights.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    torch.testing.assert_close(losses[0], losses[1])
    torch.testing.assert_close(weights[0], weights[1])


def test_the_step_clips_the_gradient_to_train_grad_clip():
    """SGD at rate 1 without momentum or decay moves the weights by the (clipped) gradient: here of norm 5, clipped
    to 1."""
    train = {"strategy": "lbt", "lr": 1.0, "momentum": 0.0, "weight_decay": 0.0, "lr_milestones": []}
    moves = []
    for clip in (None, 1.0):
        model = nn.Linear(2, 1, bias=False)
        nn.init.zeros_(model.weight)
        strategy = build_strategy(model, default_job(train={**train, "grad_clip": clip}).train, 1, 1)
        x = torch.tensor([[3.0, 4.0]])
        training_step(model, strategy, _Ascent(), [x, torch.zeros(1)])
        moves.append(model.weight.detach().flatten())
    torch.testing.assert_close(moves[0], torch.tensor([3.0, 4.0]))
    torch.testing.assert_close(moves[1], torch.tensor([0.6, 0.8]))


class _Ascent(ImageClassification):
    """Minus the output: the gradient is the input, x = (3, 4) of norm 5."""

    def loss(self, output, batch):
        return -output.sum(), self.count(batch)


class _ParityModel(nn.Module):
    """Predicts class 0 for an even-valued image and class 1 for an odd one: which images are right is known."""

    def forward(self, x):
        odd = x.reshape(len(x), -1)[:, 0].remainder(2)
        return torch.stack([1 - odd, odd], dim=1)


def _score_five_images(rank: int, outdir: str) -> None:
    """Images 0..4 labelled 0: the even ones (0, 2, 4) are right, so the accuracy is exactly 3/5."""
    images = torch.arange(5, dtype=torch.float32).reshape(5, 1, 1, 1)
    dataset = torch.utils.data.TensorDataset(images, torch.zeros(5, dtype=torch.long))
    context = Context(rank, 2, rank, torch.device("cpu"))
    accuracy = evaluate_metrics(_ParityModel(), dataset, context, IMAGES, batch_size=2)["accuracy"]
    torch.save(accuracy, f"{outdir}/rank{rank}.pt")


@pytest.mark.spawns
def test_two_ranks_score_every_image_exactly_once(tmp_path):
    # DistributedSampler would pad rank 1's share with image 0 (right), scoring 4/6 instead of 3/5.
    run_on_two_ranks(_score_five_images, str(tmp_path))
    assert [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)] == [0.6, 0.6]


def _conv_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 4))


def _images(batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(batch, 3, 8, 8, generator=gen), torch.randint(0, 4, (batch,), generator=gen)


def test_a_bf16_step_autocasts_the_forward_and_keeps_the_loss_and_the_weights_fp32():
    model = _conv_net()
    before = copy.deepcopy(model)
    strategy = build_strategy(model, default_job(train={"strategy": "lbt", "precision": "bf16"}).train, 16, 1)
    outputs = []
    for layer in (model[0], model[3]):
        layer.register_forward_hook(lambda module, inputs, out: outputs.append(out.dtype))
    loss = training_step(model, strategy, IMAGES, _images(16))
    assert outputs == [torch.bfloat16, torch.bfloat16]
    assert loss.dtype == torch.float32
    assert all(p.dtype == p.grad.dtype == torch.float32 for p in model.parameters())
    assert all(not torch.equal(p, q) for p, q in zip(model.parameters(), before.parameters()))


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Linear(32, 4))


def _ags(model: nn.Module, precision: str):
    """An AGS strategy at B=128 (B_small=32) with its epoch-cadence update due, recording what before_step sees."""
    strategy = build_strategy(model, default_job(train={"strategy": "ags", "precision": precision}).train, 128, 4)
    strategy.end_epoch()
    seen, hook = {}, strategy.before_step

    def before_step(net, loss_of, batch, reference_grads=None):
        seen["grad"] = [p.grad.clone() for p in net.parameters()]
        seen["reference"] = [reference_grads[p].clone() for p in net.parameters()]
        hook(net, loss_of, batch, reference_grads)

    strategy.before_step = before_step
    return strategy, seen


def test_fp16_ags_takes_its_factors_and_delta_from_unscaled_gradients():
    x, y = torch.randn(128, 6, generator=torch.Generator().manual_seed(2)), torch.arange(128) % 4
    runs = {}
    for precision in ("fp32", "fp16"):
        model = _mlp()
        strategy, seen = _ags(model, precision)
        training_step(model, strategy, IMAGES, [x, y])
        runs[precision] = model, strategy, seen
    (model32, fp32, seen32), (model16, fp16, seen16) = runs["fp32"], runs["fp16"]
    assert fp16.optimizer.pop_epoch_metrics()["steps"] == 1  # the step was taken, not skipped

    # The gradients AGS's Delta and factors are taken from match fp32's up to fp16's rounding...
    for key in ("grad", "reference"):
        for g16, g32 in zip(seen16[key], seen32[key]):
            torch.testing.assert_close(g16, g32, rtol=2e-2, atol=1e-4)
    pairs = zip(model16.parameters(), model32.parameters())
    factors = [(fp16.optimizer.gradscale[p], fp32.optimizer.gradscale[q]) for p, q in pairs]
    for f16, f32 in factors:
        torch.testing.assert_close(f16, f32, rtol=2e-2, atol=0)
    assert any(f32 < fp32.optimizer.s_max for _, f32 in factors)  # a factor left unclamped: the check can tell

    # ... and would have been the loss scale times too large without unscaling: what backward leaves in .grad.
    model = _mlp()
    strategy, _ = _ags(model, "fp16")
    accumulate_gradients(model, strategy, IMAGES, [x, y])
    scale = strategy.precision.loss_scale()
    assert scale >= 2**10
    for p, g32 in zip(model.parameters(), seen32["grad"]):
        torch.testing.assert_close(p.grad / scale, g32, rtol=2e-2, atol=1e-4)


def test_an_fp16_step_with_a_non_finite_gradient_is_skipped_and_the_schedule_goes_on():
    model = _mlp()
    before = copy.deepcopy(model)
    strategy, _ = _ags(model, "fp16")
    x, y = torch.randn(128, 6), torch.arange(128) % 4
    x[0, 0] = float("inf")
    scale = strategy.precision.loss_scale()
    training_step(model, strategy, IMAGES, [x, y])
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before.parameters()))
    assert strategy.precision.loss_scale() == scale / 2
    # AGS neither counted the step nor took factors from it: the due update waits for the next step.
    assert strategy.optimizer.gradscale == {} and strategy.optimizer.needs_update()
    assert strategy.optimizer.pop_epoch_metrics()["steps"] == 0
    assert strategy.scheduler.last_epoch == 1  # the rate follows the step count, as a resume places it


def test_channels_last_puts_the_weights_and_the_images_of_every_slice_in_that_format():
    cpu = Context(0, 1, 0, torch.device("cpu"))
    for channels_last in (False, True):
        _, tiny = build_for_job(default_job(train={"channels_last": channels_last}), cpu)
        weights = [p for p in tiny.parameters() if p.ndim == 4 and p.shape[1] > 1]
        assert weights and all(w.is_contiguous(memory_format=torch.channels_last) == channels_last for w in weights)

    model = _conv_net().to(memory_format=torch.channels_last)
    job = default_job(train={"strategy": "ags", "channels_last": True})
    strategy = build_strategy(model, job.train, 64, 1)
    strategy.end_epoch()  # the reference sub-batch is a slice of its own
    seen = []

    def record(conv, inputs):
        seen.append([t.is_contiguous(memory_format=torch.channels_last) for t in (inputs[0], conv.weight)])

    model[0].register_forward_pre_hook(record)
    x, y = _images(64)
    assert not x.is_contiguous(memory_format=torch.channels_last)
    training_step(model, strategy, IMAGES, [x, y])
    assert seen == [[True, True], [True, True]]
    assert model[0].weight.is_contiguous(memory_format=torch.channels_last)


def test_the_loop_step_is_the_training_step_and_reports_a_stop_noted_before_it_began():
    """Training runs it and profiling times it: the same update as training_step, with the stop-flag exchange."""
    cfg = default_job().train
    x, y = torch.randn(16, 4), torch.arange(16) % 3
    nets = [nn.Linear(4, 3) for _ in range(2)]
    nets[1].load_state_dict(nets[0].state_dict())
    stop = StopRequests(world_size=1)
    plain = training_step(nets[0], build_strategy(nets[0], cfg, 16, 4), IMAGES, [x, y])
    loss, stopping = loop_step(nets[1], build_strategy(nets[1], cfg, 16, 4), IMAGES, (x, y), x.device, stop)
    assert torch.equal(loss, plain) and not stopping
    assert all(torch.equal(a, b) for a, b in zip(nets[0].parameters(), nets[1].parameters()))
    stop.noted = REQUEUE_SIGNAL
    assert loop_step(nets[1], build_strategy(nets[1], cfg, 16, 4), IMAGES, (x, y), x.device, stop)[1]


class _TinyLM(nn.Module):
    """Embedding then a linear read-out: (batch, T) token ids to (batch, T, vocab) logits."""

    def __init__(self, vocab: int = 11):
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.out = nn.Embedding(vocab, 8), nn.Linear(8, vocab)

    def forward(self, input_ids, attention_mask=None):
        return self.out(torch.tanh(self.embed(input_ids)))


class _Slicer:
    """The parts of a strategy accumulate_gradients asks for, with a reference sub-batch at `reference`."""

    def __init__(self, net: nn.Module, reference=None):
        self.optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
        self.precision = Precision("fp32", torch.device("cpu"))
        self.reference = reference

    def reference_indices(self, local_batch: int):
        return self.reference


def _gradient(net: nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in net.parameters()])


def _token_batch() -> list[torch.Tensor]:
    """Windows whose targets are ignored in uneven places: 0, 1, 5 or all but one of a window's 6 tokens."""
    gen = torch.Generator().manual_seed(3)
    x, y = torch.randint(0, 11, (7, 6), generator=gen), torch.randint(0, 11, (7, 6), generator=gen)
    y[1, 2] = y[3, :5] = y[5, 1::2] = IGNORE_INDEX
    return [x, y]


@pytest.mark.parametrize(
    "task, make_net, batch",
    [
        (CausalLM(), _TinyLM, _token_batch()),
        (IMAGES, _conv_net, list(_images(7))),
    ],
)
def test_micro_batches_and_a_reference_sub_batch_give_the_one_big_batchs_gradient(task, make_net, batch):
    """Each slice's mean loss weighted by its count over the batch's: the sum is the whole batch's mean, exactly."""
    net = make_net()
    whole = _Slicer(net)
    accumulate_gradients(net, whole, task, batch)
    expected = _gradient(net)
    for slices in (2, 3):
        accumulate_gradients(net, _Slicer(net), task, batch, micro_batches=slices)
        torch.testing.assert_close(_gradient(net), expected, rtol=1e-6, atol=1e-6)
    reference = torch.tensor([5, 1, 3])
    _, reference_grads = accumulate_gradients(net, _Slicer(net, reference), task, batch, micro_batches=2)
    torch.testing.assert_close(_gradient(net), expected, rtol=1e-6, atol=1e-6)
    # ... and the reference gradients are the mean-loss gradients of the sub-batch alone.
    net.zero_grad()
    task.loss_of(net, [t[reference] for t in batch])[0].backward()
    torch.testing.assert_close(torch.cat([reference_grads[p].flatten() for p in net.parameters()]), _gradient(net))


@dataclasses.dataclass
class _Output:
    """A stand-in for a Hugging Face model output: logits and the model's own loss (which the task does not use)."""

    logits: torch.Tensor
    loss: torch.Tensor | None = None


class _HuggingFaceStyleLM(_TinyLM):
    def forward(self, input_ids, attention_mask=None):
        return _Output(super().forward(input_ids), loss=torch.tensor(123.0))


def test_a_dict_batch_and_a_hugging_face_style_output_train_as_the_task_says():
    """labels aligned with input_ids (shifted by the task), padding ignored: the loss is the next-token mean."""
    ids = torch.randint(0, 11, (4, 6), generator=torch.Generator().manual_seed(4))
    labels = ids.clone()
    labels[2, 4:] = IGNORE_INDEX
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
    net, task = _HuggingFaceStyleLM(), CausalLM()
    strategy = build_strategy(net, default_job(train={"strategy": "lbt"}).train, 4, 1)
    logits = _TinyLM.forward(net, ids)
    targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
    expected = F.cross_entropy(logits.reshape(-1, 11), targets.reshape(-1), ignore_index=IGNORE_INDEX)
    before = [p.detach().clone() for p in net.parameters()]
    loss = training_step(net, strategy, task, batch, micro_batches=2)
    torch.testing.assert_close(loss, expected)
    assert any(not torch.equal(p, q) for p, q in zip(net.parameters(), before))


def test_evaluate_metrics_sums_every_batch_of_the_task():
    """One rank, batches of 2 over 5 windows: the summed loss and accuracy equal the whole set's at once."""
    x, y = _token_batch()
    x, y = x[:5], y[:5]
    net, task = _TinyLM(), CausalLM(token_unit="character")
    dataset = torch.utils.data.TensorDataset(x, y)
    scores = evaluate_metrics(net, dataset, Context(0, 1, 0, torch.device("cpu")), task, batch_size=2)
    with torch.no_grad():
        whole = task.metric_values({k: (float(s), float(c)) for k, (s, c) in task.metric_sums(net(x), [x, y]).items()})
    assert scores.keys() == {"loss", "perplexity", "bits", "token_accuracy"}
    assert scores == pytest.approx(whole, rel=1e-6)
    assert scores["bits"] == pytest.approx(scores["loss"] / math.log(2))
