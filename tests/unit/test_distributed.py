"""Process groups that serve every tensor a rank hands them; their timeouts."""

from pathlib import Path

import pytest
import torch

from tula_hpc.cluster.distributed import (
    COLLECTIVE_TIMEOUT_S,
    MAIN_ONLY_TIMEOUT_S,
    wait_for_main,
)

# --- a GPU job's rank takes a GPU of its own or stops (issue 24) -----------------------------------------------


def _rank(monkeypatch, local_rank: int, gpus: int | None) -> list:
    """One rank's environment on a host with `gpus` GPUs (None: CUDA unusable); the devices it selects."""
    import tula_hpc.cluster.distributed as distributed

    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", str(local_rank))
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus is not None)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus or 0)
    selected = []
    monkeypatch.setattr(distributed.torch.cuda, "set_device", selected.append)
    return selected


def test_a_gpu_rank_never_falls_back_to_the_cpu(monkeypatch, tmp_path):
    """A driver older than the wheel's CUDA, or a CUDA_VISIBLE_DEVICES mistake: the rank stops and says why."""
    import socket

    import tula_hpc.cluster.devices as devices
    from tula_hpc.cluster.distributed import init_distributed

    selected = _rank(monkeypatch, 0, None)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-0000")
    monkeypatch.setattr(devices, "NVIDIA_DRIVER_VERSION", tmp_path / "absent")
    with pytest.raises(devices.DeviceError) as err:
        init_distributed(use_gpus=True)
    message = str(err.value)
    for fragment in (
        f"CUDA {torch.version.cuda}" if torch.version.cuda else "no CUDA (a CPU-only build)",
        "NVIDIA driver not found",
        "CUDA_VISIBLE_DEVICES='GPU-0000'",
        f"host {socket.gethostname()}",
    ):
        assert fragment in message, message
    assert selected == []
    assert init_distributed(use_gpus=False).device == torch.device("cpu")


def test_a_rank_without_a_gpu_of_its_own_stops_instead_of_sharing_one(monkeypatch):
    """Two NCCL ranks on one GPU are refused by NCCL; each rank of a node takes the GPU of its local rank."""
    from tula_hpc.cluster.devices import DeviceError
    from tula_hpc.cluster.distributed import init_distributed

    selected = _rank(monkeypatch, 1, 1)
    with pytest.raises(DeviceError, match="local rank 1 has no GPU of its own: 1 GPU"):
        init_distributed(use_gpus=True)
    assert selected == []
    selected = _rank(monkeypatch, 1, 2)
    assert init_distributed(use_gpus=True).device == torch.device("cuda", 1) and selected == [torch.device("cuda", 1)]


def test_waiting_for_rank_0_alone_has_a_timeout_of_its_own():
    assert MAIN_ONLY_TIMEOUT_S == 1800 > COLLECTIVE_TIMEOUT_S == 120
    wait_for_main()  # one process: nobody to wait for


def _mean_worker(rank: int, outdir: str) -> None:
    from tula_hpc.cluster.distributed import Context, mean_over_ranks

    ctx = Context(rank=rank, world_size=2, local_rank=rank, device=torch.device("cpu"))
    value = torch.tensor(float(rank + 1))
    Path(outdir, f"mean{rank}").write_text(repr(mean_over_ranks(value, ctx)))
    assert float(value) == rank + 1  # the caller's tensor is left alone


@pytest.mark.spawns
def test_an_epochs_loss_is_the_mean_over_ranks(tmp_path):
    from tests.conftest import run_on_two_ranks
    from tula_hpc.cluster.distributed import Context, mean_over_ranks

    run_on_two_ranks(_mean_worker, str(tmp_path))
    assert [float((tmp_path / f"mean{rank}").read_text()) for rank in range(2)] == [1.5, 1.5]
    one = Context(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    assert mean_over_ranks(torch.tensor(2.5), one) == 2.5
