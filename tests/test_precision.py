"""The precision group (moe_lab/parallel/precision.py): precision=bf16 | fp8_experts | fp8. The dispatchers'
expert_precision follows it; fp8 converts exactly the attention projections to torchao's float8 linears (names and
values unchanged) and is refused, naming the key, where its GEMMs cannot run (each recipe's compute capability and
side multiple; the experts' FP8 below Hopper); one rank's bf16 autocast reaches the routed experts' GEMMs; the planner puts those projections at
the FP8 dense rate; the converted model trains like the bf16 one within FP8's error (on CPU, where torch emulates the
FP8 GEMMs, and on a GPU: ``gpu`` marker)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from moe_lab.config.validate import validate
from moe_lab.models.qwen3_moe import Qwen3MoeConfig, SparseMoeBlock
from moe_lab.moe.dispatcher import FusedDispatcher, TorchDispatcher
from moe_lab.parallel.ac import kept_ops
from moe_lab.parallel.precision import FP8_MATMULS, PROJECTIONS, Bf16Dense, Fp8Dense
from moe_lab.runtime.device import Target
from moe_lab.runtime.errors import ConfigError

# The tiny model with the FP8 experts' 128-wide tiles: q and o 128 wide, k and v 64.
SHAPE = ("model.hidden_size=128", "model.moe_intermediate_size=128", "model.head_dim=32")


def gpu_target(capability):
    return Target(
        world_size=1, ranks_per_node=1, device_type="cuda", compute_capability=capability, deep_gemm_error=None
    )


@pytest.mark.parametrize("dispatcher", ["torch", "fused"])
def test_the_dispatchers_expert_precision_follows_the_group(compose_train, dispatcher):
    for precision, experts in (("bf16", "bf16"), ("fp8_experts", "fp8"), ("fp8", "fp8")):
        cfg = compose_train(f"precision={precision}", f"dispatcher={dispatcher}")
        assert cfg.precision.experts == experts and cfg.dispatcher.expert_precision == experts
    overridden = compose_train("precision=fp8_experts", f"dispatcher={dispatcher}", "dispatcher.expert_precision=bf16")
    assert overridden.dispatcher.expert_precision == "bf16"  # a command line's key still wins


@pytest.mark.parametrize("precision, experts", [("bf16", "bf16"), ("fp8_experts", "fp8")])
def test_bf16_and_fp8_experts_validate_on_cpu(compose_train, precision, experts):
    options = validate(compose_train(f"precision={precision}", *SHAPE))
    assert type(options.precision) is Bf16Dense and options.precision.experts == experts
    assert options.dispatcher.expert_precision == experts  # the torch dispatcher emulates FP8 on CPU


def test_fp8_is_refused_where_its_gemms_cannot_run(compose_train):
    pytest.importorskip("torchao")
    with pytest.raises(ConfigError) as error:
        validate(compose_train("precision=fp8", *SHAPE))  # this machine: no GPU
    assert error.value.key == "precision" and "fp8_experts" in str(error.value)
    # the dense FP8 alone (its experts in bf16: their own check wants SM90, tests/test_fp8.py)
    cfg = compose_train("precision=fp8", "precision.experts=bf16", *SHAPE, "trainer.device=auto")
    with pytest.raises(ConfigError) as error:
        validate(cfg, gpu_target((8, 0)))  # Ampere: no FP8 tensor cores
    assert error.value.key == "precision" and "8.9" in str(error.value)
    assert type(validate(cfg, gpu_target((8, 9))).precision) is Fp8Dense  # Ada: rowwise runs
    assert type(validate(cfg, gpu_target(None)).precision) is Fp8Dense  # a planned GPU: its profile decides
    blockwise = compose_train(
        "precision=fp8", "precision.experts=bf16", "precision.recipe=blockwise", *SHAPE, "trainer.device=auto"
    )
    with pytest.raises(ConfigError) as error:
        validate(blockwise, gpu_target((8, 9)))
    assert error.value.key == "precision" and "9.0" in str(error.value)
    with pytest.raises(ConfigError) as error:
        validate(blockwise, gpu_target((9, 0)))  # 128x128 tiles: k and v are 64 wide here
    assert error.value.key == "model.num_kv_heads"
    with pytest.raises(ConfigError) as error:
        validate(compose_train("precision=fp8", "precision.linears=[]"))
    assert error.value.key == "precision.linears"
    with pytest.raises(ConfigError) as error:
        validate(compose_train("precision=fp8", "precision.linears=[q_proj,gate]"))
    assert error.value.key == "precision.linears"


RECIPE_NEEDS = [  # (recipe, the compute capability it needs, one just below, the multiple each projection side must be)
    ("tensorwise", (8, 9), (8, 6), 16),
    ("rowwise", (8, 9), (8, 6), 16),
    ("blockwise", (9, 0), (8, 9), 128),
]


def recipe_config(compose_train, recipe: str, hidden_size: int = 128):
    return compose_train(
        "precision=fp8",
        "precision.experts=bf16",
        f"precision.recipe={recipe}",
        f"model.hidden_size={hidden_size}",
        "model.moe_intermediate_size=128",
        "model.head_dim=64",  # k and v 128 wide: blockwise's tiles
        "trainer.device=auto",
    )


@pytest.mark.parametrize("recipe, needs, below, multiple", RECIPE_NEEDS)
def test_each_fp8_recipe_runs_from_the_compute_capability_it_needs(compose_train, recipe, needs, below, multiple):
    """torchao's tensorwise and rowwise GEMMs run from Ada (8.9), its blockwise prototype from Hopper (9.0): each
    recipe is accepted there and refused just below, naming the key."""
    pytest.importorskip("torchao")
    cfg = recipe_config(compose_train, recipe)
    assert type(validate(cfg, gpu_target(needs)).precision) is Fp8Dense
    with pytest.raises(ConfigError) as error:
        validate(cfg, gpu_target(below))
    assert error.value.key == "precision" and f"{needs[0]}.{needs[1]}" in str(error.value)


@pytest.mark.parametrize("recipe, needs, below, multiple", RECIPE_NEEDS)
def test_each_fp8_recipe_refuses_projection_sides_off_its_multiple(compose_train, recipe, needs, below, multiple):
    """Each projection side a multiple of 16 (tensorwise, rowwise: torch._scaled_mm) or 128 (blockwise's tiles): a
    hidden size half that multiple off is refused naming it."""
    pytest.importorskip("torchao")
    with pytest.raises(ConfigError) as error:
        validate(recipe_config(compose_train, recipe, hidden_size=128 + multiple // 2), gpu_target(needs))
    assert error.value.key == "model.hidden_size" and f"multiple of {multiple}" in str(error.value)


@pytest.mark.parametrize("dispatcher", ["torch", "fused"])
def test_fp8_experts_are_refused_below_hopper(compose_train, dispatcher):
    """The experts' FP8 is DeepGEMM's, compute capability 9.0+: Ada (8.9), where torchao's dense FP8 runs, is refused
    naming dispatcher.expert_precision; Hopper is accepted."""
    cfg = compose_train("precision=fp8_experts", f"dispatcher={dispatcher}", *SHAPE, "trainer.device=auto")
    with pytest.raises(ConfigError) as error:
        validate(cfg, gpu_target((8, 9)))
    assert error.value.key == "dispatcher.expert_precision" and "9.0" in str(error.value)
    assert validate(cfg, gpu_target((9, 0))).dispatcher.expert_precision == "fp8"


class _ExpertGemmDtypes(TorchDispatchMode):
    """The dtypes of the tensors handed to the routed experts' GEMMs (the torch dispatcher's grouped GEMMs, the
    fused op)."""

    OPS = ("_grouped_mm", "fused_moe")

    def __init__(self):
        super().__init__()
        self.dtypes = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in self.OPS:
            self.dtypes |= {a.dtype for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()}
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(
    "dispatcher", [TorchDispatcher(), FusedDispatcher(backend="reference")], ids=["torch", "fused"]
)
def test_bf16_on_one_rank_runs_the_routed_experts_in_bf16(dispatcher):
    """precision=bf16 on one rank is bf16 autocast, which the routed experts' GEMMs follow too (their weights are
    fp32 parameters and the norm before them hands them fp32 rows); without autocast they run in fp32."""
    cfg = Qwen3MoeConfig.preset("tiny", hidden_size=32, moe_intermediate_size=16)
    torch.manual_seed(0)
    block = SparseMoeBlock(cfg, layer_idx=0)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.1)
    block.dispatcher = dispatcher
    x = torch.randn(24, 32, generator=torch.Generator().manual_seed(1))
    for autocast, expected in ((True, {torch.bfloat16}), (False, {torch.float32})):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), _ExpertGemmDtypes() as gemms:
            block(x)
        assert gemms.dtypes == expected, f"autocast={autocast}: {gemms.dtypes}"


def test_a_refusal_names_what_the_user_set(compose_train):
    """The precision's refusals come before the dispatcher's (fp8 without a GPU is refused as such, not for the tiny
    model's sizes the experts' tiles need), and a bad ``precision.experts`` is named, not the dispatcher key that
    follows it."""
    pytest.importorskip("torchao")
    with pytest.raises(ConfigError) as error:
        validate(compose_train("precision=fp8", "trainer.device=cpu"))  # model=tiny: under the experts' 128-wide tiles
    assert error.value.key == "precision"
    with pytest.raises(ConfigError) as error:
        validate(compose_train("precision.experts=fp16"))
    assert error.value.key == "precision.experts" and "dispatcher.expert_precision" in str(error.value)


def tiny_model(device="cpu"):
    cfg = Qwen3MoeConfig.preset("tiny", hidden_size=128, moe_intermediate_size=128, head_dim=32)
    with torch.device(device):
        model = cfg.build()
    return model


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_converts_exactly_the_attention_projections(recipe):
    pytest.importorskip("torchao")
    from torchao.float8.float8_linear import Float8Linear

    model = tiny_model()
    model.init_weights(seed=0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    kinds = {name: type(m) for name, m in model.named_modules()}
    Fp8Dense(recipe=recipe).apply(model)
    converted = {name for name, m in model.named_modules() if isinstance(m, Float8Linear)}
    expected = {f"model.layers.{i}.self_attn.{p}" for i in range(len(model.model.layers)) for p in PROJECTIONS}
    assert converted == expected
    # the router, the experts, the LM head, the embedding and the norms stay what they were
    assert all(type(m) is kinds[name] for name, m in model.named_modules() if name not in expected)
    scaling = model.model.layers[0].self_attn.q_proj.config.cast_config_input.scaling_granularity.value
    assert scaling == {"tensorwise": "tensorwise", "rowwise": "axiswise"}[recipe]
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], v) for k, v in before.items())


def test_fp8_converts_the_linears_it_names_on_the_meta_device():
    """As the trainer builds: on the meta device, before the parallelisms; parameters keep their names and
    materialise as the bf16 model's."""
    pytest.importorskip("torchao")
    from torchao.float8.float8_linear import Float8Linear

    model = tiny_model("meta")
    Fp8Dense(linears=["q_proj", "o_proj"]).apply(model)
    attn = model.model.layers[1].self_attn
    assert isinstance(attn.q_proj, Float8Linear) and isinstance(attn.o_proj, Float8Linear)
    assert not isinstance(attn.k_proj, Float8Linear) and not isinstance(attn.v_proj, Float8Linear)
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    reference = tiny_model()
    reference.init_weights(seed=0)
    assert all(torch.equal(p, dict(reference.named_parameters())[n]) for n, p in model.named_parameters())


