"""Behaviour of the storage modules (training checkpoints, their directory, the Hugging Face export and import, the
data options, the weights' initialisation) that the rest of the suite left unchecked, each pinned against an
independent reference: damage found to the byte, a deletion that stops midway, what a restore gives back, an
export's choice between weights and fp32 masters, the index and file names of a sharded export, the sizes the
export's command line takes, the data position and the refusals of the token reader, the synthetic language's
rule, and initial weights that do not depend on how a parameter is split."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

from moe_lab.checkpoint import directory as ckpt_dir
from moe_lab.checkpoint.checkpointer import Progress, find_damage, optimizer_mismatch
from moe_lab.data.prepare import write_token_dir
from moe_lab.data.synthetic import SyntheticData
from moe_lab.data.tokens import TokenData
from moe_lab.export import export, hf_config, parse_size
from moe_lab.models.hf_config import check_agrees, read_hf_config
from moe_lab.models.hf_weights import INDEX, SINGLE, CheckpointReader, SafetensorsWriter
from moe_lab.models.init import BLOCK_NUMEL, fill_normal_rows
from moe_lab.optim.offload import FullOffload
from moe_lab.runtime.errors import ConfigError
from tests.test_checkpointer import checkpointer_of, fake_checkpoint

# ---- checkpoints on disk ----


def dcp_checkpoint(directory, step: int = 1, tensors: dict | None = None, marker: dict | None = None):
    """A complete checkpoint written by DCP without a run: ``tensors`` (by key) and the marker ``marker``."""
    path = ckpt_dir.complete_path(directory, step)
    tensors = tensors or {"model/a": torch.arange(256.0).view(16, 16), "model/b": torch.ones(10)}
    dcp.save(tensors, checkpoint_id=str(path), no_dist=True)
    (path / ckpt_dir.MARKER).write_text(json.dumps(marker or {}))
    return path


def test_a_data_file_one_byte_short_is_found_damaged(tmp_path):
    """A copy that stopped one byte before the end of a data file is damage (the last tensor cannot be read whole),
    found from the file's size and the DCP metadata, naming the file and both sizes."""
    path = dcp_checkpoint(tmp_path)
    assert find_damage(path) is None
    (data,) = path.glob("*.distcp")
    size = data.stat().st_size
    with open(data, "r+b") as f:
        f.truncate(size - 1)
    assert find_damage(path) == (data.name, f"cut short: {size - 1} bytes, its tensors run to byte {size}")


def test_a_marker_that_is_no_json_object_is_damage(tmp_path):
    """A marker holding valid JSON that is not an object (a list) cannot be a checkpoint's marker: read_marker
    refuses it with a ValueError and find_damage names the marker, as it does an unreadable one."""
    path = dcp_checkpoint(tmp_path)
    (path / ckpt_dir.MARKER).write_text("[1, 2]")
    with pytest.raises(ValueError, match="holds a JSON list, not an object"):
        ckpt_dir.read_marker(path)
    file, problem = find_damage(path)
    assert file == ckpt_dir.MARKER and problem.startswith("unreadable (ValueError: ")


def test_a_step_directory_without_dcp_metadata_is_not_complete(tmp_path):
    """DCP writes its .metadata last: a step directory holding a marker but no .metadata is not complete (never
    loaded, never the newest), and why_incomplete says which file is missing."""
    whole = fake_checkpoint(tmp_path, 2)
    broken = fake_checkpoint(tmp_path, 4)
    (broken / ckpt_dir.DCP_METADATA).unlink()
    assert ckpt_dir.why_incomplete(broken) == f"{ckpt_dir.DCP_METADATA} is missing"
    assert ckpt_dir.complete(tmp_path) == [whole] and ckpt_dir.newest(tmp_path) == whole


