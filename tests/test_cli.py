"""The `rlfabric` command: help, spec show, clear errors without tracebacks, Ctrl-C."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from rlfabric.platform.cli import main

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "examples" / "specs" / "cartpole_seed_vtrace.yaml"


def rlfabric(*args: str, cwd: Path = ROOT, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rlfabric.platform.cli", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_train_help_lists_every_field_with_default_and_description():
    out = rlfabric("train", "--help")
    assert out.returncode == 0
    assert "algo.lr (float, default 0.0006): learning rate" in out.stdout
    for key in (
        "run.stop.env_frames",
        "env.atari.frameskip",
        "arch.inference_timeout_ms",
        "resources.num_env_runners",
        "model.hidden",
        "algo.lambda",
    ):
        assert key in out.stdout, key


def test_spec_show_prints_the_resolved_spec():
    out = rlfabric("spec", "show", str(SPEC), "algo.lr=0.01", "run.seed=3")
    assert out.returncode == 0, out.stderr
    assert "lr: 0.01" in out.stdout and "seed: 3" in out.stdout
    assert "rho_bar: 1.0" in out.stdout  # defaults are filled in


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (("spec", "show", str(SPEC), "algo.lr=fast"), "algo.lr"),
        (("spec", "show", str(SPEC), "algo.name=dqn"), "registered: a3c, ppo, sac, td3, vtrace"),
        (("spec", "show", "missing.yaml"), "'missing.yaml' is not a spec file (no such file)"),
        (("train", "--resume", "/nonexistent/run"), "not a run folder"),
        (("train",), "train needs a spec file, names (--arch, --algo, --env) or overrides"),
    ],
)
def test_user_errors_exit_2_with_one_paragraph_and_no_traceback(args, expected):
    out = rlfabric(*args)
    assert out.returncode == 2
    assert expected in out.stderr
    assert "Traceback" not in out.stderr
    assert "(traceback: " not in out.stderr  # found before anything ran: no log file


def shown(capsys, *words: str) -> str:
    """What `rlfabric spec show WORDS` prints, run in this process."""
    assert main(["spec", "show", *words]) == 0, capsys.readouterr().err
    return capsys.readouterr().out


@pytest.mark.parametrize(
    "names",
    [
        {"arch": "local", "algo": "ppo", "env": "CartPole-v1"},
        {"arch": "seed", "algo": "vtrace", "env": "ALE/Pong-v5"},
        {"env": "Acrobot-v1"},  # the names not given are the defaults
    ],
    ids=["cartpole", "pong", "env-only"],
)
def test_names_alone_are_the_python_names_only_call(capsys, names):
    """`--arch A --algo B --env E` resolves as `Platform(arch=A, algo=B, env=E)` does:
    the same preset, values and provenance, as `spec show` prints them."""
    from rlfabric.envs import describe_env
    from rlfabric.envs.config import find_spec, is_atari
    from rlfabric.platform.facade import Platform

    spec = Platform(**names).spec
    threshold = describe_env(spec.env).reward_threshold
    expected = spec.to_annotated_yaml(threshold, is_atari(find_spec(spec.env.id)))
    words = [word for name, value in names.items() for word in (f"--{name}", value)]
    assert shown(capsys, *words) == expected
    assert f"  id: {names['env']}  # user" in expected


def test_overrides_alone_need_no_spec_file(capsys):
    out = shown(capsys, "env.id=Acrobot-v1", "algo.name=ppo")
    assert out.startswith("# preset ppo/classic")
    assert "  id: Acrobot-v1  # user" in out and "  name: ppo  # user" in out
    assert "  name: seed  # default" in out  # the architecture nobody named


@pytest.mark.parametrize(
    ("words", "expected"),
    [
        # names and overrides in any order, the words after a flag included
        (
            ("env.id=Acrobot-v1", "--algo", "ppo", "algo.lr=0.01", "--arch", "impala"),
            {"env": "Acrobot-v1", "algo": "ppo", "arch": "impala", "lr": 0.01},
        ),
        # a dotted override goes on top of a name flag
        (("--algo", "ppo", "algo.name=a3c"), {"algo": "a3c"}),
        # on a spec file, a name replaces its name; its other values stay
        (
            (str(SPEC), "--arch", "impala", "--env", "Acrobot-v1", "run.seed=3"),
            {"env": "Acrobot-v1", "algo": "vtrace", "arch": "impala", "seed": 3, "lr": 0.005},
        ),
    ],
    ids=["names-and-overrides", "override-over-flag", "spec-file-and-names"],
)
def test_names_overrides_and_a_spec_file_combine(capsys, words, expected):
    spec = yaml.safe_load(shown(capsys, *words))
    got = {
        "env": spec["env"]["id"],
        "algo": spec["algo"]["name"],
        "arch": spec["arch"]["name"],
        "lr": spec["algo"]["lr"],
        "seed": spec["run"]["seed"],
    }
    assert {key: got[key] for key in expected} == expected


@pytest.mark.parametrize("command", [["train"], ["tune"], ["spec", "show"], ["bench"]])
def test_a_word_neither_a_file_nor_an_override_says_which_it_looked_for(capsys, command):
    assert main([*command, "foo.yaml", "algo.lr=0.01"]) == 2
    err = capsys.readouterr().err
    assert (
        "error: 'foo.yaml' is not a spec file (no such file) nor an override (section.field=value)"
    ) in err


@pytest.mark.parametrize("text", ["", "# only a comment\n", "{}\n"], ids=["empty", "comment", "{}"])
def test_an_empty_spec_file_is_an_error_that_says_how_to_train_the_defaults(tmp_path, capsys, text):
    empty = tmp_path / "spec.yaml"
    empty.write_text(text)
    assert main(["train", str(empty)]) == 2  # before anything starts
    err = capsys.readouterr().err
    assert f"spec file '{empty}' is empty" in err
    assert "`rlfabric train --env CartPole-v1`" in err


def test_resume_from_a_corrupt_checkpoint_is_a_clear_error(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "spec.yaml").write_text("arch: local\nenv: CartPole-v1\n")
    (run / "checkpoints" / "ckpt_0000000000100.pt").write_bytes(b"not a checkpoint")
    out = rlfabric("train", "--resume", str(run))
    assert out.returncode == 2
    assert "cannot be read" in out.stderr and "ckpt_0000000000100.pt" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize(
    "sig, arch",
    [(signal.SIGINT, "local"), (signal.SIGTERM, "local"), (signal.SIGTERM, "seed")],
    # seed: a driver on Ray, whose ray.init() installs its own SIGTERM crash handler
    ids=["ctrl-c", "sigterm", "sigterm-ray"],
)
def test_ctrl_c_and_sigterm_write_a_final_checkpoint_and_exit(tmp_path, sig, arch):
    spec = tmp_path / "spec.yaml"
    spec.write_text(
        f"arch: {arch}\nenv: {{id: CartPole-v1, num_envs: 8}}\n"
        f"run: {{logdir: {tmp_path}, name: interrupted, display: plain}}\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlfabric.platform.cli", "train", str(spec)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # A suite started in the background by a shell without job control (`make test &`
        # in a script) inherits SIGINT ignored, and Python then never turns it into
        # KeyboardInterrupt: give the child the default, as a terminal's process has.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    metrics = tmp_path / "interrupted" / "metrics.jsonl"
    deadline = time.time() + 60
    while time.time() < deadline and not (metrics.exists() and metrics.stat().st_size):
        time.sleep(0.2)
    proc.send_signal(sig)  # SIGTERM is what `ray job stop` sends
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "interrupted" in err
    assert "stopped: interrupted (Ctrl-C or SIGTERM)" in out
    assert (
        "run interrupted (Ctrl-C or SIGTERM)" in (tmp_path / "interrupted" / "run.log").read_text()
    )
    assert list((tmp_path / "interrupted" / "checkpoints").glob("ckpt_*.pt"))


def test_sigterm_ends_a_python_fit_with_a_final_checkpoint(tmp_path):
    # A script's fit() under a scheduler's SIGTERM: no handler of its own, and a periodic
    # checkpoint far off, so only the final one can be there.
    script = (
        "from rlfabric import Platform\n"
        "Platform(arch='local', env={'id': 'CartPole-v1', 'num_envs': 8}, run={'logdir': "
        f"{str(tmp_path)!r}, 'name': 'py', 'display': 'none', 'checkpoint_interval_s': 3600}})"
        ".fit()\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    metrics = tmp_path / "py" / "metrics.jsonl"
    deadline = time.time() + 60
    while time.time() < deadline and not (metrics.exists() and metrics.stat().st_size):
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert b"KeyboardInterrupt" in err  # what the script sees, as after Ctrl-C
    assert "run interrupted (Ctrl-C or SIGTERM)" in (tmp_path / "py" / "run.log").read_text()
    assert list((tmp_path / "py" / "checkpoints").glob("ckpt_*.pt"))


@pytest.mark.parametrize(
    ("settings", "code", "message"),
    [
        (["algo.lr=1e20"], 2, "error: 3 updates in a row had a NaN or inf loss or gradient"),
        # torch's RMSprop raises on its first step: -lr does not fit in a float32
        (
            ["algo.optimizer=rmsprop", "algo.lr=1e39"],
            1,
            "error: the learner raised RuntimeError: ",
        ),
    ],
    ids=["user-error-in-an-actor", "other-error-in-an-actor"],
)
def test_an_error_inside_an_actor_is_one_paragraph(tmp_path, settings, code, message):
    """An actor's RLFabricError reads as the driver's would (exit 2); anything else names
    the actor and the exception (exit 1); the remote traceback goes to the log file."""
    out = rlfabric(
        "train",
        str(ROOT / "examples/specs/cartpole_seed_vtrace.yaml"),
        *settings,
        "run.max_nonfinite_updates=3",
        "run.display=none",
        f"run.logdir={tmp_path}",
        "run.name=broken",
        "resources.num_cpus=2",
    )
    assert out.returncode == code, out.stderr
    paragraph = out.stderr.strip().splitlines()
    assert paragraph[0].startswith(message), out.stderr
    assert len(paragraph) == 2 and paragraph[1].startswith("(traceback: ")
    log = Path(paragraph[1].removeprefix("(traceback: ").rstrip(")"))
    assert log == tmp_path / "broken" / "run.log"  # the run's own log, not a temporary file
    assert "Traceback" in log.read_text() and "run stopped by error" in log.read_text()
    # The learner's state is intact (the bad steps were skipped or refused): saved at the end.
    assert list((tmp_path / "broken" / "checkpoints").glob("ckpt_*.pt"))


def test_reference_pages_are_what_the_code_generates():
    """docs/reference is generated from the pydantic models and argparse: a field or an
    option changed without `python -m rlfabric.platform.reference docs/reference` fails."""
    from rlfabric.platform.reference import PAGES

    for name, page in PAGES.items():
        committed = (ROOT / "docs" / "reference" / name).read_text()
        assert committed == page(), (
            f"docs/reference/{name} is stale: run python -m rlfabric.platform.reference "
            "docs/reference"
        )


def test_spec_schema_prints_every_section_and_registered_name():
    out = rlfabric("spec", "schema")
    assert out.returncode == 0, out.stderr
    for heading in ("## env", "### arch: seed", "### algo: sac", "## tune", "## run"):
        assert heading in out.stdout
    assert (
        "| `algo.lr` |" in out.stdout and "| `tune.scheduler.perturbation_frames` |" in out.stdout
    )
