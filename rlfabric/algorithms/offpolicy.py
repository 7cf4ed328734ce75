"""What the off-policy actor-critics (SAC, TD3) share.

Both learn from replay batches (ARCHITECTURE.md, "Batch"): `obs [B, ...]`,
`action [B, A]` in the env's units, `reward [B]`, `next_obs [B, ...]` and
`discount [B]`, with n-step folding done by `runtime.replay.ReplayBuffer`, so
`discount` is already gamma^m (m the fold length) or 0 after a termination. A
target is therefore `reward + discount * bootstrap`; gamma is never applied
again here.

Defaults follow the papers and CleanRL's `td3_continuous_action.py` /
`sac_continuous_action.py`: Adam lr 3e-4, batch 256, tau 0.005, two hidden
layers of 256 ReLU units, one update per agent step, and 5,000 random
warm-up steps (CleanRL SAC's `learning_starts`; the TD3 paper, Section 6.1,
used 1,000 to 10,000; its later code and CleanRL's TD3 use 25,000, which
`algo.warmup_steps` restores for long MuJoCo runs). The networks have their
own `hidden` field rather than the spec's `model.hidden` (whose [64, 64]
default suits the on-policy MLPs) so that the off-policy defaults are the
references'; of `model`, only `precision` ('bf16': the networks' matmuls run in
bfloat16, see `offpolicy_networks`), `normalize_obs` / `obs_clip` and, for SAC's
gSDE, `sde` / `sde_sample_freq` / `log_std_init` are read.
Layers keep PyTorch's default init, as in the references. The twin critics are
one module, `self.critic`, giving Q values `[2, B]`, evaluated as one batched
ensemble unless `ensemble_critics` is off.

Observation normalization (`model.normalize_obs`) follows SB3's VecNormalize with
an off-policy algorithm: the replay buffer stores raw observations, and every batch
is normalized when sampled, with the statistics of that moment, so all networks
(actor, critics, targets) see normalized observations in `update`, and `act` and the
exported policy normalize first. The statistics are updated from each sampled batch
(SB3 updates them from each new env step): a uniform sample estimates the moments of
what the buffer holds, which is what the critics train on, and this keeps one path
for every topology, data-parallel learners included, and for a replay buffer in its
own actor, whose adds the learner never sees.

Policies act in tanh units, [-1, 1] per dimension, and the critics see
actions in those units too (the batch's env-unit actions are mapped back), so
one network and one noise scale fit any bounded box; Fujimoto's
`max_action * noise` is the symmetric-box case of "noise scaled to the half
range".
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from fractions import Fraction
from typing import Any, ClassVar, Literal

import gymnasium as gym
import numpy as np
import torch
from pydantic import Field
from torch import Tensor, nn

from rlfabric.algorithms.base import AlgoConfig, Algorithm, SparseRole
from rlfabric.algorithms.offpolicy_networks import EnsembleQ, SeparateQ
from rlfabric.models import ModelConfig, build_obs_normalizer
from rlfabric.models.config import runs_bf16, torso_name


class OffPolicyConfig(AlgoConfig):
    """Fields SAC and TD3 share (defaults: Fujimoto et al. 2018, Haarnoja et al. 2018, CleanRL)."""

    lr: float = Field(3e-4, gt=0, description="Adam learning rate of every network")
    lr_schedule: Literal["constant", "linear"] = Field(
        "constant",
        description="'linear' anneals lr to 0 over the run's env-frame budget "
        "(run.stop.env_frames, 5M when run.stop names nothing; constant without one)",
    )
    batch_size: int = Field(256, ge=1, description="transitions per learner batch")
    tau: float = Field(0.005, gt=0, le=1, description="soft target update rate (polyak)")
    hidden: list[int] = Field(
        [256, 256], description="hidden sizes of the actor and critic ReLU MLPs (not model.hidden)"
    )
    buffer_capacity: int = Field(1_000_000, ge=1, description="replay capacity in transitions")
    warmup_steps: int = Field(
        5_000, ge=0, description="agent steps of uniform random actions before learning starts"
    )
    updates_per_step: float = Field(
        1.0, gt=0, description="learner updates per agent step (update-to-data ratio)"
    )
    n_step: int = Field(1, ge=1, description="n of the n-step target once n_step_after is reached")
    n_step_after: int = Field(
        0,
        ge=0,
        description="updates with 1-step targets before n_step applies (RLx2: n_step 3 after 300k)",
    )
    unroll_length: int = Field(
        8,
        ge=1,
        description="agent steps per chunk of transitions an env group sends to the buffer "
        "(transport only: the update-to-data ratio holds within one chunk)",
    )
    dynamic_buffer: bool = Field(
        False,
        description="RLx2's dynamic capacity: drop the oldest 10% while the policy has moved "
        "away from the buffer's oldest actions (buffer_capacity is then the maximum)",
    )
    buffer_min_capacity: int | None = Field(
        None,
        ge=1,
        description="dynamic buffer's floor; null: RLx2's (TD3 100k, SAC 200k)",
    )
    buffer_check_every: int = Field(
        10_000, ge=1, description="stored transitions between dynamic-capacity checks (RLx2)"
    )
    buffer_threshold: float = Field(
        0.2, gt=0, description="policy distance above which the dynamic buffer shrinks (RLx2)"
    )
    ensemble_critics: bool = Field(
        True,
        description="evaluate the twin critics as one batched ensemble (one matmul per layer); "
        "false: two separate networks in a row, as the references (same math, slower)",
    )


@torch.no_grad()
def polyak(target: nn.Module, source: nn.Module, tau: float) -> None:
    """Soft target update, theta' <- tau * theta + (1 - tau) * theta' (TD3 Alg. 1, SAC Alg. 1),
    as one multi-tensor op over all parameters."""
    torch._foreach_lerp_(list(target.parameters()), list(source.parameters()), tau)


@contextmanager
def frozen(module: nn.Module) -> Iterator[None]:
    """`module`'s parameters out of autograd while a graph is built through it.

    The actor's loss needs dQ/da through the critic, not the critic's weight gradients,
    which the critic's next `zero_grad` would discard: leaving them out of the graph saves
    a third of the critic's backward pass in every actor step.
    """
    module.requires_grad_(False)
    try:
        yield
    finally:
        module.requires_grad_(True)


class OffPolicyAlgorithm(Algorithm):
    """Replay-batch actor-critics on bounded Box actions: spaces, rescaling, optimizers, state.

    `self.model` holds the actor and the observation normalizer (if any), so the
    inherited `get_weights`/`set_weights` move exactly what an env runner needs to
    act; `state_dict` holds every network (the normalizer too), target, optimizer,
    the update counter and (SAC) the temperature.
    Subclasses fill `self.networks` and `self.optimizers` and implement
    `act` and `update`. Sparse roles: "actor" and "critic" (both Q networks).
    """

    config_cls: ClassVar[type[OffPolicyConfig]]
    cfg: OffPolicyConfig
    data = "replay"
    action_spaces = (gym.spaces.Box,)
    sparse_roles_reason = "The critic role is both Q networks together, as in RLx2."
    intermediate_observations: ClassVar[bool] = False
    """Whether the target needs a fold's inner observations (`ReplayBuffer.sample`'s
    `intermediate`): SAC's soft n-step return adds the entropy at each of them."""

    def __init__(
        self,
        cfg: OffPolicyConfig,
        obs_space: gym.Space,
        action_space: gym.Space,
        model_cfg: ModelConfig,
        device: str = "cpu",
    ) -> None:
        super().__init__(cfg, obs_space, action_space, model_cfg, device)
        self.check_spaces(obs_space, action_space)
        self.check_model(model_cfg)
        self.obs_dim = int(np.prod(obs_space.shape))
        self.action_dim = int(action_space.shape[0])
        # Copies: a space that came through Ray holds read-only arrays, and torch warns
        # when it wraps one (IMPALA's runners build their acting copy from such a space).
        low = torch.tensor(action_space.low, dtype=torch.float32, device=self.device)
        high = torch.tensor(action_space.high, dtype=torch.float32, device=self.device)
        self.action_scale = (high - low) / 2
        self.action_bias = (high + low) / 2
        self.updates = 0
        norm = build_obs_normalizer(obs_space, model_cfg)
        self.obs_norm = None if norm is None else norm.to(self.device)
        self.networks: dict[str, nn.Module] = {}
        self.optimizers: dict[str, torch.optim.Optimizer] = {}

    @classmethod
    def check_model(cls, model_cfg: ModelConfig) -> None:
        check_offpolicy_torso(cls.config_cls.model_fields["name"].default, model_cfg)
        if model_cfg.sde:
            name = cls.config_cls.model_fields["name"].default
            raise ValueError(
                f"model.sde=true (gSDE) is for the on-policy actor-critics and SAC; '{name}' "
                "explores with its algo.exploration settings (allowed: model.sde=false)"
            )

    @classmethod
    def check_spaces(cls, obs_space: gym.Space, action_space: gym.Space) -> None:
        """Continuous control only: a 1-D Box with finite bounds and low < high in every
        dimension (tanh squashing maps [-1, 1] onto the bounds, and `from_env` divides by
        the half range, which is 0 where low == high)."""
        super().check_spaces(obs_space, action_space)
        name = cls.config_cls.model_fields["name"].default
        if not isinstance(obs_space, gym.spaces.Box):
            raise ValueError(
                f"algorithm '{name}' takes Box observations (its networks are MLPs on the "
                f"flat observation), got {obs_space}; allowed: Box (a wrapper in env.wrappers "
                "can map the observations to one)"
            )
        if len(action_space.shape) != 1 or not (
            np.all(np.isfinite(action_space.low)) and np.all(np.isfinite(action_space.high))
        ):
            raise ValueError(
                f"algorithm '{name}' needs a 1-D Box action space with finite bounds, "
                f"got {action_space}"
            )
        empty = np.flatnonzero(action_space.low >= action_space.high)
        if len(empty):
            bounds = ", ".join(
                f"dimension {i}: low={action_space.low[i]}, high={action_space.high[i]}"
                for i in empty
            )
            raise ValueError(
                f"algorithm '{name}' scales actions by the half range (high - low) / 2, so it "
                f"needs low < high in every action dimension; {bounds}"
            )

    @property
    def n_step(self) -> int:
        """The n to sample with now: 1 until `n_step_after` updates (RLx2's delayed multi-step)."""
        return self.cfg.n_step if self.updates >= self.cfg.n_step_after else 1

    def to_env(self, action: Tensor) -> Tensor:
        """Tanh units [-1, 1] to the Box bounds."""
        return action * self.action_scale + self.action_bias

    def greedy_policy(self) -> nn.Module:
        return _GreedyActor(
            self.deterministic_actor(), self.obs_norm, self.action_scale, self.action_bias
        )

    def deterministic_actor(self) -> nn.Module:
        """obs -> the deterministic action in tanh units (TD3's mu, SAC's tanh(mean))."""
        raise NotImplementedError

    def from_env(self, action: Tensor) -> Tensor:
        """Box bounds to tanh units [-1, 1]."""
        return (action - self.action_bias) / self.action_scale

    def normalize(self, obs: Tensor) -> Tensor:
        """Observations as the networks take them: float, normalized if `model.normalize_obs`."""
        return obs.float() if self.obs_norm is None else self.obs_norm(obs)

    def batch_tensors(self, batch: dict[str, np.ndarray]) -> dict[str, Tensor]:
        """A replay batch as float tensors on the device, actions in tanh units, and the
        observations normalized once they have updated the running statistics."""
        t = {k: torch.as_tensor(v, device=self.device) for k, v in batch.items()}
        self.update_obs_stats(t["obs"])
        t["obs"], t["next_obs"] = self.normalize(t["obs"]), self.normalize(t["next_obs"])
        if "mid_obs" in t:
            t["mid_obs"] = self.normalize(t["mid_obs"])
            t["mid_discount"] = t["mid_discount"].float()
        t["action"] = self.from_env(t["action"].float())
        t["reward"], t["discount"] = t["reward"].float(), t["discount"].float()
        return t

    @property
    def bf16(self) -> bool:
        """Whether the networks' matmuls run under bfloat16 autocast (`model.precision`)."""
        return runs_bf16(self.model_cfg.precision, self.device)

    def build_networks(self, actor: nn.Module, actor_target: bool = False) -> None:
        """The actor (a target copy of it too, for TD3), the twin critics Q1, Q2 as one
        module with its target (the clipped double Q of TD3, which SAC shares), and the
        actor's and critics' Adam.

        Fills `model` (the actor and the observation normalizer: what env runners need),
        `networks` (with the normalizer, for checkpoints) and `optimizers`.
        """
        critic_cls = EnsembleQ if self.cfg.ensemble_critics else SeparateQ
        self.actor = actor.to(self.device)
        self.model = nn.ModuleDict({"actor": self.actor})
        self.critic = critic_cls(
            self.obs_dim, self.action_dim, self.cfg.hidden, members=2, bf16=self.bf16
        ).to(self.device)
        self.critic_target = copy.deepcopy(self.critic)
        self.networks = {
            "actor": self.actor,
            "critic": self.critic,
            "critic_target": self.critic_target,
        }
        if actor_target:
            self.networks["actor_target"] = copy.deepcopy(self.actor)
        if self.obs_norm is not None:
            self.model["obs_norm"] = self.networks["obs_norm"] = self.obs_norm
        self.optimizers = {
            "actor": self.make_optimizer(self.actor),
            "critic": self.make_optimizer(self.critic),
        }
        self.optimizer = self.optimizers["actor"]

    def make_optimizer(self, *modules: nn.Module) -> torch.optim.Adam:
        """Adam over the modules' parameters (`fused`: one kernel per step, not one per
        parameter and moment; the same update)."""
        params = [p for m in modules for p in m.parameters()]
        return torch.optim.Adam(params, lr=self.cfg.lr, fused=True)

    def gradient_step(self, optimizer: torch.optim.Optimizer, loss: Tensor) -> None:
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer_step(optimizer)

    def sample_inputs(self, *, action: bool) -> tuple[Tensor, ...]:
        """A zero observation (and action) batch of one, for counting FLOPs."""
        obs = torch.zeros((1, *self.obs_space.shape), device=self.device)
        if not action:
            return (obs,)
        return obs, torch.zeros((1, self.action_dim), device=self.device)

    def sparse_roles(self) -> dict[str, SparseRole]:
        """The actor with its optimizer; the critic: Q1 and Q2 (one module, one ERK over
        both members, as RLx2) with their optimizer and target."""
        return {
            "actor": SparseRole(
                self.actor,
                self.optimizers["actor"],
                lambda: self.sample_inputs(action=False),
                targets=tuple(n for k, n in self.networks.items() if k == "actor_target"),
                steps_per_update=self.actor_steps_per_update(),
            ),
            "critic": SparseRole(
                self.critic,
                self.optimizers["critic"],
                lambda: self.sample_inputs(action=True),
                targets=(self.critic_target,),
            ),
        }

    def actor_steps_per_update(self) -> Fraction:
        """Actor optimizer steps per `update()` (TD3 delays the actor)."""
        return Fraction(1)

    def expected_updates(self, agent_steps: int) -> int:
        """`update()` calls in `agent_steps`: `updates_per_step` per step after the warm-up."""
        return int(max(0, agent_steps - self.cfg.warmup_steps) * self.cfg.updates_per_step)

    def set_lr(self, lr: float) -> None:
        """Actor, critic and (SAC) temperature optimizers all take the one `algo.lr`."""
        for optimizer in self.optimizers.values():
            for group in optimizer.param_groups:
                group["lr"] = lr

    def state_dict(self) -> dict[str, Any]:
        """Tensors, ints and floats only, so that `torch.load(weights_only=True)` reads it."""
        return {
            "networks": {k: m.state_dict() for k, m in self.networks.items()},
            "optimizers": {k: o.state_dict() for k, o in self.optimizers.items()},
            "updates": self.updates,
            "sparse": self.sparse_state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.check_sparse_state(state)
        saved = state["networks"]
        self.check_obs_norm_state("obs_norm" in saved)
        if "critic" not in saved:
            raise ValueError(
                f"checkpoint holds networks {sorted(saved)}: the separate q1/q2 critics of "
                "rlfabric before the critics became one module; this version cannot resume it"
            )
        if set(saved["critic"]) != set(self.critic.state_dict()):
            raise ValueError(
                "checkpoint's twin critics are laid out differently from this run's "
                f"(algo.ensemble_critics={self.cfg.ensemble_critics}); resume with the "
                "algo.ensemble_critics it was trained with"
            )
        for key, module in self.networks.items():
            module.load_state_dict(state["networks"][key])
        for key, optimizer in self.optimizers.items():
            optimizer.load_state_dict(state["optimizers"][key])
        self.set_lr(self.cfg.lr)  # the spec's lr, not the saved one (as the base class)
        self.updates = int(state["updates"])
        self.load_sparse_state(state)


def check_offpolicy_torso(name: str, model_cfg: ModelConfig) -> None:
    """SAC and TD3 build MLPs on the flat observation (`offpolicy_networks`): refuse a
    `model.torso` they would not build, rather than train something else."""
    if model_cfg.torso not in ("auto", "mlp"):
        raise ValueError(
            f"algorithm '{name}' builds MLP actors and critics on the flat observation; "
            f"model.torso={torso_name(model_cfg.torso)!r} is "
            "for the on-policy algorithms for now (allowed: 'auto' or 'mlp')"
        )


class _GreedyActor(nn.Module):
    """obs -> the deterministic action in the env's units (tanh units rescaled to the box),
    the observation normalized first if the algorithm normalizes."""

    def __init__(
        self, actor: nn.Module, obs_norm: nn.Module | None, scale: Tensor, bias: Tensor
    ) -> None:
        super().__init__()
        self.actor = actor
        self.obs_norm = obs_norm
        self.register_buffer("scale", scale.clone())
        self.register_buffer("bias", bias.clone())

    def forward(self, obs: Tensor) -> Tensor:
        if self.obs_norm is not None:
            obs = self.obs_norm(obs)
        return self.actor(obs) * self.scale + self.bias
