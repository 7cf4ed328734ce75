"""ExperimentSpec: the one source of truth for the Python API, YAML files and CLI.

Each section's model lives with the layer that consumes it (envs, models,
algorithms, architectures); this module composes them, loads YAML with the
safe loader, applies dotted overrides and turns pydantic's errors into one
paragraph that names the field, the value given and what is allowed.
"""

from __future__ import annotations

import copy
import difflib
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    SerializeAsAny,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)

from rlfabric.algorithms import ALGORITHMS, AlgoConfig
from rlfabric.architectures import ARCHITECTURES, ArchConfig
from rlfabric.envs import EnvConfig
from rlfabric.errors import SpecError
from rlfabric.models import ModelConfig
from rlfabric.platform import presets
from rlfabric.platform.presets import Provenance
from rlfabric.runtime.config import ResourcesConfig, RunConfig, StopConfig
from rlfabric.sparse.config import SparseConfig

#: Frame budget of a run whose spec names no stop condition (besides the env's
#: registered reward threshold, which also applies then).
DEFAULT_ENV_FRAMES = 5_000_000


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _registered(value: Any, registry: dict[str, Any], what: str) -> BaseModel:
    """Validate a section against the config model its `name` registers."""
    if isinstance(value, BaseModel):
        value = value.model_dump(by_alias=True)
    if isinstance(value, str):
        value = {"name": value}
    if not isinstance(value, dict):
        raise ValueError(f"{what} must be a name or a mapping with a 'name' key, got {value!r}")
    name = value.get("name")
    if name not in registry:
        raise ValueError(f"unknown {what} {name!r}; registered: {', '.join(sorted(registry))}")
    return registry[name].config_cls.model_validate(value)


class Distribution(_Section):
    """One searched value: exactly one of its fields, named as Ray Tune names them."""

    uniform: tuple[float, float] | None = Field(None, description="[low, high)")
    loguniform: tuple[float, float] | None = Field(
        None, description="[low, high), uniform in log space; low > 0"
    )
    randint: tuple[int, int] | None = Field(None, description="integers in [low, high)")
    choice: list[Any] | None = Field(None, min_length=1, description="one of these, at random")
    grid: list[Any] | None = Field(
        None, min_length=1, description="every one of these (each with num_samples trials)"
    )

    @model_validator(mode="before")
    @classmethod
    def _one_kind(cls, value: Any) -> Any:
        kinds = ", ".join(cls.model_fields)
        if not isinstance(value, dict) or len(value) != 1:
            raise ValueError(f"must be a mapping with one key, one of {kinds} (given: {value!r})")
        (kind,) = value
        if kind not in cls.model_fields:
            raise ValueError(f"unknown distribution {kind!r}; allowed: {kinds}")
        return value

    @model_validator(mode="after")
    def _bounds(self) -> Distribution:
        kind, value = self.kind, self.value
        if kind in ("uniform", "loguniform", "randint") and not value[0] < value[1]:
            raise ValueError(f"{kind} needs low < high (given: {list(value)})")
        if kind == "loguniform" and value[0] <= 0:
            raise ValueError(f"loguniform needs low > 0 (given: {list(value)})")
        return self

    @model_serializer
    def _as_written(self) -> dict[str, Any]:
        return {self.kind: list(self.value)}

    @property
    def kind(self) -> str:
        return next(iter(self.model_fields_set))

    @property
    def value(self) -> Any:
        return getattr(self, self.kind)

    def examples(self) -> list[Any]:
        """Values a trial may get, to check against the field before any trial starts:
        every choice, or both ends of a range."""
        if self.kind in ("choice", "grid"):
            return list(self.value)
        low, high = self.value
        return [low, high - 1] if self.kind == "randint" else [low, high]


