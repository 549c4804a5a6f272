"""Token datasets (issue 19): a small corpus written here and a tokenizer trained here with the ``tokenizers``
library go through ``python -m moe_lab.data.prepare`` into ``data=tokens``; the packed batches are deterministic,
the same global batch on any world size, and resume at their position; a real training job reads them and records
its eval loss; document masking computes exactly what each document computes alone."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import numpy as np
import pytest
import tokenizers
import torch
import transformers

from moe_lab.data.prepare import main as prepare_main
from moe_lab.data.prepare import write_token_dir
from moe_lab.data.synthetic import SyntheticData
from moe_lab.data.tokens import TokenData
from moe_lab.models.qwen3_moe import Documents, Qwen3MoeConfig
from moe_lab.runtime.errors import ConfigError
from tests.sweep import ROOT

WORDS = "the cat sat on a mat while dogs ran across green fields under grey skies and birds sang of rain".split()


def corpus(n: int = 80, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 40))) for _ in range(n)]


def train_test_tokenizer(texts: list[str], directory) -> transformers.PreTrainedTokenizerFast:
    """A word-level tokenizer trained here with the tokenizers library, saved as a Hugging Face tokenizer."""
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.train_from_iterator(texts, tokenizers.trainers.WordLevelTrainer(special_tokens=["[UNK]", "</s>"]))
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="</s>")
    hf.save_pretrained(str(directory))
    return hf


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """The corpus as jsonl, its tokenizer, and the prepared token directory."""
    base = tmp_path_factory.mktemp("tokens")
    texts = corpus()
    with open(base / "corpus.jsonl", "w") as f:
        for i, text in enumerate(texts):
            f.write(json.dumps({"body": text, "id": i}) + "\n")
    tok = train_test_tokenizer(texts, base / "tokenizer")
    prepare_main(
        [
            "--dataset",
            str(base / "corpus.jsonl"),
            "--tokenizer",
            str(base / "tokenizer"),
            "--out",
            str(base / "out"),
            "--text-field",
            "body",
            "--eval-fraction",
            "0.1",
            "--shard-tokens",
            "400",
        ]
    )
    return texts, tok, base / "out"


def read_documents(directory, split: str) -> list[list[int]]:
    index = np.load(directory / split / "index.npy")
    shards = {}
    docs = []
    for shard, first, length in index:
        path = directory / split / f"tokens-{shard:05d}.bin"
        shards.setdefault(shard, np.fromfile(path, dtype=np.uint32))
        docs.append(shards[shard][first : first + length].tolist())
    return docs


def test_prepare_writes_every_document_tokenised_with_its_end(prepared):
    texts, tok, out = prepared
    meta = json.loads((out / "meta.json").read_text())
    assert meta["vocab_size"] == len(tok) and meta["eos_id"] == tok.eos_token_id
    train, held_out = read_documents(out, "train"), read_documents(out, "eval")
    assert (
        meta["splits"]["train"]["documents"] == len(train) and meta["splits"]["eval"]["documents"] == len(held_out) == 8
    )
    assert meta["splits"]["train"]["shards"] > 1  # --shard-tokens 400: several shards, no document split across two
    expected = sorted(tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for t in texts)
    assert sorted(train + held_out) == expected
    assert meta["splits"]["train"]["tokens"] == sum(map(len, train))


def test_prepare_reads_saved_datasets_and_text_files_and_trains_a_tokenizer(tmp_path):
    datasets = pytest.importorskip("datasets")
    texts = corpus(40, seed=1)
    datasets.Dataset.from_dict({"text": texts}).save_to_disk(str(tmp_path / "saved"))
    prepare_main(
        [
            "--dataset",
            str(tmp_path / "saved"),
            "--train-tokenizer",
            "300",
            "--out",
            str(tmp_path / "a"),
            "--eval-fraction",
            "0",
        ]
    )
    meta = json.loads((tmp_path / "a" / "meta.json").read_text())
    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "a" / "tokenizer"))
    assert meta["tokenizer"] == str(tmp_path / "a" / "tokenizer") and meta["vocab_size"] == len(tok) <= 300
    assert meta["splits"]["train"]["documents"] == 40 and meta["splits"]["eval"]["documents"] == 0
    assert sorted(read_documents(tmp_path / "a", "train")) == sorted(
        tok(t)["input_ids"] + [tok.eos_token_id] for t in texts
    )
    (tmp_path / "book.txt").write_text("\n\n".join(texts[:5]) + "\n")
    prepare_main(
        [
            "--dataset",
            str(tmp_path / "book.txt"),
            "--tokenizer",
            str(tmp_path / "a" / "tokenizer"),
            "--out",
            str(tmp_path / "b"),
            "--text-unit",
            "paragraph",
            "--eval-fraction",
            "0",
        ]
    )
    assert json.loads((tmp_path / "b" / "meta.json").read_text())["splits"]["train"]["documents"] == 5
    (tmp_path / "a_file").write_text("not a directory")
    for out, refusal in [("b", "exists and is not empty"), ("a_file", "is a file; choose a new directory")]:
        with pytest.raises(SystemExit, match=refusal):
            prepare_main(
                ["--dataset", str(tmp_path / "book.txt"), "--tokenizer", str(tmp_path / "a" / "tokenizer")]
                + ["--out", str(tmp_path / out)]
            )


def synthetic_dir(tmp_path, lengths, eval_lengths=(30, 30)) -> TokenData:
    """A token directory whose document d holds tokens 1000 * (d + 1) + position (the last one its end)."""
    docs = [("train", np.arange(n, dtype=np.uint32) + 1000 * (d + 1)) for d, n in enumerate(lengths)]
    docs += [("eval", np.arange(n, dtype=np.uint32) + 100_000 * (d + 1)) for d, n in enumerate(eval_lengths)]
    write_token_dir(tmp_path, iter(docs), {"tokenizer": "test", "vocab_size": 10**6, "eos_id": 0}, shard_tokens=50)
    return tmp_path


def test_packing_covers_each_epoch_once_in_a_seeded_order(tmp_path):
    lengths = [7, 23, 5, 41, 12, 9, 30, 6]
    data = TokenData(str(synthetic_dir(tmp_path, lengths)), seq_len=9, batch_size=1, seed=3)
    per_epoch = sum(lengths) // 10  # 13 samples of 10 tokens; 3 left out
    samples = torch.cat([data.batch(s, 0, 1).inputs for s in range(per_epoch)])
    labels = torch.cat([data.batch(s, 0, 1).labels for s in range(per_epoch)])
    torch.testing.assert_close(samples[:, 1:], labels[:, :-1])
    seen = sorted(torch.cat([samples, labels[:, -1:]], dim=1).flatten().tolist())
    every = sorted(t for d, n in enumerate(lengths) for t in range(1000 * (d + 1), 1000 * (d + 1) + n))
    assert len(set(seen)) == len(seen) == 130 and set(seen) <= set(every)
    again = TokenData(str(tmp_path), seq_len=9, batch_size=1, seed=3)
    assert torch.equal(again.batch(1, 0, 1).inputs, data.batch(1, 0, 1).inputs)
    assert not torch.equal(data.batch(per_epoch, 0, 1).inputs, data.batch(0, 0, 1).inputs)  # epoch 1: another order
    other_seed = TokenData(str(tmp_path), seq_len=9, batch_size=1, seed=4)
    assert not torch.equal(other_seed.batch(0, 0, 1).inputs, data.batch(0, 0, 1).inputs)


def test_any_world_size_sees_the_same_global_batch_and_resumes_at_its_position(tmp_path):
    path = str(synthetic_dir(tmp_path, [17, 8, 33, 21, 5, 40, 11, 26, 9, 14]))

    def global_batch(data, step, world):
        return torch.cat([data.batch(step, r, world).inputs for r in range(world)])

    one_rank = TokenData(path, seq_len=7, batch_size=4, seed=1)
    two_ranks = TokenData(path, seq_len=7, batch_size=2, seed=1)
    steps = [global_batch(one_rank, s, 1) for s in range(12)]  # past the first epoch (25 samples)
    for s in range(12):
        assert torch.equal(global_batch(two_ranks, s, 2), steps[s]), s
    # Resume after step 4 on four ranks of one sample each: the same samples go on.
    saved = TokenData(path, seq_len=7, batch_size=4, seed=1)
    for s in range(5):
        saved.batch(s, 0, 1)
    state = saved.state_dict()
    assert state["step"] == 5 and state["sample"] == 20
    resumed = TokenData(path, seq_len=7, batch_size=1, seed=1)
    resumed.load_state_dict(json.loads(json.dumps(state)))
    assert torch.equal(global_batch(resumed, 5, 4), steps[5])
    # A different global batch after the resume starts at the next unseen sample.
    bigger = TokenData(path, seq_len=7, batch_size=8, seed=1)
    bigger.load_state_dict(state)
    assert torch.equal(bigger.batch(5, 0, 1).inputs, torch.cat(steps[5:7]))
    with pytest.raises(ValueError, match="data.seq_len"):
        TokenData(path, seq_len=8, batch_size=4, seed=1).load_state_dict(state)
    # Another corpus is refused naming data.path; a position saved before positions named their corpus is taken.
    other = TokenData(str(synthetic_dir(tmp_path / "other", [30, 40])), seq_len=7, batch_size=4, seed=1)
    with pytest.raises(ValueError, match="another corpus than data.path"):
        other.load_state_dict(state)
    unnamed = {key: value for key, value in state.items() if key != "corpus"}
    TokenData(path, seq_len=7, batch_size=4, seed=1).load_state_dict(unnamed)


@pytest.mark.parametrize("saved_by", ["synthetic", "tokens"])
def test_a_data_position_of_another_data_source_is_refused_naming_data(saved_by, tmp_path):
    """A run resumed under another ``data`` option than the checkpoint's is refused, not failed with a KeyError some
    steps in (synthetic's position into tokens) nor restored as if nothing were amiss (tokens' into synthetic)."""
    sources = {
        "synthetic": SyntheticData(seq_len=7, batch_size=2, vocab_size=64),
        "tokens": TokenData(str(synthetic_dir(tmp_path, [17, 8, 33])), seq_len=7, batch_size=2),
    }
    sources["tokens"].batch(0, 0, 1)  # a position past the start
    saved = sources.pop(saved_by).state_dict()
    (loading_into,) = sources.values()
    with pytest.raises(ConfigError, match="written with another data source") as refused:
        loading_into.load_state_dict(saved)
    assert refused.value.key == "data"


def test_eval_batches_come_from_the_held_out_split(tmp_path):
    data = TokenData(str(synthetic_dir(tmp_path, [50, 50])), seq_len=9, batch_size=2)
    batch = data.eval_batch(0, 1, 2)
    assert (batch.inputs >= 100_000).all()
    assert torch.equal(data.eval_batch(3, 0, 2).inputs, data.eval_batch(0, 0, 2).inputs)  # 6 samples, wrapping


@pytest.mark.parametrize("split", [(2, 2, 1), (3, 2, 2), (4, 1, 2)], ids=lambda s: "accum{}-ranks{}-batch{}".format(*s))
@pytest.mark.parametrize("source", ["synthetic", "tokens"])
@pytest.mark.parametrize("read", ["batch", "eval_batch"])
def test_a_batch_split_over_ranks_and_micro_batches_holds_the_one_big_batchs_samples(read, source, split, tmp_path):
    """A step's batch, or held-out batch i read as a step reads its batch, in micro-batches of each rank's share is
    the one batch of the whole global size, in its order (micro-batch m of rank r holds samples from
    (m * ranks + r) * batch_size on): none repeated, none left out. Gradient accumulation's equivalence to one big
    batch and a resume at another world size rest on it."""
    micro_batches, ranks, batch_size = split
    path = str(synthetic_dir(tmp_path, [50, 50, 37, 61]))

    def make(batch_size):
        if source == "synthetic":
            return SyntheticData(seq_len=9, batch_size=batch_size, vocab_size=64)
        return TokenData(path, seq_len=9, batch_size=batch_size)

    whole, parts = make(micro_batches * ranks * batch_size), make(batch_size)
    for index in range(2):
        pieces = [
            getattr(parts, read)(index, rank, ranks, micro_batch, micro_batches).inputs
            for micro_batch in range(micro_batches)
            for rank in range(ranks)
        ]
        assert torch.equal(torch.cat(pieces), getattr(whole, read)(index, 0, 1).inputs), index


def test_documents_carry_ids_and_restarting_positions(tmp_path):
    data = TokenData(str(synthetic_dir(tmp_path, [4, 6, 3, 9])), seq_len=11, batch_size=1, document_mask=True)
    batch = data.batch(0, 0, 1)
    ids, positions = batch.documents
    starts = batch.inputs[0] % 1000 == 0  # each document's first token is 1000 * (d + 1)
    assert torch.equal(positions[0] == 0, starts | (torch.arange(11) == 0))
    assert torch.equal(ids[0], torch.cumsum((positions[0] == 0).long(), 0) - 1)


@pytest.mark.parametrize(
    "edit, problem",
    [
        pytest.param(lambda meta: [meta], "holds a JSON list, not an object", id="list"),
        pytest.param(
            lambda meta: meta | {"vocab_size": "big"}, "\"vocab_size\" must be an integer, got 'big'", id="string"
        ),
        pytest.param(lambda meta: meta | {"vocab_size": True}, '"vocab_size" must be an integer, got True', id="bool"),
        pytest.param(lambda meta: meta | {"tokenizer": None}, '"tokenizer" must be a string, got None', id="null"),
        pytest.param(
            lambda meta: {k: v for k, v in meta.items() if k != "splits"}, '"splits" is missing', id="no splits"
        ),
        pytest.param(
            lambda meta: meta | {"splits": {"train": meta["splits"]["train"]}}, '"splits.eval" is missing', id="no eval"
        ),
        pytest.param(
            lambda meta: meta | {"splits": meta["splits"] | {"eval": {**meta["splits"]["eval"], "tokens": 1.5}}},
            '"splits.eval.tokens" must be an integer, got 1.5',
            id="float count",
        ),
    ],
)
def test_a_meta_json_of_the_wrong_shape_is_refused_naming_the_field(edit, problem, tmp_path):
    path = synthetic_dir(tmp_path, [17, 8, 33])
    meta_file = path / "meta.json"
    meta_file.write_text(json.dumps(edit(json.loads(meta_file.read_text()))))
    with pytest.raises(ConfigError) as refused:
        TokenData(str(path), seq_len=7, batch_size=2)
    assert refused.value.key == "data.path" and str(refused.value).startswith(f"data.path: {meta_file}: {problem}")


@pytest.fixture
def hf_tiny_model():
    torch.manual_seed(0)
    cfg = Qwen3MoeConfig.preset("tiny", num_layers=2)
    model = cfg.build()
    model.init_weights(seed=1)
    with torch.no_grad():  # sharper attention than the initial weights, so that a leak across documents shows
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(20)
            layer.self_attn.k_proj.weight.mul_(20)
    return model.eval()


def test_document_mask_equals_each_document_alone(hf_tiny_model):
    """A packed sample with document masking gives each document's logits as the document alone gives them."""
    gen = torch.Generator().manual_seed(0)
    layouts = [[5, 9, 7, 3], [11, 13]]  # two samples of 24 tokens
    tokens = torch.randint(0, 512, (2, 24), generator=gen)
    ids = torch.tensor([sum(([d] * n for d, n in enumerate(layout)), []) for layout in layouts])
    positions = torch.tensor([sum((list(range(n)) for n in layout), []) for layout in layouts])
    with torch.no_grad():
        packed = hf_tiny_model(tokens, Documents(ids.int(), positions))
        plain = hf_tiny_model(tokens).logits
        for b, layout in enumerate(layouts):
            start = 0
            for n in layout:
                alone = hf_tiny_model(tokens[b : b + 1, start : start + n]).logits[0]
                torch.testing.assert_close(packed.logits[b, start : start + n], alone, rtol=1e-5, atol=1e-5)
                start += n
    assert not torch.allclose(packed.logits, plain, atol=1e-3)  # without the mask, later documents see earlier ones
    counts = packed.router_stats[:, :8].sum(dim=-1)
    assert counts.tolist() == [2 * 24 * 2] * 2  # every token routed to K=2 experts in each layer


