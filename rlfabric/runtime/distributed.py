"""Data-parallel learners: batch shards and a gradient all-reduce (torch.distributed, no Ray).

N learners hold the same weights and optimizer state. Each update, learner 0
cuts the batch into N equal shards along its batch axis and every learner runs
the algorithm's ordinary `update` on its shard; every optimizer step inside it
first all-reduces the gradients (`GradientAllReduce`, installed as the
algorithm's `grad_sync`). The algorithms' losses are either sums over the batch
(IMPALA's V-trace, A3C) or means (PPO, SAC, TD3): a sum's full-batch gradient
is the sum of the shards' gradients, a mean's is their average over equal
shards. So the step equals one learner's on the whole batch, up to float
rounding (and, for a mean over valid steps only, up to shards holding
different numbers of autoreset steps), and all learners stay identical: the
same reduced gradient goes into the same optimizer state. This is what torch
DDP does, done at the optimizer step so that any algorithm, which may run
several forward passes and optimizers per update, needs no change. Sparse
training's RigL grow scores (each layer's dense gradient) are reduced the same
way before a topology update (`GradientAllReduce.reduce`), so that every
learner grows the same connections, as RigL's and RLx2's distributed code.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Literal

import numpy as np
import torch
import torch.distributed as dist

Reduction = Literal["sum", "mean"]


def shard_batch(batch: dict[str, np.ndarray], shards: int) -> list[dict[str, np.ndarray]]:
    """Cut a batch into `shards` equal parts along its batch axis.

    Trajectory batches are time-major, `[T(+1), B, ...]` (the recurrent state
    `[1, B, ...]`): the batch axis is 1. Replay batches are `[B, ...]`.
    """
    axis = 1 if batch["reward"].ndim == 2 else 0
    size = batch["reward"].shape[axis]
    if size % shards:
        raise ValueError(f"a batch of {size} does not split into {shards} equal shards")
    return [{k: np.split(v, shards, axis=axis)[i] for k, v in batch.items()} for i in range(shards)]


class GradientAllReduce:
    """Before each optimizer step: the gradients summed (or averaged) over the group."""

    def __init__(self, world_size: int, reduction: Reduction) -> None:
        self.world_size = world_size
        self.reduction = reduction

    def __call__(self, optimizer: torch.optim.Optimizer) -> None:
        self.reduce(
            [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        )

    def reduce(self, tensors: list[torch.Tensor]) -> None:
        """Sum (or average) `tensors` over the group in place, in one message.

        Every learner must call it with the same shapes in the same order (collective).
        """
        self._all_sum(tensors, self.world_size if self.reduction == "mean" else 1)

    def sum(self, tensors: list[torch.Tensor]) -> None:
        """Sum `tensors` over the group in place, in one message, whatever the reduction
        (batch moments: `models.ObsNormalizer.update`). A collective, as `reduce`."""
        self._all_sum(tensors, 1)

    def _all_sum(self, tensors: list[torch.Tensor], divide_by: int) -> None:
        if not tensors:
            return
        flat = torch.cat([t.reshape(-1) for t in tensors])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        if divide_by != 1:
            flat /= divide_by
        offset = 0
        for tensor in tensors:
            tensor.copy_(flat[offset : offset + tensor.numel()].view_as(tensor))
            offset += tensor.numel()


def host_rendezvous(host: str, world_size: int, timeout_s: float) -> tuple[str, dist.TCPStore]:
    """Learner 0's rendezvous: a TCPStore on a port the OS picks and the store keeps
    bound, so no other process can take it between picking and joining (picking a
    free port by bind-and-close raced). Returns the address others join and the store."""
    store = dist.TCPStore(
        host,
        0,
        world_size,
        is_master=True,
        timeout=timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )
    return f"tcp://{host}:{store.port}", store


def join_group(
    address: str,
    rank: int,
    world_size: int,
    device: str,
    timeout_s: float = 1800.0,
    store: dist.Store | None = None,
    rendezvous_s: float | None = None,
) -> None:
    """Join the learners' process group: gloo on CPU, NCCL when learners have GPUs.

    `store` is the host's own (`host_rendezvous`); without one, rank 0 hosts the
    rendezvous at `address` and the others connect to it. A collective that waits
    longer than `timeout_s` for a peer (one that died) raises instead of blocking its
    caller, and the lock it holds, forever.

    Every rank first waits for all the others on the store, for up to `rendezvous_s`
    (default `timeout_s`): a peer may still be starting (a new process importing torch),
    which is the start's patience, not a collective's. Once all are there, the process
    group's own handshake takes milliseconds within `timeout_s`.
    """
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if backend == "nccl":
        # gloo raises in the caller when a peer is gone past `timeout`; NCCL's collectives
        # run on a stream and would wait forever. Blocking wait makes NCCL raise in the
        # caller too, and async error handling aborts the communicator (a user's own
        # setting of either wins). Only a GPU run shows it: `tests/test_gpu.py`.
        os.environ.setdefault("TORCH_NCCL_BLOCKING_WAIT", "1")
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    timeout = timedelta(seconds=timeout_s)
    rendezvous = timedelta(seconds=timeout_s if rendezvous_s is None else rendezvous_s)
    if store is None:
        host, port = address.removeprefix("tcp://").rsplit(":", 1)
        store = dist.TCPStore(host, int(port), world_size, is_master=rank == 0, timeout=rendezvous)
    store.set(f"rlfabric/arrived/{rank}", "1")
    store.wait([f"rlfabric/arrived/{r}" for r in range(world_size)], rendezvous)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)


def leave_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
