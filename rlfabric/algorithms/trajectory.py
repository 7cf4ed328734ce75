"""What the on-policy actor-critics (V-trace, A3C, PPO) share.

All three learn from time-major unrolls (ARCHITECTURE.md, "Batch") with the
same `ActorCritic` network, so the plumbing around their losses lives here:
the optimizer built from config fields, the policy step, the forward pass over
an unroll, the per-step `valid` mask, clipped rewards and discounts, and the
clipped gradient step. Each algorithm file keeps only its own targets and loss.

Time alignment (deepmind/scalable_agent): `obs[t]` is what `action[t]` was
taken in; `reward[t]`, `terminated[t]` and `truncated[t]` are what followed it;
`obs[T]` only bootstraps. Step t is gymnasium's NEXT_STEP autoreset step (the
action only reset the env) exactly when `is_first[t+1]`; it is masked out of
every loss term. gamma_t = gamma * (1 - terminated_t) * valid_t, so a
truncated episode bootstraps from V(obs[t+1]), its final observation.
"""

from __future__ import annotations

from fractions import Fraction
from typing import Any, ClassVar, Literal, NamedTuple

import gymnasium as gym
import numpy as np
import torch
from pydantic import Field, model_validator
from torch import Tensor

from rlfabric.algorithms.base import Algorithm, SparseRole, TrajectoryConfig, to_tensors
from rlfabric.algorithms.optim import RMSpropTF
from rlfabric.models import ActorCritic, ModelConfig, RewardScaler
from rlfabric.models.networks import SDEGaussianHead, advance_held_noise
from rlfabric.observations import batch_len, obs_map, sample_batch


class ActorCriticConfig(TrajectoryConfig):
    """Optimizer and reward fields every trajectory actor-critic has.

    The defaults here are CleanRL's `ppo.py` (Adam, eps 1e-5); each algorithm
    redeclares the fields its reference sets differently, with the source.
    """

    optimizer: Literal["rmsprop", "rmsprop_tf", "adam"] = Field(
        "adam",
        description="optimizer; rmsprop: torch's RMSprop (eps outside the square root, mean "
        "square from 0); rmsprop_tf: TF1's, as IMPALA and GA3C ran it (eps inside, from 1)",
    )
    eps: float = Field(1e-5, gt=0, description="optimizer epsilon")
    rmsprop_decay: float = Field(0.99, gt=0, lt=1, description="RMSProp decay (alpha)")
    rmsprop_momentum: float = Field(0.0, ge=0, lt=1, description="RMSProp momentum")
    grad_clip: float | None = Field(None, gt=0, description="global grad-norm clip; null: none")
    entropy_cost: float = Field(0.01, ge=0, description="weight of the entropy bonus")
    entropy_decay_frames: int | None = Field(
        None,
        gt=0,
        description="anneal entropy_cost linearly to 0 over this many env frames, then keep "
        "it 0 (RLlib's Pong examples: over 3M agent steps, 12M frames); null: constant",
    )
    reward_clip: float | None = Field(
        None, gt=0, description="clip rewards to [-x, x] (Atari: 1); null: no clipping"
    )
    normalize_reward: bool = Field(
        False,
        description="divide rewards by the running std of the discounted return, as SB3's "
        "VecNormalize(norm_reward=True) (the RL Zoo's `normalize`): one set of statistics, "
        "the learner's, kept in checkpoints; episode returns are reported unscaled",
    )
    reward_norm_clip: float = Field(
        10.0, gt=0, description="scaled rewards are clipped to [-x, x] (VecNormalize's clip_reward)"
    )

    def return_discount(self) -> float | None:
        return self.gamma if self.normalize_reward else None

    @model_validator(mode="after")
    def _minibatches_fit(self) -> ActorCriticConfig:
        """PPO's and V-trace's `num_minibatches` (A3C has none: one step per batch)."""
        minibatches = getattr(self, "num_minibatches", 1)
        steps = self.batch_size * self.unroll_length
        if minibatches > steps:
            raise ValueError(
                f"num_minibatches={minibatches} must be <= batch_size x "
                f"unroll_length={steps}: each minibatch needs at least one step"
            )
        return self


class UnrollSteps(NamedTuple):
    """Per-step terms of a batch, all float `[T, B]`."""

    valid: Tensor
    """1 where the step is a real decision, 0 at autoreset steps."""
    rewards: Tensor
    """Rewards, clipped if the config asks."""
    discounts: Tensor
    """gamma * (1 - terminated) * valid: cut at terminations and autoreset steps only."""


