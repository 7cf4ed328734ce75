"""How many ReLU units of an Atari checkpoint's torso never fire on a sample of frames.

A diagnostic for the Pong runs (docs/experiments/atari-pong.md, "Pong with SEED + V-trace"): a
unit whose output is 0 on every frame passes no gradient, so a torso that
lost most of its units early learns slowly or not at all. The frames come
from random play (8 envs, every 10th of 300 steps: 240 frames), the same for
every checkpoint, so the fractions compare across runs.

Beside them, the policy on the same frames: its mean entropy, the mean norm of
the torso's output, and the share of frames whose most likely action is the
most common one. A policy that collapsed to one action shows an entropy near 0
and a share near 1, and tells whether the torso's features or the head grew.

    python benchmarks/dead_units.py RUN_DIR/checkpoints/ckpt_*.pt [--game pong] [--init]

`--init` adds a freshly initialized torso as the baseline (no policy columns).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch

from rlfabric.envs.config import AtariConfig
from rlfabric.envs.factory import make_atari_vector_env
from rlfabric.models.networks import NatureCNN
from rlfabric.platform.checkpoint import load_checkpoint


def random_play_frames(game: str, seed: int = 0) -> torch.Tensor:
    """240 stacked-frame observations of random play, DeepMind preprocessing."""
    envs = make_atari_vector_env(game, 8, AtariConfig())
    envs.reset(seed=seed)
    rng = np.random.default_rng(seed)
    frames = []
    for t in range(300):
        obs, *_ = envs.step(rng.integers(0, envs.single_action_space.n, 8))
        if t % 10 == 0:
            frames.append(obs.copy())
    envs.close()
    return torch.as_tensor(np.concatenate(frames))


def dead_fractions(torso: torch.nn.Module, frames: torch.Tensor) -> list[float]:
    """Per ReLU layer, in order: the fraction of units (channels) at 0 on every frame."""
    outputs: list[torch.Tensor] = []
    hooks = [
        m.register_forward_hook(lambda _m, _i, out: outputs.append(out))
        for m in torso.modules()
        if isinstance(m, torch.nn.ReLU)
    ]
    with torch.no_grad():
        torso(frames)
    for hook in hooks:
        hook.remove()
    fractions = []
    for out in outputs:
        per_unit = out.transpose(0, 1).flatten(1)  # channels (conv) or units (fc) first
        fractions.append(float((per_unit.max(dim=1).values <= 0).float().mean()))
    return fractions


def policy_summary(
    torso: torch.nn.Module, head: dict[str, torch.Tensor], frames: torch.Tensor
) -> tuple[float, float, float]:
    """Mean entropy of the categorical policy, mean feature norm, and the share of
    frames whose greedy action is the most common greedy action."""
    with torch.no_grad():
        features = torso(frames)
        logits = features @ head["weight"].T + head["bias"]
    log_p = torch.log_softmax(logits, dim=-1)
    entropy = -(log_p.exp() * log_p).sum(-1)
    greedy = torch.bincount(logits.argmax(-1), minlength=logits.shape[-1])
    return (
        float(entropy.mean()),
        float(features.norm(dim=-1).mean()),
        float(greedy.max()) / len(frames),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoints", type=Path, nargs="*")
    parser.add_argument("--game", default="pong")
    parser.add_argument("--init", action="store_true", help="also a freshly initialized torso")
    args = parser.parse_args()
    frames = random_play_frames(args.game)
    shape = tuple(frames.shape[1:])
    torsos: list[tuple[str, torch.nn.Module, dict[str, torch.Tensor] | None]] = []
    if args.init:
        torch.manual_seed(0)
        torsos.append(("init", NatureCNN(shape, 512), None))
    for path in args.checkpoints:
        model = load_checkpoint(path)["algorithm"]["model"]
        torso = NatureCNN(shape, 512)
        weights = {k.removeprefix("torso."): v for k, v in model.items() if k.startswith("torso.")}
        torso.load_state_dict(weights)
        head = None  # a categorical policy's linear head, where the model has one
        if "policy.linear.weight" in model:
            head = {k: model[f"policy.linear.{k}"] for k in ("weight", "bias")}
        torsos.append((f"{path.parent.parent.name}/{path.name}", torso, head))
    print(
        f"{'checkpoint':<48} dead ReLU units: conv1  conv2  conv3  fc"
        "   entropy  |features|  top action"
    )
    for name, torso, head in torsos:
        cells = "  ".join(f"{f:5.2f}" for f in dead_fractions(torso, frames))
        policy = ""
        if head is not None:
            entropy, norm, top = policy_summary(torso, head, frames)
            policy = f"   {entropy:7.3f}  {norm:10.1f}  {top:10.2f}"
        print(f"{name:<48}                  {cells}{policy}")


if __name__ == "__main__":
    main()