def test_selective_ac_keeps_the_fp8_gemms_as_matmuls():
    kept = kept_ops(["matmul"], {"matmul": Fp8Dense.matmul_ops})
    assert torch.ops.aten._scaled_mm.default in kept and torch.ops.aten.mm.default in kept
    assert kept_ops(["matmul"], {"matmul": Bf16Dense.matmul_ops}) == kept_ops(["matmul"], {})
    assert FP8_MATMULS <= kept


def _planned(*overrides):
    from moe_lab.plan.config import compose
    from moe_lab.plan.planner import plan

    base = ["+experiment=full_depth", "data.seq_len=4096", "data.batch_size=4", "ac=selective"]
    return plan(compose([*base, *overrides]), search=False)["metrics"]["trace_breakdown"]["seconds"]


def test_the_planner_runs_the_projections_at_the_fp8_dense_rate():
    from moe_lab.plan.hardware import Hardware

    experts, fp8 = _planned("precision=fp8_experts"), _planned("precision=fp8")
    hw = Hardware(**{**_h200(), "name": "h200"})
    c = Qwen3MoeConfig.preset("qwen3_30b", num_layers=48, num_experts=16)
    projections = 48 * 2 * 16384 * c.hidden_size * 2 * (c.num_heads + c.num_kv_heads) * c.head_dim
    saved = 3 * projections * (1 / hw.flops("dense_gemm") - 1 / hw.flops("fp8_dense_gemm"))
    assert experts["dense_gemm"] - fp8["dense_gemm"] == pytest.approx(saved)
    assert {k: v for k, v in experts.items() if k != "dense_gemm"} == {
        k: v for k, v in fp8.items() if k != "dense_gemm"
    }
    with pytest.raises(ConfigError) as error:
        _planned("precision=fp8", "precision.experts=bf16", "hardware=b300")  # no FP8 peak in that profile
    assert error.value.key == "hardware.peak_fp8_tflops"