def test_pruning_without_a_limit_keeps_every_checkpoint(tmp_path):
    """trainer.checkpoint.keep=null keeps every complete checkpoint."""
    paths = [fake_checkpoint(tmp_path, step) for step in (1, 2, 3)]
    ckpt_dir.prune(tmp_path, None)
    assert ckpt_dir.complete(tmp_path) == paths
    ckpt_dir.prune(tmp_path, 1)
    assert ckpt_dir.complete(tmp_path) == paths[-1:]


def test_leftovers_of_killed_writers_and_deletions_go_and_nothing_else(tmp_path):
    """What a killed run left half-written (a partial checkpoint, a deletion that did not finish) is cleared; a
    checkpoint set aside as damaged, an unmarked step directory and a complete one stay."""
    complete = fake_checkpoint(tmp_path, 8)
    unmarked = fake_checkpoint(tmp_path, 10, marker=False)
    leftovers = [tmp_path / ".step_00000002.deleting", ckpt_dir.partial_path(tmp_path, 4)]
    kept = [tmp_path / "step_00000006.damaged", complete, unmarked]
    for path in leftovers + kept[:1]:
        (path / "sub").mkdir(parents=True)
    ckpt_dir.remove_leftovers(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in kept)


def test_a_deletion_stopped_midway_leaves_no_complete_checkpoint(tmp_path, monkeypatch):
    """Deleting renames the checkpoint away before its first file goes: a deletion killed midway leaves nothing that
    reads as complete (a later resume would load a half-deleted checkpoint), and the next run clears the rest."""
    path = fake_checkpoint(tmp_path, 2)

    def killed(doomed, *args, **kwargs):
        (doomed / ckpt_dir.MARKER).unlink(missing_ok=True)  # the first file goes, then the process dies
        raise KeyboardInterrupt

    monkeypatch.setattr(ckpt_dir.shutil, "rmtree", killed)
    with pytest.raises(KeyboardInterrupt):
        ckpt_dir.remove(path)
    monkeypatch.undo()
    assert not path.exists() and ckpt_dir.complete(tmp_path) == []
    ckpt_dir.remove_leftovers(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_checkpoints_past_step_ten_to_the_eighth_are_complete_and_ordered_by_step(tmp_path):
    """From step 10**8 a step's name has nine digits: it is still a complete checkpoint (resumed, pruned), the newest
    after step 99,999,999 (by step, not by name), and its partial directory is still a leftover."""
    before, after = fake_checkpoint(tmp_path, 99_999_999), fake_checkpoint(tmp_path, 100_000_000)
    assert after.name == "step_100000000" and ckpt_dir.why_incomplete(after) is None
    assert ckpt_dir.complete(tmp_path) == [before, after] and ckpt_dir.newest(tmp_path) == after
    partial = ckpt_dir.partial_path(tmp_path, 100_000_001)
    partial.mkdir()
    ckpt_dir.remove_leftovers(tmp_path)
    assert not partial.exists()
    ckpt_dir.prune(tmp_path, 1)
    assert ckpt_dir.complete(tmp_path) == [after]


def test_setting_a_step_aside_again_replaces_the_copy_set_aside_before(tmp_path):
    """A step found damaged, written afresh and found damaged again is set aside again: the newer copy replaces the
    older one, and the step is no longer complete."""
    first = fake_checkpoint(tmp_path, 4)
    (first / "which").write_text("first")
    aside = ckpt_dir.set_aside(first)
    second = fake_checkpoint(tmp_path, 4)
    (second / "which").write_text("second")
    assert ckpt_dir.set_aside(second) == aside == tmp_path / "step_00000004.damaged"
    assert (aside / "which").read_text() == "second" and ckpt_dir.complete(tmp_path) == []


def test_a_restore_gives_back_the_progress_and_the_random_generators(tmp_path):
    """A checkpoint restored at the world size that wrote it gives back the progress (step, every loss, the held-out
    losses, the routers' statistics) and this rank's Python and torch generators as they were at the save."""
    checkpointer, _ = checkpointer_of(tmp_path)
    expert_load = torch.arange(12, dtype=torch.float64).view(2, 6)
    eval_losses = [{"step": 1, "loss": 3.5}, {"step": 2, "loss": 3.25}]
    torch.manual_seed(123)
    random.seed(5)
    checkpointer.save(Progress(2, [4.0, 3.75], eval_losses, expert_load))
    expected = (torch.rand(4), random.random())
    torch.manual_seed(999)
    random.seed(0)
    progress = checkpointer_of(tmp_path)[0].restore()  # trainer.resume=auto: the step-2 checkpoint
    assert (progress.step, progress.losses, progress.eval_losses) == (2, [4.0, 3.75], eval_losses)
    assert torch.equal(progress.expert_load, expert_load)
    got = (torch.rand(4), random.random())
    assert torch.equal(got[0], expected[0]) and got[1] == expected[1]


def test_an_optimizer_mismatch_needs_two_named_classes():
    """A checkpoint is refused for its optimizer only when its marker and the run both name one and they differ: a
    marker naming none (written before optimizers were recorded) or no config restores."""
    adamw, signsgd = ({"optimizer": {"_target_": name}} for name in ("torch.optim.AdamW", "moe_lab.optim.SignSGD"))
    assert optimizer_mismatch({"config": adamw}, adamw) is None
    assert optimizer_mismatch({}, adamw) is None
    assert optimizer_mismatch({"config": {"model": {}}}, adamw) is None
    assert optimizer_mismatch({"config": adamw}, {}) is None
    why = optimizer_mismatch({"config": signsgd}, adamw)
    assert "moe_lab.optim.SignSGD" in why and "torch.optim.AdamW" in why


# ---- the Hugging Face export ----

MODEL = {  # every value its own, so that a key read from another's place shows
    "vocab_size": 16,
    "hidden_size": 8,
    "num_layers": 3,
    "num_heads": 4,
    "num_kv_heads": 2,
    "head_dim": 6,
    "num_experts": 5,
    "num_experts_per_tok": 7,
    "moe_intermediate_size": 9,
    "norm_topk_prob": False,
    "max_position_embeddings": 11,
    "rope_theta": 12345.0,
    "rms_norm_eps": 1e-5,
    "init_std": 0.03,
    "router_aux_loss_coef": 0.004,
}
FULL = f"{FullOffload.__module__}.{FullOffload.__qualname__}"


@pytest.mark.parametrize("offload, exported", [(None, "master"), (FULL, "master"), ("other", "model")])
def test_export_takes_the_fp32_masters_only_where_they_are_the_weights(offload, exported, tmp_path):
    """A checkpoint whose optimizer kept fp32 masters apart from its bf16 weights (offload=full, or a marker naming
    no offload option) exports the masters; one of another offload mode (masters carried on, stale) its weights."""
    name = "model.embed_tokens.weight"
    weights = torch.randn(16, 8, generator=torch.Generator().manual_seed(0))
    tensors = {f"model/{name}": weights.bfloat16(), f"optimizer/{name}/master": weights + 1}
    config = {} if offload is None else {"offload": {"_target_": offload}}
    checkpoint = dcp_checkpoint(tmp_path / "ckpt", tensors=tensors, marker={"model": MODEL, "config": config})
    export(checkpoint, tmp_path / "hf")
    got = CheckpointReader(tmp_path / "hf").get(name, (16, 8), torch.float32)
    assert torch.equal(got, weights + 1 if exported == "master" else weights.bfloat16().float())


def test_the_exported_config_json_reads_back_as_every_model_key(tmp_path):
    """export's config.json, read by model=hf's reader, gives each model key its own value back (no key written
    from another's place, none left at a default)."""
    (tmp_path / "config.json").write_text(json.dumps(hf_config(MODEL, torch.float32)))
    read = read_hf_config(tmp_path, "model.path")
    assert {key: value for key, value in read.items() if key != "name"} == MODEL


def test_max_shard_size_takes_decimal_and_binary_units_in_any_case():
    """--max-shard-size: KB/MB/GB are powers of ten, KiB/MiB/GiB of two, in any case; a bare number is bytes."""
    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("500MiB") == 500 * 2**20
    assert parse_size("2gib") == 2 * 2**30
    assert parse_size("1.5kb") == 1500
    assert parse_size("1000") == 1000


def test_sharded_safetensors_are_numbered_from_one_and_indexed_with_their_total_size(tmp_path):
    """Shards hold at most max_shard_bytes, a shard filling exactly up to the limit included; they are named
    model-0000i-of-0000n from 1, as transformers names them, and the index gives every tensor's file and the bytes
    of all of them."""
    tensors = {name: torch.full((16, 16), float(i)) for i, name in enumerate("abc")}  # 1 KiB each
    writer = SafetensorsWriter(tmp_path / "two", max_shard_bytes=2048)
    for name, tensor in tensors.items():
        writer.add(name, tensor)
    writer.close()
    index = json.loads((tmp_path / "two" / INDEX).read_text())
    first, second = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    assert index == {"metadata": {"total_size": 3 * 1024}, "weight_map": {"a": first, "b": first, "c": second}}
    assert sorted(p.name for p in (tmp_path / "two").iterdir()) == sorted([first, second, INDEX])
    reader = CheckpointReader(tmp_path / "two")
    assert all(torch.equal(reader.get(name, (16, 16), torch.float32), t) for name, t in tensors.items())
    writer = SafetensorsWriter(tmp_path / "one", max_shard_bytes=3 * 1024)  # exactly all of them: one file
    for name, tensor in tensors.items():
        writer.add(name, tensor)
    writer.close()
    assert [p.name for p in (tmp_path / "one").iterdir()] == [SINGLE]


def write_hf_config(directory, model: dict):
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(hf_config(model, torch.float32)))
    return directory