#: Searched fields population-based training may change in a running trial: values
#: the algorithm reads at each update, none that a checkpoint holds (optimizer
#: state besides lr, replay contents) or that shapes the run (networks, envs,
#: batches, the topology).
PBT_MUTABLE = (
    "algo.lr",
    "algo.entropy_cost",
    "algo.grad_clip",
    "algo.reward_clip",
    "algo.baseline_cost",
    "algo.value_cost",
    "algo.clip_coef",
    "algo.gae_lambda",
    "algo.lambda",
    "algo.rho_bar",
    "algo.c_bar",
    "algo.pg_rho_bar",
    "algo.pg_clip",
    "algo.epochs",
    "algo.num_minibatches",
    "algo.tau",
    "algo.policy_noise",
    "algo.noise_clip",
    "algo.exploration_noise",
    "algo.policy_freq",
)


class SchedulerConfig(_Section):
    """Which trials go on: ASHA stops the worse ones at rungs; PBT copies the better
    ones' checkpoints into the worse and perturbs their values; FIFO runs every trial out."""

    name: Literal["asha", "pbt", "fifo"] = Field("asha", description="trial scheduler")
    grace_frames: int = Field(
        50_000, ge=1, description="asha: env frames every trial runs before it can be stopped"
    )
    reduction_factor: float = Field(
        4.0, gt=1, description="asha: 1/reduction_factor of the trials go on at each rung"
    )
    perturbation_frames: int = Field(
        50_000,
        ge=1,
        description="pbt: env frames between a trial's exploit/explore decisions",
    )
    quantile_fraction: float = Field(
        0.25,
        gt=0,
        le=0.5,
        description="pbt: the bottom fraction of trials copies a trial of the top fraction",
    )
    resample_probability: float = Field(
        0.25,
        ge=0,
        le=1,
        description="pbt: chance that explore draws a value anew from its distribution "
        "instead of scaling it by 0.8 or 1.2",
    )
    synch: bool = Field(
        False,
        description="pbt: trials wait for each other at each perturbation point (Tune's "
        "synch), so every decision ranks the whole population; each run is paused and "
        "started again from its checkpoint there",
    )


class TuneConfig(_Section):
    """A search over spec fields on Ray Tune; each trial is one ordinary run."""

    num_samples: int = Field(
        1, ge=1, description="trials drawn from `search` (a grid: trials per grid point)"
    )
    metric: str = Field("episode_return_mean", description="reported metric that ranks trials")
    mode: Literal["max", "min"] = Field("max", description="whether higher metric is better")
    scheduler: SchedulerConfig = Field(
        default_factory=SchedulerConfig, description="trial scheduler; time is env frames"
    )
    search: dict[str, Distribution] = Field(
        default_factory=dict,
        description="dotted spec field (algo.lr) -> distribution {uniform|loguniform|randint|"
        "choice|grid: ...}",
    )
    max_concurrent_trials: int | None = Field(
        None,
        ge=1,
        description="trials running at once; null: all of them, each with an equal share of "
        "the CPUs where resources.learner_cpus / cpus_per_env_runner are null",
    )
    seed: int | None = Field(
        None,
        ge=0,
        description="seed of the values drawn for the trials: the same seed and search draw "
        "the same trials (to compare schedulers); null: new values each search",
    )


