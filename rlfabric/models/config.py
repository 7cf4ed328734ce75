"""Model section of the experiment spec."""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, field_serializer, field_validator

BUILTIN_TORSOS = ("auto", "mlp", "cnn", "impala_cnn")


class ModelConfig(BaseModel):
    """Which torso and heads to build; the spaces decide the rest."""

    model_config = ConfigDict(extra="forbid")

    torso: str | Callable[..., Any] = Field(
        "auto",
        description="feature extractor: 'auto' picks the Nature CNN ('cnn') for image "
        "observations (uint8, 3-D, 36 pixels or more a side) and an MLP otherwise (one-hot "
        "for discrete entries; a CNN per image entry of a Dict); 'impala_cnn': IMPALA's deep "
        "ResNet (15 conv layers, 16/32/32 channels); or your own: an import path "
        "'module:Class' (Python: the class or a factory), built as "
        "Torso(obs_space, **torso_kwargs) with an int out_dim",
    )
    torso_kwargs: dict[str, Any] = Field(
        {}, description="keyword arguments of your own torso (model.torso as an import path)"
    )
    image_layout: Literal["auto", "chw", "hwc"] = Field(
        "auto",
        description="axis order of image observations: 'chw' channels first (Atari here), "
        "'hwc' channels last (MiniGrid, most image envs); 'auto': the shorter of the first "
        "and last axes is the channel axis",
    )
    hidden: list[int] = Field(
        [64, 64], description="MLP hidden layer sizes (ignored by the CNN torsos)"
    )
    activation: Literal["tanh", "relu"] = Field("tanh", description="MLP activation")
    cnn_features: int = Field(512, gt=0, description="width of the Nature CNN's last layer")
    impala_features: int = Field(
        256, gt=0, description="width of the IMPALA ResNet's last layer (the paper's 256)"
    )
    lstm: int = Field(0, ge=0, description="LSTM core size; 0 means no recurrent core")
    shared_torso: bool = Field(
        True,
        description="policy and value share the torso; false: the value gets its own MLP "
        "(CleanRL's continuous PPO); MLP torsos without an LSTM only",
    )
    precision: Literal["fp32", "bf16", "auto"] = Field(
        "fp32",
        description="'bf16' runs the torso (SAC/TD3: every network's matmuls) under bfloat16 "
        "autocast (as SEED RL on TPUs): about 2x faster convolutions and matmuls on CPUs with "
        "AVX512-BF16 or AMX, and on GPUs; about 3x slower on CPUs without them, which emulate "
        "it. 'auto': bf16 where the device has it natively, fp32 elsewhere (decided by each "
        "process for its own device, so one spec suits a laptop and a GPU cluster)",
    )
    normalize_obs: bool = Field(
        False,
        description="normalize vector observations by their running mean and variance, as SB3's "
        "VecNormalize (the RL Zoo's `normalize`): one set of statistics, updated by the learner "
        "from each training batch and carried with the weights; not for image observations",
    )
    obs_clip: float = Field(
        10.0,
        gt=0,
        description="normalized observations are clipped to [-obs_clip, obs_clip] "
        "(VecNormalize's clip_obs); read only with normalize_obs",
    )
    log_std_init: float = Field(
        0.0, description="initial log standard deviation of the Gaussian head (continuous actions)"
    )
    sde: bool = Field(
        False,
        description="generalized state-dependent exploration (gSDE, SB3's use_sde) for "
        "continuous actions: noise linear in the policy's features, its matrix held per env "
        "for sde_sample_freq steps; the on-policy algorithms (without an LSTM core) and SAC",
    )
    sde_sample_freq: int = Field(
        -1,
        ge=-1,
        description="agent steps each env holds its gSDE noise matrix; -1: one unroll "
        "(algo.unroll_length), as SB3's -1 holds it for a rollout. Read only with sde",
    )

    @field_validator("torso")
    @classmethod
    def _known_torso(cls, torso: str | Callable[..., Any]) -> str | Callable[..., Any]:
        if isinstance(torso, str) and torso not in BUILTIN_TORSOS and ":" not in torso:
            raise ValueError(
                f"unknown torso {torso!r}; allowed: {', '.join(BUILTIN_TORSOS)}, or an import "
                "path 'module:Class' to your own"
            )
        return torso

    @field_serializer("torso")
    def _torso_path(self, torso: str | Callable[..., Any]) -> str:
        return torso_name(torso)

    @field_validator("sde_sample_freq")
    @classmethod
    def _no_zero_frequency(cls, freq: int) -> int:
        if freq == 0:
            raise ValueError("sde_sample_freq must be -1 (one unroll) or a positive step count")
        return freq

    @field_validator("hidden")
    @classmethod
    def _positive_sizes(cls, sizes: list[int]) -> list[int]:
        if not sizes or any(s <= 0 for s in sizes):
            raise ValueError(f"hidden sizes must be a non-empty list of positive ints, got {sizes}")
        return sizes


def torso_name(torso: str | Callable[..., Any]) -> str:
    """`model.torso` as the spec writes it: a class or factory given in Python becomes its
    import path, so the spec a run saves names it (one from the driver's `__main__` can
    then be resumed from Python only, where the class is passed again)."""
    return torso if isinstance(torso, str) else f"{torso.__module__}:{torso.__qualname__}"


def runs_bf16(precision: str, device: torch.device) -> bool:
    """Whether a model of `model.precision` runs bfloat16 autocast on `device`."""
    if precision == "auto":
        return native_bf16(device.type)
    return precision == "bf16"


@functools.cache
def native_bf16(device_type: str) -> bool:
    """Whether `device_type` computes bfloat16 natively: a GPU that supports it, or a CPU with
    AVX512-BF16 or AMX (Linux flags). Elsewhere oneDNN emulates bf16 at about 3x fp32's cost."""
    if device_type == "cuda":
        # Native only: by default the call also counts emulation (T4, V100), slower than fp32.
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False)
    if device_type != "cpu":
        return False
    try:
        return cpu_flags_have_bf16(Path("/proc/cpuinfo").read_text())
    except OSError:
        return False


def cpu_flags_have_bf16(cpuinfo: str) -> bool:
    """Whether a /proc/cpuinfo text lists `avx512_bf16` or `amx_bf16` among its CPU flags."""
    flags = re.findall(r"^flags\s*:(.*)$", cpuinfo, flags=re.MULTILINE)
    return any({"avx512_bf16", "amx_bf16"} & set(line.split()) for line in flags)