def test_a_model_config_must_agree_with_the_checkpoints_and_take_at_most_its_layers(tmp_path):
    """trainer.init_checkpoint's config.json against the model: the top-k renormalisation (which changes what the
    model computes, not its shapes) must agree, and a proxy may take fewer layers than the checkpoint, not more."""
    directory = write_hf_config(tmp_path / "ckpt", MODEL)
    check_agrees(MODEL, directory, "trainer.init_checkpoint")
    check_agrees({**MODEL, "num_layers": 1}, directory, "trainer.init_checkpoint")
    with pytest.raises(ConfigError) as refused:
        check_agrees({**MODEL, "norm_topk_prob": True}, directory, "trainer.init_checkpoint")
    assert refused.value.key == "model.norm_topk_prob"
    with pytest.raises(ConfigError, match="has 3 layers") as refused:
        check_agrees({**MODEL, "num_layers": 4}, directory, "trainer.init_checkpoint")
    assert refused.value.key == "model.num_layers"


# ---- data ----


def token_dir(directory, lengths=(17, 8, 33, 21), vocab_size: int = 10**6):
    """A token directory of shards of 50 tokens at most: train document d holds tokens 1000 * (d + 1) + position,
    eval documents alike from 100,000 (ids taken modulo a smaller vocabulary)."""
    docs = [("train", np.arange(n, dtype=np.uint32) + 1000 * (d + 1)) for d, n in enumerate(lengths)]
    docs += [("eval", np.arange(n, dtype=np.uint32) + 100_000 * (d + 1)) for d, n in enumerate((30, 30))]
    docs = [(split, tokens % vocab_size) for split, tokens in docs]
    write_token_dir(directory, iter(docs), {"tokenizer": "test", "vocab_size": vocab_size, "eos_id": 0}, 50)
    return str(directory)


