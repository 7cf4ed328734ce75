"""The `rlfabric` command.

    rlfabric train SPEC.yaml [section.field=value ...]
    rlfabric train [--arch NAME] [--algo NAME] [--env ID] [section.field=value ...]
    rlfabric train --resume runs/<name> [section.field=value ...]
    rlfabric train --resume auto SPEC.yaml run.name=NAME [section.field=value ...]
    rlfabric tune [SPEC.yaml] [--arch/--algo/--env NAME] [section.field=value ...]
    rlfabric tune --resume SEARCH_DIR
    rlfabric spec show [SPEC.yaml] [--arch/--algo/--env NAME] [section.field=value ...]
    rlfabric spec schema
    rlfabric eval runs/<name> [--episodes 20] [--stochastic] [--video]
    rlfabric export runs/<name> [--format torchscript] [--out DIR]

What to train is a spec file, names, overrides, or any of them together: the
first word is the spec file if it is a file, else an override like the words
after it. `--arch seed --algo vtrace --env CartPole-v1` is the names-only call
`Platform(arch="seed", algo="vtrace", env="CartPole-v1")`; on a spec file they
replace its arch.name, algo.name and env.id. The spec file comes first, the
names on it, the dotted overrides last, each on top of the one before.

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
from typing import TYPE_CHECKING, Any

from rlfabric.errors import ActorError, RLFabricError, SpecError

if TYPE_CHECKING:
    from rlfabric.platform.spec import ExperimentSpec


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
    train = commands.add_parser(
        "train",
        help="train from a YAML spec, or from names and overrides alone",
        spec_help=True,
        epilog=TRAIN_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_spec_words(train, "dotted overrides, e.g. algo.lr=3e-4")
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
        epilog=TUNE_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_spec_words(
        search,
        "dotted overrides, e.g. tune.num_samples=8",
        "YAML experiment spec with a tune section (optional: names and overrides alone do)",
    )
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
    bench.add_argument(
        "spec", nargs="?", help="base YAML spec (optional; a word that is no file is an override)"
    )
    bench.add_argument("overrides", nargs="*", help="dotted overrides applied to every run")
    bench.add_argument(
        "--env",
        help="env id (default: the spec's, else CartPole-v1); without "
        "a spec each run starts from examples/specs/<env>_<arch>_<algo>.yaml",
    )
    bench.add_argument(
        "--archs", "--arch", dest="archs", default="seed,impala,ga3c", help="comma-separated archs"
    )
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
        epilog=SHOW_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_spec_words(show, "dotted overrides")
    _add_import(show)
    spec_sub.add_parser(
        "schema",
        help="print every spec field with its type, default and description (Markdown; "
        "docs/reference/spec.md)",
    )
    return parser


TRAIN_EXAMPLES = """\
examples:
  rlfabric train --algo ppo --env CartPole-v1          # names alone, the preset for them
  rlfabric train env.id=LunarLander-v3 algo.name=ppo   # overrides alone
  rlfabric train --env ALE/Pong-v5 algo.lr=3e-4        # names and overrides
  rlfabric train examples/specs/cartpole_seed_vtrace.yaml algo.lr=1e-3
  rlfabric train examples/specs/cartpole_seed_vtrace.yaml --arch impala

The first word is the spec file if it is a file, else an override. On a spec
file, --arch/--algo/--env replace its arch.name, algo.name, env.id (its other
fields stay, and must fit the new name); the dotted overrides go on top of both."""

TUNE_EXAMPLES = """\
examples:
  rlfabric tune search.yaml tune.num_samples=4
  rlfabric tune --algo ppo --env CartPole-v1 tune.num_samples=8 \\
      "tune.search.algo.lr={loguniform: [1.0e-4, 1.0e-2]}"   # names alone, a searched field"""

SHOW_EXAMPLES = """\
examples:
  rlfabric spec show --algo ppo --env CartPole-v1      # what `rlfabric train` would train
  rlfabric spec show examples/specs/cartpole_seed_ppo.yaml env.id=Acrobot-v1"""

#: `--arch/--algo/--env NAME`, the field each names (`--algo ppo` is algo.name ppo).
NAME_FLAGS = (("arch", "arch.name"), ("algo", "algo.name"), ("env", "env.id"))


def _add_spec_words(
    parser: argparse.ArgumentParser, overrides_help: str, spec_help: str = ""
) -> None:
    """A spec file, names and overrides: what train, tune and spec show take."""
    parser.add_argument(
        "spec",
        nargs="?",
        help=spec_help or "YAML experiment spec (optional: names and overrides alone do)",
    )
    parser.add_argument("overrides", nargs="*", help=overrides_help)
    parser.add_argument(
        "--arch", metavar="NAME", help="architecture (arch.name), e.g. seed, impala"
    )
    parser.add_argument("--algo", metavar="NAME", help="algorithm (algo.name), e.g. vtrace, ppo")
    parser.add_argument("--env", metavar="ID", help="gymnasium env id (env.id), e.g. ALE/Pong-v5")


