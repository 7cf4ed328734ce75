"""RMSpropTF against TF1's RMSPropOptimizer update rule, written out in numpy."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rlfabric.algorithms.optim import RMSpropTF


def tf1_rmsprop(w, grads, lr, decay, eps, momentum):
    """tensorflow/core/kernels/training_ops.cc ApplyRMSProp: ms starts at 1, mom at 0."""
    ms, mom = np.ones_like(w), np.zeros_like(w)
    for g in grads:
        ms = decay * ms + (1 - decay) * g * g
        mom = momentum * mom + lr * g / np.sqrt(ms + eps)
        w = w - mom
    return w


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_rmsprop_tf_follows_tf1s_rule(momentum):
    rng = np.random.default_rng(0)
    w0 = rng.normal(size=(3, 4))
    grads = [rng.normal(scale=scale, size=(3, 4)) for scale in (1e-3, 0.05, 2.0, 1e-3, 0.3)]
    param = torch.nn.Parameter(torch.tensor(w0))
    opt = RMSpropTF([param], lr=6e-4, alpha=0.99, eps=0.01, momentum=momentum)
    for g in grads:
        param.grad = torch.tensor(g)
        opt.step()
    expected = tf1_rmsprop(w0, grads, 6e-4, 0.99, 0.01, momentum)
    np.testing.assert_allclose(param.detach().numpy(), expected, rtol=1e-12, atol=1e-15)
    assert int(opt.state[param]["step"]) == len(grads)


def test_rmsprop_tf_starts_gently_where_torch_jumps():
    """The first step for a gradient of 1: TF moves lr * 1 / sqrt(1 + eps); torch's RMSprop,
    whose mean square starts at 0, moves lr / (sqrt(0.01) + eps), about 9x more."""
    steps = {}
    for name, cls in (("tf", RMSpropTF), ("torch", torch.optim.RMSprop)):
        param = torch.nn.Parameter(torch.zeros(1, dtype=torch.float64))
        opt = cls([param], lr=1e-3, alpha=0.99, eps=0.01)
        param.grad = torch.ones(1, dtype=torch.float64)
        opt.step()
        steps[name] = -param.item()
    assert steps["tf"] == pytest.approx(1e-3 / np.sqrt(1.01))
    assert steps["torch"] == pytest.approx(1e-3 / 0.11)


def test_rmsprop_tf_state_round_trips_and_follows_the_lr_schedule():
    param = torch.nn.Parameter(torch.ones(2, dtype=torch.float64))
    opt = RMSpropTF([param], lr=1e-2, eps=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 0.0 if i >= 1 else 1.0)
    param.grad = torch.ones(2, dtype=torch.float64)
    opt.step()
    sched.step()  # lr 0 from here: the weights stay where they are
    moved = param.detach().clone()
    opt.step()
    torch.testing.assert_close(param.detach(), moved)
    again = RMSpropTF([torch.nn.Parameter(moved.clone())], lr=1e-2, eps=0.01)
    again.load_state_dict(opt.state_dict())
    square_avg = again.state[again.param_groups[0]["params"][0]]["square_avg"]
    torch.testing.assert_close(square_avg, opt.state[param]["square_avg"])


def test_rmsprop_tf_refuses_bad_settings():
    with pytest.raises(ValueError, match="alpha"):
        RMSpropTF([torch.nn.Parameter(torch.zeros(1))], lr=1e-3, alpha=1.0)