def test_a_data_position_of_another_seed_is_refused(tmp_path):
    """The position counts samples of the order a seed draws: a resume with another data.seed would skip and repeat
    samples, so it is refused naming data.seed."""
    path = token_dir(tmp_path)
    saved = TokenData(path, seq_len=7, batch_size=2, seed=1)
    saved.batch(0, 0, 1)
    with pytest.raises(ValueError, match="data.seed=1, this run has 2"):
        TokenData(path, seq_len=7, batch_size=2, seed=2).load_state_dict(saved.state_dict())


def test_a_restored_position_is_the_position_until_a_batch_is_read(tmp_path):
    """A run that resumes and checkpoints again before it reads a batch (a save at the resumed step, a signal)
    saves the position it resumed from, not the start of the data."""
    path = token_dir(tmp_path)
    saved = TokenData(path, seq_len=7, batch_size=2, seed=1)
    for step in range(3):
        saved.batch(step, 0, 1)
    resumed = TokenData(path, seq_len=7, batch_size=2, seed=1)
    resumed.load_state_dict(saved.state_dict())
    assert resumed.state_dict() == saved.state_dict() and resumed.state_dict()["sample"] == 6


def test_a_token_id_equal_to_the_vocabulary_size_is_refused(tmp_path):
    """Ids run from 0 to vocab_size - 1: a token of id vocab_size is past the vocabulary (an embedding's bare
    IndexError a step later), refused naming its shard."""
    docs = [("train", np.array([5, 7] * 10, dtype=np.uint32))] * 2
    write_token_dir(tmp_path / "ok", iter(docs), {"tokenizer": "test", "vocab_size": 8, "eos_id": 0}, 50)
    TokenData(str(tmp_path / "ok"), seq_len=9, batch_size=2).batch(0, 0, 1)  # 7 is the largest id of 8
    write_token_dir(tmp_path / "past", iter(docs), {"tokenizer": "test", "vocab_size": 7, "eos_id": 0}, 50)
    with pytest.raises(ValueError, match="token id 7 in train shard"):
        TokenData(str(tmp_path / "past"), seq_len=9, batch_size=2).batch(0, 0, 1)


