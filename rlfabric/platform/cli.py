"""The `rlfabric` command.

    rlfabric train SPEC.yaml [section.field=value ...]
    rlfabric train --resume runs/<name> [section.field=value ...]
    rlfabric train --resume auto SPEC.yaml run.name=NAME [section.field=value ...]
    rlfabric tune SPEC.yaml [section.field=value ...]
    rlfabric tune --resume SEARCH_DIR
    rlfabric spec show SPEC.yaml [section.field=value ...]
    rlfabric spec schema
    rlfabric eval runs/<name> [--episodes 20] [--stochastic] [--video]
    rlfabric export runs/<name> [--format torchscript] [--out DIR]

A user error (bad spec, unknown name, missing checkpoint, also one raised
inside an actor, such as too many non-finite updates) prints one paragraph
and exits 2; any other exception inside an actor prints one paragraph naming
the actor and the exception and exits 1. Tracebacks, the actor's included, go
to a log file, not the terminal.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any

from rlfabric.errors import ActorError, RLFabricError


def spec_reference() -> str:
    """Every field of every section, with registered algorithms and architectures (the
    same walk as docs/reference/spec.md, as plain text for --help)."""
    from rlfabric.platform.reference import fields, spec_sections

    lines = ["spec fields (override any with section.field=value):"]
    for heading, description, model, section in spec_sections():
        if model is None:  # a top-level field (preset)
            lines.append(f" {heading}: {description}")
            continue
        # a registered name ("algo: vtrace") is its own heading; a section has a line
        lines.append(f" {heading}" if heading != section else f" {heading}: {description}")
        lines += [
            f"  {key} ({kind}, default {default!r}): {text}"
            for key, kind, default, text in fields(model, section)
        ]
    return "\n".join(lines)


class _Parser(argparse.ArgumentParser):
    """A parser whose help can end with the spec reference (built only when shown)."""

    def __init__(self, *args: Any, spec_help: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.spec_help = spec_help

    def format_help(self) -> str:
        text = super().format_help()
        return f"{text}\n{spec_reference()}\n" if self.spec_help else text


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="rlfabric", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    train = commands.add_parser("train", help="train from a YAML spec", spec_help=True)
    train.add_argument("spec", nargs="?", help="YAML experiment spec")
    train.add_argument("overrides", nargs="*", help="dotted overrides, e.g. algo.lr=3e-4")
    train.add_argument(
        "--resume",
        metavar="LOGDIR",
        help="continue the run in LOGDIR; 'auto' with a spec: continue its run.name's "
        "folder if it holds this spec's checkpoint, else start it (run.resume=auto)",
    )
    train.add_argument("--address", help="Ray cluster to join (default: RAY_ADDRESS or embedded)")
    _add_import(train)
    search = commands.add_parser(
        "tune",
        help="search the spec's `tune` section on Ray Tune; each trial is one run",
        spec_help=True,
    )
    search.add_argument("spec", nargs="?", help="YAML experiment spec with a tune section")
    search.add_argument("overrides", nargs="*", help="dotted overrides, e.g. tune.num_samples=8")
    search.add_argument(
        "--resume",
        metavar="SEARCH_DIR",
        help="go on with the search in SEARCH_DIR (stopped by Ctrl-C or SIGTERM): unfinished "
        "trials from their newest checkpoints, finished ones not again",
    )
    search.add_argument("--address", help="Ray cluster to join (default: RAY_ADDRESS or embedded)")
    _add_import(search)
    bench = commands.add_parser(
        "bench", help="run one spec under several architectures and compare them"
    )
    bench.add_argument("spec", nargs="?", help="base YAML spec (optional)")
    bench.add_argument("overrides", nargs="*", help="dotted overrides applied to every run")
    bench.add_argument(
        "--env",
        help="env id (default: the spec's, else CartPole-v1); without "
        "a spec each run starts from examples/specs/<env>_<arch>_<algo>.yaml",
    )
    bench.add_argument("--archs", default="seed,impala,ga3c", help="comma-separated archs")
    bench.add_argument("--algo", default="vtrace", help="comma-separated algorithms")
    bench.add_argument("--frames", type=int, default=300_000, help="env frames per run")
    bench.add_argument(
        "--threshold",
        type=float,
        help="return for 'time to threshold' (default: the env's reward_threshold)",
    )
    bench.add_argument("--out", default="runs/bench", help="folder for runs, bench.json, bench.png")
    _add_import(bench)
    evaluate = commands.add_parser("eval", help="evaluate a run's newest checkpoint")
    evaluate.add_argument("logdir", help="the run's folder (runs/<name>)")
    evaluate.add_argument("--episodes", type=int, default=10, help="episodes, one per env")
    evaluate.add_argument(
        "--stochastic", action="store_true", help="sample actions instead of the mode"
    )
    evaluate.add_argument("--video", action="store_true", help="record one more episode")
    evaluate.add_argument("--seed", type=int, default=1_000_003, help="seed of the eval envs")
    _add_import(evaluate)
    export = commands.add_parser("export", help="export a run's policy to run without rlfabric")
    export.add_argument("logdir", help="the run's folder (runs/<name>)")
    export.add_argument(
        "--format",
        default="torchscript",
        help="comma-separated: torchscript, onnx (needs the onnx package)",
    )
    export.add_argument("--out", help="output folder (default: <logdir>/export)")
    _add_import(export)
    spec_cmd = commands.add_parser("spec", help="inspect specs")
    spec_sub = spec_cmd.add_subparsers(dest="spec_command", required=True)
    show = spec_sub.add_parser(
        "show",
        help="print the fully resolved spec, each value with where it came from "
        "(user, preset <name>, default)",
    )
    show.add_argument("spec", help="YAML experiment spec")
    show.add_argument("overrides", nargs="*", help="dotted overrides")
    _add_import(show)
    spec_sub.add_parser(
        "schema",
        help="print every spec field with its type, default and description (Markdown; "
        "docs/reference/spec.md)",
    )
    return parser


def _add_import(parser: argparse.ArgumentParser) -> None:
    """`--import MODULE` on every command that reads a spec or a run's folder."""
    parser.add_argument(
        "--import",
        dest="imports",
        metavar="MODULE",
        action="append",
        default=[],
        help="import MODULE first (repeatable; from the current folder too): it registers "
        "your own env ids with gymnasium.register; Ray's workers import it as they make "
        "the envs",
    )


