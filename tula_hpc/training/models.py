"""Networks by name, with the right number of classes and input channels and a stem for small images.

A model is a built-in name or `package.module:callable`. A user's factory is called with those of
`num_classes`, `in_channels` and `image_size` (from the data set) that its signature names, plus the job's
`model.kwargs`. A torchvision builder (`torchvision.models:resnet34`) is called with `num_classes` and
`model.kwargs` only (it forwards any other keyword to its network's class, which would refuse it), and its
ImageNet stem is fitted to the data by `adapt_stem`, as for the built-in resnet and mobilenet entries.
torchvision is imported only for a network that needs it.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

SMALL_IMAGE = 64  # at or below this side, torchvision's ImageNet stems downsample too early


class ModelError(ValueError):
    """The model cannot be built as configured; `field` is the setting to change (model.name, model.kwargs or
    data.image_size)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


class TinyCNN(nn.Module):
    """conv32-conv64-pool-fc128: the default job's network, seconds to train on the CPU."""

    def __init__(self, num_classes: int, in_channels: int, image_size: int):
        super().__init__()
        pooled = image_size // 2
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 32, 3, padding=1),
            nn.ReLU(inplace=True),
            nn.Conv2d(32, 64, 3, padding=1),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(
            nn.Flatten(), nn.Linear(64 * pooled * pooled, 128), nn.ReLU(inplace=True), nn.Linear(128, num_classes)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


class BatchNormCNN(nn.Module):
    """Two conv-BatchNorm-ReLU-pool blocks of `width` and 2 x `width` channels, then a linear classifier: the small
    BatchNorm network of the Fashion-MNIST example and benchmark, an epoch of 54,000 14x14 images in seconds on
    two CPU cores."""

    def __init__(self, num_classes: int, in_channels: int, image_size: int, width: int = 16):
        super().__init__()

        def block(inputs: int, outputs: int) -> list[nn.Module]:
            return [nn.Conv2d(inputs, outputs, 3, padding=1, bias=False), nn.BatchNorm2d(outputs), nn.ReLU(True)]

        pooled = image_size // 4
        self.features = nn.Sequential(
            *block(in_channels, width), nn.MaxPool2d(2), *block(width, 2 * width), nn.MaxPool2d(2)
        )
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(2 * width * pooled * pooled, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


class CifarResNet(nn.Module):
    """He et al.'s CIFAR ResNet (6n + 2 layers: ResNet-20 at `blocks` = 3) from torchvision's BasicBlock: a 3x3
    stem of `width` channels, three stages of `blocks` blocks at width, 2 x width and 4 x width channels (the
    last two halve the image), global average pooling and a linear classifier."""

    def __init__(self, num_classes: int, in_channels: int, width: int = 16, blocks: int = 3):
        super().__init__()
        from torchvision.models.resnet import BasicBlock

        def stage(inputs: int, outputs: int, stride: int) -> nn.Sequential:
            shortcut = None
            if stride != 1 or inputs != outputs:
                shortcut = nn.Sequential(nn.Conv2d(inputs, outputs, 1, stride, bias=False), nn.BatchNorm2d(outputs))
            first = BasicBlock(inputs, outputs, stride, downsample=shortcut)
            return nn.Sequential(first, *(BasicBlock(outputs, outputs) for _ in range(blocks - 1)))

        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU(True)
        )
        self.stages = nn.Sequential(stage(width, width, 1), stage(width, 2 * width, 2), stage(2 * width, 4 * width, 2))
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4 * width, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.stages(self.stem(x)))


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent), attr, module)


def adapt_stem(model: nn.Module, in_channels: int, image_size: int) -> nn.Module:
    """Fit an ImageNet network's stem to the data: its first Conv2d takes `in_channels`.

    At image sizes up to SMALL_IMAGE a downsampling stem (a strided first conv, such as ResNet's 7x7/2) becomes
    a 3x3 stride-1 conv, and a max-pool right after it (ResNet's `maxpool`, before any other conv) becomes an
    Identity, as the CIFAR recipes do: else a 32-pixel image is 8 pixels wide before the first block. A stem that
    does not downsample (VGG) keeps its shape; the replaced conv is freshly initialised.
    """
    modules = list(model.named_modules())
    first = next(i for i, (_, module) in enumerate(modules) if isinstance(module, nn.Conv2d))
    name, stem = modules[first]
    bias = stem.bias is not None
    if image_size <= SMALL_IMAGE and stem.stride != (1, 1):
        _replace(model, name, nn.Conv2d(in_channels, stem.out_channels, 3, stride=1, padding=1, bias=bias))
        for after, module in modules[first + 1 :]:
            if isinstance(module, nn.Conv2d):
                break
            if isinstance(module, nn.MaxPool2d):
                _replace(model, after, nn.Identity())
                break
    elif in_channels != stem.in_channels:
        conv = nn.Conv2d(in_channels, stem.out_channels, stem.kernel_size, stem.stride, stem.padding, bias=bias)
        _replace(model, name, conv)
    return model


