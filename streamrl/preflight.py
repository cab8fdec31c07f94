"""Preflight: what a run needs from the machine, checked before any process starts.

:func:`~streamrl.config.load_config` checks values on their own (types, ranges, names).
Preflight checks them against the world outside the config: the model folder or hub id
exists (offline), every input file named in the config is there, reward and environment
plug-ins import and are callable, the learner's expert-parallel degree fits the world size and the model,
``model.lora`` fits the model (its target modules exist, its family is not refused), and an
optional metric sink that was asked for (``run.wandb``) is installed.
``streamrl-launch --dry-run`` and the launcher's start run it; each problem is one line
naming the dotted field, and the launcher exits 2 (bad input) instead of a child process
failing later with a traceback.

Examples:
    >>> from streamrl.config import load_config
    >>> preflight(load_config("configs/tiny.yaml"), learner_world=2)
    []
"""
from __future__ import annotations

import dataclasses
import importlib
import json
from pathlib import Path
from typing import Iterator

from streamrl.config import Config, ConfigError
from streamrl.metrics import wandb_available
from streamrl.rewards import parse_reward_spec
from streamrl.tasks.datasets import check_dataset_columns

# Config fields whose (non-empty) value names an input the run reads. ``model.path`` is
# resolved on its own (a folder or a cached hub id).
_INPUT_SUFFIXES = ("_file", "path", "dataset")
# Keys under which HF configs store the routed-expert count.
_EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


def input_fields(cfg: Config) -> Iterator[tuple[str, str]]:
    """``(dotted name, value)`` of every non-empty string field naming an input file or folder
    (names ending in ``_file``, ``path`` or ``dataset``), whatever section declares it."""
    for section in dataclasses.fields(cfg):
        node = getattr(cfg, section.name)
        if not dataclasses.is_dataclass(node):
            continue
        for f in dataclasses.fields(node):
            value = getattr(node, f.name)
            if isinstance(value, str) and value and f.name.endswith(_INPUT_SUFFIXES):
                yield f"{section.name}.{f.name}", value


def _looks_like_path(value: str) -> bool:
    """A dataset field may also hold a registered name (``basic_arithmetic``): only values that
    look like paths (a separator or a file suffix) are checked on disk."""
    return "/" in value or value.startswith((".", "~")) or bool(Path(value).suffix)


def check_inputs(cfg: Config) -> list[str]:
    """One line per input file or folder named in the config that does not exist."""
    problems = []
    for name, value in input_fields(cfg):
        if name == "model.path":
            continue
        if name.endswith("dataset") and not _looks_like_path(value):
            continue
        if not Path(value).expanduser().exists():
            problems.append(f"config field '{name}' = {value!r}: no such file or folder")
    return problems


def check_model(cfg: Config) -> tuple[list[str], Path | None]:
    """``model.path`` resolved (local folder or cached hub id); the tiny model needs nothing."""
    if not cfg.model.path:
        return [], None
    # the streamrl.models package loads torch and transformers: the launcher stays free of them
    from streamrl.models.resolve import resolve_model_path  # noqa: PLC0415

    try:
        return [], resolve_model_path(cfg.model.path)
    except ConfigError as e:
        return [str(e)], None


def _import_callable(spec: str, field: str) -> str | None:
    """None when ``package.module:function`` imports to a callable, else the problem."""
    module, _, attr = spec.partition(":")
    if not module or not attr:
        return f"config field '{field}' names {spec!r}: expected 'package.module:function'"
    try:
        obj = importlib.import_module(module)
    except Exception as e:  # noqa: BLE001 (any import failure is the user's to see, in one line)
        return f"config field '{field}' names {spec!r}: cannot import {module!r} ({type(e).__name__}: {e})"
    for part in attr.split("."):
        if not hasattr(obj, part):
            return f"config field '{field}' names {spec!r}: module {module!r} has no attribute {attr!r}"
        obj = getattr(obj, part)
    if not callable(obj):
        return f"config field '{field}' names {spec!r}: {attr!r} is a {type(obj).__name__}, not callable"
    return None


