"""The Algorithm contract every architecture calls (see ARCHITECTURE.md).

An algorithm is pure torch: it owns its networks and optimizer, turns
observations into actions (`act`) and batches into updates (`update`), and
never knows which process it runs in.

Sparse training (RLx2, arXiv 2205.15043) wraps any algorithm the same way:
each algorithm names its `sparse_roles` (the actor, the critic), `sparsify`
puts a `SparseTrainer` on each role the spec makes sparse, and every optimizer
step and target update of every algorithm goes through `optimizer_step` and
`after_target_update`, which are plain `optimizer.step()` and nothing for a
dense network.
"""

from __future__ import annotations

import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, ClassVar, Literal, Protocol

import gymnasium as gym
import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor, nn

from rlfabric.models import ModelConfig, ObsNormalizer
from rlfabric.observations import obs_map
from rlfabric.sparse import SparseConfig, SparseTrainer, forward_flops, training_flops

DataKind = Literal["trajectory", "replay"]

#: torch's warning when it wraps a read-only numpy array, as Ray's object store hands
#: them out; harmless where the array is only read or copied.
NOT_WRITABLE_WARNING = "The given NumPy array is not writable"


class AlgoConfig(BaseModel):
    """Fields every algorithm has; each algorithm subclasses this with its own."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(description="registered algorithm name")
    lr: float = Field(6e-4, gt=0, description="learning rate")
    lr_schedule: Literal["constant", "linear"] = Field(
        "linear",
        description="'linear' anneals lr to 0 over the run's env-frame budget "
        "(run.stop.env_frames, 5M when run.stop names nothing; constant without one)",
    )
    gamma: float = Field(0.99, ge=0, le=1, description="discount factor")

    def return_discount(self) -> float | None:
        """The discount of the running return unrolls carry for reward normalization
        (`runtime.unrolls.UnrollAssembler`), or None when no return is wanted."""
        return None


class TrajectoryConfig(AlgoConfig):
    """On-policy algorithms learn from batches of `batch_size` unrolls of `unroll_length`."""

    unroll_length: int = Field(20, ge=1, description="agent steps per unroll (T)")
    batch_size: int = Field(32, ge=1, description="unrolls per learner batch (B)")


@dataclass(frozen=True)
class SparseRole:
    """A network sparse training can wrap, and what its training touches.

    RLx2 sparsifies the actor and the critic separately, each with its own
    sparsity, optimizer and (for off-policy algorithms) target networks.
    """

    module: nn.Module
    """The network; ERK spreads the role's sparsity over all its Linear/Conv layers."""
    optimizer: torch.optim.Optimizer
    """The optimizer that steps `module` (through `Algorithm.optimizer_step`)."""
    sample_inputs: Callable[[], tuple[Tensor, ...]]
    """A batch of one for `module(*inputs)`: what FLOPs are counted on."""
    targets: tuple[nn.Module, ...] = ()
    """Same-structured target networks, re-masked after every soft update."""
    steps_per_update: Fraction = Fraction(1)
    """Optimizer steps of `module` per `update()` (TD3's actor: 1 / policy_freq)."""


class GradientSync(Protocol):
    """How data-parallel learners combine what each computed on its shard (set by the
    learner group; `platform.distributed.GradientAllReduce`)."""

    def __call__(self, optimizer: torch.optim.Optimizer) -> None:
        """Reduce the gradients of `optimizer`'s parameters over the group, in place."""

    def reduce(self, tensors: list[Tensor]) -> None:
        """Reduce any tensors over the group, in place (e.g. RigL's grow scores)."""

    def sum(self, tensors: list[Tensor]) -> None:
        """Sum tensors over the group, in place, whatever the loss reduction (batch moments)."""