class UnrollEval(NamedTuple):
    """The current network's view of an unroll."""

    logp: Tensor
    """`[T, B]` log pi(action_t | obs_t), with gradient."""
    entropy: Tensor
    """`[T, B]` H(pi(. | obs_t)), with gradient."""
    values: Tensor
    """`[T+1, B]` V(obs_t), with gradient; `values[T]` bootstraps."""


def unroll_steps(
    batch: dict[str, Tensor], gamma: float, reward_clip: float | None = None
) -> UnrollSteps:
    """`valid`, (clipped) rewards and discounts of a batch (module docstring)."""
    valid = (~batch["is_first"][1:]).float()
    rewards = batch["reward"].float()
    if reward_clip is not None:
        rewards = rewards.clamp(-reward_clip, reward_clip)
    discounts = gamma * (1.0 - batch["terminated"].float()) * valid
    return UnrollSteps(valid, rewards, discounts)


def forward(model: ActorCritic, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
    """Policy parameters `[T+1, B, P]` and values `[T+1, B]` over a batch's observations.

    A recurrent core restarts from the state the unroll's first step was acted
    on with (`state [1, B, ...]`) and resets wherever `is_first` marks an
    episode start, as the actor's did: the learner recomputes the unroll.
    """
    state = batch["state"][0] if "state" in batch else None
    return model(batch["obs"], batch["is_first"], state)


def evaluate(model: ActorCritic, batch: dict[str, Tensor]) -> UnrollEval:
    """One time-major forward pass over `obs [T+1, B, ...]` scoring `action [T, B, ...]`."""
    params, values = forward(model, batch)
    dist = model.distribution(params[:-1])
    return UnrollEval(dist.log_prob(batch["action"]), dist.entropy(), values)


def minibatch_layout(
    model: ActorCritic, batch: dict[str, Tensor], targets: dict[str, Tensor]
) -> tuple[dict[str, Tensor], int]:
    """A batch and its per-step targets laid out for minibatches, and the axis to split.

    A feed-forward model's steps are flat `[T * B, ...]` (CleanRL `ppo.py` shuffles flat
    transitions); a recurrent model keeps time-major columns (axis 1), so that its core
    sees whole unrolls from their stored first state.
    """
    if model.recurrent:
        return batch | targets, 1
    steps = {
        "obs": obs_map(lambda x: x[:-1], batch["obs"]),
        "action": batch["action"],
        "logp": batch["logp"],
    }
    return {k: obs_map(lambda x: x.flatten(0, 1), v) for k, v in (steps | targets).items()}, 0


def score_minibatch(model: ActorCritic, mb: dict[str, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    """log pi(a|x), entropy and V(x) of a minibatch's steps (`minibatch_layout`), with
    gradient: whole unrolls through the recurrent core, flat steps in one pass."""
    if model.recurrent:
        logp, entropy, values = evaluate(model, mb)
        return logp, entropy, values[:-1]
    params, values = model(obs_map(lambda x: x[None], mb["obs"]))
    dist = model.distribution(params[0])
    return dist.log_prob(mb["action"]), dist.entropy(), values[0]


class ActorCriticAlgorithm(Algorithm):
    """An `ActorCritic` network, its optimizer and the sampling policy step.

    Subclasses implement `update`; they act in Discrete (categorical head),
    MultiDiscrete (a categorical per dimension), MultiBinary (Bernoulli) and 1-D Box
    (diagonal Gaussian head) action spaces.
    """

    config_cls: ClassVar[type[ActorCriticConfig]]
    data = "trajectory"
    action_spaces = (
        gym.spaces.Discrete,
        gym.spaces.MultiDiscrete,
        gym.spaces.MultiBinary,
        gym.spaces.Box,
    )
    sparse_roles_reason = (
        "The policy and the value heads share one network and optimizer (one torso, or two "
        "with model.shared_torso=false), so the whole network is one role: sparse.actor."
    )

    def __init__(
        self,
        cfg: ActorCriticConfig,
        obs_space: gym.Space,
        action_space: gym.Space,
        model_cfg: ModelConfig,
        device: str = "cpu",
    ) -> None:
        super().__init__(cfg, obs_space, action_space, model_cfg, device)
        self.model = ActorCritic(obs_space, action_space, model_cfg).to(self.device)
        self.obs_norm = self.model.obs_norm
        self.reward_scaler = (
            RewardScaler(cfg.reward_norm_clip).to(self.device) if cfg.normalize_reward else None
        )
        """The running variance of the discounted return (`algo.normalize_reward`)."""
        params = self.model.parameters()
        if cfg.optimizer in ("rmsprop", "rmsprop_tf"):
            rmsprop = torch.optim.RMSprop if cfg.optimizer == "rmsprop" else RMSpropTF
            self.optimizer = rmsprop(
                params,
                lr=cfg.lr,
                alpha=cfg.rmsprop_decay,
                eps=cfg.eps,
                momentum=cfg.rmsprop_momentum,
            )
        else:  # fused: one kernel per step, not one per parameter and moment (same update)
            self.optimizer = torch.optim.Adam(params, lr=cfg.lr, eps=cfg.eps, fused=True)
        self.entropy_cost = cfg.entropy_cost
        """The entropy bonus's weight now: `algo.entropy_cost`, annealed by `set_progress`
        when `algo.entropy_decay_frames` is set."""

    def set_progress(self, env_frames: int, fraction: float | None) -> None:
        super().set_progress(env_frames, fraction)
        if self.cfg.entropy_decay_frames is not None:
            left = max(0.0, 1.0 - env_frames / self.cfg.entropy_decay_frames)
            self.entropy_cost = self.cfg.entropy_cost * left

    @torch.no_grad()
    def act(
        self,
        obs: np.ndarray,
        state: np.ndarray | None = None,
        first: np.ndarray | None = None,
        deterministic: bool = False,
    ) -> tuple[np.ndarray, dict[str, np.ndarray], np.ndarray | None]:
        """Sample (or take the mode); `logp` is the behaviour log-prob the learner needs.

        With `model.sde` the state is each env's held gSDE noise (`acting_state`) and
        the action is the mean plus that noise; its log-prob is under the Gaussian that
        action has over the noise, as SB3 scores it.
        """
        device = self.device
        sde = isinstance(self.model.policy, SDEGaussianHead)
        params, _, state_out = self.model.unroll(
            obs_map(lambda x: torch.as_tensor(x, device=device)[None], obs),
            None if first is None else torch.as_tensor(first, device=device)[None],
            None if state is None or sde else torch.as_tensor(state, device=device),
        )
        params = params[0]
        dist = self.model.distribution(params)
        if deterministic:
            action = self.model.mode(params)
        elif sde:
            held = self.acting_state(batch_len(obs)) if state is None else state
            action, state_out = self._explore(params, torch.as_tensor(held, device=device))
        else:
            action = dist.sample()
        logp = dist.log_prob(action)
        next_state = None if state_out is None else state_out.cpu().numpy()
        # The env's own dtype (int8 for MultiBinary, whose Bernoulli samples are floats).
        action_np = action.cpu().numpy().astype(self.action_space.dtype, copy=False)
        return action_np, {"logp": logp.cpu().numpy()}, next_state

    def acting_state(self, num_envs: int) -> np.ndarray | None:
        """With `model.sde`, each env's gSDE noise `[N, 1 + features x actions]`: the
        steps it has been held (modulo its period), then the flattened matrix. Zero steps:
        a fresh matrix is drawn at the next act."""
        head = self.model.policy
        if not isinstance(head, SDEGaussianHead):
            return self.initial_state(num_envs)
        return np.zeros((num_envs, 1 + head.in_dim * head.action_dim), np.float32)

    def _explore(self, params: Tensor, held: Tensor) -> tuple[Tensor, Tensor]:
        """gSDE actions, and the held noise after this step: an env whose matrix has been
        held `sde_sample_freq` steps (one unroll for -1) draws a fresh one first."""
        head = self.model.policy
        freq = self.model_cfg.sde_sample_freq
        freq = self.cfg.unroll_length if freq == -1 else freq
        shape = (head.in_dim, head.action_dim)
        noise, state = advance_held_noise(held, shape, freq, head.sample_exploration)
        return head.explore(params, noise), state

    def greedy_policy(self) -> torch.nn.Module:
        return _GreedyActorCritic(self.model)

    def batch_tensors(self, batch: dict[str, np.ndarray]) -> dict[str, Tensor]:
        """A trajectory batch as tensors on the device, once its observations have updated
        the running statistics (`model.normalize_obs`; the model normalizes inside).

        `obs[:T]` only: `obs[T]` bootstraps here and is the next unroll's `obs[0]`.
        With `algo.normalize_reward` the valid steps' running returns update the return
        statistics (summed over data-parallel learners, as the observations'), and the
        batch's rewards come back scaled by them.
        """
        b = to_tensors(batch, self.device)
        self.update_obs_stats(obs_map(lambda x: x[:-1], b["obs"]))
        if self.reward_scaler is not None:
            if "return" not in b:
                raise RuntimeError(
                    "algo.normalize_reward is on but the unrolls carry no `return`: their "
                    "UnrollAssembler must be built with return_gamma=algo.return_discount()"
                )
            group_sum = None if self.grad_sync is None else self.grad_sync.sum
            self.reward_scaler.update(b["return"][~b["is_first"][1:]], group_sum)
            b["reward"] = self.reward_scaler(b["reward"])
        return b

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        if self.reward_scaler is not None:
            state["reward_scaler"] = self.reward_scaler.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved, ours = "reward_scaler" in state, self.reward_scaler is not None
        if saved != ours:
            raise ValueError(
                f"checkpoint was trained with algo.normalize_reward={str(saved).lower()}, "
                f"this run has algo.normalize_reward={str(ours).lower()}. Resume with the "
                "algo section it was trained with"
            )
        super().load_state_dict(state)
        if self.reward_scaler is not None:
            self.reward_scaler.load_state_dict(state["reward_scaler"])

    def initial_state(self, num_envs: int) -> np.ndarray | None:
        if not self.model.recurrent:
            return None
        return self.model.initial_state(num_envs).cpu().numpy()

    def gradient_step(self, loss: Tensor) -> Tensor:
        """Backward, global grad-norm clip if configured, step; returns the pre-clip norm.

        A sparse network's gradients are masked during backward, so the norm and the
        clip see only its active weights; with data-parallel learners they see the
        whole batch's gradient (`Algorithm.optimizer_step`).
        """
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        return self.optimizer_step(self.optimizer, self.cfg.grad_clip)

    def optimizer_steps_per_update(self) -> int:
        """`gradient_step` calls per `update()`: one, unless the loss takes minibatches."""
        return 1

    def expected_updates(self, agent_steps: int) -> int:
        """`update()` calls in `agent_steps`: one per batch of `batch_size` unrolls.

        Unrolls also hold autoreset steps, which are no agent steps, so a run makes
        slightly more updates than this; the sparse topology then freezes just early.
        """
        return agent_steps // (self.cfg.unroll_length * self.cfg.batch_size)

    def sparse_roles(self) -> dict[str, SparseRole]:
        """One role, "actor": the whole shared network (torso, core, heads), one optimizer."""
        obs = obs_map(lambda x: x[None], sample_batch(self.obs_space, 1))
        return {
            "actor": SparseRole(
                self.model,
                self.optimizer,
                lambda: (obs_map(lambda x: torch.as_tensor(x, device=self.device), obs),),
                steps_per_update=Fraction(self.optimizer_steps_per_update()),
            )
        }


class _GreedyActorCritic(torch.nn.Module):
    """The mode of the policy head: obs [N, ...] -> action, or with an LSTM
    (obs, state [N, 2, H], first [N]) -> (action, next state)."""

    def __init__(self, model: ActorCritic) -> None:
        super().__init__()
        self.model = model

    def forward(
        self, obs: Tensor, state: Tensor | None = None, first: Tensor | None = None
    ) -> Tensor | tuple[Tensor, Tensor]:
        params, _, next_state = self.model.unroll(
            obs_map(lambda x: x[None], obs), None if first is None else first[None], state
        )
        action = self.model.mode(params[0])
        return action if next_state is None else (action, next_state)


def masked_mean(x: Tensor, valid: Tensor) -> Tensor:
    """Mean over valid steps; `torch.where` so that inf/nan at masked steps cannot leak."""
    return torch.where(valid > 0, x, torch.zeros_like(x)).sum() / valid.sum().clamp(min=1.0)


def normalize(advantages: Tensor, valid: Tensor) -> Tensor:
    """(A - mean) / (std + 1e-8) over the valid steps (CleanRL `norm_adv`, unbiased std)."""
    mean = masked_mean(advantages, valid)
    n = valid.sum()
    var = masked_mean((advantages - mean) ** 2, valid) * n / (n - 1).clamp(min=1.0)
    return (advantages - mean) / (var.sqrt() + 1e-8)
