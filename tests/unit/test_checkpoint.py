"""Checkpoints keep every rank's RNG states, and each rank restores its own."""

import random

import numpy as np
import pytest
import torch

from tests.conftest import run_on_two_ranks
from tula_hpc import checkpoint as checkpoint_module
from tula_hpc.training.checkpoint import own_rng_state, restore_rng, rng_state, rng_states


def test_each_rank_takes_its_own_states_and_rank_0s_when_the_world_size_changed(capsys):
    states = [{"rank": 0}, {"rank": 1}]
    assert [own_rng_state(states, rank, world_size=2) for rank in (0, 1)] == states
    assert capsys.readouterr().out == ""
    assert [own_rng_state(states, rank, world_size=4) for rank in range(4)] == [states[0]] * 4
    assert own_rng_state(states, 0, world_size=1) == states[0]
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        "[checkpoint] saved by 2 ranks, resumed by 4: every rank restores rank 0's RNG states",
        "[checkpoint] saved by 2 ranks, resumed by 1: every rank restores rank 0's RNG states",
    ]  # one line a resume, from rank 0


def test_a_restored_state_replays_the_same_draws():
    torch.manual_seed(3)
    saved = rng_states(world_size=1)
    drawn = (random.random(), np.random.rand(), torch.rand(2))
    restore_rng(own_rng_state(saved, 0, world_size=1))
    assert (random.random(), np.random.rand()) == drawn[:2] and torch.equal(torch.rand(2), drawn[2])


def _gather_seeded_states(rank: int, outdir: str) -> None:
    torch.manual_seed(rank)
    random.seed(rank)
    states = rng_states(world_size=2)
    if rank == 0:
        torch.save(states, f"{outdir}/states.pt")
    else:
        assert states is None


@pytest.mark.spawns
def test_rank_0_gathers_every_ranks_states_by_rank(tmp_path):
    run_on_two_ranks(_gather_seeded_states, str(tmp_path))
    states = torch.load(tmp_path / "states.pt", weights_only=False)
    for rank in (0, 1):
        torch.manual_seed(rank)
        random.seed(rank)
        assert torch.equal(states[rank]["torch"], rng_state()["torch"])
        assert states[rank]["python"] == random.getstate()


def test_a_rank_saves_and_restores_only_its_own_gpus_generator(monkeypatch):
    """One GPU's state, the current device's: never every visible GPU's (a CUDA context on each), never CUDA's
    on a process that does not use it."""
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert rng_state()["cuda"] is None
    own, restored = torch.tensor([7], dtype=torch.uint8), []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device="cuda": own)
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device="cuda": restored.append(state))
    state = rng_state()
    assert state["cuda"] is own
    restore_rng(state)
    assert restored == [own]


def test_the_checkpointer_loads_only_its_own_runs_checkpoint(tmp_path, capsys):
    from torch import nn

    from tula_hpc.cluster.distributed import Context
    from tula_hpc.training.checkpoint import Checkpointer

    ctx = Context(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    model = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    run = {"train": {"epochs": 3}, "format": 4}
    Checkpointer(tmp_path / "ckpt.pt", run, ctx).save(model, optimizer, {"epoch": 2, "step": 7})
    loaded = Checkpointer(tmp_path / "ckpt.pt", run, ctx).load()
    assert loaded["state"] == {"epoch": 2, "step": 7} and loaded["run"] == run
    assert set(loaded) == {"model", "optimizer", "state", "rng", "run"}
    other = Checkpointer(tmp_path / "ckpt.pt", {**run, "format": 5}, ctx)
    assert other.load() is None
    assert "belongs to a different configuration" in capsys.readouterr().out
    assert (tmp_path / "ckpt.pt").exists()  # left alone
    assert Checkpointer(tmp_path / "none.pt", run, ctx).load() is None


def test_a_damaged_checkpoint_falls_back_to_the_previous_one_and_an_error_names_both_files(tmp_path, capsys):
    """Each save keeps the checkpoint it replaces; a truncated last one resumes from that, and where neither can be
    read the error names both files and what to do."""
    path = tmp_path / "checkpoint.pt"
    for step in (1, 2, 3):
        checkpoint_module.save_checkpoint(path, {"step": step})
    assert checkpoint_module.load_checkpoint(path) == {"step": 3}
    assert checkpoint_module.load_checkpoint(checkpoint_module.previous_path(path)) == {"step": 2}
    path.write_bytes(path.read_bytes()[:40])  # truncated after it was written
    assert checkpoint_module.load_checkpoint(path) == {"step": 2}
    assert f"cannot read {path}" in capsys.readouterr().out
    checkpoint_module.previous_path(path).write_bytes(b"not a checkpoint")
    with pytest.raises(checkpoint_module.CheckpointUnreadable, match=r"Delete .*checkpoint\.pt and .*previous\.pt"):
        checkpoint_module.load_checkpoint(path)
    assert checkpoint_module.load_checkpoint(tmp_path / "none.pt") is None