class Algorithm(ABC):
    """Base class: registry metadata, weights and checkpoint plumbing.

    Subclasses set `config_cls`, `data` and `action_spaces` (the single-env
    action space types they can act in), and implement `act` and `update`.
    """

    config_cls: ClassVar[type[AlgoConfig]]
    data: ClassVar[DataKind]
    action_spaces: ClassVar[tuple[type[gym.Space], ...]]
    sparse_roles_reason: ClassVar[str] = ""
    """Why `sparse_roles` are what they are; `sparsify` quotes it when a role is missing."""

    def __init__(
        self,
        cfg: AlgoConfig,
        obs_space: gym.Space,
        action_space: gym.Space,
        model_cfg: ModelConfig,
        device: str = "cpu",
    ) -> None:
        self.cfg = cfg
        self.obs_space = obs_space
        self.action_space = action_space
        self.model_cfg = model_cfg
        self.device = torch.device(device)
        self.model: torch.nn.Module
        self.optimizer: torch.optim.Optimizer
        self.grad_sync: GradientSync | None = None
        """Data-parallel learners: reduces the gradients over the group before each step."""
        self.obs_norm: ObsNormalizer | None = None
        """The running observation statistics (`model.normalize_obs`), set by subclasses."""
        self.nonfinite_steps = 0
        """Optimizer steps skipped because a gradient was NaN or inf."""
        self.sparse_trainers: dict[str, SparseTrainer] = {}
        """One trainer per role that trains sparse, set by `sparsify`."""
        self._roles: dict[str, SparseRole] | None = None
        self._forward_flops: dict[str, tuple[int, int]] = {}  # role -> (dense, sparse)

    @classmethod
    def check_spaces(cls, obs_space: gym.Space, action_space: gym.Space) -> None:
        """Raise ValueError naming the space and what is allowed if it cannot act there."""
        if not isinstance(action_space, cls.action_spaces):
            allowed = ", ".join(t.__name__ for t in cls.action_spaces)
            raise ValueError(
                f"algorithm '{cls.config_cls.model_fields['name'].default}' cannot act in "
                f"action space {action_space}; allowed: {allowed}"
            )

    @classmethod  # noqa: B027 (an optional hook)
    def check_model(cls, model_cfg: ModelConfig) -> None:
        """Raise ValueError naming a `model` field this algorithm cannot honour."""

    @abstractmethod
    def act(
        self,
        obs: np.ndarray,
        state: np.ndarray | None = None,
        first: np.ndarray | None = None,
        deterministic: bool = False,
    ) -> tuple[np.ndarray, dict[str, np.ndarray], np.ndarray | None]:
        """Policy step on a batch of observations `[N, ...]`.

        `state` is the recurrent state `[N, ...]` each env's previous step left
        (None without a recurrent core); `first` `[N]` marks observations that
        start an episode, where the state is reset. Returns the actions
        `[N, ...]`, the extras the learner needs later (e.g. behaviour
        log-probs) and the next recurrent state.
        """

    def initial_state(self, num_envs: int) -> np.ndarray | None:
        """The recurrent state of fresh envs, or None if the policy has no memory."""
        return None

    def acting_state(self, num_envs: int) -> np.ndarray | None:
        """What sampling carries per env besides the policy's memory (e.g. TD3's
        Ornstein-Uhlenbeck noise): the state the architectures keep for each env and pass
        to `act`. The greedy policy (evaluation, export) keeps only `initial_state`."""
        return self.initial_state(num_envs)

    @abstractmethod
    def update(self, batch: dict[str, np.ndarray]) -> dict[str, float]:
        """One learning step on a batch (see ARCHITECTURE.md's Batch contract)."""

    @property
    def loss_reduction(self) -> Literal["sum", "mean"]:
        """Whether the losses sum or average over the batch (how shards' gradients combine)."""
        return "mean"

    def greedy_policy(self) -> nn.Module:
        """A standalone torch module of the deterministic policy, for export.

        `forward(obs)` -> action for a batch of observations as the env produces
        them (any scaling, e.g. Atari's /255, is inside); a recurrent policy takes
        `forward(obs, state, first)` and returns `(action, next_state)`.
        """
        raise NotImplementedError(f"{type(self).__name__} cannot export its policy")

    def expected_updates(self, agent_steps: int) -> int:
        """How many times a run of `agent_steps` agent steps calls `update()`."""
        raise NotImplementedError(f"{type(self).__name__} does not say how many updates it makes")

    def set_progress(self, env_frames: int, fraction: float | None) -> None:
        """Tell the algorithm how far the run is: its env frames, and the fraction (0..1)
        of its frame budget they are (None: the run has no frame budget), for schedules."""
        if fraction is None:
            return
        scale = max(0.0, 1.0 - fraction) if self.cfg.lr_schedule == "linear" else 1.0
        self.set_lr(self.cfg.lr * scale)

    def set_lr(self, lr: float) -> None:
        """Every optimizer's learning rate (the off-policy algorithms have several)."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def update_obs_stats(self, obs: Tensor) -> None:
        """Merge a training batch's observations into the running statistics, if any.

        Every `update` calls it first, so there is one set of statistics, the learner's,
        merged from every runner's data, which acting copies receive with the weights.
        Data-parallel learners each see a shard: the shards' moments are summed over the
        group, so every learner merges the whole batch and their statistics stay equal.
        """
        if self.obs_norm is not None:
            self.obs_norm.update(obs, None if self.grad_sync is None else self.grad_sync.sum)

    def check_obs_norm_state(self, saved: bool) -> None:
        """Refuse a checkpoint whose `model.normalize_obs` differs from this run's."""
        ours = self.obs_norm is not None
        if saved != ours:
            raise ValueError(
                f"checkpoint was trained with model.normalize_obs={str(saved).lower()}, this "
                f"run has model.normalize_obs={str(ours).lower()}. Resume with the model "
                "section it was trained with"
            )

    def get_weights(self) -> dict[str, np.ndarray]:
        """The model's weights as numpy copies: never views of the live tensors, which a
        CPU model's `.numpy()` would give. Callers hand them to Ray, which serializes a
        method's return after it (and any lock it held) has returned, so a view could
        carry weights stepped or synced in between under the version read before."""
        return {
            k: v.detach().to("cpu", copy=True).numpy() for k, v in self.model.state_dict().items()
        }

    def set_weights(self, weights: dict[str, np.ndarray]) -> None:
        """Copy `weights` into the model.

        They often arrive read-only from Ray's object store (an IMPALA runner's
        broadcast, the driver's periodic evaluation); `load_state_dict` copies them,
        so torch's warning that the arrays are not writable is moot, and wrapping
        them without a copy keeps a weight update to one copy.
        """
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=NOT_WRITABLE_WARNING)
            self.model.load_state_dict({k: torch.as_tensor(v) for k, v in weights.items()})

    def state_dict(self) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "sparse": self.sparse_state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.check_sparse_state(state)
        self.check_obs_norm_state(any(k.startswith("obs_norm.") for k in state["model"]))
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        # The spec's lr, not the saved one: a run resumed with another algo.lr (a PBT
        # exploit, an override) trains with it; `set_progress` applies the schedule.
        self.set_lr(self.cfg.lr)
        self.load_sparse_state(state)

    # -- sparse training (RLx2) ---------------------------------------------

    def sparse_roles(self) -> dict[str, SparseRole]:
        """The networks sparse training can wrap, by role ("actor", "critic")."""
        return {}

    def sparsify(self, cfg: SparseConfig, total_updates: int | None, seed: int) -> None:
        """Train each role whose sparsity in `cfg` is above 0 sparse, from now on.

        `total_updates` is the run's expected number of `update()` calls (see
        `expected_updates`), the topology's end when `cfg.t_end` is null, as RLx2's
        `T_end = max_timesteps - start_timesteps`. A role counts `t_end` in its own
        optimizer steps: updates times `steps_per_update` (RLx2 `TD3.py` gives the actor
        `T_end / policy_freq`), and so does `delta`. Call once, after the networks are on
        their device and before training; the targets, deep-copied from the dense
        init, are masked here too.
        """
        if self.sparse_trainers:
            raise RuntimeError("sparsify was already called on this algorithm")
        roles = self._sparse_roles()
        wanted = {name: s for name, s in (("actor", cfg.actor), ("critic", cfg.critic)) if s > 0}
        for name, sparsity in wanted.items():
            if name not in roles:
                raise ValueError(
                    f"sparse.{name}={sparsity}: algorithm '{self.cfg.name}' has no {name} "
                    f"network to sparsify; its roles: {', '.join(roles) or 'none'}. "
                    f"{self.sparse_roles_reason}".strip()
                )
        if not wanted:
            return
        updates = cfg.t_end if cfg.t_end is not None else total_updates
        if updates is None:
            raise ValueError(
                "sparse.t_end is needed: the run has no env-frame budget (run.stop.env_frames) "
                "to count the learner updates after which the topology freezes"
            )
        for index, (name, role) in enumerate(roles.items()):
            if name not in wanted:
                continue
            self.sparse_trainers[name] = SparseTrainer(
                role.module,
                role.optimizer,
                wanted[name],
                t_end=max(1, int(updates * role.steps_per_update)),
                distribution=cfg.distribution,
                method=cfg.method,
                delta=cfg.delta,
                zeta=cfg.zeta,
                seed=seed + index,
            )
        self._forward_flops.clear()
        self.after_target_update()

    def optimizer_step(
        self, optimizer: torch.optim.Optimizer, max_norm: float | None = None
    ) -> Tensor:
        """Every optimizer step of every algorithm: sync, check, clip, step.

        In order: the gradients are reduced over data-parallel learners
        (`grad_sync`), so that what follows sees the whole batch's gradient (a
        sparse role's RigL grow scores too, right before its topology update); a
        step whose gradient is not finite (a NaN or inf loss) is skipped and
        counted in `nonfinite_steps`, so one bad batch cannot poison the weights;
        the global norm is clipped to `max_norm` if given; then `optimizer.step()`,
        or the sparse trainer's step for a sparse role (which does a topology
        update instead on its update steps, as RLx2's `DST_Scheduler.__call__`).
        Returns the gradient's global norm before clipping.
        """
        if self.grad_sync is not None:
            self.grad_sync(optimizer)
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
        if not bool(torch.isfinite(norm)):
            optimizer.zero_grad(set_to_none=True)
            self.nonfinite_steps += 1
            return norm
        if max_norm is not None:
            torch.nn.utils.clip_grads_with_norm_(grads, max_norm, norm)
        for name, trainer in self.sparse_trainers.items():
            if trainer.optimizer is optimizer:
                if self.grad_sync is not None:  # every learner grows by the whole batch's
                    self.grad_sync.reduce(trainer.grow_scores())
                if not trainer.step():  # a topology update: the FLOP counts are stale
                    self._forward_flops.pop(name, None)
                return norm
        optimizer.step()
        return norm

    def after_target_update(self) -> None:
        """Re-mask every sparse role's targets: a soft update of masked weights would
        keep stale values where the online network dropped connections (RLx2 `TD3.py`)."""
        roles = self._sparse_roles()
        for name, trainer in self.sparse_trainers.items():
            for target in roles[name].targets:
                trainer.mask_target(target)

    def sparse_metrics(self) -> dict[str, float]:
        """Parameters, sparsity and FLOP fractions (sparse / dense) of every role.

        Dense roles report too (sparsity 0, fractions 1) so that runs compare. FLOPs are
        RigL's theoretical count (`rlfabric.sparse.flops`); training FLOPs span the role's
        whole schedule (its `t_end`, or the steps taken if more). The overall
        `train_flops_fraction` weighs roles by steps per update; `inference_flops_fraction`
        is the actor's, the network that acts (RLx2 reports the same split).
        """
        out: dict[str, float] = {}
        train_dense = train_sparse = 0.0
        for name, role in self._sparse_roles().items():
            trainer = self.sparse_trainers.get(name)
            dense, sparse = self._role_forward_flops(name, role)
            out[f"params_{name}"] = float(
                sum(int(torch.count_nonzero(p)) for p in role.module.parameters())
            )
            out[f"sparsity_{name}"] = 0.0
            per_step_dense, per_step_sparse = 3.0 * dense, 3.0 * sparse
            if trainer is not None:
                out[f"sparsity_{name}"] = trainer.overall_sparsity
                steps = max(trainer.t_end, trainer.step_count)
                total = training_flops(
                    dense, sparse, trainer.method, steps, trainer.delta, trainer.t_end
                )
                per_step_sparse = total / steps
            out[f"inference_flops_fraction_{name}"] = sparse / dense
            out[f"train_flops_fraction_{name}"] = per_step_sparse / per_step_dense
            train_dense += float(role.steps_per_update) * per_step_dense
            train_sparse += float(role.steps_per_update) * per_step_sparse
        if train_dense:
            out["train_flops_fraction"] = train_sparse / train_dense
        if "inference_flops_fraction_actor" in out:
            out["inference_flops_fraction"] = out["inference_flops_fraction_actor"]
        return out

    def sparse_state_dict(self) -> dict[str, Any]:
        """Each sparse role's masks, step count and RNG; empty for a dense algorithm."""
        return {name: trainer.state_dict() for name, trainer in self.sparse_trainers.items()}

    def check_sparse_state(self, state: dict[str, Any]) -> None:
        """Refuse a checkpoint whose sparse roles or sparsities differ from this run's."""
        saved = state.get("sparse", {})

        def named(roles: Any) -> str:
            return ", ".join(sorted(roles)) or "none (dense)"

        if set(saved) != set(self.sparse_trainers):
            raise ValueError(
                f"checkpoint has sparse roles: {named(saved)}; this run: "
                f"{named(self.sparse_trainers)}. Resume with the sparse section it was trained with"
            )
        for name, trainer in self.sparse_trainers.items():
            masks = saved[name]["masks"]
            kept = sum(int(m.sum()) for m in masks.values())
            expected = sum(int(m.sum()) for m in trainer.masks.values())
            if kept != expected:
                raise ValueError(
                    f"checkpoint's {name} keeps {kept} weights, this run's sparse.{name} "
                    f"{expected}. Resume with the sparse section it was trained with"
                )

    def load_sparse_state(self, state: dict[str, Any]) -> None:
        """After the weights are loaded (and `check_sparse_state`): masks, weights, targets."""
        for name, trainer in self.sparse_trainers.items():
            trainer.load_state_dict(state["sparse"][name])
        self._forward_flops.clear()
        self.after_target_update()

    def _sparse_roles(self) -> dict[str, SparseRole]:
        """`sparse_roles()`, built once: wrappers stay the same objects."""
        if self._roles is None:
            self._roles = self.sparse_roles()
        return self._roles

    def _role_forward_flops(self, name: str, role: SparseRole) -> tuple[int, int]:
        """Dense and sparse forward FLOPs per sample, cached until the topology changes."""
        if name not in self._forward_flops:
            trainer = self.sparse_trainers.get(name)
            flops = forward_flops(
                role.module, *role.sample_inputs(), masks=trainer.masks if trainer else None
            )
            self._forward_flops[name] = (flops.dense, flops.sparse)
        return self._forward_flops[name]


def to_tensors(batch: dict[str, np.ndarray], device: torch.device) -> dict[str, torch.Tensor]:
    """Numpy batch to torch: without copying on the CPU; to a GPU through pinned memory,
    each copy queued on the stream without waiting (a pageable copy blocks the host)."""
    if device.type != "cuda":
        return {
            k: obs_map(lambda x: torch.as_tensor(x, device=device), v) for k, v in batch.items()
        }

    def pinned(x: np.ndarray) -> torch.Tensor:
        return torch.as_tensor(x).pin_memory().to(device, non_blocking=True)

    return {k: obs_map(pinned, v) for k, v in batch.items()}
