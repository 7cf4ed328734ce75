"""Learner updates/s of SAC (or TD3) at the default size, per precision x threads x critics.

One standalone `update()` of the algorithm as the learner runs it (replay batch to
tensors, critic, actor and temperature steps, soft target update) on random batches of
HalfCheetah's sizes (17-dim observations, 6-dim actions), with the default networks
(2x256 ReLU MLPs, twin critics, batch 256, Adam). Variants: `model.precision` fp32 or
bf16, torch threads, and the twin critics as separate networks or one batched ensemble
(`algo.ensemble_critics`). Rounds interleave the variants so that load from other
processes spreads over all of them; each row gives the median and the best round (on a
shared machine the best is the nearer to what a quiet one does), the fp32 / 1-thread /
separate-critics baseline's median beside it, and the speed-up of the medians.

`--plain` adds a row per precision and thread count for a hand-written SAC update in
plain torch (`PlainSAC`: CleanRL's `sac_continuous_action.py` step without its delayed
actor, the same sizes, fused Adam; bf16 as one autocast around the whole step): the
same work with none of the platform's layers (no replay-batch conversion, finiteness
check, sparse hooks or metrics), so the table shows how much of an update's time is
the platform's and how much this CPU's.

    python benchmarks/offpolicy_speed.py                       # SAC, threads 1 and all CPUs
    python benchmarks/offpolicy_speed.py --algo td3 --threads 1 2 4 --seconds 5 --rounds 5
    python benchmarks/offpolicy_speed.py --precisions fp32 --plain   # against plain torch

`--in-run SECONDS` adds the same update inside a run: names-only SEED + the algorithm
on HalfCheetah-v5 (a fresh process, Ray's start included), its agent steps per second
(one update each) over SECONDS once past `--warmup` agent steps, beside the standalone
rate of the variant the run's learner uses (its precision and torch threads), measured
in the same invocation. Inside a run the update should be all the learner waits on.

    python benchmarks/offpolicy_speed.py --in-run 100          # SAC, standalone and in a run
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import gymnasium as gym
import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rlfabric.algorithms import ALGORITHMS, Algorithm
from rlfabric.models import ModelConfig
from rlfabric.runtime.config import available_cpus

OBS_DIM, ACTION_DIM = 17, 6  # HalfCheetah-v5


@dataclass(frozen=True)
class Variant:
    precision: str
    threads: int
    ensemble: bool
    plain: bool = False

    def __str__(self) -> str:
        critics = "plain" if self.plain else "ensemble" if self.ensemble else "separate"
        return f"{self.precision:<5} {self.threads:>2} thr  {critics:<8}"


class PlainSAC:
    """One SAC update written directly in torch, as a reference for the platform's.

    CleanRL's step with the actor and temperature updated every step (as rlfabric's
    SAC): twin 2x256 critics as two `nn.Sequential`, a tanh-Gaussian actor, target
    critics with a soft update, learned alpha; fused Adam, no checks. `bf16`: the whole
    step under bfloat16 autocast.
    """

    def __init__(
        self, bf16: bool = False, hidden: int = 256, lr: float = 3e-4, tau: float = 0.005
    ) -> None:
        def mlp(i: int, o: int) -> nn.Sequential:
            return nn.Sequential(
                nn.Linear(i, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                nn.Linear(hidden, o),
            )  # fmt: skip

        self.q = nn.ModuleList([mlp(OBS_DIM + ACTION_DIM, 1) for _ in range(2)])
        self.q_target = copy.deepcopy(self.q)
        self.actor = mlp(OBS_DIM, 2 * ACTION_DIM)
        self.log_alpha = torch.zeros((), requires_grad=True)
        self.q_opt = torch.optim.Adam(self.q.parameters(), lr=lr, fused=True)
        self.actor_opt = torch.optim.Adam(self.actor.parameters(), lr=lr, fused=True)
        self.alpha_opt = torch.optim.Adam([self.log_alpha], lr=lr, fused=True)
        self.tau, self.bf16 = tau, bf16

    def sample(self, obs: Tensor) -> tuple[Tensor, Tensor]:
        mean, log_std = self.actor(obs).chunk(2, dim=-1)
        log_std = -5.0 + 3.5 * (torch.tanh(log_std) + 1)
        x = mean + log_std.exp() * torch.randn_like(mean)
        action = torch.tanh(x)
        normal = torch.distributions.Normal(mean, log_std.exp())
        logp = (normal.log_prob(x) - torch.log(1 - action.pow(2) + 1e-6)).sum(-1)
        return action, logp

    def update(self, batch: dict[str, np.ndarray]) -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.bf16):
            self.step(batch)

    def step(self, batch: dict[str, np.ndarray]) -> None:
        obs, action, next_obs = (torch.from_numpy(batch[k]) for k in ("obs", "action", "next_obs"))
        reward, discount = torch.from_numpy(batch["reward"]), torch.from_numpy(batch["discount"])
        alpha = self.log_alpha.detach().exp()
        with torch.no_grad():
            next_action, next_logp = self.sample(next_obs)
            x = torch.cat([next_obs, next_action], -1)
            next_q = torch.min(*(q(x).squeeze(-1) for q in self.q_target))
            y = reward + discount * (next_q - alpha * next_logp)
        x = torch.cat([obs, action], -1)
        q_loss = sum(F.mse_loss(q(x).squeeze(-1), y) for q in self.q)
        self.q_opt.zero_grad()
        q_loss.backward()
        self.q_opt.step()

        pi_action, logp = self.sample(obs)
        x = torch.cat([obs, pi_action], -1)
        q_pi = torch.min(*(q(x).squeeze(-1) for q in self.q))
        actor_loss = (alpha * logp - q_pi).mean()
        self.actor_opt.zero_grad()
        actor_loss.backward()
        self.actor_opt.step()

        alpha_loss = -(self.log_alpha.exp() * (logp.detach() - ACTION_DIM)).mean()
        self.alpha_opt.zero_grad()
        alpha_loss.backward()
        self.alpha_opt.step()
        with torch.no_grad():
            torch._foreach_lerp_(
                list(self.q_target.parameters()), list(self.q.parameters()), self.tau
            )


def build(algo: str, variant: Variant, batch_size: int) -> Algorithm | PlainSAC:
    torch.manual_seed(0)
    if variant.plain:
        return PlainSAC(bf16=variant.precision == "bf16")
    cls = ALGORITHMS[algo]
    cfg = cls.config_cls(batch_size=batch_size, ensemble_critics=variant.ensemble)
    obs = gym.spaces.Box(-np.inf, np.inf, (OBS_DIM,), np.float32)
    act = gym.spaces.Box(-1.0, 1.0, (ACTION_DIM,), np.float32)
    return cls(cfg, obs, act, ModelConfig(precision=variant.precision))


def batches(batch_size: int, count: int = 8) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    return [
        {
            "obs": rng.normal(size=(batch_size, OBS_DIM)).astype(np.float32),
            "action": rng.uniform(-1, 1, (batch_size, ACTION_DIM)).astype(np.float32),
            "reward": rng.normal(size=batch_size).astype(np.float32),
            "next_obs": rng.normal(size=(batch_size, OBS_DIM)).astype(np.float32),
            "discount": np.full(batch_size, 0.99, np.float32),
        }
        for _ in range(count)
    ]


def updates_per_s(
    algo: Algorithm | PlainSAC, data: list[dict[str, np.ndarray]], threads: int, seconds: float
) -> float:
    """Updates/s over `seconds` after a short warm-up, with `threads` torch threads."""
    torch.set_num_threads(threads)
    for batch in data:  # warm-up: allocator, oneDNN kernels, autocast paths
        algo.update(batch)
    count, start = 0, time.perf_counter()
    for batch in itertools.cycle(data):
        algo.update(batch)
        count += 1
        if time.perf_counter() - start >= seconds:
            break
    return count / (time.perf_counter() - start)


# argv: algo, seed, logdir, warm-up agent steps, seconds, then spec overrides. Names-only
# SEED + algo on HalfCheetah-v5; prints agent steps/s after the warm-up and what its
# learner runs.
_IN_RUN = r"""
import json, sys
from pathlib import Path
import torch
from rlfabric import Platform
from rlfabric.models.config import runs_bf16
from rlfabric.platform.reporting import read_records
algo, seed, logdir = sys.argv[1], int(sys.argv[2]), sys.argv[3]
warmup, seconds = int(sys.argv[4]), float(sys.argv[5])
platform = Platform(
    arch="seed", algo=algo, env="HalfCheetah-v5",
    run={"seed": seed, "logdir": logdir, "display": "none", "report_interval_s": 2.0,
         "stop": {"wall_time_s": seconds + 60}},
    overrides=sys.argv[6:],
)
result = platform.fit()
records = [r for r in read_records(Path(result.logdir) / "metrics.jsonl")
           if r["agent_steps"] >= warmup]
