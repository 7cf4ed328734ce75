"""ReplayBuffer and DynamicCapacity: ring semantics, n-step folding, RLx2 capacity rule.

Observations carry a unique id per env step (`obs[:, 0]`), so each sampled row
can be matched to its transition and checked against a slow reference fold.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from rlfabric.runtime.replay import BATCH_KEYS, DynamicCapacity, ReplayBuffer

GAMMA = 0.9


@dataclass
class Transition:
    obs_id: int
    reward: float
    terminated: bool
    next_id: int
    end: bool  # a fold stops after this step: termination, truncation or a skipped step


def make_buffer(capacity: int, num_envs: int, **kwargs) -> ReplayBuffer:
    return ReplayBuffer(capacity, (2,), (1,), num_envs, gamma=GAMMA, **kwargs)


class Simulator:
    """N envs under gymnasium's NEXT_STEP autoreset, feeding a buffer; keeps the stored history.

    After a done, an env spends one step resetting (`valid=False`, reward 0). With
    `p_skip`, a live step is also dropped now and then (a break in the stream).
    """

    def __init__(self, num_envs: int, seed: int, p_term=0.1, p_trunc=0.1, p_skip=0.0) -> None:
        self.rng = np.random.default_rng(seed)
        self.p_term, self.p_trunc, self.p_skip = p_term, p_trunc, p_skip
        self.ids = np.arange(num_envs) * 10_000  # id of each env's current observation
        self.resetting = np.zeros(num_envs, bool)
        self.history: list[list[Transition]] = [[] for _ in range(num_envs)]

    def step(self, buffer: ReplayBuffer, steps: int = 1) -> None:
        for _ in range(steps):
            n = len(self.ids)
            u = self.rng.random(n)
            terminated = ~self.resetting & (u < self.p_term)
            truncated = ~self.resetting & ~terminated & (u < self.p_term + self.p_trunc)
            skipped = ~self.resetting & (self.rng.random(n) < self.p_skip)
            valid = ~self.resetting & ~skipped
            reward = np.where(self.resetting, 0.0, self.rng.normal(size=n)).astype(np.float32)
            next_ids = self.ids + 1  # the final observation at a done, the reset one after
            obs = np.stack([self.ids, -self.ids], 1).astype(np.float32)
            next_obs = np.stack([next_ids, -next_ids], 1).astype(np.float32)
            buffer.add(obs, 2.0 * obs[:, :1], reward, terminated, truncated, next_obs, valid)
            for e in range(n):
                if valid[e]:
                    done = bool(terminated[e] or truncated[e])
                    t = Transition(
                        int(self.ids[e]),
                        float(reward[e]),
                        bool(terminated[e]),
                        int(next_ids[e]),
                        done,
                    )
                    self.history[e].append(t)
                elif self.history[e]:
                    self.history[e][-1].end = True
            self.resetting = terminated | truncated
            self.ids = next_ids


def reference_fold(seq: list[Transition], i: int, n: int) -> tuple[float, int, float]:
    """Slow n-step return (Sutton & Barto eq. 7.1) over one stream's stored transitions."""
    ret, m = 0.0, 0
    for k in range(n):
        if i + k >= len(seq):
            break
        ret += GAMMA**k * seq[i + k].reward
        m += 1
        if seq[i + k].end:
            break
    last = seq[i + m - 1]
    return ret, last.next_id, 0.0 if last.terminated else GAMMA**m


def stored_windows(buffer: ReplayBuffer, history: list[list[Transition]]) -> list[list[Transition]]:
    """Each stream's stored transitions, checked to be a suffix of its history (oldest go first)."""
    obs, action = buffer.oldest(10**9)
    np.testing.assert_array_equal(action[:, 0], 2 * obs[:, 0])
    ids = set(obs[:, 0].astype(int).tolist())
    windows = [[t for t in seq if t.obs_id in ids] for seq in history]
    for seq, window in zip(history, windows):
        assert window == seq[len(seq) - len(window) :]
    assert sum(map(len, windows)) == len(buffer) <= buffer.capacity
    return windows


