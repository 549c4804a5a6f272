"""Validation of a composed config, before any model is built or memory allocated; it returns the options it built,
so that nothing is built twice.

Three layers, each failing with one ``ConfigError`` that names the key:
1. top-level and schema-section keys against the structured schema; every group node against the signature of the
   class its ``_target_`` names (unknown keys, types, allowed literal values);
2. cross-field rules on plain values (mesh vs world size, experts vs EP, sequence vs rope range, ...);
3. each option built once (its constructor's checks) and its own ``validate(cfg, target)`` hook for the cross-group
   rules it owns (dispatcher, activation checkpointing, offload).

Validation is told where the config is to run (``moe_lab.runtime.device.Target``: the job's ranks, its device, what
kernels import there): the job's own (``job_target``), a planned machine's (``moe_lab.plan``) or an emulated
layout's (``moe_lab.parallel.emulate.emulated_target``), never read from the environment by a rule.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import inspect
import math
import os
import re
import types
import typing
from pathlib import Path

import torch
import yaml
from hydra.utils import get_object
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from moe_lab.checkpoint import directory as checkpoint_directory
from moe_lab.config.options import Options, build_options
from moe_lab.config.schema import GROUPS, TrainConfig, default_options
from moe_lab.parallel.emulate import emulated_target
from moe_lab.runtime.device import Target, machine_target
from moe_lab.runtime.errors import ConfigError
from moe_lab.runtime.paths import CONF_DIR, EXPERIMENTS_DIR

DEVICES = ("auto", "cpu", "cuda")
PRECISIONS = ("auto", "bf16", "fp32")
GRAD_SYNCS = ("step", "micro_batch")


def validate(cfg: DictConfig, target: Target | None = None) -> Options:
    """Check ``cfg`` for ``target`` (None: this job's, ``job_target``) and return its options, built."""
    check_known_keys(cfg)
    check_resolves(cfg)
    for group in GROUPS:
        check_target_node(group, cfg[group])
    target = target or job_target(cfg)
    check_rules(cfg, target)
    options = build_options(cfg)
    for option in options.with_rules():
        option.validate(cfg, target)
    return options


def job_target(cfg: DictConfig) -> Target:
    """Where this job runs: the emulated layout (``parallel.emulate``); the ranks an outer launcher (torchrun, srun:
    ``moe_lab.job.launcher``) started, as its WORLD_SIZE and LOCAL_WORLD_SIZE say; else the ranks the job starts
    itself on this node."""
    outer = "WORLD_SIZE" in os.environ
    if cfg.parallel.emulate:
        return emulated_target(cfg.trainer.nproc_per_node, cfg.parallel.emulate_nodes, outer_launcher=outer)
    if outer:
        world = int(os.environ["WORLD_SIZE"])
        return machine_target(world, int(os.environ.get("LOCAL_WORLD_SIZE", world)), outer_launcher=True)
    return machine_target(cfg.trainer.nproc_per_node, cfg.trainer.nproc_per_node)


def check_known_keys(cfg: DictConfig) -> None:
    """Top-level keys and the keys of schema sections (trainer, parallel, ...) must be the schema's: an appending
    override (``+trainer.foo=1``) gets past the structured config's struct flag."""
    hints = typing.get_type_hints(TrainConfig)
    for key in cfg:
        if key == "hydra":  # present when composed with return_hydra_config
            continue
        if key not in hints:
            raise _unknown_key(key, hints)
        if dataclasses.is_dataclass(hints[key]):
            _check_section(key, cfg[key], hints[key])


def _check_section(prefix: str, node, schema) -> None:
    hints = typing.get_type_hints(schema)
    unknown = [k for k in node if k not in hints]
    if unknown:
        raise _unknown_key(f"{prefix}.{unknown[0]}", hints)
    for key, hint in hints.items():
        if dataclasses.is_dataclass(hint) and isinstance(node.get(key), DictConfig):
            _check_section(f"{prefix}.{key}", node[key], hint)


def check_override_keys(
    overrides: list[str], schema: type = TrainConfig, every_option: bool = True, multirun: bool = False
) -> None:
    """The command line's keys and group options, before Hydra composes them: a mistyped top-level or schema-section
    key (``dispacher=fused``, ``trainer.stpes=10``), an option its group lacks (``dispatcher=fusd``, also in a sweep)
    or a key no chosen option of its group has (``dispatcher.sav=x``) is refused in one line naming what is allowed,
    rather than with Hydra's advice to append it with ``+`` or its search path. ``schema``: the entry point's
    (train's, or the planner's and the tune's with their own groups). A group's key must be a key of each option it
    has (``every_option``: each is composed with it): the command line's, else its presets' (their sweeps of it too
    under ``multirun``: ``-m``), else train.yaml's default;
    else (the tune: a key axis applies where a point has the key) of one of its options. Appended keys
    and deeper keys are checked once composed (``check_known_keys``, ``check_target_node``); a line Hydra cannot
    parse is left to Hydra to explain."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except OverrideParseException:
        return
    hints = typing.get_type_hints(schema)
    chosen: dict[str, list[str]] = {}
    for override in parsed:
        key = override.key_or_group
        if override.is_delete() or key == "hydra" or key.startswith(("hydra.", "hydra/")):
            continue
        if key == EXPERIMENT:
            if not override.is_add():
                raise ConfigError(key, "a study's preset is appended: +experiment=<study>[/<variant>]")
            check_options(key, _choices(override))
        elif _is_group(key, hints) and not override.is_add():
            chosen[key] = _choices(override)
            check_options(key, chosen[key])
    origin: dict[str, str] = {}  # where a group's options came from, when not from the command line
    if every_option:  # a group the command line leaves alone has the preset's option, else train.yaml's default
        for group, (options, source) in _implied_choices(parsed, multirun).items():
            if group not in chosen and _is_group(group, hints):
                chosen[group], origin[group] = options, source
    for override in parsed:
        key = override.key_or_group
        if override.is_add() or override.is_force_add() or key == "hydra" or key.startswith(("hydra.", "hydra/")):
            continue
        group, _, rest = key.partition(".")
        if rest and _is_group(group, hints):
            _check_option_key(
                group, rest.partition(".")[0], chosen.get(group) if every_option else None, origin.get(group)
            )
            continue
        parts, section, parent = key.split("."), schema, schema
        for depth in range(len(parts)):
            if not dataclasses.is_dataclass(section):
                break  # a key under a value
            section_hints = typing.get_type_hints(section)
            if parts[depth] not in section_hints:
                raise _unknown_key(".".join(parts[: depth + 1]), section_hints)
            parent, section = section, section_hints[parts[depth]]
        else:
            if not dataclasses.is_dataclass(section):
                _check_schema_value(key, parent, parts[-1], override)


def _check_schema_value(key: str, section: type, name: str, override) -> None:
    """A schema key's value (each of a choice sweep's) must be one OmegaConf can store in the key's type: else Hydra
    would stop the whole command (a sweep's valid points too) with its merge error."""
    values = [override.value()] if not override.is_sweep_override() else []
    values = list(override.sweep_iterator()) if override.is_choice_sweep() else values
    node = OmegaConf.structured(section)
    for value in values:
        try:
            node[name] = value
        except OmegaConfBaseException:
            raise ConfigError(
                key, f"expected {_describe(typing.get_type_hints(section)[name])}, got {value!r}"
            ) from None


def check_command_line(argv: list[str], schema: type = TrainConfig) -> None:
    """``check_override_keys`` over an entry point's ``sys.argv``: its ``key=value`` words, a sweep under ``-m``."""
    overrides = [arg for arg in argv[1:] if not arg.startswith("-") and "=" in arg]
    check_override_keys(overrides, schema, multirun=bool({"-m", "--multirun"} & set(argv)))


EXPERIMENT = "experiment"  # the studies' presets, appended: +experiment=<study>[/<variant>]


def _is_group(key: str, hints: dict) -> bool:
    return key in hints and (CONF_DIR / key).is_dir()


def _choices(override) -> list[str]:
    """The options an override of a group names (each of a choice sweep's); none for other sweeps (glob, range)."""
    if not override.is_sweep_override():
        value = override.value()
        return [value] if isinstance(value, str) else []
    return list(override.sweep_string_iterator()) if override.is_choice_sweep() else []


def options_of(group: str) -> list[str]:
    """A group's options: its yaml files (the studies' presets for ``experiment``)."""
    if group == EXPERIMENT:
        presets = [p.parent.name for p in EXPERIMENTS_DIR.glob("*/preset.yaml")]
        variants = [f"{p.parent.name}/{p.stem}" for p in EXPERIMENTS_DIR.glob("*/*.yaml") if p.name != "preset.yaml"]
        return sorted(presets + variants + [p.stem for p in EXPERIMENTS_DIR.glob("*.yaml")])
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def check_options(group: str, names: list[str]) -> None:
    options = options_of(group)
    for name in names:
        if name not in options:
            where = "studies' presets" if group == EXPERIMENT else "options"
            raise ConfigError(group, f"no option {name!r}; {where}: {', '.join(options)}")


def _implied_choices(parsed, multirun: bool) -> dict[str, tuple[list[str], str]]:
    """The options of the groups a command line does not choose: its presets' (``+experiment``, each of a sweep's;
    under ``multirun`` a preset's own sweep of a group too), else train.yaml's default; with where they come from,
    for the message."""
    presets = next((_choices(o) for o in parsed if o.key_or_group == EXPERIMENT and o.is_add()), [])
    chosen_by = [_preset_options(name, multirun) for name in presets]
    defaults = default_options()
    implied: dict[str, tuple[list[str], str]] = {}
    for group, default in defaults.items():
        options = sorted({o for by in chosen_by for o in by.get(group, [default])} or {default})
        implied[group] = (options, "the preset's" if any(group in by for by in chosen_by) else "the default")
    return implied


def _preset_options(name: str, multirun: bool) -> dict[str, list[str]]:
    """The group options a study's preset chooses: its defaults list, after those of the presets it includes; under
    ``multirun`` its ``hydra.sweeper.params`` of a group (``ac: full,selective``) instead."""
    path = EXPERIMENTS_DIR / name / "preset.yaml"
    path = path if path.is_file() else EXPERIMENTS_DIR / f"{name}.yaml"
    preset = yaml.safe_load(path.read_text()) or {}
    options: dict[str, list[str]] = {}
    for entry in preset.get("defaults") or []:
        if isinstance(entry, str) and entry.startswith(f"/{EXPERIMENT}/"):
            options |= _preset_options(entry.removeprefix(f"/{EXPERIMENT}/"), multirun)
        elif isinstance(entry, dict):
            for key, option in entry.items():
                group = key.removeprefix("override").strip().strip("/")
                if "/" not in group and isinstance(option, str):
                    options[group] = [option]
    swept = ((preset.get("hydra") or {}).get("sweeper") or {}).get("params") or {} if multirun else {}
    for group, values in swept.items():
        if "." not in group:  # a group, not a key
            options[group] = [str(v).strip() for v in (values if isinstance(values, list) else str(values).split(","))]
    return options


def _check_option_key(group: str, key: str, options: list[str] | None, origin: str | None = None) -> None:
    """``key`` must be set by each option ``group`` has here (by one of its options when that is unknown);
    ``_target_`` too is a key an override may set (a class of one's own). ``origin``: where the options came from
    when the command line did not choose them (the preset's, the default)."""
    keys = {name: set(OmegaConf.load(CONF_DIR / group / f"{name}.yaml") or {}) for name in options_of(group)}

    def shown(held: set[str]) -> str:
        return ", ".join(sorted(k for k in held if not k.startswith("_"))) or "no keys"

    having = [f"{group}={name}" for name, held in keys.items() if key in held]
    if not having and (taking := _classes_taking(group, key)):
        raise ConfigError(
            f"{group}.{key}", f"not in a {group} option's yaml, but {taking} takes it: append it, +{group}.{key}=..."
        )
    if not having:
        chosen = [name for name in options or [] if name in keys]  # the keys of the options in use, where known
        scope = f" with {', '.join(f'{group}={name}' for name in chosen)}" if chosen else ""
        scope += f" ({origin})" if chosen and origin else ""
        allowed = set().union(*(keys[name] for name in chosen or keys))
        message = f"no {group} option has this key; allowed{scope}: {shown(allowed)}"
        others = {k: name for name, held in keys.items() for k in held - allowed if not k.startswith("_")}
        if near := difflib.get_close_matches(key, others, n=1):  # another option's key, mistyped
            message += f"; {group}={others[near[0]]} has {near[0]}"
        raise ConfigError(f"{group}.{key}", message)
    lacking = [name for name in options or [] if name in keys and key not in keys[name]]
    if lacking:
        message = f"unknown key for {group}={lacking[0]}" + (f" ({origin})" if origin else "")
        message += (
            f"; allowed: {shown(keys[lacking[0]])}; {' and '.join(having)} {'has' if len(having) == 1 else 'have'} it"
        )
        raise ConfigError(f"{group}.{key}", message)


def _classes_taking(group: str, key: str) -> str:
    """The option classes of ``group`` with a parameter ``key`` their yaml leaves to its default (a hardware
    profile's efficiencies, say), by name; "" for none."""
    taking = []
    for name in options_of(group):
        target = (OmegaConf.load(CONF_DIR / group / f"{name}.yaml") or {}).get("_target_")
        with contextlib.suppress(Exception):  # a class that cannot be imported or read here takes nothing here
            if target and key in inspect.signature(get_object(target)).parameters and target not in taking:
                taking.append(target)
    return ", ".join(taking)


def _unknown_key(key: str, allowed) -> ConfigError:
    where = "top-level key" if "." not in key else "key"
    return ConfigError(key, f"unknown {where}; allowed: {', '.join(allowed)}")


def check_resolves(cfg: DictConfig) -> None:
    """Every value must be given and resolve: a required key left ``???`` (``data.path`` of data=tokens) or an
    interpolation that fails (``model=hf`` reading a missing config.json) is named."""
    for key in cfg:
        if key == "hydra":
            continue
        try:
            OmegaConf.to_container(cfg[key], resolve=True, throw_on_missing=True)
        except OmegaConfBaseException as e:
            cause = _config_error_in(e)
            if cause is not None:
                raise cause from None
            missing = isinstance(e, MissingMandatoryValue) or isinstance(e.__cause__, MissingMandatoryValue)
            where = getattr(e.__cause__, "full_key", None) if missing and e.__cause__ is not None else e.full_key
            raise ConfigError(where or key, "is required: set it on the command line" if missing else str(e)) from None


def _config_error_in(e: BaseException) -> ConfigError | None:
    while e is not None and not isinstance(e, ConfigError):
        e = e.__cause__ or e.__context__
    return e


def check_target_node(key: str, node) -> None:
    if not isinstance(node, DictConfig) or "_target_" not in node:
        raise ConfigError(key, "must be a config group option with a _target_")
    try:
        target = get_object(node._target_)
    except Exception as e:
        raise ConfigError(f"{key}._target_", f"cannot import {node._target_!r}: {e}") from None
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):  # a builtin without one: an option is a Python class whose keys can be read
        raise ConfigError(f"{key}._target_", f"{node._target_} is no option class (its keys cannot be read)") from None
    params = {
        name: p for name, p in signature.parameters.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    }
    try:
        hints = typing.get_type_hints(target.__init__ if inspect.isclass(target) else target)
    except Exception:
        hints = {}
    values = OmegaConf.to_container(node, resolve=True)
    for name, value in values.items():
        if name.startswith("_"):
            continue
        if name not in params:
            raise ConfigError(
                f"{key}.{name}", f"unknown key for {node._target_}; allowed: {', '.join(sorted(params)) or 'no keys'}"
            )
        if name in hints and not _matches(value, hints[name]):
            message = f"expected {_describe(hints[name])}, got {value!r}"
            raw = OmegaConf.to_container(node, resolve=False)[name] if OmegaConf.is_interpolation(node, name) else None
            followed = re.fullmatch(r"\$\{([\w.]+)\}", str(raw)) if raw is not None else None
            if followed:  # the key the user set, which this one follows (``${precision.experts}``)
                raise ConfigError(followed[1], f"{message} (as {key}.{name}, which follows it)")
            raise ConfigError(f"{key}.{name}", message)