class ExperimentSpec(_Section):
    """Everything a run needs. Strings for env/arch/algo are shorthand for their name.

    Build it with `build` / `from_yaml` (the Python API and CLI do): they fill what the
    user left out from the preset for the algorithm and env family before validating.
    """

    preset: str = Field(
        presets.AUTO,
        description="tuned settings under the user's own values: 'auto' (by algo and env "
        "family), 'none' (the algorithm's paper defaults), a family name ('classic') or "
        "'<algo>/<family>'; a resolved spec names the preset it used",
    )
    env: EnvConfig = Field(default_factory=EnvConfig, description="environment")
    arch: SerializeAsAny[ArchConfig] = Field(
        default_factory=lambda: ARCHITECTURES["seed"].config_cls(),
        description="distributed architecture",
    )
    algo: SerializeAsAny[AlgoConfig] = Field(
        default_factory=lambda: ALGORITHMS["vtrace"].config_cls(), description="algorithm"
    )
    model: ModelConfig = Field(default_factory=ModelConfig, description="network")
    sparse: SparseConfig = Field(default_factory=SparseConfig, description="sparse training")
    resources: ResourcesConfig = Field(default_factory=ResourcesConfig, description="resources")
    run: RunConfig = Field(default_factory=RunConfig, description="run bookkeeping")
    tune: TuneConfig | None = Field(
        None,
        description="hyperparameter search (`rlfabric tune`); `rlfabric train` ignores it",
    )
    _provenance: Provenance | None = PrivateAttr(None)

    @field_validator("env", mode="before")
    @classmethod
    def _env_shorthand(cls, value: Any) -> Any:
        return {"id": value} if isinstance(value, str) else value

    @field_validator("arch", mode="before")
    @classmethod
    def _arch(cls, value: Any) -> BaseModel:
        return _registered(value, ARCHITECTURES, "architecture")

    @field_validator("algo", mode="before")
    @classmethod
    def _algo(cls, value: Any) -> BaseModel:
        return _registered(value, ALGORITHMS, "algorithm")

    @model_validator(mode="after")
    def _recurrent_minibatches_fit(self) -> ExperimentSpec:
        minibatches = getattr(self.algo, "num_minibatches", None)
        if self.model.lstm and minibatches and minibatches > self.algo.batch_size:
            raise ValueError(
                f"algo.num_minibatches={minibatches} must be <= algo.batch_size="
                f"{self.algo.batch_size} with model.lstm: recurrent minibatches are groups "
                "of whole unrolls"
            )
        return self

    # -- construction -------------------------------------------------------

    @classmethod
    def build(cls, data: dict[str, Any], overrides: list[str] | None = None) -> ExperimentSpec:
        """Validate a raw mapping after applying dotted overrides; raise SpecError."""
        data = presets.normalize(apply_overrides(data, overrides or []))
        preset = _find_preset(data)
        merged = copy.deepcopy(data)
        if preset:
            # The preset's algo/arch fields belong to the names the spec chose.
            chosen = {k: {"name": v} for k, v in presets.names(data).items() if k != "env"}
            presets.fill(merged, presets.fill(preset.merged(), chosen))
        merged["preset"] = preset.name if preset else presets.NONE
        try:
            spec = cls.model_validate(merged)
        except ValidationError as err:
            raise SpecError(format_validation_error(err, merged)) from None
        spec._provenance = Provenance(data, preset)
        if spec.tune is not None:
            _check_search(spec.tune, data)
        return spec

    @classmethod
    def from_yaml(cls, path: str | Path, overrides: list[str] | None = None) -> ExperimentSpec:
        return cls.build(read_spec_file(path), overrides)

    def user_values(self) -> dict[str, Any]:
        """What the user wrote (overrides applied, shorthands expanded), before presets:
        the base a search varies, so that a searched `arch.name` or `algo.name` gets its
        own preset and fields rather than the first choice's."""
        if self._provenance is None:
            return self.to_dict()
        return copy.deepcopy(self._provenance.user)

    def __eq__(self, other: object) -> bool:
        """Equal values are equal specs, whatever their provenance."""
        if not isinstance(other, ExperimentSpec):
            return NotImplemented
        return self.to_dict() == other.to_dict()

    __hash__ = None  # type: ignore[assignment]  # mutable, like any pydantic model

    def origin(self, path: tuple[str, ...]) -> str:
        """Where the value at `path` came from: 'user', 'preset <name>' or 'default'."""
        return self._provenance.origin(path) if self._provenance else "user"

    def provenance(self) -> list[tuple[str, Any, str]]:
        """(dotted key, value, origin) of every value of the resolved spec, the origin
        as `spec show` gives it: what a tracker logs as the run's config."""
        return list(_leaves(self.to_dict(), (), self.origin))

    def to_dict(self) -> dict[str, Any]:
        # No `tune: null` in every run's spec.yaml: the section is for searches only.
        exclude = {"tune"} if self.tune is None else None
        return self.model_dump(mode="json", by_alias=True, exclude=exclude)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def to_annotated_yaml(self, reward_threshold: float | None, atari: bool) -> str:
        """The spec as `rlfabric spec show` prints it: every value followed by where it
        came from; the stop conditions in force (the defaults when the spec names none,
        which a comment says); no env.atari block for an env that is not Atari."""
        data = self.to_dict()
        if not atari:
            del data["env"]["atari"]
        stop = self.stop_conditions(reward_threshold)
        data["run"]["stop"] = {k: v for k, v in stop.model_dump().items() if v is not None}
        header = [f"# preset {self.preset}"]
        if self._provenance and self._provenance.preset:
            source = textwrap.wrap(f"source: {self._provenance.preset.source}", 88)
            header += [f"#   {line}" for line in source]
        if stop is not self.run.stop:
            header.append(
                f"# run.stop names no condition: in force are the default budget "
                f"({DEFAULT_ENV_FRAMES:,} env frames) and the env's reward threshold "
                f"({reward_threshold})"
            )
        return "\n".join([*header, *_annotate(data, (), self.origin)]) + "\n"

    def stop_conditions(self, reward_threshold: float | None) -> StopConfig:
        """The stop conditions in force: the spec's, or the defaults if it names none."""
        stop = self.run.stop
        if any(v is not None for v in stop.model_dump().values()):
            return stop
        return StopConfig(env_frames=DEFAULT_ENV_FRAMES, episode_return_mean=reward_threshold)


