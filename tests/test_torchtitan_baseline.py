"""experiments/torchtitan_baseline/torchtitan_baseline.py on CPU: its log parser and summary, its tokenizer and dataset, and (where
torchtitan 0.2.2 is installed) the proxy flavours, the argument list and the FLOP count against torchtitan's own."""

import importlib.util
import json
import statistics
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "experiments" / "torchtitan_baseline"


def _load(name):
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


baseline = _load("torchtitan_baseline")


def _titan_line(step, loss, grad_norm, reserved_gib, reserved_pct, tps, tflops, mfu):
    """A step line as torchtitan 0.2.2 prints it under torchrun's rank prefix: MetricsProcessor.log's f-string with
    colours off (utils.NoColor), inside init_logger's format."""
    message = (
        f"step: {step:2}  loss: {loss:8.5f}  grad_norm: {grad_norm:7.4f}  "
        f"memory: {reserved_gib:5.2f}GiB({reserved_pct:.2f}%)  tps: {round(tps):,}  "
        f"tflops: {tflops:,.2f}  mfu: {mfu:.2f}%"
    )
    return f"[rank0]:[titan] 2026-11-30 06:00:00,000 - root - INFO - {message}"


def test_parse_steps_reads_torchtitan_step_lines():
    tps = [9_000.4, 40_111.0, 49_321.6, 49_100.2, 48_999.9, 49_500.0, 49_250.0]
    lines = ["[rank0]:[titan] 2026-11-30 06:00:00,000 - root - INFO - Peak FLOPS used for computing MFU: 9.890e+14"]
    for i, t in enumerate(tps, start=1):
        lines.append(
            _titan_line(i, 12.5 - i / 10, 1.25, 50.0 + i, 35.1, t, t * 6.45e9 / 1e12, 100 * t * 6.45e9 / 989e12)
        )
        lines.append("[rank0]:W1130 06:00:00.000 some warning between steps")
    steps = baseline.parse_steps("\n".join(lines))

    assert [s["step"] for s in steps] == list(range(1, 8))
    assert [s["tps"] for s in steps] == [float(round(t)) for t in tps]
    assert steps[2]["loss"] == pytest.approx(12.2, abs=1e-5)
    assert steps[2]["memory_gib"] == 53.0
    assert steps[2]["mfu"] == pytest.approx(49_322 * 6.45e9 / 989e12, abs=1e-4)
    assert steps[2]["tflops"] == pytest.approx(49_321.6 * 6.45e9 / 1e12, abs=0.01)

    flops = {"shared": 6.45e9, "executed": 4.8e9}
    summary = baseline.summarize(steps, tokens_per_gpu_step=16384, timing_from=3, flops=flops, peak=989e12)
    median = statistics.median(round(t) for t in tps[2:])
    assert summary["status"] == "ok"
    assert summary["steps_timed"] == [3, 4, 5, 6, 7]
    assert summary["tokens_per_s_per_gpu"] == median
    assert summary["s_per_step"] == pytest.approx(16384 / median)
    assert summary["mfu"] == pytest.approx(median * 6.45e9 / 989e12)
    assert summary["mfu_executed"] == pytest.approx(median * 4.8e9 / 989e12)
    assert summary["peak_gpu_mem_reserved_gib"] == 57.0
    assert summary["losses"] == [s["loss"] for s in steps]

    assert (
        baseline.summarize(steps, tokens_per_gpu_step=16384, timing_from=9, flops=flops, peak=989e12)["status"]
        == "error"
    )
    assert baseline.summarize(steps, tokens_per_gpu_step=16384, timing_from=3, flops=None, peak=None)["mfu"] is None


def test_every_torchtitan_ac_setting_maps_to_its_flags():
    """none, full, op-level and layer-level (every 2nd block) selective: torchtitan 0.2.2's AC settings
    (ActivationCheckpoint.mode and selective_ac_option), each point's flags as torchrun gets them."""

    def flags(setting):
        args = baseline.torchtitan_args(
            flavour="30B-A3B-4L",
            gpus=1,
            seq_len=16384,
            ac=setting,
            steps=12,
            compile=True,
            assets=Path("a"),
            data=Path("d"),
            dump=Path("o"),
        )
        return {k: v for k, v in zip(args, args[1:]) if k.startswith("--activation_checkpoint.")}

    assert flags("none") == {"--activation_checkpoint.mode": "none"}
    assert flags("full") == {"--activation_checkpoint.mode": "full"}
    assert flags("op-selective") == {
        "--activation_checkpoint.mode": "selective",
        "--activation_checkpoint.selective_ac_option": "op",
    }
    assert flags("layer-selective") == {
        "--activation_checkpoint.mode": "selective",
        "--activation_checkpoint.selective_ac_option": "2",
    }
    with pytest.raises(KeyError):
        flags("selective")