def train_cli(*overrides: str, cwd) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run(
        [sys.executable, "-m", "moe_lab.train", *overrides],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_training_job_reads_prepared_tokens_and_records_eval_loss(prepared, tmp_path):
    _, _, out = prepared
    proc = train_cli(
        "data=tokens",
        f"data.path={out}",
        "data.seq_len=32",
        "data.batch_size=2",
        "data.document_mask=true",
        "trainer.steps=4",
        "trainer.eval_every=2",
        "trainer.eval_batches=2",
        "trainer.expert_load_every=3",
        f"hydra.run.dir={tmp_path / 'run'}",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads((tmp_path / "run" / "result.json").read_text())
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    metrics = record["metrics"]
    assert [r["step"] for r in rows if "eval_loss" in r] == [1, 3] == [e["step"] for e in metrics["eval_losses"]]
    assert metrics["final_eval_loss"] == rows[3]["eval_loss"] and 0 < metrics["final_eval_loss"] < 10
    assert [r["step"] for r in rows if "expert_load" in r] == [0, 3]
    load = rows[3]["expert_load"]
    assert [sum(layer) for layer in load["tokens"]] == [2 * 32 * 2] * 2  # batch 2 x seq 32 tokens, top-2, each layer
    assert metrics["expert_load_max_over_mean"] >= 1 and record["config"]["data"]["path"] == str(out)


@pytest.mark.slow  # three jobs, one of two ranks
def test_a_resume_at_another_world_size_reads_the_next_unseen_samples(prepared, tmp_path):
    """A checkpoint of one rank resumed on two, with twice the global batch, trains on what the same resume on one
    rank trains on: the data position goes on from rank 0's, not from sample 0 (step 3 of 4 samples: sample 12)."""
    _, _, out = prepared
    common = ["data=tokens", f"data.path={out}", "data.seq_len=32", "trainer.steps=6", "trainer.warmup_steps=0"]
    first = tmp_path / "first"
    proc = train_cli(*common, "data.batch_size=2", "trainer.checkpoint.every=3", f"hydra.run.dir={first}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    checkpoint = f"trainer.resume={first / 'checkpoints' / 'step_00000003'}"
    losses = {}
    for name, layout in {
        "one": ["data.batch_size=4"],
        "two": ["data.batch_size=2", "trainer.nproc_per_node=2"],
    }.items():
        proc = train_cli(*common, *layout, checkpoint, f"hydra.run.dir={tmp_path / name}", cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-3000:]
        losses[name] = json.loads((tmp_path / name / "result.json").read_text())["metrics"]["losses"]
    assert losses["two"][3:] == pytest.approx(losses["one"][3:], rel=1e-5)


@pytest.mark.parametrize(
    "overrides, key",
    [
        ([], "data.path"),  # required
        (["data.path=/nonexistent/tokens"], "data.path"),
        (["data.path=OUT", "model.vocab_size=8"], "data.path"),  # the tokenizer's vocabulary is larger
        (["data.path=OUT", "data.seq_len=2048"], "data.seq_len"),  # more than the train split holds
        (
            ["data.path=OUT", "data.seq_len=400", "trainer.eval_every=5"],
            "trainer.eval_every",
        ),  # the eval split is smaller
    ],
)
def test_bad_token_configs_fail_naming_their_key(overrides, key, prepared, monkeypatch, compose_train):
    from moe_lab import config

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    cfg = compose_train("data=tokens", *(o.replace("OUT", str(prepared[2])) for o in overrides))
    with pytest.raises(config.ConfigError) as e:
        config.validate(cfg)
    assert e.value.key == key, e.value


@pytest.mark.gpu
@pytest.mark.parametrize("ac", ["none", "full", "selective"])
def test_flex_document_mask_on_gpu_equals_documents_alone_and_compiles(ac, hf_tiny_model):
    """On a GPU the document mask is a FlexAttention block mask: eager (flex compiled on its own) it gives each
    document's own logits in fp32; blocks compiled with fullgraph=True under each AC mode give eager's logits and
    gradients in bf16, as trainer.compile=true runs them."""
    from moe_lab.parallel.ac import FullCheckpoint, NoCheckpoint, SelectiveCheckpoint
    from moe_lab.parallel.compile import apply_compile

    model = hf_tiny_model.cuda()
    layout = [100, 60, 96]  # 256 tokens: two 128-token blocks, documents across the block boundary
    tokens = torch.randint(0, 512, (1, 256), generator=torch.Generator().manual_seed(0)).cuda()
    ids = torch.tensor([sum(([d] * n for d, n in enumerate(layout)), [])], dtype=torch.int32).cuda()
    positions = torch.tensor([sum((list(range(n)) for n in layout), [])]).cuda()
    documents = Documents(ids, positions)
    assert not isinstance(documents.attention_mask(), torch.Tensor)  # a BlockMask
    with torch.no_grad():
        packed = model(tokens, documents).logits[0]
        start = 0
        for n in layout:
            torch.testing.assert_close(
                packed[start : start + n], model(tokens[:, start : start + n]).logits[0], rtol=1e-4, atol=1e-4
            )
            start += n

    def step(checkpointing: str | None, compiled: bool):
        torch.manual_seed(0)
        m = Qwen3MoeConfig.preset("tiny", num_layers=2).build().cuda()
        m.init_weights(seed=1)
        m.init_buffers()
        if checkpointing is not None:
            modes = {"none": NoCheckpoint, "full": FullCheckpoint, "selective": SelectiveCheckpoint}
            modes[checkpointing]().apply(m)
        if compiled:
            apply_compile(m)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = m(tokens, documents)
        (out.logits.float().square().mean() + m.config.balance().loss(out.router_stats)).backward()
        return out.logits.float(), {n: p.grad.float() for n, p in m.named_parameters()}

    eager_logits, eager_grads = step(None, False)
    for compiled in (False, True):  # the AC mode alone (flex compiled on its own), then inside compiled blocks
        logits, grads = step(ac, compiled)
        torch.testing.assert_close(logits, eager_logits, rtol=2e-2, atol=2e-2)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, eager_grads[name], rtol=5e-2, atol=5e-3, msg=f"compiled={compiled} {name}")


@pytest.mark.parametrize("damage", ["shard deleted", "shard cut short", "shard grown", "index of other counts"])
def test_damaged_token_files_fail_validation_naming_the_file(damage, tmp_path, monkeypatch):
    """Every shard is checked against the index and meta.json before a step: one deleted, cut short by a copy that
    stopped or holding more than its documents, or an index that disagrees with meta.json, is refused naming it."""
    from moe_lab import config
    from tests.configs import compose_train

    docs = [("train", np.arange(n, dtype=np.uint32) % 500) for n in (30, 40, 25, 35)]
    docs += [("eval", np.arange(n, dtype=np.uint32) % 500) for n in (30, 30)]
    write_token_dir(tmp_path, iter(docs), {"tokenizer": "test", "vocab_size": 512, "eos_id": 0}, shard_tokens=50)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    cfg = compose_train("data=tokens", f"data.path={tmp_path}", "data.seq_len=16")
    config.validate(cfg)  # intact

    shard, index = tmp_path / "train" / "tokens-00001.bin", tmp_path / "train" / "index.npy"
    if damage == "shard deleted":
        shard.unlink()
    elif damage == "index of other counts":
        np.save(index, np.load(index)[:-1])
    else:
        size = shard.stat().st_size
        with open(shard, "r+b") as f:
            f.truncate(size // 2 if damage == "shard cut short" else size + 4)
    named = index if damage == "index of other counts" else shard
    with pytest.raises(config.ConfigError, match=f"{named} (is missing|holds|lists)") as e:
        config.validate(cfg)
    assert e.value.key == "data.path"


@pytest.mark.parametrize(
    "name, content, problem",
    [
        ("empty.txt", b"", "the file is empty"),
        ("empty.jsonl", b"", "the file is empty"),
        ("noise.txt", bytes(random.Random(0).randrange(128, 256) for _ in range(2000)), "cannot be read as UTF-8 text"),
        ("cut.jsonl", b'{"text": "the cat"}\n{"text": "the d', "cannot be read as JSON lines or a JSON file"),
        ("bytes.jsonl", b'{"text": "the cat"}\n{"text": "ok \xff\xfe"}\n', "holds bytes that are not UTF-8 text"),
        ("blank.txt", b"\n\n  \n", "none of its 1 texts held for training has a token"),
    ],
)
def test_prepare_refuses_a_corpus_that_makes_no_dataset_naming_the_file(name, content, problem, tmp_path):
    """Refused with a message naming the file and what is wrong (no traceback), and no output directory left that
    looks like a dataset."""
    train_test_tokenizer(corpus(10), tmp_path / "tokenizer")
    (tmp_path / name).write_bytes(content)
    out = tmp_path / "out"
    args = ["--dataset", str(tmp_path / name), "--tokenizer", str(tmp_path / "tokenizer"), "--out", str(out)]
    with pytest.raises(SystemExit) as refused:
        prepare_main(args)
    assert str(refused.value).startswith(f"--dataset {tmp_path / name}: {problem}"), refused.value
    assert not out.exists() and not list(tmp_path.glob(".out.*"))


def test_prepare_clears_what_a_killed_prepare_left_and_nothing_else(tmp_path):
    """A prepare killed midway leaves its work directory beside --out (holding its lock file and the datasets
    library's cache; nothing in the system's temporary directory): the next prepare into that --out removes it,
    but not one a prepare running now holds, nor a directory of the same prefix that is no prepare's."""
    import fcntl

    train_test_tokenizer(corpus(10), tmp_path / "tokenizer")
    (tmp_path / "corpus.txt").write_text("\n".join(corpus(10)))
    out = tmp_path / "out"
    killed, running, other = (tmp_path / f".out.{name}" for name in ("killed1", "running1", "notes"))
    for directory in (killed, running, other):
        (directory / "train").mkdir(parents=True)
    (killed / ".lock").write_text("")
    (running / ".lock").write_text("")
    with open(running / ".lock") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        prepare_main(["--dataset", str(tmp_path / "corpus.txt"), "--tokenizer", str(tmp_path / "tokenizer"),
                      "--out", str(out), "--text-unit", "line"])  # fmt: skip
    assert sorted(p.name for p in tmp_path.glob(".out.*")) == [".out.notes", ".out.running1"]
    assert sorted(p.name for p in out.iterdir()) == ["eval", "meta.json", "train"]  # no lock, no cache


@pytest.mark.parametrize(
    "tokenizer, problem",
    [
        (["--tokenizer", "{tmp}/no_tokenizer"], "--tokenizer {tmp}/no_tokenizer: no such directory"),
        (["--tokenizer", "{tmp}"], "--tokenizer {tmp}: cannot be read as a tokenizer"),
        (["--tokenizer", "{tmp}/not_one"], "--tokenizer {tmp}/not_one: cannot be read as a tokenizer"),
        (["--train-tokenizer", "5"], "--train-tokenizer must exceed 257"),
    ],
)
def test_prepare_refuses_a_tokenizer_it_cannot_use_in_one_line(tokenizer, problem, tmp_path):
    (tmp_path / "book.txt").write_text("\n\n".join(corpus(4)) + "\n")
    (tmp_path / "not_one").mkdir()  # JSON, but no tokenizer's
    (tmp_path / "not_one" / "tokenizer.json").write_text('{"version": "1.0", "model": 5}')
    args = ["--dataset", str(tmp_path / "book.txt"), "--out", str(tmp_path / "out")]
    with pytest.raises(SystemExit) as refused:
        prepare_main(args + [a.format(tmp=tmp_path) for a in tokenizer])
    assert str(refused.value).startswith(problem.format(tmp=tmp_path)), refused.value
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.*"))


def test_a_token_past_the_vocabulary_names_its_shard(tmp_path):
    """A shard overwritten in place keeps its size (validation reads sizes): its ids past the vocabulary are said as
    a damaged shard, not an embedding's bare IndexError a step later."""
    docs = [("train", np.arange(n, dtype=np.uint32) % 500) for n in (30, 40, 25, 35)]
    write_token_dir(tmp_path, iter(docs), {"tokenizer": "test", "vocab_size": 512, "eos_id": 0}, shard_tokens=50)
    data = TokenData(str(tmp_path), seq_len=16, batch_size=2)
    for step in range(4):  # intact: every batch reads
        data.batch(step, 0, 1)
    shard = tmp_path / "train" / "tokens-00001.bin"  # the other shards stay intact
    shard.write_bytes(b"\xff" * shard.stat().st_size)
    data, refusals = TokenData(str(tmp_path), seq_len=16, batch_size=2), []
    for step in range(4):  # the epoch's batches: those reading the damaged shard are refused, naming it alone
        try:
            data.batch(step, 0, 1)
        except ValueError as e:
            refusals.append(str(e))
    assert refusals and all(
        "token id 4294967295 in train shard(s) tokens-00001.bin is past its vocabulary of 512 ids" in r
        for r in refusals
    ), refusals