def _matches(value, annotation) -> bool:
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return value in typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, arm) for arm in typing.get_args(annotation))
    if annotation is type(None):
        return value is None
    if annotation is bool:
        return isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is str:
        return isinstance(value, str)
    if origin in (tuple, list) and isinstance(value, list):
        args = typing.get_args(annotation)
        if origin is list or (len(args) == 2 and args[1] is Ellipsis):
            return all(_matches(v, args[0]) for v in value) if args else True
        return len(value) == len(args) and all(_matches(v, a) for v, a in zip(value, args))
    if origin in (tuple, list):  # a string would be read a character at a time, a number not at all
        return False
    if inspect.isclass(annotation) and not isinstance(value, dict):
        # A yaml scalar or list is never a Tensor / ProcessGroup; a dict may be a node that instantiates one.
        return isinstance(value, annotation)
    return True  # other annotations (iterables of params, callables) are left to the class itself


def _describe(annotation) -> str:
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(annotation))
    if origin in (tuple, list):
        return f"a list of [{', '.join(_describe(a) for a in typing.get_args(annotation))}]"
    if annotation is type(None):
        return "null"
    return getattr(annotation, "__name__", str(annotation))


def check_rules(cfg: DictConfig, target: Target) -> None:
    m, t, p, d = cfg.model, cfg.trainer, cfg.parallel, cfg.data
    sizes = "vocab_size hidden_size num_layers num_heads num_kv_heads head_dim num_experts moe_intermediate_size"
    for key in sizes.split():
        _require(m[key] >= 1, f"model.{key}", f"must be >= 1, got {m[key]}")
    for key in ("rope_theta", "rms_norm_eps", "init_std"):
        _require(m[key] > 0, f"model.{key}", f"must be > 0, got {m[key]}")
    for key in ("seq_len", "batch_size"):
        _require(d[key] >= 1, f"data.{key}", f"must be >= 1, got {d[key]}")
    _require(
        1 <= m.num_experts_per_tok <= m.num_experts,
        "model.num_experts_per_tok",
        f"must be in [1, model.num_experts={m.num_experts}], got {m.num_experts_per_tok}",
    )
    _require(
        m.num_heads % m.num_kv_heads == 0,
        "model.num_kv_heads",
        f"must divide model.num_heads={m.num_heads}, got {m.num_kv_heads}",
    )
    _require(m.head_dim % 2 == 0, "model.head_dim", f"must be even for rotary embeddings, got {m.head_dim}")
    _require(m.routing_skew > 0, "model.routing_skew", f"must be > 0, got {m.routing_skew}")
    _require(
        d.seq_len <= m.max_position_embeddings,
        "data.seq_len",
        f"must be <= model.max_position_embeddings={m.max_position_embeddings}, got {d.seq_len}",
    )
    for key in ("router_aux_loss_coef", "router_bias_update_rate"):
        _require(m[key] >= 0, f"model.{key}", f"must be >= 0, got {m[key]}")
    check_optimizer(cfg.optimizer)
    _require(t.steps >= 1, "trainer.steps", f"must be >= 1, got {t.steps}")
    _require(t.grad_accum >= 1, "trainer.grad_accum", f"must be >= 1, got {t.grad_accum}")
    # A warmup longer than the run is allowed: a short smoke run (trainer.steps=3) then stays in warmup.
    _require(t.warmup_steps >= 0, "trainer.warmup_steps", f"must be >= 0, got {t.warmup_steps}")
    _require(0 <= t.min_lr_ratio <= 1, "trainer.min_lr_ratio", f"must be in [0, 1], got {t.min_lr_ratio}")
    _require(t.grad_clip is None or t.grad_clip > 0, "trainer.grad_clip", f"must be null or > 0, got {t.grad_clip}")
    _require(t.timing_skip >= 0, "trainer.timing_skip", f"must be >= 0, got {t.timing_skip}")
    _require(t.nproc_per_node >= 1, "trainer.nproc_per_node", f"must be >= 1, got {t.nproc_per_node}")
    _require(t.device in DEVICES, "trainer.device", f"must be one of {', '.join(DEVICES)}, got {t.device!r}")
    _require(
        t.device != "cuda" or target.device_type == "cuda",
        "trainer.device",
        "is cuda but the machine has no CUDA device; use auto or cpu",
    )
    _require(
        t.precision in PRECISIONS, "trainer.precision", f"must be one of {', '.join(PRECISIONS)}, got {t.precision!r}"
    )
    _require(t.peak_flops is None or t.peak_flops > 0, "trainer.peak_flops", f"must be null or > 0, got {t.peak_flops}")
    _require(t.eval_every >= 0, "trainer.eval_every", f"must be >= 0, got {t.eval_every}")
    _require(t.eval_batches >= 1, "trainer.eval_batches", f"must be >= 1, got {t.eval_batches}")
    _require(t.expert_load_every >= 0, "trainer.expert_load_every", f"must be >= 0, got {t.expert_load_every}")
    check_determinism(t)
    check_init_checkpoint(t.init_checkpoint, m)
    check_checkpointing(t)
    pr = cfg.profile
    # The first step span opens when the profiler starts, before the model is built: never record it.
    _require(pr.wait >= 1, "profile.wait", f"must be >= 1, got {pr.wait}")
    _require(pr.warmup >= 0, "profile.warmup", f"must be >= 0, got {pr.warmup}")
    _require(pr.active >= 1, "profile.active", f"must be >= 1, got {pr.active}")
    window = pr.wait + pr.warmup + pr.active
    _require(
        not pr.enabled or window <= t.steps,
        "profile.active",
        f"the profile window (wait + warmup + active = {window}) must fit in trainer.steps={t.steps}",
    )

    check_emulation(cfg, target)
    check_mesh(p, target.world_size, target.ranks_per_node)
    _require(
        p.grad_sync in GRAD_SYNCS, "parallel.grad_sync", f"must be one of {', '.join(GRAD_SYNCS)}, got {p.grad_sync!r}"
    )
    _require(m.num_experts % p.ep == 0, "parallel.ep", f"must divide model.num_experts={m.num_experts}, got {p.ep}")