def test_failure_status_names_out_of_memory():
    assert baseline.failure_status("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate") == (
        "oom",
        "OutOfMemoryError",
    )
    assert baseline.failure_status("RuntimeError: NCCL error")[0] == "error"


def test_tokenizer_and_dataset_round_trip(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    vocab_size = 1000
    tokenizer = tokenizers.Tokenizer.from_file(
        str(baseline.build_tokenizer(tmp_path / "tok", vocab_size) / "tokenizer.json")
    )
    assert tokenizer.get_vocab_size() == vocab_size
    assert tokenizer.encode("t1 t999 t42").ids == [1, 999, 42]

    data = baseline.build_dataset(tmp_path / "data", vocab_size, num_tokens=2500, words_per_row=1000)
    rows = [json.loads(line)["text"] for line in (data / "train.jsonl").read_text().splitlines()]
    ids = [i for row in rows for i in tokenizer.encode(row).ids]
    assert [len(r.split()) for r in rows] == [1000, 1000, 500]
    assert len(ids) == 2500 and min(ids) >= 1 and max(ids) < vocab_size  # every word is a known token


def test_proxy_flavour_args_and_flops_match_torchtitan(tmp_path, monkeypatch):
    pytest.importorskip("torchtitan")
    torch = pytest.importorskip("torch")
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    sys.modules.pop("torchtitan_proxy", None)
    import torchtitan_proxy  # noqa: F401 - registers the flavours, as --experimental.custom_import does
    from torchtitan.config import ConfigManager
    from torchtitan.protocols.train_spec import get_train_spec

    args = baseline.torchtitan_args(
        flavour="30B-A3B-4L",
        gpus=2,
        seq_len=16384,
        ac="op-selective",
        steps=12,
        compile=True,
        assets=tmp_path,
        data=tmp_path,
        dump=tmp_path,
    )
    config = ConfigManager().parse_args(args)
    assert (config.model.flavor, config.training.seq_len, config.training.local_batch_size) == ("30B-A3B-4L", 16384, 1)
    assert config.debug.moe_force_load_balance and config.compile.enable
    assert (config.parallelism.data_parallel_shard_degree, config.parallelism.expert_parallel_degree) == (2, 2)
    assert (config.activation_checkpoint.mode, config.activation_checkpoint.selective_ac_option) == ("selective", "op")
    for setting, expected in {
        "none": ("none", "2"),
        "full": ("full", "2"),
        "layer-selective": ("selective", "2"),
    }.items():
        ac = (
            ConfigManager()
            .parse_args(
                baseline.torchtitan_args(
                    flavour="30B-A3B-4L",
                    gpus=1,
                    seq_len=16384,
                    ac=setting,
                    steps=12,
                    compile=True,
                    assets=tmp_path,
                    data=tmp_path,
                    dump=tmp_path,
                )
            )
            .activation_checkpoint
        )
        assert (ac.mode, ac.selective_ac_option) == expected, setting  # "2": torchtitan's default, every 2nd block

    spec = get_train_spec(config.model.name)
    base, proxy = spec.model_args["30B-A3B"], spec.model_args["30B-A3B-4L"]
    assert proxy.n_layers == 4 and proxy.dim == base.dim and proxy.moe_args == base.moe_args
    proxy.update_from_config(config)
    assert proxy.moe_args._debug_force_load_balance and not base.moe_args._debug_force_load_balance
    with torch.device("meta"):
        model = spec.model_cls(proxy)
    _, titan_flops = proxy.get_nparams_and_flops(model, 16384)
    assert baseline.moe_lab_flops("30B-A3B", 4, 16384)["shared"] == titan_flops
    narrowed = spec.model_args["30B-A3B-48L-16E"]  # the full-depth share of one GPU at EP 8 (experiments/full_depth)
    assert (narrowed.n_layers, narrowed.moe_args.num_experts, narrowed.moe_args.top_k) == (48, 16, base.moe_args.top_k)
    assert base.moe_args.num_experts == 128
    with torch.device("meta"):
        _, narrowed_flops = narrowed.get_nparams_and_flops(spec.model_cls(narrowed), 16384)
    assert baseline.moe_lab_flops("30B-A3B", 48, 16384, experts=16)["shared"] == narrowed_flops
