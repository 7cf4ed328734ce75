"""Train CartPole with SEED RL + V-trace, then read the result.

python examples/quickstart.py
"""

from rlfabric import Platform

if __name__ == "__main__":
    result = Platform(
        arch="seed",
        algo="vtrace",
        env="CartPole-v1",
        run={"stop": {"env_frames": 300_000}},
    ).fit()
    print("mean return of the last 100 episodes:", result.metrics.get("episode_return_mean"))
    print("env frames:", result.metrics["env_frames"])
    print("checkpoint:", result.checkpoint)
    print("logdir:", result.logdir)