def check_mesh(p: DictConfig, world: int, node: int) -> None:
    """The (dp_replicate, dp_shard) mesh of ``world`` ranks, ``node`` on each node, and EP inside it (``p``: the
    parallel section): replicas of world / dp_replicate ranks each; EP groups split a replica's ranks and, with
    replicas, stay inside a node (consecutive ranks: an EP group never spans replicas, nor nodes where there are
    replicas; the fused dispatcher's gpu backend checks its own node rule)."""
    # the same words for an emulated layout as for its real ranks: emulation refuses what the real run refuses
    ranks = f"the job's {world} ranks (trainer.nproc_per_node or WORLD_SIZE, x parallel.emulate_nodes when emulated)"
    _require(
        p.dp_replicate >= 1 and world % p.dp_replicate == 0,
        "parallel.dp_replicate",
        f"must be >= 1 and divide {ranks}, got {p.dp_replicate}",
    )
    shard = world // p.dp_replicate  # FSDP2 shards the dense weights over a replica's ranks
    replica = f"the {shard} ranks of a replica (world {world} / parallel.dp_replicate={p.dp_replicate})"
    _require(
        p.ep >= 1 and shard % p.ep == 0,
        "parallel.ep",
        f"must be >= 1 and divide {replica}, got {p.ep}"
        if p.dp_replicate > 1
        else f"must be >= 1 and divide {ranks}, got {p.ep}",
    )
    _require(
        p.dp_replicate == 1 or node % p.ep == 0,
        "parallel.ep",
        f"with parallel.dp_replicate > 1 must divide a node's {node} ranks (EP inside a node), got {p.ep}",
    )


