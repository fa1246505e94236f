"""Model factories as users write them, good and bad, named in configs as `tests.unit.factories:NAME`."""

from __future__ import annotations

import torch
from torch import nn


class Net(nn.Module):
    """conv-pool-linear for any image size; `received` holds the keyword arguments its factory was given."""

    def __init__(self, num_classes: int, in_channels: int, width: int = 4, received: dict | None = None):
        super().__init__()
        self.layers = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, padding=1),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(width, num_classes),
        )
        self.received = received

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def classes_and_channels(num_classes, in_channels):
    return Net(num_classes, in_channels, received={"num_classes": num_classes, "in_channels": in_channels})


def with_image_size(num_classes, in_channels, image_size):
    """A head sized for the image: flattens the whole feature map."""
    model = nn.Sequential(
        nn.Conv2d(in_channels, 2, 3, padding=1), nn.Flatten(), nn.Linear(2 * image_size**2, num_classes)
    )
    model.received = {"num_classes": num_classes, "in_channels": in_channels, "image_size": image_size}
    return model


def keywords_only(**kwargs):
    """Gets model.kwargs only: its signature names none of num_classes, in_channels, image_size."""
    return Net(kwargs["classes"], kwargs["channels"], received=kwargs)


def with_width(num_classes, in_channels, width):
    """`width` has no default: model.kwargs must give it."""
    return Net(num_classes, in_channels, width, received={"width": width})


def value_dependent(num_classes, in_channels):
    """Reads a tensor's value while building, as torchvision's regnet does: the meta device has no values."""
    return Net(num_classes, in_channels, width=int(torch.tensor([3, 5]).sum()))


def raises(num_classes):
    raise RuntimeError("no weights for this many classes")


def not_a_module(num_classes, in_channels):
    return {"num_classes": num_classes}


def fixed_input(num_classes, in_channels):
    """Only for 32x32 images."""
    return nn.Sequential(nn.Flatten(), nn.Linear(in_channels * 32 * 32, num_classes))


def ignores_classes(in_channels):
    return Net(1000, in_channels)


NOT_CALLABLE = 42


class TinyLM(nn.Module):
    """Token ids (B, T) -> logits (B, T, vocab_size), reading at most `context` positions; `config` stands for a
    Hugging Face model's (where n_positions says the context) when `in_config`."""

    def __init__(self, vocab_size: int, context: int, in_config: bool = False):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocab_size, 8), nn.Embedding(context, 8)
        self.head = nn.Linear(8, vocab_size)
        if in_config:
            self.config = type("Config", (), {"n_positions": context})()
        else:
            self.block_size = context

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.tokens(ids) + self.positions(torch.arange(ids.shape[1], device=ids.device)))


def short_context(vocab_size, context: int = 4, in_config: bool = False):
    """A language model whose context (block_size, or its config's n_positions) is `context`, whatever data.seq_len."""
    return TinyLM(vocab_size, context, in_config)
