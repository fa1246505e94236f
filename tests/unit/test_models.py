"""Real torchvision networks and user model factories on small inputs."""

import pytest
import torch
from torch import nn

from tests.conftest import default_job
from tula_hpc.config import MIN_IMAGE_SIZE
from tula_hpc.training.evaluation import load_trained_model
from tula_hpc.training.models import SMALL_IMAGE, ModelError, build_model, check_model, index_cap, model_context
from tula_hpc.training.tasks import CausalLM, ImageClassification
from tula_hpc.training.trainer import train_worker

IMAGES = ImageClassification()

FACTORIES = "tests.unit.factories"
# torchvision's notice that googlenet's and inception's default initialisation will change: not ours to act on.
INIT_NOTICE = "ignore:The default weight initialization:FutureWarning"


def _classify(model: nn.Module, in_channels: int, size: int) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(torch.randn(2, in_channels, size, size))


@pytest.mark.parametrize("name", sorted(MIN_IMAGE_SIZE))
def test_every_builtin_model_classifies_its_smallest_images(name):
    size = max(MIN_IMAGE_SIZE[name], 8)
    model = build_model(name, {"num_classes": 7, "in_channels": 1, "image_size": size})
    assert _classify(model, 1, size).shape == (2, 7)


@pytest.mark.parametrize(
    "factory, kwargs, received",
    [
        ("classes_and_channels", {}, {"num_classes": 3, "in_channels": 2}),
        ("with_image_size", {}, {"num_classes": 3, "in_channels": 2, "image_size": 6}),
        ("keywords_only", {"classes": 3, "channels": 2}, {"classes": 3, "channels": 2}),
        ("with_width", {"width": 5}, {"width": 5}),
    ],
)
def test_a_factory_gets_the_data_shape_its_signature_names_and_model_kwargs(factory, kwargs, received):
    model = build_model(f"{FACTORIES}:{factory}", {"num_classes": 3, "in_channels": 2, "image_size": 6}, kwargs=kwargs)
    assert model.received == received
    assert _classify(model, 2, 6).shape == (2, 3)
    check_model(
        f"{FACTORIES}:{factory}", {"num_classes": 3, "in_channels": 2, "image_size": 6}, kwargs=kwargs, task=IMAGES
    )


@pytest.mark.parametrize(
    "factory, kwargs, field, fragments",
    [
        ("with_width", {}, "model.name", ["requires argument 'width'", "model.kwargs"]),
        ("classes_and_channels", {"depth": 3}, "model.kwargs", ["takes no argument depth"]),
        ("classes_and_channels", {"num_classes": 5}, "model.kwargs", ["num_classes", "from the data set"]),
    ],
)
def test_a_factory_that_cannot_be_called_as_configured_is_refused_before_it_runs(factory, kwargs, field, fragments):
    with pytest.raises(ModelError) as err:
        build_model(f"{FACTORIES}:{factory}", {"num_classes": 3, "in_channels": 2, "image_size": 6}, kwargs=kwargs)
    assert err.value.field == field
    assert all(fragment in str(err.value) for fragment in fragments), str(err.value)


@pytest.mark.parametrize("in_channels", [1, 3])
def test_torchvision_resnet34_by_import_path_gets_a_cifar_stem_for_small_images(in_channels):
    model = build_model(
        "torchvision.models:resnet34", {"num_classes": 10, "in_channels": in_channels, "image_size": 28}
    )
    assert (model.conv1.in_channels, model.conv1.kernel_size, model.conv1.stride) == (in_channels, (3, 3), (1, 1))
    assert isinstance(model.maxpool, nn.Identity)
    assert _classify(model, in_channels, 28).shape == (2, 10)


def test_above_small_images_the_imagenet_stem_stays_and_only_takes_the_data_channels():
    size = SMALL_IMAGE + 32
    model = build_model("torchvision.models:resnet18", {"num_classes": 4, "in_channels": 1, "image_size": size})
    assert (model.conv1.in_channels, model.conv1.kernel_size, model.conv1.stride) == (1, (7, 7), (2, 2))
    assert isinstance(model.maxpool, nn.MaxPool2d)
    assert _classify(model, 1, size).shape == (2, 4)


@pytest.mark.parametrize("family", ["resnet18", "resnet34", "mobilenet_v3_small", "efficientnet_b0"])
@pytest.mark.parametrize("in_channels", [1, 3])
@pytest.mark.parametrize("size", [14, 28, 32])
def test_torchvision_families_classify_small_images_of_one_or_three_channels(family, in_channels, size):
    name = f"torchvision.models:{family}"
    check_model(name, {"num_classes": 10, "in_channels": in_channels, "image_size": size}, task=IMAGES)
    assert _classify(
        build_model(name, {"num_classes": 10, "in_channels": in_channels, "image_size": size}), in_channels, size
    ).shape == (2, 10)