first = records[0]
last = next((r for r in records if r["wall_time_s"] - first["wall_time_s"] >= seconds),
            records[-1])
spec = platform.spec
print(json.dumps({
    "steps_per_s": (last["agent_steps"] - first["agent_steps"])
    / (last["wall_time_s"] - first["wall_time_s"]),
    "steps": last["agent_steps"] - first["agent_steps"],
    "precision": "bf16" if runs_bf16(spec.model.precision, torch.device("cpu")) else "fp32",
    "learner_threads": spec.resources.learner_threads,
    "ensemble_critics": spec.algo.ensemble_critics,
}))
"""


def in_run(
    algo: str, seed: int, warmup: int, seconds: float, overrides: list[str] | None = None
) -> dict:
    """Agent steps/s of a names-only SEED run (with `overrides`, dotted spec settings)
    after `warmup` steps, in a fresh process."""
    env = dict(os.environ, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    with tempfile.TemporaryDirectory() as logdir:
        done = subprocess.run(
            [sys.executable, "-c", _IN_RUN, algo, str(seed), logdir, str(warmup), str(seconds),
             *(overrides or [])],
            capture_output=True, text=True, env=env, timeout=seconds * 4 + 600,
        )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"the run failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--algo", choices=["sac", "td3"], default="sac")
    parser.add_argument("--threads", type=int, nargs="+", default=None, help="default: 1, all")
    parser.add_argument("--precisions", nargs="+", default=["fp32", "bf16"])
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--seconds", type=float, default=3.0, help="per variant and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--plain", action="store_true", help="add plain-torch SAC rows (--algo sac only)"
    )
    parser.add_argument(
        "--in-run", type=float, metavar="SECONDS", help="also time the update inside a run"
    )
    parser.add_argument("--warmup", type=int, default=6_000, help="agent steps before --in-run")
    parser.add_argument("--seed", type=int, default=0, help="the --in-run run's seed")
    parser.add_argument(
        "--set", nargs="+", default=[], metavar="KEY=VALUE",
        help="spec overrides of the --in-run run (arch.env_groups=1)",
    )  # fmt: skip
    args = parser.parse_args()
    if args.plain and args.algo != "sac":
        parser.error("--plain is a SAC update; run it with --algo sac")
    threads = args.threads or sorted({1, available_cpus()})

    baseline = Variant("fp32", 1, False)
    variants = [Variant(p, t, e) for p in args.precisions for t in threads for e in (False, True)]
    if baseline not in variants:
        variants.insert(0, baseline)
    if args.plain:
        variants += [Variant(p, t, False, plain=True) for p in args.precisions for t in threads]
    run = None
    if args.in_run:  # first, so that the standalone rounds do not share the machine with it
        run = in_run(args.algo, args.seed, args.warmup, args.in_run, args.set)
        match = Variant(run["precision"], run["learner_threads"], run["ensemble_critics"])
        if match not in variants:
            variants.append(match)
    algos = {v: build(args.algo, v, args.batch_size) for v in variants}
    data = batches(args.batch_size)
    rates: dict[Variant, list[float]] = {v: [] for v in variants}
    for _ in range(args.rounds):
        for variant in variants:
            rates[variant].append(
                updates_per_s(algos[variant], data, variant.threads, args.seconds)
            )

    base = statistics.median(rates[baseline])
    print(
        f"{args.algo} updates/s, batch {args.batch_size}, obs {OBS_DIM}, act {ACTION_DIM}, "
        f"median of {args.rounds} rounds x {args.seconds:g} s; torch {torch.__version__}, "
        f"{available_cpus()} CPUs"
    )
    print(
        f"{'variant':<26} {'updates/s':>10} {'best':>8} {'ms/update':>10} "
        f"{'fp32 1 thr sep':>15} {'x':>6}"
    )
    for variant in variants:
        rate = statistics.median(rates[variant])
        print(
            f"{variant!s:<26} {rate:>10.1f} {max(rates[variant]):>8.1f} {1000 / rate:>10.2f} "
            f"{base:>15.1f} {rate / base:>6.2f}"
        )
    if run is not None:
        standalone = statistics.median(rates[match])
        print(
            f"in a run (names-only SEED + {args.algo}, HalfCheetah-v5, {args.in_run:g} s after "
            f"{args.warmup:,} agent steps): {run['steps_per_s']:.1f} agent steps/s, one update "
            f"each; standalone {match}: {standalone:.1f} updates/s; in-run / standalone "
            f"{run['steps_per_s'] / standalone:.2f}"
        )


if __name__ == "__main__":
    main()