def check_reward_plugins(cfg: Config) -> list[str]:
    """Every ``package.module:function`` in ``rollout.rewards`` and ``rollout.reward_model`` (or its HF folder)."""
    problems = []
    for name, _ in parse_reward_spec(cfg.rollout.rewards):
        if ":" in name:
            problems.append(_import_callable(name, "rollout.rewards"))
    if cfg.rollout.reward_model:
        from streamrl.roles.reward_model import is_reward_model_folder, reward_model_kind  # noqa: PLC0415 (torch)

        if is_reward_model_folder(cfg.rollout.reward_model):  # an HF reward-model folder: its kind must be known
            try:
                reward_model_kind(cfg.rollout.reward_model)
            except ValueError as e:
                problems.append(str(e))
        else:
            problems.append(_import_callable(cfg.rollout.reward_model, "rollout.reward_model"))
    return [p for p in problems if p]


def check_env_plugin(cfg: Config) -> list[str]:
    """A plug-in environment (``env.name = 'package.module:function'``) imports and is callable."""
    if ":" not in cfg.env.name:
        return []
    problem = _import_callable(cfg.env.name, "env.name")
    return [problem] if problem else []


def model_expert_count(cfg: Config, folder: Path | None) -> int:
    """Routed experts per MoE layer: from the folder's config.json, or the tiny model's config."""
    if folder is None:
        return cfg.model.num_experts
    try:
        hf = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return 0
    hf = {**hf.get("text_config", {}), **hf}
    return next((int(hf[k]) for k in _EXPERT_KEYS if isinstance(hf.get(k), int)), 0)


def check_parallel(cfg: Config, learner_world: int | None, folder: Path | None) -> list[str]:
    """``learner.ep`` against the learner world size and the model's experts."""
    if learner_world is None:
        return []
    from streamrl.parallel.mesh import ParallelConfigError, ParallelDims  # noqa: PLC0415 (torch.distributed, as above)

    try:
        ParallelDims(learner_world, cfg.learner.ep).validate(model_expert_count(cfg, folder))
    except ParallelConfigError as e:
        return [f"{e} (--learners / placement.learner give {learner_world} learner rank(s))"]
    return []


def check_lora(cfg: Config, folder: Path | None) -> list[str]:
    """``model.lora`` against the model: a refused family, target modules that match nothing."""
    if not cfg.model.lora.active or (cfg.model.path and folder is None):  # no model: check_model said so
        return []
    from streamrl.models.lora import lora_problems  # noqa: PLC0415 (torch, transformers, peft, as above)

    return lora_problems(cfg.model, folder)


def check_sinks(cfg: Config) -> list[str]:
    """Optional metric sinks that were asked for must be installed."""
    if cfg.run.wandb and not wandb_available():
        return ["config field 'run.wandb' = true: the wandb package is not installed "
                "(pip install 'streamrl[wandb]'), or drop --wandb"]
    return []


def preflight(cfg: Config, learner_world: int | None = None) -> list[str]:
    """All problems found, one line each (empty: the run can start).

    Args:
        cfg: a validated config.
        learner_world: learner ranks in the run (None: this host starts no learner).
    """
    problems, folder = check_model(cfg)
    problems += check_inputs(cfg)
    problems += check_dataset_columns(cfg)
    problems += check_reward_plugins(cfg)
    problems += check_env_plugin(cfg)
    problems += check_parallel(cfg, learner_world, folder)
    problems += check_lora(cfg, folder)
    problems += check_sinks(cfg)
    return problems


class PreflightError(ConfigError):
    """One or more preflight problems; the message holds one line per problem."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


def require_preflight(cfg: Config, learner_world: int | None = None) -> None:
    """Raise :class:`PreflightError` listing every problem, if any."""
    problems = preflight(cfg, learner_world)
    if problems:
        raise PreflightError(problems)
