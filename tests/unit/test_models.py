"""Real torchvision networks and user model factories on small inputs."""

import pytest
import torch

from tula_hpc.config import MIN_IMAGE_SIZE
from tula_hpc.models import build_model


@pytest.mark.parametrize("name", sorted(MIN_IMAGE_SIZE))
def test_every_builtin_model_classifies_its_smallest_images(name):
    size = max(MIN_IMAGE_SIZE[name], 8)
    model = build_model(name, num_classes=7, in_channels=1, image_size=size).eval()
    with torch.no_grad():
        out = model(torch.randn(2, 1, size, size))
    assert out.shape == (2, 7)


def test_user_model_factory_is_called_with_the_data_shape():
    model = build_model("tula_hpc.models:TinyCNN", num_classes=3, in_channels=2, image_size=6)
    assert model(torch.randn(1, 2, 6, 6)).shape == (1, 3)