def vgg11(num_classes: int, in_channels: int, image_size: int) -> nn.Module:
    """torchvision's VGG-11; at small sizes with the CIFAR-style head (512-512-classes): the ImageNet head would be
    100M parameters of padding."""
    from torchvision import models as tv

    model = tv.vgg11(num_classes=num_classes)
    model.features[0] = nn.Conv2d(in_channels, 64, 3, padding=1)
    if image_size <= SMALL_IMAGE:
        model.avgpool = nn.AdaptiveAvgPool2d(1)
        model.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Linear(512, 512),
            nn.ReLU(True),
            nn.Dropout(),
            nn.Linear(512, 512),
            nn.ReLU(True),
            nn.Dropout(),
            nn.Linear(512, num_classes),
        )
    return model


def alexnet(num_classes: int, in_channels: int) -> nn.Module:
    """torchvision's AlexNet with its ImageNet stem (11x11, stride 4) at every size, taking `in_channels`."""
    from torchvision import models as tv

    model = tv.alexnet(num_classes=num_classes)
    model.features[0] = nn.Conv2d(in_channels, 64, 11, stride=4, padding=2)
    return model


# Built-in names, each an import path built as a user's would be.
BUILTINS = {
    "tiny_cnn": f"{__name__}:TinyCNN",
    "bn_cnn": f"{__name__}:BatchNormCNN",
    "cifar_resnet": f"{__name__}:CifarResNet",
    "resnet18": "torchvision.models:resnet18",
    "resnet50": "torchvision.models:resnet50",
    "mobilenet_v3_small": "torchvision.models:mobilenet_v3_small",
    "mobilenet_v3_large": "torchvision.models:mobilenet_v3_large",
    "vgg11": f"{__name__}:vgg11",
    "alexnet": f"{__name__}:alexnet",
    "gpt": "tula_hpc.training.gpt:gpt",
}


def _load_factory(name: str) -> Callable:
    """The callable a model name stands for; ModelError('model.name') if it does not import."""
    path = BUILTINS.get(name, name)
    module_name, _, attr = path.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise ModelError("model.name", f"'{name}' does not import ({err}); expected package.module:callable") from None
    if not callable(factory):
        raise ModelError("model.name", f"'{name}' is not callable")
    return factory


def _from_torchvision(factory: Callable) -> bool:
    return (getattr(factory, "__module__", None) or "").startswith("torchvision.models")