def check_emulation(cfg: DictConfig, target: Target) -> None:
    """``parallel.emulate``: one process of its own; the mesh rules below then hold for the emulated layout, so a
    layout the real run refuses is refused the same way."""
    p = cfg.parallel
    if not p.emulate:
        return

    _require(
        not target.outer_launcher,
        "parallel.emulate",
        "runs as one process; start it without torchrun / srun (trainer.nproc_per_node and parallel.emulate_nodes "
        "say the layout)",
    )
    _require(p.emulate_nodes >= 1, "parallel.emulate_nodes", f"must be >= 1, got {p.emulate_nodes}")
    world = cfg.trainer.nproc_per_node * p.emulate_nodes
    _require(
        0 <= p.emulate_rank < world,
        "parallel.emulate_rank",
        f"must be a rank of the emulated layout's {world} (trainer.nproc_per_node x parallel.emulate_nodes), got "
        f"{p.emulate_rank}",
    )
    c = cfg.trainer.checkpoint
    _require(
        not (c.every or c.on_signal),
        "trainer.checkpoint.every" if c.every else "trainer.checkpoint.on_signal",
        "an emulated rank's weights are not a model's: parallel.emulate saves no checkpoints (set 0 / false)",
    )
    profiles = sorted(f.stem for f in (CONF_DIR / "hardware").glob("*.yaml") if f.stem != "file")
    _require(
        p.emulate_hardware in profiles,
        "parallel.emulate_hardware",
        f"must be one of {', '.join(profiles)}, got {p.emulate_hardware!r}",
    )


