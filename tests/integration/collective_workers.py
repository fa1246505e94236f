"""A spy on torch.distributed's collectives, and the harness that runs the package's workers under it on two ranks.

Every tensor a collective is handed must be on a device type its group's backend serves: a group made
with "cpu:gloo,cuda:nccl" serves both, one made with "nccl" alone has no backend for a CPU tensor. The
spy checks each call before it reaches torch and records what it saw, so a wrong device is reported the
same way whether the backend would fail, hang or (gloo with a CUDA tensor) quietly copy.
"""

from __future__ import annotations

import inspect
import json
import os
from collections import defaultdict
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
import torch.multiprocessing as mp
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

from tests.conftest import free_port

COLLECTIVES = (
    "all_reduce",
    "all_reduce_coalesced",
    "all_gather",
    "all_gather_coalesced",
    "all_gather_object",
    "all_gather_into_tensor",
    "_all_gather_base",
    "broadcast",
    "broadcast_object_list",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "_reduce_scatter_base",
    "barrier",
    "monitored_barrier",
    "gather",
    "gather_object",
    "scatter",
    "scatter_object_list",
    "all_to_all",
    "all_to_all_single",
    "send",
    "recv",
    "isend",
    "irecv",
    "send_object_list",
    "recv_object_list",
)
# C++ collectives DDP calls with the group first and the tensors second: its start-up checks and broadcasts.
DDP_COLLECTIVES = ("_verify_params_across_processes", "_broadcast_coalesced")


def served_device_types(config: str) -> set[str]:
    """Device types a backend config serves: "cpu:gloo, cuda:nccl" both; a bare name, what that backend can."""
    served = set()
    for entry in config.split(","):
        device, _, backend = entry.strip().rpartition(":")
        served |= {device} if device else set(dist.Backend.backend_capability.get(backend.lower(), []))
    return served


def _tensors(values: Iterable) -> list[torch.Tensor]:
    found = []
    for value in values:
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            found.extend(v for v in value if isinstance(v, torch.Tensor))
    return found


class CollectiveSpy:
    """Records every collective call (and the device types of its tensors) and every tensor its group cannot serve.

    It records rather than raises: a rank that raises leaves its peer waiting in the collective.
    """

    def __init__(self) -> None:
        self.calls: dict[str, set[str]] = defaultdict(set)
        self.violations: list[str] = []

    def check(self, collective: str, tensors: list[torch.Tensor], group) -> None:
        config = str(dist.get_backend_config(group))
        served = served_device_types(config)
        self.calls[collective] |= {t.device.type for t in tensors}
        for tensor in tensors:
            message = f"{collective} was handed a tensor on {tensor.device}; its group's backends are {config!r}"
            if tensor.device.type not in served and message not in self.violations:  # once, not once a step
                self.violations.append(message)

    def report(self) -> dict:
        return {"calls": {name: sorted(types) for name, types in self.calls.items()}, "violations": self.violations}

    def install(self, patch: Callable = setattr) -> None:
        """Wrap torch.distributed's collectives and DDP's (`patch`: setattr, or pytest's monkeypatch.setattr).

        Wrapped in torch.distributed and in distributed_c10d, so collectives torch calls from inside others
        (all_gather_object's all_gather of the pickled bytes) are checked too. DDP all-reduces its gradient
        buckets in C++: every DDP model gets a checking comm hook, the job's own (polo's) wrapped or, if it
        registers none, torch's allreduce_hook, which does what the built-in all-reduce does.
        """
        for name in COLLECTIVES:
            wrapped = self._public(name, getattr(dist, name))
            patch(dist, name, wrapped)
            patch(c10d, name, wrapped)
        for name in DDP_COLLECTIVES:
            patch(dist, name, self._positional(name, getattr(dist, name)))

        spy, register, forward = self, DistributedDataParallel.register_comm_hook, DistributedDataParallel.forward

        def register_checked(ddp, state, hook):
            def checked(state, bucket):
                spy.check(f"DDP gradient bucket ({hook.__name__})", [bucket.buffer()], ddp.process_group)
                return hook(state, bucket)

            register(ddp, state, checked)

        def forward_with_hook(ddp, *inputs, **kwargs):
            if not ddp._comm_hooks:
                ddp.register_comm_hook(ddp.process_group, allreduce_hook)
            return forward(ddp, *inputs, **kwargs)

        patch(DistributedDataParallel, "register_comm_hook", register_checked)
        patch(DistributedDataParallel, "forward", forward_with_hook)

    def _public(self, name: str, collective: Callable) -> Callable:
        signature = inspect.signature(collective)

        def wrapped(*args, **kwargs):
            arguments = signature.bind(*args, **kwargs).arguments
            self.check(name, _tensors(arguments.values()), arguments.get("group"))
            return collective(*args, **kwargs)

        return wrapped

    def _positional(self, name: str, collective: Callable) -> Callable:
        def wrapped(group, tensors, *args, **kwargs):
            self.check(name, list(tensors), group)
            return collective(group, tensors, *args, **kwargs)

        return wrapped


def _rank(rank: int, ports: list[int], phases: list[tuple[str, Callable, dict]], report: str) -> None:
    """One rank: the spy installed, then each phase (a worker that joins and leaves the group itself) in turn."""
    os.environ.update(MASTER_ADDR="127.0.0.1", RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2")
    torch.set_num_threads(1)
    spy, reports = CollectiveSpy(), {}
    spy.install()
    for port, (name, worker, kwargs) in zip(ports, phases):
        os.environ["MASTER_PORT"] = str(port)  # a fresh rendezvous: the last phase's store is gone
        spy.calls, spy.violations = defaultdict(set), []
        worker(**kwargs)
        reports[name] = spy.report()
        Path(report, f"rank{rank}.json").write_text(json.dumps(reports))


def spied_on_two_ranks(phases: list[tuple[str, Callable, dict]], report: Path) -> list[dict]:
    """Run `phases` (name, module-level worker, its kwargs) on two fresh ranks under the spy; each rank's reports."""
    mp.spawn(_rank, args=([free_port() for _ in phases], phases, str(report)), nprocs=2, join=True)
    return [json.loads((report / f"rank{rank}.json").read_text()) for rank in range(2)]