def _import_modules(modules: list[str]) -> None:
    """Import the user's modules, looking in the current folder first as `python -m` does.

    The `rlfabric` script's sys.path starts with its own bin folder, not the folder it is
    run from, so `--import my_env` next to the spec failed without PYTHONPATH=. ; Ray's
    workers already look in the driver's folder.
    """
    if modules and os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as err:
            raise RLFabricError(f"--import {module}: {err}") from None


def _train(args: argparse.Namespace) -> int:
    from rlfabric.platform.facade import Platform

    overrides = list(args.overrides)
    if args.address:
        overrides.append(f"resources.address={args.address}")
    if args.resume == "auto":  # `train --resume auto SPEC`: the spec's run.resume
        if not args.spec:
            raise RLFabricError("train --resume auto needs a spec file: SPEC run.name=NAME")
        platform = Platform.from_yaml(args.spec, [*overrides, "run.resume=auto"])
    elif args.resume:
        if args.spec:  # `train --resume DIR a.b=c`: argparse took the first override as spec
            overrides.insert(0, args.spec)
        platform = Platform.resume(args.resume, overrides)
    elif args.spec:
        platform = Platform.from_yaml(args.spec, overrides)
    else:
        raise RLFabricError("train needs a spec file or --resume LOGDIR")
    try:
        platform.fit()  # SIGTERM (`ray job stop`, schedulers) ends it as Ctrl-C does
    except KeyboardInterrupt:
        print("interrupted: final checkpoint written, every actor stopped", file=sys.stderr)
        return 130
    return 0


def _tune(args: argparse.Namespace) -> int:
    from rlfabric.platform.facade import Platform
    from rlfabric.platform.tune import resume_search

    if args.resume and (args.spec or args.overrides):
        raise RLFabricError("tune --resume SEARCH_DIR takes no spec or overrides")
    if not args.resume and not args.spec:
        raise RLFabricError("tune needs a spec file or --resume SEARCH_DIR")
    overrides = list(args.overrides)
    if args.address:
        overrides.append(f"resources.address={args.address}")
    # A bad spec fails here, before Ray starts.
    platform = None if args.resume else Platform.from_yaml(args.spec, overrides)
    try:
        result = platform.tune() if platform else resume_search(args.resume, args.address)
    except KeyboardInterrupt:  # a second Ctrl-C: trials still writing were ended
        print("interrupted at once: trials end with their newest checkpoints", file=sys.stderr)
        return 130
    print(result.table())
    folder = Path(result.logdir)
    print(f"trials: {folder / 'trials.csv'}, curves: {folder / 'trials.png'}")
    if result.best_spec is not None:
        print(f"best:   {result.best_metric:.4g}; `rlfabric train {folder / 'best_spec.yaml'}`")
    if result.interrupted:
        print(f"interrupted: `rlfabric tune --resume {folder}` goes on", file=sys.stderr)
        return 130
    return 0