def check_optimizer(o) -> None:
    """Ranges of the hyperparameters torch's optimizers share (a key the option lacks is not checked)."""
    _require(math.isfinite(o.lr) and o.lr > 0, "optimizer.lr", f"must be finite and > 0, got {o.lr}")
    if "weight_decay" in o:
        _require(
            math.isfinite(o.weight_decay) and o.weight_decay >= 0,
            "optimizer.weight_decay",
            f"must be finite and >= 0, got {o.weight_decay}",
        )
    if "eps" in o:
        _require(math.isfinite(o.eps) and o.eps > 0, "optimizer.eps", f"must be finite and > 0, got {o.eps}")
    if "betas" in o:
        _require(all(0 <= b < 1 for b in o.betas), "optimizer.betas", f"each must be in [0, 1), got {list(o.betas)}")
    _require(
        not (o.get("fused") and o.get("foreach")),
        "optimizer.foreach",
        "picks torch's multi-tensor path; optimizer.fused=true picks its fused kernel: set one of them to false",
    )


def check_determinism(t) -> None:
    from moe_lab.runtime.determinism import inductor_has_deterministic_mode

    _require(
        not (t.deterministic and t.compile and not inductor_has_deterministic_mode()),
        "trainer.deterministic",
        f"with trainer.compile=true needs Inductor's deterministic mode, which torch {torch.__version__} lacks (its "
        "kernels' configurations are benchmarked anew in each process); set trainer.compile=false",
    )


