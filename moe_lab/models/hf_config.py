"""A Hugging Face Qwen3-MoE ``config.json`` in this project's model keys (``conf/model/*.yaml``), and the check
that a model config does not contradict one. Plain Python (json only): validation reads it before anything is built.

Both spellings transformers has written are read: ``num_experts`` (transformers 4) or ``num_local_experts`` (5),
``rope_theta`` at the top (4) or under ``rope_parameters`` (5), ``rope_type`` or its older ``type``, and ``head_dim``
absent (hidden_size / heads); a file giving both spellings of one key with two values is refused (the two readers
would pick different ones).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from moe_lab.runtime.errors import ConfigError

CONFIG = "config.json"
# The keys that define what the model computes: a config that differs in one of them is another model, even where
# the weights' shapes agree. (num_layers may be smaller: a proxy of the first layers.)
ARCHITECTURE = (
    "vocab_size",
    "hidden_size",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "norm_topk_prob",
    "max_position_embeddings",
    "rope_theta",
    "rms_norm_eps",
)
# What moe_lab's Qwen3-MoE does not build, as config.json spells it, with the value it assumes.
UNSUPPORTED = {
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "tie_word_embeddings": False,
    "attention_bias": False,
    "use_sliding_window": False,
    "rope_scaling": None,
    "attention_dropout": 0.0,
}
ACTIVATIONS = ("silu", "swish")  # the experts' SwiGLU gate: transformers' two names of one function


def read_hf_config(directory: str | Path, key: str) -> dict:
    """The model keys a Qwen3-MoE ``config.json`` in ``directory`` gives; failures raise ``ConfigError(key)``, ``key``
    being the setting that named the directory."""
    path = Path(directory) / CONFIG
    try:
        hf = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(key, f"needs a Hugging Face {CONFIG} in {directory!r}: {e}") from None
    if not isinstance(hf, dict):
        raise ConfigError(key, f"{path} holds a JSON {type(hf).__name__}, not an object of config keys")
    if hf.get("model_type") != "qwen3_moe":
        raise ConfigError(key, f"{path} is model_type {hf.get('model_type')!r}; moe_lab builds qwen3_moe")
    rope = hf.get("rope_parameters")
    rope = {} if rope is None else rope
    if not isinstance(rope, dict):
        raise ConfigError(key, f"{path} has rope_parameters={rope!r}, not an object of RoPE keys")
    spellings = [("rope_parameters.rope_type", rope, "rope_type"), ("rope_parameters.type", rope, "type")]
    rope_type = _one_of(path, key, spellings, default="default")
    if rope_type != "default":
        raise ConfigError(
            key, f"{path} has rope_parameters' rope_type {rope_type!r}; moe_lab's RoPE is the default one"
        )
    if hf.get("hidden_act", "silu") not in ACTIVATIONS:
        raise ConfigError(
            key, f"{path} has hidden_act={hf['hidden_act']!r}; moe_lab's experts gate with {' = '.join(ACTIVATIONS)}"
        )
    for name, assumed in UNSUPPORTED.items():
        if hf.get(name, assumed) not in (assumed, None):
            raise ConfigError(
                key, f"{path} has {name}={hf[name]!r}; moe_lab's Qwen3-MoE builds only {name}={assumed!r}"
            )
    try:
        return {
            "name": Path(directory).resolve().name,
            "vocab_size": hf["vocab_size"],
            "hidden_size": hf["hidden_size"],
            "num_layers": hf["num_hidden_layers"],
            "num_heads": hf["num_attention_heads"],
            "num_kv_heads": hf["num_key_value_heads"],
            "head_dim": hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
            "num_experts": _one_of(
                path, key, [("num_experts", hf, "num_experts"), ("num_local_experts", hf, "num_local_experts")]
            ),
            "num_experts_per_tok": hf["num_experts_per_tok"],
            "moe_intermediate_size": hf["moe_intermediate_size"],
            "norm_topk_prob": hf["norm_topk_prob"],
            "max_position_embeddings": hf["max_position_embeddings"],
            "rope_theta": float(
                _one_of(
                    path, key, [("rope_theta", hf, "rope_theta"), ("rope_parameters.rope_theta", rope, "rope_theta")]
                )
            ),
            "rms_norm_eps": float(hf["rms_norm_eps"]),
            "init_std": float(hf.get("initializer_range", 0.02)),
            "router_aux_loss_coef": float(hf.get("router_aux_loss_coef", 0.001)),
        }
    except KeyError as e:
        raise ConfigError(key, f"{path} has no {e.args[0]}") from None


def _one_of(path: Path, key: str, spellings: list[tuple[str, dict, str]], default=None):
    """The value of a setting ``config.json`` may spell several ways, each spelling (its name in a message, the
    object holding it, its key there): the one given, or ``default``; none given without a default is a
    ``KeyError`` naming the first spelling, two given with two values a ``ConfigError``."""
    given = [(name, holder[field]) for name, holder, field in spellings if field in holder]
    if any(value != given[0][1] for _, value in given[1:]):
        both = ", ".join(f"{name}={value!r}" for name, value in given)
        raise ConfigError(
            key, f"{path} gives {both}: two values for one setting (readers differ on which wins); keep one"
        )
    if given:
        return given[0][1]
    if default is None:
        raise KeyError(spellings[0][0])
    return default


def check_agrees(model: dict, directory: str | Path, key: str) -> None:
    """Refuse a model config (``model``: its keys and values) that contradicts the ``config.json`` in
    ``directory`` in a key that defines the model, naming the model's key; ``key`` names the setting that
    pointed at the directory."""
    hf = read_hf_config(directory, key)
    for name in ARCHITECTURE:
        ours, theirs = model[name], hf[name]
        same = math.isclose(ours, theirs, rel_tol=1e-9) if isinstance(theirs, float) else ours == theirs
        if not same:
            raise ConfigError(f"model.{name}", f"is {ours!r}, but {Path(directory) / CONFIG} ({key}) says {theirs!r}")
    if model["num_layers"] > hf["num_layers"]:
        raise ConfigError(
            "model.num_layers",
            f"is {model['num_layers']}, but {Path(directory) / CONFIG} ({key}) has {hf['num_layers']} layers (a proxy takes at most that many)",
        )