def read_spec_file(path: str | Path) -> dict[str, Any]:
    """The raw mapping a YAML spec file holds; raise SpecError naming the file if there is
    none, it is not YAML, it holds no mapping, or an empty one.

    An empty file is refused rather than read as the defaults: it is more often the wrong
    file, or one not yet saved, than a choice, and it would train CartPole for minutes.
    """
    path = Path(path)
    if not path.is_file():
        raise SpecError(f"spec file {str(path)!r} does not exist")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise SpecError(f"spec file {str(path)!r} is not valid YAML: {err}") from None
    if data is None or data == {}:
        defaults = presets.DEFAULT_NAMES["env"]
        raise SpecError(
            f"spec file {str(path)!r} is empty: it names nothing to train. To train the "
            f"defaults on purpose, name them: `rlfabric train --env {defaults}` without a "
            f"file, or `env: {defaults}` in it (`rlfabric spec show --env {defaults}` "
            "prints what that trains)"
        )
    if not isinstance(data, dict):
        raise SpecError(f"spec file {str(path)!r} must hold a mapping, got {type(data).__name__}")
    return data


def _check_search(tune: TuneConfig, data: dict[str, Any]) -> None:
    """Build the spec with each searched field at the values a trial may get, so that a
    key naming no field or a value the field refuses fails now, naming the key."""
    base = {k: v for k, v in data.items() if k != "tune"}
    if tune.scheduler.name == "pbt" and not tune.search:
        raise SpecError("invalid spec: tune.search: pbt needs at least one searched field")
    for key, distribution in tune.search.items():
        path = key.split(".")
        if path[0] == "tune" or not all(path):
            raise SpecError(
                f"invalid spec: tune.search.{key}: must name a field outside the tune section"
            )
        if tune.scheduler.name == "pbt" and key not in PBT_MUTABLE:
            raise SpecError(
                f"invalid spec: tune.search.{key}: pbt changes searched values in running "
                f"trials, and {key} cannot change mid-run (it shapes the run or lives in its "
                f"checkpoint); pbt can search: {', '.join(PBT_MUTABLE)}. Search {key} with "
                "asha or fifo"
            )
        for value in distribution.examples():
            trial = copy.deepcopy(base)
            try:
                set_dotted(trial, path, value)
                ExperimentSpec.build(trial)
            except SpecError as err:
                detail = str(err).removeprefix("invalid spec: ")
                raise SpecError(
                    f"invalid spec: tune.search.{key}: value {value!r}: {detail}"
                ) from None