def check_init_checkpoint(path, model: DictConfig) -> None:
    """A checkpoint directory; with a Hugging Face config.json beside the weights, the model config must not
    contradict it (shape-preserving differences such as rope_theta would otherwise load into another model)."""
    if path is None:
        return
    from moe_lab.models.hf_config import CONFIG, check_agrees
    from moe_lab.models.hf_weights import INDEX, SINGLE  # (moe_lab.models imports this package's errors)

    _require(
        path != "" and any((Path(path) / name).is_file() for name in (SINGLE, INDEX)),
        "trainer.init_checkpoint",
        f"must be null or a directory holding {SINGLE} or {INDEX}, got {path!r}",
    )

    if (Path(path) / CONFIG).is_file():
        check_agrees(OmegaConf.to_container(model, resolve=True), path, "trainer.init_checkpoint")


def check_checkpointing(t) -> None:
    c = t.checkpoint
    _require(c.every is None or c.every >= 0, "trainer.checkpoint.every", f"must be null or >= 0, got {c.every}")
    _require(c.keep is None or c.keep >= 1, "trainer.checkpoint.keep", f"must be null (keep all) or >= 1, got {c.keep}")
    _require(
        c.dir is None or c.dir != "",
        "trainer.checkpoint.dir",
        "must be null (the run directory's checkpoints/) or a path, got ''",
    )
    if t.resume not in ("auto", "never"):
        problem = checkpoint_directory.why_incomplete(t.resume)
        _require(
            problem is None,
            "trainer.resume",
            f"must be auto, never or a complete checkpoint (a step_<N> directory holding {checkpoint_directory.MARKER}), "
            f"got {t.resume!r}: {problem}",
        )


def _require(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ConfigError(key, message)
