"""Observation normalization by running mean and variance, kept inside the model.

SB3's `VecNormalize` and CleanRL's `gym.wrappers.NormalizeObservation` normalize in
an env wrapper, which under a distributed topology would keep one set of statistics
per env runner. Here, as Sample Factory does, the statistics are buffers of a module
at the front of the network: the learner merges each training batch into them (one
set, from every runner's data), and they travel wherever the weights go (inference
servers, IMPALA runners, checkpoints, evaluation, the exported policy) because they
are part of the model's `state_dict`.

The arithmetic is SB3's (`common/running_mean_std.py`, `VecNormalize`): population
variance merged by Chan et al.'s parallel formula, the observation mapped to
clip((x - mean) / sqrt(var + 1e-8), -clip, clip). The statistics change only when
the learner calls `update`; a forward pass never touches them (no train/eval mode).
"""

from __future__ import annotations

from collections.abc import Callable

import gymnasium as gym
import torch
from torch import Tensor, nn

from rlfabric.models.config import ModelConfig
from rlfabric.models.networks import is_image_space

EPS = 1e-8
"""Added to the variance under the square root (SB3 VecNormalize's `epsilon`)."""

#: Sums tensors over data-parallel learners in place (`algorithms.base.GradientSync.sum`).
GroupSum = Callable[[list[Tensor]], None]


class ObsNormalizer(nn.Module):
    """clip((obs - mean) / sqrt(var + eps), -clip, clip) with running mean, var and count.

    Buffers, not parameters: no optimizer or sparse mask sees them, and `state_dict`
    carries them. They start as mean 0, var 1, count 0, so an untrained model sees
    its observations unchanged (but clipped), and the first batch sets them outright.
    """

    def __init__(self, shape: tuple[int, ...], clip: float = 10.0) -> None:
        super().__init__()
        self.clip = clip
        self.register_buffer("mean", torch.zeros(shape))
        self.register_buffer("var", torch.ones(shape))
        # float64: a float32 count stops counting single steps past 2^24.
        self.register_buffer("count", torch.zeros((), dtype=torch.float64))

    def forward(self, obs: Tensor) -> Tensor:
        """Normalize `obs [..., *shape]`, in float32."""
        return ((obs.float() - self.mean) / torch.sqrt(self.var + EPS)).clamp(-self.clip, self.clip)

    @torch.no_grad()
    def update(self, obs: Tensor, group_sum: GroupSum | None = None) -> None:
        """Merge the observations `obs [..., *shape]` into the running moments.

        The batch's sums are taken around the current running mean (in float64, so no
        cancellation however far the features sit from 0), which is the same on every
        data-parallel learner: summing them over the group (`group_sum`) gives the whole
        batch's moments, so every learner merges the same numbers and the statistics
        stay identical. Then Chan et al.'s merge, as SB3's
        `RunningMeanStd.update_from_moments`. An empty batch changes nothing (shards are
        equal, so either all learners' are empty or none).
        """
        mean = self.mean.double()
        x = obs.reshape(-1, *self.mean.shape).double() - mean
        if x.shape[0] == 0:
            return
        n = torch.tensor([float(x.shape[0])], dtype=torch.float64, device=x.device)
        sums = [n, x.sum(0), x.square().sum(0)]
        if group_sum is not None:
            group_sum(sums)
        n, s1, s2 = sums[0][0], sums[1], sums[2]
        delta = s1 / n  # batch mean - running mean
        batch_var = s2 / n - delta.square()
        total = self.count + n
        m2 = (
            self.var.double() * self.count + batch_var * n + delta.square() * self.count * n / total
        )
        self.mean.copy_(mean + delta * n / total)
        self.var.copy_(m2 / total)
        self.count.copy_(total)


class RewardScaler(ObsNormalizer):
    """reward / sqrt(var + eps), clipped to [-clip, clip], with `var` the running variance of
    the discounted return (SB3 `VecNormalize(norm_reward=True)`; CleanRL's
    `NormalizeReward`). Not centred: shifting rewards would change which episodes are
    better (a per-step penalty would become a bonus).

    The learner merges each batch's running returns (the unrolls' `return`, valid steps
    only) with the inherited `update`, then scales that batch's rewards, as VecNormalize
    updates its statistics before it scales a step's reward. Only training reads the
    scale: the policy never sees rewards, so it is algorithm state, not model weights.
    """

    def __init__(self, clip: float = 10.0) -> None:
        super().__init__((), clip)

    def forward(self, reward: Tensor) -> Tensor:
        return (reward.float() / torch.sqrt(self.var + EPS)).clamp(-self.clip, self.clip)


class DictObsNormalizer(nn.Module):
    """Dict observations: one `ObsNormalizer` per vector Box entry (by position, as module
    names may not hold a key's '.'); images and discrete entries pass as they are."""

    def __init__(self, entries: dict[str, gym.spaces.Box], clip: float) -> None:
        super().__init__()
        self.keys = list(entries)
        self.norms = nn.ModuleList([ObsNormalizer(tuple(s.shape), clip) for s in entries.values()])

    def forward(self, obs: dict[str, Tensor]) -> dict[str, Tensor]:
        out = dict(obs)
        for key, norm in zip(self.keys, self.norms):
            out[key] = norm(obs[key])
        return out

    @torch.no_grad()
    def update(self, obs: dict[str, Tensor], group_sum: GroupSum | None = None) -> None:
        for key, norm in zip(self.keys, self.norms):
            norm.update(obs[key], group_sum)


def build_obs_normalizer(
    obs_space: gym.Space, cfg: ModelConfig
) -> ObsNormalizer | DictObsNormalizer | None:
    """The normalizer `model.normalize_obs` asks for, or None.

    Image observations are refused: the Nature CNN already scales pixels by 1/255,
    and per-pixel running statistics of frames are not what the presets mean
    (SB3 and the RL Zoo normalize vector observations only).
    """
    if not cfg.normalize_obs:
        return None
    if isinstance(obs_space, gym.spaces.Dict):
        vectors = {
            k: s
            for k, s in obs_space.spaces.items()
            if isinstance(s, gym.spaces.Box) and not is_image_space(s)
        }
        if not vectors:
            raise ValueError(
                f"model.normalize_obs=true normalizes the vector Box entries of {obs_space}, "
                "which has none (allowed: model.normalize_obs=false)"
            )
        return DictObsNormalizer(vectors, cfg.obs_clip)
    if not isinstance(obs_space, gym.spaces.Box):
        raise ValueError(
            f"model.normalize_obs=true normalizes Box observations; {obs_space} is encoded "
            "one-hot or as 0/1, with nothing to normalize (allowed: model.normalize_obs=false)"
        )
    if is_image_space(obs_space) or cfg.torso in ("cnn", "impala_cnn"):
        raise ValueError(
            f"model.normalize_obs=true normalizes vector observations; these are "
            f"{obs_space} for the CNN torso, which scales pixels by 1/255 itself "
            "(allowed: model.normalize_obs=false for image observations)"
        )
    return ObsNormalizer(tuple(obs_space.shape), cfg.obs_clip)
