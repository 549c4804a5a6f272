"""``python -m moe_lab.train --help`` (and ``moe_lab.plan``'s): every config group with its options and every schema
key, each in a line, fed from the schema (``moe_lab.config.schema``) and the option files' leading comments or
classes' docstrings."""

from __future__ import annotations

import dataclasses
import inspect
import re
from pathlib import Path

import yaml
from hydra.core.config_store import ConfigStore
from hydra.utils import get_object

from moe_lab.config.schema import GROUPS, ParallelConfig, ProfileConfig, TrainerConfig, default_options
from moe_lab.runtime.paths import CONF_DIR, EXPERIMENTS_DIR

SECTIONS = {"trainer": TrainerConfig, "parallel": ParallelConfig, "profile": ProfileConfig}


def option_line(path: Path, width: int = 110) -> str:
    """What an option is: the first sentence of its file's leading comment, else of its class's docstring."""
    comment = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        if "@package" not in line:
            comment.append(line.lstrip("# ").strip())
    text = " ".join(comment).removeprefix("Question: ")
    if not text:
        target = (yaml.safe_load(path.read_text()) or {}).get("_target_")
        try:
            text = " ".join((inspect.getdoc(get_object(target)) or "").split()) if target else ""
        except Exception:  # an option whose class cannot be imported here still gets listed
            text = ""
    sentence = re.split(r"(?<=[.?])\s", text, maxsplit=1)[0]
    return sentence if len(sentence) <= width else sentence[: width - 3].rstrip() + "..."


TRAIN_USAGE = """moe_lab: Mixture-of-Experts parallelism experiments on Qwen3-MoE, one Hydra config group per axis.

  python -m moe_lab.train [group=option ...] [key=value ...]      one run
  python -m moe_lab.train -m ac=full,selective dispatcher=torch,fused   a sweep: one result.json per point
  python -m moe_lab.train [overrides] --cfg job --resolve         the whole resolved config, nothing run"""


def help_text(usage: str = TRAIN_USAGE, groups: dict[str, str] = GROUPS, defaults: dict[str, str] | None = None) -> str:
    """The page: ``usage``, then ``groups`` (train's by default) with their options, train.yaml's default first
    (``defaults`` adds those of groups train.yaml lacks), the study presets and the schema's keys."""
    lines = [*usage.splitlines(), "", "== Config groups (group=option; the default first) =="]
    defaults = default_options() | (defaults or {})
    for group, what in groups.items():
        options = sorted((CONF_DIR / group).glob("*.yaml"), key=lambda p: (p.stem != defaults.get(group), p.stem))
        lines.append(f"{group}: {what}")
        lines += [f"    {p.stem:<12} {option_line(p)}" for p in options]
    lines += ["", "== Study presets (+experiment=NAME; experiments/<study>/README.md says what each answers) =="]
    presets = sorted(EXPERIMENTS_DIR.glob("*/preset.yaml")) + sorted(EXPERIMENTS_DIR.glob("*.yaml"))
    presets += sorted(p for p in EXPERIMENTS_DIR.glob("*/*.yaml") if p.name != "preset.yaml")
    for path in presets:
        name = (
            path.parent.name
            if path.name == "preset.yaml"
            else path.relative_to(EXPERIMENTS_DIR).with_suffix("").as_posix()
        )
        lines.append(f"    {name:<24} {option_line(path)}")
    lines += ["", "== Keys (key=value; the default shown) =="]
    for section, schema in SECTIONS.items():
        lines += key_lines(section, schema)
    lines += [
        "",
        "Group options' own keys (model.num_layers, dispatcher.backend, ...): see --cfg job.",
        "",
        "$FLAGS_HELP",
    ]
    return "\n".join(lines).replace("${", "$${") + "\n"


def key_rows(prefix: str, schema) -> list[tuple[str, str | None, str]]:
    """(key, default as yaml spells it, what it does) per key of a schema section, a nested section's keys after its
    own row (default None) under its own prefix."""
    rows = []
    for f in dataclasses.fields(schema):
        if dataclasses.is_dataclass(f.default_factory):  # a nested section
            rows.append((f"{prefix}.{f.name}", None, f.metadata["help"]))
            rows += key_rows(f"{prefix}.{f.name}", f.default_factory)
            continue
        default = (
            "null" if f.default is None else str(f.default).lower() if isinstance(f.default, bool) else str(f.default)
        )
        rows.append((f"{prefix}.{f.name}", default, f.metadata["help"]))
    return rows


def key_lines(prefix: str, schema) -> list[str]:
    """One line per key of a schema section, a nested section's keys under its own prefix."""
    lines = []
    for key, default, what in key_rows(prefix, schema):
        lines.append(
            f"  {key}.*".ljust(40) + f" {what}:" if default is None else f"  {key}={default}".ljust(40) + f" {what}"
        )
    return lines


def register_help(
    usage: str = TRAIN_USAGE, groups: dict[str, str] = GROUPS, defaults: dict[str, str] | None = None
) -> str:
    """Store the help page (``help_text``'s arguments) as Hydra's ``hydra/help=moe_lab`` option; returns the override
    that selects it."""
    node = {"app_name": "moe_lab", "header": "", "footer": "", "template": help_text(usage, groups, defaults)}
    ConfigStore.instance().store(group="hydra/help", name="moe_lab", node=node)
    return "hydra/help=moe_lab"