def _bench(args: argparse.Namespace) -> int:
    import yaml

    from rlfabric.envs import describe_env
    from rlfabric.platform.bench import format_table, plan_bench, run_bench
    from rlfabric.platform.spec import ExperimentSpec

    if args.spec and "=" in args.spec and not Path(args.spec).exists():
        args.overrides.insert(0, args.spec)  # no spec file: argparse took an override
        args.spec = None
    base: dict[str, Any] | None = None
    if args.spec:
        spec = ExperimentSpec.from_yaml(args.spec)  # fail early, with the spec's own message
        base = yaml.safe_load(Path(args.spec).read_text()) or {}
    env_id = args.env or (spec.env.id if args.spec else "CartPole-v1")
    out = Path(args.out)
    specs = plan_bench(
        base,
        env_id,
        args.archs.split(","),
        args.algo.split(","),
        args.frames,
        out,
        args.overrides,
    )
    threshold = args.threshold
    if threshold is None:
        threshold = describe_env(specs[0].env).reward_threshold
    rows = run_bench(specs, threshold, out)
    print(format_table(rows))
    print(f"wrote {out / 'bench.json'} and {out / 'bench.png'}")
    return 0


def _eval(args: argparse.Namespace) -> int:
    from rlfabric.platform.evaluate import evaluate, load_policy, record_video

    if args.episodes < 1:
        raise RLFabricError(f"--episodes must be at least 1, got {args.episodes}")
    if args.video:  # renders off screen: headless EGL for MuJoCo, no display for pygame
        os.environ.setdefault("MUJOCO_GL", "egl")
        os.environ.setdefault("SDL_VIDEODRIVER", "dummy")
    spec, algorithm = load_policy(args.logdir)
    deterministic = not args.stochastic
    result = evaluate(
        algorithm, spec.env, args.episodes, deterministic=deterministic, seed=args.seed
    )
    mode = "greedy" if deterministic else "stochastic"
    print(
        f"{spec.env.id}, {mode} policy, {args.episodes} episodes: return {result.mean:.2f} "
        f"+- {result.std:.2f} (min {result.returns.min():.2f}, max {result.returns.max():.2f}), "
        f"length {result.lengths.mean():.1f}"
    )
    if args.video:
        path, total = record_video(
            algorithm,
            spec.env,
            Path(args.logdir) / "eval_episode",
            deterministic=deterministic,
            seed=args.seed,
        )
        print(f"video: {path} (return {total:.2f})")
    return 0


def _export(args: argparse.Namespace) -> int:
    from rlfabric.platform.evaluate import load_policy
    from rlfabric.platform.export import export_policy

    spec, algorithm = load_policy(args.logdir)
    out = Path(args.out) if args.out else Path(args.logdir) / "export"
    for path in export_policy(spec, algorithm, out, tuple(args.format.split(","))):
        print(f"wrote {path}")
    return 0


def _spec(args: argparse.Namespace) -> int:
    if args.spec_command == "schema":
        from rlfabric.platform.reference import spec_markdown

        print(spec_markdown(), end="")
        return 0
    return _spec_show(args)


def _spec_show(args: argparse.Namespace) -> int:
    from rlfabric.envs import describe_env
    from rlfabric.envs.config import find_spec, is_atari
    from rlfabric.platform.spec import ExperimentSpec

    spec = ExperimentSpec.from_yaml(args.spec, args.overrides)
    threshold = describe_env(spec.env).reward_threshold
    print(spec.to_annotated_yaml(threshold, is_atari(find_spec(spec.env.id))), end="")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    handlers: dict[str, Any] = {
        "train": _train,
        "tune": _tune,
        "spec": _spec,
        "bench": _bench,
        "eval": _eval,
        "export": _export,
    }
    console = logging.StreamHandler()
    console.setLevel(logging.WARNING)  # INFO goes to the run's run.log only
    console.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=logging.WARNING, handlers=[console])
    try:
        _import_modules(getattr(args, "imports", []))
        return handlers[args.command](args)
    except RLFabricError as err:
        print(f"error: {err}", file=sys.stderr)
        if not isinstance(err, ActorError) and not hasattr(err, "run_log"):
            return 2  # found in this process before a run: the message is all there is
        where = getattr(err, "run_log", None)  # a run's errors: its run.log has the traceback
        if where is None:
            with tempfile.NamedTemporaryFile(
                "w", prefix="rlfabric-error-", suffix=".log", delete=False
            ) as f:
                traceback.print_exc(file=f)
                if isinstance(err, ActorError) and err.remote_traceback:
                    f.write(f"\nraised in {err.actor}:\n{err.remote_traceback}\n")
            where = f.name
        print(f"(traceback: {where})", file=sys.stderr)
        # 2: the message says what to fix; 1: something broke inside an actor.
        return 1 if isinstance(err, ActorError) and not err.user_error else 2


if __name__ == "__main__":
    sys.exit(main())