@pytest.mark.parametrize("damage", ["overlapping", "two columns"])
def test_an_index_that_does_not_lay_out_its_shard_is_refused(damage, tmp_path):
    """An index whose documents run past the tokens its shard holds (two rows overlapping, the shard's size still
    the sum of their lengths), or of another shape than (documents, 3), is refused naming it, before a step reads."""
    path = token_dir(tmp_path, lengths=(10, 10))  # one shard of 20 tokens
    index_file = tmp_path / "train" / "index.npy"
    index = np.load(index_file)
    if damage == "overlapping":
        index[1, 1] = 15  # document 1 at tokens 15..25 of the 20-token shard, overlapping document 0's last
    else:
        index = index[:, :2]
    np.save(index_file, index)
    with pytest.raises(ConfigError) as refused:
        TokenData(path, seq_len=7, batch_size=2).check_split_files("train")
    assert refused.value.key == "data.path" and str(refused.value).startswith(f"data.path: {index_file} ")
    if damage == "overlapping":  # says what is wrong: the shard's size alone is right
        assert "places a document of tokens-00000.bin to end at token 25; the shard holds 20 tokens" in str(
            refused.value
        )


def test_a_tokenizer_vocabulary_as_large_as_the_models_is_accepted(tmp_path, monkeypatch, compose_train):
    """A data vocabulary equal to model.vocab_size fits (ids up to vocab_size - 1); one id more does not."""
    from moe_lab import config

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    for vocab, fits in ((512, True), (513, False)):
        path = token_dir(tmp_path / str(vocab), lengths=(30, 40, 25, 35), vocab_size=vocab)
        cfg = compose_train("data=tokens", f"data.path={path}", "data.seq_len=16", "model.vocab_size=512")
        if fits:
            config.validate(cfg)
        else:
            with pytest.raises(ConfigError) as refused:
                config.validate(cfg)
            assert refused.value.key == "data.path"


