"""Process groups that serve every tensor a rank hands them."""

import torch

from tula_hpc.distributed import backend_for


def test_a_gpu_rank_joins_a_group_that_serves_its_cpu_tensors_too():
    """NCCL serves CUDA tensors only; profiling's bookkeeping collectives hold CPU tensors, which go to gloo."""
    mapping = dict(pair.split(":") for pair in backend_for(torch.device("cuda", 0)).split(","))
    assert mapping == {"cpu": "gloo", "cuda": "nccl"}


def test_a_cpu_rank_joins_gloo():
    assert backend_for(torch.device("cpu")) == "gloo"