def _arguments(factory: Callable, name: str, shape: dict, kwargs: dict | None = None) -> dict[str, Any]:
    """The keyword arguments `factory` is called with: those of the data's `shape` (datasets.data_shape: an image
    classifier's num_classes, in_channels and image_size, a language model's vocab_size and seq_len) its signature
    names (a torchvision builder: num_classes), then `kwargs` (the job's model.kwargs).

    ModelError when a kwargs key repeats one of those or is not accepted (model.kwargs), or a required parameter
    is left without a value (model.name).
    """
    kwargs = kwargs or {}
    try:
        parameters = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError) as err:
        raise ModelError("model.name", f"'{name}': cannot read its signature ({err})") from None
    by_keyword = [p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    any_keyword = any(p.kind == p.VAR_KEYWORD for p in parameters)
    given = (
        {"num_classes": shape["num_classes"]}
        if _from_torchvision(factory)
        else {k: shape[k] for k in by_keyword if k in shape}
    )
    if repeated := sorted(set(kwargs) & set(given)):
        raise ModelError(
            "model.kwargs", f"{', '.join(repeated)}: given to '{name}' from the data set, not from model.kwargs"
        )
    if not any_keyword and (unknown := sorted(set(kwargs) - set(by_keyword))):
        accepted = ", ".join(k for k in by_keyword if k not in given) or "none"
        raise ModelError("model.kwargs", f"'{name}' takes no argument {', '.join(unknown)}; it accepts: {accepted}")
    arguments = {**given, **kwargs}
    for p in parameters:
        if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and p.name not in arguments:
            raise ModelError(
                "model.name",
                f"'{name}' requires argument '{p.name}', which tula-hpc cannot give: it passes {', '.join(shape)} "
                "where the signature names them; give others in model.kwargs",
            )
    return arguments


def build_model(name: str, shape: dict, kwargs: dict | None = None) -> nn.Module:
    """The network `name` (a built-in or package.module:callable) for the data's `shape`, with `kwargs`
    (model.kwargs) passed on; a torchvision network gets its stem adapted (adapt_stem)."""
    factory = _load_factory(name)
    model = factory(**_arguments(factory, name, shape, kwargs))
    if not isinstance(model, nn.Module):
        raise ModelError("model.name", f"'{name}' returned {type(model).__name__}, not a torch.nn.Module")
    return adapt_stem(model, shape["in_channels"], shape["image_size"]) if _from_torchvision(factory) else model


def _run_on_two(name: str, shape: dict, kwargs: dict | None, task) -> Any:
    """The output of the model for two of the task's example samples, built and run on the current default
    device."""
    try:
        model = build_model(name, shape, kwargs)
    except ModelError:
        raise
    except Exception as err:
        # A TypeError naming a model.kwargs key: the factory (or the class a torchvision builder passes it on to)
        # refused it.
        refused = isinstance(err, TypeError) and any(f"'{key}'" in str(err) for key in kwargs or {})
        raise ModelError(
            "model.kwargs" if refused else "model.name", f"'{name}' raised {type(err).__name__}: {err}"
        ) from None
    _check_context(name, model, shape)
    batch = task.example_batch(shape, 2, torch.get_default_device())
    try:
        with torch.no_grad():
            return task.forward(model, batch), batch
    except Exception as err:
        field = "data.image_size" if "image_size" in shape else "data.seq_len"
        raise ModelError(
            field,
            f"'{name}' cannot run on {task.describe(shape)} ({type(err).__name__}: {err}); choose another "
            f"{field.split('.')[1]} or model",
        ) from None


# Where a model says the longest sequence it reads: nanoGPT's block_size, Hugging Face's n_positions (GPT-2) or
# max_position_embeddings, on the model or its `config`.
CONTEXT_ATTRIBUTES = ("seq_len", "block_size", "n_positions", "max_position_embeddings")


def model_context(model: nn.Module) -> tuple[str, int] | None:
    """(attribute, value) of the first of CONTEXT_ATTRIBUTES the model or its config holds as an int, else None."""
    for holder in (model, getattr(model, "config", None)):
        for attribute in CONTEXT_ATTRIBUTES:
            value = getattr(holder, attribute, None)
            if isinstance(value, int) and not isinstance(value, bool):
                return attribute, value
    return None


def _check_context(name: str, model: nn.Module, shape: dict) -> None:
    """data.seq_len within the model's context where it says it: beyond it, positions it never learned (or, on the
    meta device, an embedding read past its end that nothing notices)."""
    context = model_context(model)
    if "seq_len" in shape and context and shape["seq_len"] > context[1]:
        raise ModelError(
            "data.seq_len",
            f"{shape['seq_len']} tokens exceed the context of '{name}' ({context[0]} {context[1]}); allowed: at most "
            f"{context[1]}",
        )


def check_model(name: str, shape: dict, kwargs: dict | None = None, *, task) -> None:
    """Build the model and run it on two of the task's example samples, or raise ModelError naming the setting to
    change; the task checks the output's shape and its loss's answer (tasks.check_loss).

    Shapes only, on the meta device (no memory, no arithmetic: resnet50 in a quarter of a second). A network that
    needs values while it is built or run (torchvision's regnet computes its widths with tensors; meta tensors
    have none) is tried again on the CPU, and what fails there is reported.
    """
    from tula_hpc.training.tasks import TaskError, check_loss

    try:
        with torch.device("meta"):
            output, batch = _run_on_two(name, shape, kwargs, task)
    except ModelError:
        output, batch = _run_on_two(name, shape, kwargs, task)
    try:
        task.check_output(output, shape, 2)
        check_loss(task, output, batch)
    except TaskError as err:
        raise ModelError(err.field, f"'{name}' {err}" if err.field == "model.name" else str(err)) from None


def _tensors(output: Any):
    """The tensors a module returned: itself, or those in a (nested) tuple or list."""
    if isinstance(output, torch.Tensor):
        yield output
    elif isinstance(output, (tuple, list)):
        for item in output:
            yield from _tensors(item)


def index_cap(name: str, shape: dict, kwargs: dict | None, task) -> int:
    """The largest batch at which no module's output holds 2^31 elements or more: beyond it CUDA kernels split the
    batch or index in 64 bits, which a probe's small batch does not show.

    Read from a forward pass on two of the task's example samples on the meta device (shapes only), every module's
    output per sample.
    """
    largest = 0

    def see(_module: nn.Module, _inputs: Any, output: Any) -> None:
        nonlocal largest
        largest = max([largest, *(tensor.numel() // 2 for tensor in _tensors(output))])

    with torch.device("meta"), torch.no_grad():
        model = build_model(name, shape, kwargs).eval()
        for module in model.modules():
            module.register_forward_hook(see)
        task.forward(model, task.example_batch(shape, 2, "meta"))
    return (2**31 - 1) // largest