def check_samples(buffer: ReplayBuffer, history: list[list[Transition]], n: int) -> None:
    """Every stored transition is sampled, nothing else, and each folds as the reference."""
    where = {t.obs_id: (w, i) for w in stored_windows(buffer, history) for i, t in enumerate(w)}
    batch = buffer.sample(20 * len(buffer) + 100, n_step=n)
    assert set(batch) == set(BATCH_KEYS)
    ids = batch["obs"][:, 0].astype(int)
    assert set(ids.tolist()) == set(where)
    expected = np.array([reference_fold(*where[i], n) for i in ids.tolist()])
    np.testing.assert_allclose(batch["reward"], expected[:, 0], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(batch["next_obs"][:, 0], expected[:, 1])
    np.testing.assert_allclose(batch["discount"], expected[:, 2], rtol=1e-6)


def test_hand_written_folds_stop_at_terminations_and_bootstrap_through_truncations():
    buffer = ReplayBuffer(16, (1,), (1,), 1, gamma=0.5, n_step=3)

    def step(obs_id, reward, next_id, terminated=False, truncated=False, valid=True):
        o, n = np.array([[obs_id]], np.float32), np.array([[next_id]], np.float32)
        flags = np.array([terminated]), np.array([truncated])
        buffer.add(o, o, np.array([reward]), *flags, n, np.array([valid]))

    step(0, 1, 1)
    step(1, 2, 2)
    step(2, 4, 102, terminated=True)  # 102: final observation
    step(102, 0, 3, valid=False)  # NEXT_STEP autoreset step: not stored
    step(3, 8, 4)
    step(4, 16, 104, truncated=True)
    step(104, 0, 5, valid=False)
    step(5, 32, 6)
    step(6, 64, 7)
    step(7, 99, 8, valid=False)  # a dropped live step: the fold must stop at step 6
    step(8, 128, 9)
    # obs id -> (reward, next obs id, discount), n = 3, gamma = 0.5
    expected = {
        0: (1 + 0.5 * 2 + 0.25 * 4, 102, 0.0),  # termination: no bootstrap
        1: (2 + 0.5 * 4, 102, 0.0),
        2: (4, 102, 0.0),
        3: (8 + 0.5 * 16, 104, 0.25),  # truncation: bootstrap from the final observation
        4: (16, 104, 0.5),
        5: (32 + 0.5 * 64, 7, 0.25),  # stream break after step 6
        6: (64, 7, 0.5),
        8: (128, 9, 0.5),  # newest: fold cut, bootstrap
    }
    batch = buffer.sample(400)
    ids = batch["obs"][:, 0].astype(int).tolist()
    assert set(ids) == set(expected)
    got = np.stack([batch["reward"], batch["next_obs"][:, 0], batch["discount"]], 1)
    np.testing.assert_allclose(got, np.array([expected[i] for i in ids]))
    one_step = buffer.sample(400, n_step=1)
    terminal = one_step["obs"][:, 0] == 2
    np.testing.assert_array_equal(one_step["discount"], np.where(terminal, 0.0, 0.5))
    # The fold's inner observations s_{t+k}, k = 1, 2, and gamma^k where the fold goes on.
    mids = {0: [1, 2], 1: [2], 3: [4], 5: [6]}  # the other folds have one step
    batch = buffer.sample(400, intermediate=True)
    for row, obs_id in enumerate(batch["obs"][:, 0].astype(int).tolist()):
        ids = mids.get(obs_id, [])
        np.testing.assert_array_equal(batch["mid_obs"][row, : len(ids), 0], ids)
        expected_discount = [0.5**k if k <= len(ids) else 0.0 for k in (1, 2)]
        np.testing.assert_array_equal(batch["mid_discount"][row], expected_discount)


@pytest.mark.parametrize("n", [1, 3, 5])
def test_folds_match_reference_with_autoresets_and_breaks(n):
    buffer = make_buffer(600, 3)
    sim = Simulator(3, seed=n, p_skip=0.05)
    sim.step(buffer, 60)
    check_samples(buffer, sim.history, n)


@pytest.mark.parametrize("n", [1, 3, 5])
def test_intermediate_observations_match_reference(n):
    buffer = make_buffer(600, 3)
    sim = Simulator(3, seed=n, p_skip=0.05)
    sim.step(buffer, 60)
    where = {t.obs_id: (w, i) for w in stored_windows(buffer, sim.history) for i, t in enumerate(w)}
    batch = buffer.sample(500, n_step=n, intermediate=True)
    assert batch["mid_obs"].shape == (500, n - 1, 2) and batch["mid_discount"].shape == (500, n - 1)
    for row, obs_id in enumerate(batch["obs"][:, 0].astype(int).tolist()):
        seq, i = where[obs_id]
        ids = []  # s_{t+k} while the fold goes on past step t+k-1
        for k in range(1, n):
            if i + k >= len(seq) or seq[i + k - 1].end:
                break
            ids.append(seq[i + k].obs_id)
        np.testing.assert_array_equal(batch["mid_obs"][row, : len(ids), 0], ids)
        expected = [GAMMA**k if k <= len(ids) else 0.0 for k in range(1, n)]
        np.testing.assert_allclose(batch["mid_discount"][row], expected, rtol=1e-6)


def test_folds_at_wrap_around_never_reach_overwritten_slots():
    buffer = make_buffer(10, 2, n_step=3)
    sim = Simulator(2, seed=1, p_skip=0.05)
    for _ in range(40):  # 5 slots per env: wraps many times, at every phase
        sim.step(buffer)
        check_samples(buffer, sim.history, 3)
    assert len(buffer) == 10


def test_ring_keeps_the_newest_and_samples_uniformly():
    buffer = make_buffer(30, 3, seed=3)
    sim = Simulator(3, seed=0, p_term=0.0, p_trunc=0.0)
    sim.step(buffer, 25)
    assert len(buffer) == 30
    windows = stored_windows(buffer, sim.history)
    assert [len(w) for w in windows] == [10, 10, 10]
    assert windows[0][0].obs_id == 15  # steps 15..24 of env 0 remain
    ids = buffer.sample(60_000)["obs"][:, 0]
    _, counts = np.unique(ids, return_counts=True)
    assert len(counts) == 30
    assert np.abs(counts / 2_000 - 1).max() < 0.1  # 2,000 expected each; 4.5 sigma


def test_capacity_shrink_drops_oldest_and_grow_keeps_all():
    buffer = make_buffer(8, 2, n_step=3)
    sim = Simulator(2, seed=2)
    sim.step(buffer, 12)
    before = stored_windows(buffer, sim.history)
    buffer.capacity = 4
    after = stored_windows(buffer, sim.history)
    assert after == [w[-2:] for w in before]
    buffer.capacity = 14  # past the allocation: reallocated in order
    assert stored_windows(buffer, sim.history) == after
    check_samples(buffer, sim.history, 3)
    sim.step(buffer, 20)
    assert len(buffer) == 14
    check_samples(buffer, sim.history, 3)


def test_oldest_returns_the_behaviour_policy_action_when_stored():
    buffer = ReplayBuffer(8, (1,), (1,), 2, store_policy_action=True)
    for t in range(6):
        obs = np.full((2, 1), t, np.float32)
        buffer.add(obs, obs + 0.3, np.zeros(2), [0, 0], [0, 0], obs + 1, policy_action=obs)
    obs, action = buffer.oldest(4)
    np.testing.assert_array_equal(obs[:, 0], [2, 3, 2, 3])
    np.testing.assert_array_equal(action, obs)


def test_policy_distance_is_halved_mean_square_in_scaled_units():
    buffer = ReplayBuffer(4, (1,), (2,), 1)
    for _ in range(4):
        buffer.add(np.zeros((1, 1)), np.zeros((1, 2)), [0], [0], [0], np.zeros((1, 1)))
    rule = DynamicCapacity(min_capacity=1, max_capacity=4)
    far = rule.policy_distance(buffer, lambda s: np.tile([1.0, 0.5], (len(s), 1)), [0, -1], [4, 1])
    assert far == pytest.approx(0.25 / 2)  # both dims move half their half-range


def test_dynamic_capacity_shrinks_when_the_policy_moves_and_grows_back():
    rule = DynamicCapacity(min_capacity=200, max_capacity=1_000, oldest_k=64)
    buffer = ReplayBuffer(rule.max_capacity, (3,), (1,), 2, store_policy_action=True)
    rng = np.random.default_rng(0)

    def behaviour(obs):
        return np.tanh(obs[:, :1]) * 2

    def add(steps):
        for _ in range(steps):
            obs = rng.normal(size=(2, 3))
            noisy = behaviour(obs) + rng.normal(scale=0.2, size=(2, 1))
            buffer.add(obs, noisy, np.zeros(2), [0, 0], [0, 0], obs, policy_action=behaviour(obs))

    def check(policy):
        return rule.update(buffer, rule.policy_distance(buffer, policy, -2.0, 2.0))

    add(500)
    assert check(behaviour) == 1_000  # stored actions are the policy's: distance 0
    oldest_before = buffer.oldest(10**9)[0]
    assert check(lambda s: behaviour(s) + 2.0) == 900  # distance 0.5 > 0.2: drop 10%
    np.testing.assert_array_equal(buffer.oldest(10**9)[0], oldest_before[np.r_[50:500, 550:1000]])
    sizes = []
    for _ in range(30):
        add(20)
        sizes.append(check(lambda s: -behaviour(s)))
        assert 200 <= len(buffer) <= buffer.capacity == sizes[-1]
    assert sizes == sorted(sizes, reverse=True) and sizes[-1] == 200
    add(50)
    assert len(buffer) == 200  # held small while the policy stays away
    assert check(behaviour) == 1_000
    add(100)
    assert len(buffer) == 400  # grows back, keeping everything
    add(1_000)
    assert len(buffer) == 1_000


def test_dynamic_capacity_schedule_counts_crossings():
    rule = DynamicCapacity(check_every=10)
    assert rule.due(9, 10) and rule.due(8, 12) and not rule.due(10, 12)


@pytest.mark.parametrize("contents", [True, False])
def test_state_dict_round_trips_through_a_weights_only_checkpoint(contents):
    buffer = make_buffer(20, 2, n_step=3, seed=5)
    sim = Simulator(2, seed=4)
    sim.step(buffer, 15)

    def to_torch(x):
        if isinstance(x, np.ndarray):
            return torch.from_numpy(x)
        return {k: to_torch(v) for k, v in x.items()} if isinstance(x, dict) else x

    file = io.BytesIO()
    torch.save(to_torch(buffer.state_dict(contents)), file)
    file.seek(0)
    restored = make_buffer(4, 2, seed=0)
    restored.load_state_dict(torch.load(file, weights_only=True))
    assert (restored.capacity, restored.n_step) == (20, 3)
    if not contents:
        assert len(restored) == 0
        return
    a, b = buffer.sample(64), restored.sample(64)  # same RNG state: same batch
    for key in BATCH_KEYS:
        np.testing.assert_array_equal(a[key], b[key])
    check_samples(restored, sim.history, 3)