def _h200() -> dict:
    import yaml

    from moe_lab.runtime.paths import CONF_DIR

    values = yaml.safe_load((CONF_DIR / "hardware" / "h200.yaml").read_text())
    values.pop("_target_")
    return values


def _losses_and_gradients(recipe: str, device: str, **shape) -> tuple[list[float], list[dict]]:
    """One forward + backward of the tiny model as built and converted, same weights and tokens, under bf16
    autocast: the two losses and the attention projections' weight gradients."""
    cfg = Qwen3MoeConfig.preset("tiny", **shape)
    tokens = torch.randint(0, cfg.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0)).to(device)
    losses, grads = [], []
    for convert in (False, True):
        with torch.device(device):
            model = cfg.build()
        model.init_weights(seed=0)
        if convert:
            Fp8Dense(recipe=recipe).apply(model)
        with torch.autocast(device, dtype=torch.bfloat16):
            logits = model(tokens).logits
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1)[:-1], tokens.flatten()[1:])
        loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad.float() for n, p in model.named_parameters() if "self_attn" in n and "proj" in n})
    return losses, grads


def _assert_within_fp8_error(losses, grads):
    """The loss within 1 %; each projection's weight gradient within 20 % (its operands and the gradient reaching
    it through the FP8 projections above are each rounded to e4m3: about 3.6 % rms apiece)."""
    assert losses[1] == pytest.approx(losses[0], rel=1e-2)
    assert losses[1] != losses[0]  # converted: not the bf16 GEMMs again
    for name, reference in grads[0].items():
        error = (grads[1][name] - reference).norm() / reference.norm()
        assert 0 < error < 0.2, (name, float(error))


def test_fp8_trains_like_bf16_on_cpu():
    """torch's CPU build runs torchao's rowwise float8 GEMMs (emulated, slowly): the same check as on a GPU, so the
    conversion's numerics are held here too, where validation refuses to train with it."""
    pytest.importorskip("torchao")
    try:
        one = torch.ones(16, 16).to(torch.float8_e4m3fn)
        torch._scaled_mm(one, one.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError) as e:
        pytest.skip(f"no FP8 GEMM on this CPU build: {e}")
    _assert_within_fp8_error(
        *_losses_and_gradients("rowwise", "cpu", hidden_size=128, moe_intermediate_size=128, head_dim=32)
    )


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "blockwise"])
def test_fp8_trains_like_bf16_on_a_gpu(recipe):
    pytest.importorskip("torchao")
    needs = (9, 0) if recipe == "blockwise" else (8, 9)
    if torch.cuda.get_device_capability() < needs:
        pytest.skip(f"{recipe} needs compute capability {needs}")
    shape = dict(hidden_size=256, moe_intermediate_size=256, head_dim=128, num_heads=2, num_kv_heads=1)
    _assert_within_fp8_error(*_losses_and_gradients(recipe, "cuda", **shape))