def _leaves(
    node: dict[str, Any], path: tuple[str, ...], origin: Any
) -> Iterator[tuple[str, Any, str]]:
    """The leaves of a mapping as `_annotate` walks them, each with its origin."""
    for key, value in node.items():
        here = (*path, key)
        if isinstance(value, dict) and value:
            yield from _leaves(value, here, origin)
        else:
            yield ".".join(here), value, origin(here)


def _annotate(node: dict[str, Any], path: tuple[str, ...], origin: Any) -> list[str]:
    """YAML lines of a mapping, a `# origin` comment after every leaf value."""
    lines = []
    indent = "  " * len(path)
    for key, value in node.items():
        here = (*path, key)
        if isinstance(value, dict) and value:
            lines.append(f"{indent}{key}:")
            lines += _annotate(value, here, origin)
            continue
        text = yaml.safe_dump({key: value}, default_flow_style=True, width=1_000)
        text = text.strip().removeprefix("{").removesuffix("}")
        lines.append(f"{indent}{text}  # {origin(here)}")
    return lines


def _find_preset(data: dict[str, Any]) -> presets.Preset | None:
    """The preset a normalized raw spec asks for, checked against its algo and arch.

    A preset naming a field the chosen algorithm (or architecture) does not have
    is a spec error naming the preset, raised before anything starts.
    """
    chosen = presets.names(data)
    name = data.get("preset", presets.AUTO)
    if not isinstance(name, str):
        raise SpecError(f"preset: must be a name (given: {name!r})")
    try:
        env = EnvConfig.model_validate(data.get("env") or {})
    except ValidationError:
        return None  # the whole spec's validation names the env's error
    try:
        preset = presets.find_preset(name, chosen["algo"], chosen["arch"], env)
    except SpecError:  # the env's own (a wrapper that fails on the env the family needs)
        raise
    except ValueError as err:
        raise SpecError(f"preset: {err}") from None
    if preset is None:
        return None
    preset = preset.yielding_to(data)
    probe = presets.fill(
        {"algo": {"name": chosen["algo"]}, "arch": {"name": chosen["arch"]}}, preset.merged()
    )
    try:
        ExperimentSpec.model_validate(probe)
    except ValidationError as err:
        detail = format_validation_error(err, probe).removeprefix("invalid spec: ")
        raise SpecError(
            f"preset {preset.name!r} does not fit algo '{chosen['algo']}' / arch "
            f"'{chosen['arch']}': {detail}"
        ) from None
    return preset