def split_spec_words(words: list[str]) -> tuple[Path | None, list[str]]:
    """The spec file and the overrides among a command's words: the first word is the
    spec file if it is a file, else an override like every word after it."""
    from rlfabric.platform.spec import parse_override

    path = Path(words[0]) if words and Path(words[0]).is_file() else None
    overrides = words[1:] if path else list(words)
    for i, word in enumerate(overrides):
        try:
            parse_override(word)
        except SpecError:
            if path is None and i == 0:
                why = "a folder" if Path(word).is_dir() else "no such file"
                raise SpecError(
                    f"{word!r} is not a spec file ({why}) nor an override (section.field=value)"
                ) from None
            first = (
                "; the spec file is the first word, and only one" if Path(word).is_file() else ""
            )
            raise SpecError(f"{word!r} is not an override (section.field=value){first}") from None
    return path, overrides


def spec_from_args(
    args: argparse.Namespace, command: str, extra: list[str] | None = None, otherwise: str = ""
) -> ExperimentSpec:
    """The spec a command line names, built as `Platform(...)` builds it: the spec file's
    mapping (none: empty), `--arch/--algo/--env` set in it, then the dotted overrides and
    `extra` applied; so names alone are the names-only call, same presets and provenance."""
    from rlfabric.platform.spec import ExperimentSpec, read_spec_file, set_dotted

    path, overrides = split_spec_words(_spec_words(args))
    names = [(key, getattr(args, flag)) for flag, key in NAME_FLAGS if getattr(args, flag)]
    if path is None and not names and not overrides:
        raise SpecError(
            f"{command} needs a spec file, names (--arch, --algo, --env) or overrides "
            f"(section.field=value){otherwise}, e.g. `rlfabric {command} --env CartPole-v1`"
        )
    data = read_spec_file(path) if path else {}
    for key, value in names:  # strings as given: an env id is not parsed as YAML
        set_dotted(data, key.split("."), value)
    return ExperimentSpec.build(data, [*overrides, *(extra or [])])


def _spec_words(args: argparse.Namespace) -> list[str]:
    return ([args.spec] if args.spec else []) + list(args.overrides)


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

    address = [f"resources.address={args.address}"] if args.address else []
    if args.resume and args.resume != "auto":
        # `train --resume DIR a.b=c`: every word is an override of the run's own spec
        names = [f"{key}={getattr(args, flag)}" for flag, key in NAME_FLAGS if getattr(args, flag)]
        platform = Platform.resume(args.resume, [*names, *_spec_words(args), *address])
    else:  # `train --resume auto SPEC`: the spec's run.resume
        resume = ["run.resume=auto"] if args.resume else []
        spec = spec_from_args(args, "train", [*address, *resume], ", or --resume LOGDIR")
        platform = Platform(spec)
    try:
        platform.fit()  # SIGTERM (`ray job stop`, schedulers) ends it as Ctrl-C does
    except KeyboardInterrupt:
        print("interrupted: final checkpoint written, every actor stopped", file=sys.stderr)
        return 130
    return 0


def _tune(args: argparse.Namespace) -> int:
    from rlfabric.platform.facade import Platform
    from rlfabric.platform.tune import resume_search

    if args.resume and (_spec_words(args) or any(getattr(args, f) for f, _ in NAME_FLAGS)):
        raise RLFabricError("tune --resume SEARCH_DIR takes no spec, names or overrides")
    address = [f"resources.address={args.address}"] if args.address else []
    platform = None
    if not args.resume:  # a bad spec fails here, before Ray starts
        platform = Platform(spec_from_args(args, "tune", address, ", or --resume SEARCH_DIR"))
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
    from rlfabric.envs import describe_env
    from rlfabric.platform import presets
    from rlfabric.platform.bench import format_table, plan_bench, run_bench
    from rlfabric.platform.spec import ExperimentSpec, apply_overrides, read_spec_file

    path, overrides = split_spec_words(_spec_words(args))
    base = read_spec_file(path) if path else None
    if base is not None:
        ExperimentSpec.build(base)  # fail early, with the spec's own message
    # --env, else the spec's or an override's env.id, else the default env
    raw = presets.normalize(apply_overrides(base or {}, overrides))
    env_id = args.env or presets.names(raw)["env"]
    out = Path(args.out)
    specs = plan_bench(
        base, env_id, args.archs.split(","), args.algo.split(","), args.frames, out, overrides
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

    spec = spec_from_args(args, "spec show")
    threshold = describe_env(spec.env).reward_threshold
    print(spec.to_annotated_yaml(threshold, is_atari(find_spec(spec.env.id))), end="")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args, rest = parser.parse_known_args(argv)
    # argparse leaves the words after a flag that follows a word (`train env.id=X --algo
    # ppo algo.lr=1e-3`): overrides too, where the command takes them
    if rest:
        if not hasattr(args, "overrides") or any(word.startswith("-") for word in rest):
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        args.overrides += rest
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