@pytest.mark.filterwarnings(INIT_NOTICE)
def test_torchvision_builders_pass_model_kwargs_to_their_network():
    name = "torchvision.models:googlenet"
    # In training mode googlenet returns its logits and its auxiliary heads' (a tuple): the first are the logits.
    check_model(name, {"num_classes": 10, "in_channels": 3, "image_size": 32}, task=IMAGES)
    check_model(
        name, {"num_classes": 10, "in_channels": 3, "image_size": 32}, kwargs={"aux_logits": False}, task=IMAGES
    )
    with pytest.raises(ModelError, match="unexpected keyword argument 'depth'") as err:
        check_model(
            "torchvision.models:resnet34",
            {"num_classes": 10, "in_channels": 3, "image_size": 32},
            kwargs={"depth": 3},
            task=IMAGES,
        )
    assert err.value.field == "model.kwargs"


@pytest.mark.filterwarnings(INIT_NOTICE)
@pytest.mark.parametrize("family, size", [("vgg11", 28), ("inception_v3", 32), ("vit_b_16", 32)])
def test_torchvision_networks_too_deep_for_the_image_size_are_refused_naming_it(family, size):
    with pytest.raises(ModelError, match=f"cannot run on {size}x{size} images") as err:
        check_model(
            f"torchvision.models:{family}", {"num_classes": 10, "in_channels": 3, "image_size": size}, task=IMAGES
        )
    assert err.value.field == "data.image_size"


def test_a_factory_that_needs_tensor_values_is_checked_on_the_cpu():
    check_model(f"{FACTORIES}:value_dependent", {"num_classes": 3, "in_channels": 1, "image_size": 8}, task=IMAGES)
    check_model(
        "torchvision.models:regnet_y_400mf", {"num_classes": 10, "in_channels": 1, "image_size": 28}, task=IMAGES
    )


def test_evaluation_rebuilds_the_trained_network_with_its_model_kwargs(tmp_path):
    model = {"name": f"{FACTORIES}:with_width", "kwargs": {"width": 6}}
    job = default_job(model=model, train=dict(epochs=1, lr_milestones=[]))
    paths = {f"{name}_path": str(tmp_path / f"{name}.pt") for name in ("checkpoint", "model", "metrics")}
    train_worker(job, 64, **paths)
    loaded = load_trained_model(tmp_path / "model.pt")
    assert loaded.received == {"width": 6} and loaded.layers[0].out_channels == 6


class Widen(nn.Module):
    """Returns its input and five copies of it side by side: a tuple whose second tensor is the widest."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, x.repeat(1, 5, 1, 1)


class TupleInside(nn.Module):
    """A network whose largest activation is only in a module's tuple output."""

    def __init__(self, num_classes: int, in_channels: int):
        super().__init__()
        self.widen, self.head = Widen(), nn.Linear(5 * in_channels, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _, wide = self.widen(x)
        return self.head(wide.mean((2, 3)))


@pytest.mark.parametrize(
    "name, in_channels, image_size, per_image",
    [
        ("tiny_cnn", 1, 32, 64 * 32 * 32),  # its second convolution's output
        ("resnet18", 3, 32, 64 * 32 * 32),  # the CIFAR stem's 64 channels at full size
        (f"{__name__}:TupleInside", 2, 16, 5 * 2 * 16 * 16),  # the tuple's wide tensor
    ],
)
def test_the_index_cap_is_the_largest_batch_whose_activations_stay_below_2_to_the_31(
    name, in_channels, image_size, per_image
):
    cap = index_cap(name, {"num_classes": 10, "in_channels": in_channels, "image_size": image_size}, None, IMAGES)
    assert cap == (2**31 - 1) // per_image
    assert cap * per_image < 2**31 <= (cap + 1) * per_image


@pytest.mark.parametrize("in_config", [False, True], ids=["block_size", "config.n_positions"])
def test_data_seq_len_beyond_a_models_context_is_refused(in_config):
    """On the meta device an embedding read past its end goes unnoticed: the context the model states is checked."""
    name, kwargs = f"{FACTORIES}:short_context", {"context": 4, "in_config": in_config}
    check_model(name, {"vocab_size": 11, "seq_len": 4}, kwargs, task=CausalLM())
    with pytest.raises(ModelError) as err:
        check_model(name, {"vocab_size": 11, "seq_len": 8}, kwargs, task=CausalLM())
    attribute = "n_positions" if in_config else "block_size"
    assert err.value.field == "data.seq_len"
    assert str(err.value) == f"8 tokens exceed the context of '{name}' ({attribute} 4); allowed: at most 4"
    assert model_context(build_model(name, {"vocab_size": 11}, kwargs)) == (attribute, 4)
    assert model_context(build_model(f"{FACTORIES}:classes_and_channels", {"num_classes": 3, "in_channels": 1})) is None