def test_prepare_keeps_a_training_document_whatever_the_eval_fraction(tmp_path):
    """--eval-fraction holds out at most all documents but one: a small corpus with a large fraction still has a
    training split (3 documents at 0.9: 2 held out, 1 to train on), not a refusal for having none."""
    from moe_lab.data.prepare import main as prepare_main
    from tests.test_tokens import corpus, train_test_tokenizer

    texts = corpus(3, seed=2)
    train_test_tokenizer(texts, tmp_path / "tokenizer")
    (tmp_path / "corpus.jsonl").write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    args = ["--dataset", str(tmp_path / "corpus.jsonl"), "--tokenizer", str(tmp_path / "tokenizer")]
    prepare_main([*args, "--out", str(tmp_path / "out"), "--eval-fraction", "0.9"])
    splits = json.loads((tmp_path / "out" / "meta.json").read_text())["splits"]
    assert (splits["train"]["documents"], splits["eval"]["documents"]) == (1, 2)


def test_synthetic_held_out_batches_are_no_training_batch():
    """The held-out split draws from streams no step uses: no held-out batch is a training step's batch."""
    data = SyntheticData(seq_len=16, batch_size=2, vocab_size=64, seed=3)
    training = [data.batch(step, 0, 1).inputs for step in range(8)]
    for index in range(4):
        held_out = data.eval_batch(index, 0, 1).inputs
        assert not any(torch.equal(held_out, batch) for batch in training), index


def test_synthetic_tokens_follow_the_cycle_within_a_run():
    """Without restarts a sample is one run of the cycle: each token is the successor of the one before it on the
    seed's cycle over the vocabulary (the bigram rule a model learns); with restarts most tokens still are."""
    steady = SyntheticData(seq_len=32, batch_size=4, vocab_size=64, seed=3, restart_prob=0.0)
    successor = torch.empty(64, dtype=torch.long)
    successor[steady.cycle] = steady.cycle.roll(-1)
    batch = steady.batch(5, 0, 1)
    assert torch.equal(batch.labels, successor[batch.inputs])
    restarting = SyntheticData(seq_len=32, batch_size=4, vocab_size=64, seed=3, restart_prob=0.1)
    batch = restarting.batch(5, 0, 1)
    follows = (batch.labels == successor[batch.inputs]).float().mean()
    assert 0.75 < follows < 1.0


# ---- initial weights ----


def test_initial_rows_do_not_depend_on_how_a_parameter_is_split():
    """Rows [a, b) of a parameter drawn by a rank holding only them are the whole parameter's rows [a, b), also where
    a piece starts inside a block of rows and where it crosses from one block into the next."""
    row = BLOCK_NUMEL // 4  # four rows a block: ten rows span three blocks
    whole = torch.empty(10, row)
    fill_normal_rows(whole, 0.02, seed=7, name="w")
    for first, last in ((0, 10), (1, 3), (3, 6), (5, 10), (9, 10)):
        piece = torch.empty(last - first, row)
        fill_normal_rows(piece, 0.02, seed=7, name="w", first_row=first)
        assert torch.equal(piece, whole[first:last]), (first, last)


def test_initial_weights_are_drawn_with_the_std_asked_and_differ_between_blocks():
    """The rows are N(0, std^2) for the std asked, and each block of rows is a draw of its own (not one block's
    values repeated down the parameter); another seed or another name draws other values."""
    row = BLOCK_NUMEL // 4
    whole = torch.empty(8, row)
    fill_normal_rows(whole, 0.5, seed=7, name="w")
    assert whole.std().item() == pytest.approx(0.5, rel=0.01) and abs(whole.mean().item()) < 0.01
    assert not torch.equal(whole[:4], whole[4:])
    for other in ({"seed": 8, "name": "w"}, {"seed": 7, "name": "v"}):
        again = torch.empty(8, row)
        fill_normal_rows(again, 0.5, **other)
        assert not torch.equal(again, whole), other