def parse_override(text: str) -> tuple[list[str], Any]:
    """`algo.lr=3e-4` -> (["algo", "lr"], 0.0003); values parse as YAML scalars."""
    key, sep, raw = text.partition("=")
    if not sep or not key or any(not part for part in key.split(".")):
        raise SpecError(f"override {text!r} is not of the form section.field=value")
    try:
        value = yaml.safe_load(raw) if raw else None
    except yaml.YAMLError:
        value = raw
    return key.split("."), value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Patch a raw spec mapping with dotted `key=value` overrides (returns a copy)."""
    data = copy.deepcopy(data)
    for text in overrides:
        path, value = parse_override(text)
        if path[:2] == ["tune", "search"] and len(path) > 3:
            # A searched field is one key with dots: `tune.search.algo.lr={choice: [..]}`
            path = [*path[:2], ".".join(path[2:])]
        try:
            set_dotted(data, path, value)
        except SpecError as err:
            raise SpecError(f"override {text!r}: {err}") from None
    return data


def set_dotted(data: dict[str, Any], path: list[str], value: Any) -> None:
    """Set `data[path[0]][path[1]]... = value` in place, creating sections on the way."""
    node = data
    for depth, part in enumerate(path[:-1]):
        child = node.get(part)
        if isinstance(child, str):  # shorthand `algo: vtrace` -> {name: vtrace}
            child = {"id" if path[: depth + 1] == ["env"] else "name": child}
        elif child is None:
            child = {}
        elif not isinstance(child, dict):
            raise SpecError(f"{'.'.join(path[: depth + 1])} is not a section")
        node[part] = child
        node = child
    node[path[-1]] = value


#: Field names as Stable-Baselines3, RLlib or CleanRL write them -> rlfabric's (the
#: ones a section has are suggested for an unknown field).
SYNONYMS: dict[str, tuple[str, ...]] = {
    "learning_rate": ("lr",),
    "ent_coef": ("entropy_cost",),
    "entropy_coeff": ("entropy_cost",),
    "vf_coef": ("baseline_cost", "value_cost"),
    "vf_loss_coeff": ("baseline_cost", "value_cost"),
    "max_grad_norm": ("grad_clip",),
    "grad_clip_norm": ("grad_clip",),
    "n_steps": ("unroll_length",),
    "rollout_fragment_length": ("unroll_length",),
    "num_steps": ("unroll_length",),
    "clip_range": ("clip_coef",),
    "clip_param": ("clip_coef", "pg_clip"),
    "n_epochs": ("epochs",),
    "update_epochs": ("epochs",),
    "num_sgd_iter": ("epochs",),
    "gae_lambda": ("lambda", "gae_lambda"),
    "buffer_size": ("buffer_capacity",),
    "learning_starts": ("warmup_steps",),
    "n_envs": ("num_envs",),
    "num_envs_per_env_runner": ("num_envs",),
    "num_env_runners": ("max_env_runners",),
    "total_timesteps": ("env_frames", "agent_steps"),
}


def format_validation_error(err: ValidationError, data: dict[str, Any]) -> str:
    """One paragraph: each bad field with the value given and what is allowed."""
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"])
        if e["type"] == "extra_forbidden":
            model = _model_at(e["loc"][:-1], data)
            # The names users write: a field's alias (`lambda`), not its Python name.
            names = [
                info.alias or name for name, info in (model.model_fields if model else {}).items()
            ]
            given_name = str(e["loc"][-1])
            close = difflib.get_close_matches(given_name, names, n=3, cutoff=0.6)
            close = [
                s for s in SYNONYMS.get(given_name, ()) if s in names and s not in close
            ] + close
            hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
            allowed = f"; allowed here: {', '.join(names)}" if names else ""
            lines.append(f"{loc}: unknown field{hint}{allowed}")
            continue
        msg = e["msg"].removeprefix("Value error, ")
        given = e.get("input")
        given_txt = "" if isinstance(given, dict) else f" (given: {given!r})"
        lines.append(f"{loc or 'spec'}: {msg}{given_txt}")
    return "invalid spec: " + "; ".join(lines)


def _model_at(loc: tuple[Any, ...], data: dict[str, Any]) -> type[BaseModel] | None:
    """The config model at `loc` in the spec; algo and arch resolve through their name."""
    model: Any = ExperimentSpec
    node: Any = data
    for part in loc:
        node = node.get(part) if isinstance(node, dict) else None
        if model is ExperimentSpec and part in ("algo", "arch"):
            registry: dict[str, Any] = ALGORITHMS if part == "algo" else ARCHITECTURES
            name = node if isinstance(node, str) else (node or {}).get("name")
            model = registry[name].config_cls if name in registry else None
        else:
            field = model.model_fields.get(part)
            model = field.annotation if field else None
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            return None
    return model
