"""Token datasets written by ``python -m moe_lab.data.prepare``: the ``data`` group's ``tokens`` option.

On disk (``<path>/``): ``meta.json`` (tokenizer, vocabulary size, end-of-document id, counts) and one folder per
split, ``train/`` and ``eval/``, each holding uint32 token shards (``tokens-00000.bin``, ...) and ``index.npy``,
one row per document: (shard, first token in the shard, length). Every document ends with the end-of-document token;
no document straddles two shards. Everything is read through memory maps.
"""

from __future__ import annotations

import json
import reprlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from moe_lab.data.batch import Batch, DataSource, refuse_another_sources_state
from moe_lab.models.qwen3_moe import Documents
from moe_lab.runtime.errors import ConfigError

FORMAT = "moe_lab.tokens/1"
META = "meta.json"
INDEX = "index.npy"
SPLITS = ("train", "eval")
COUNTS = ("documents", "tokens", "shards")  # each split's, in meta.json
KINDS = {int: "an integer", str: "a string", dict: "an object"}


def shard_name(number: int) -> str:
    return f"tokens-{number:05d}.bin"


def _damaged(what: str) -> ConfigError:
    return ConfigError("data.path", f"{what}; prepare it again (python -m moe_lab.data.prepare) or copy it whole")


def read_meta(path: Path) -> dict:
    """``path``'s meta.json, refused unless it is of this format and holds each field the reader uses, of its type
    (a hand-edited or foreign file is named with its field, not failed on where a field is first used)."""
    file = path / META
    try:
        meta = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(
            "data.path", f"must be a directory written by python -m moe_lab.data.prepare (no readable {META}: {e})"
        ) from None
    if not isinstance(meta, dict):
        raise _damaged(f"{file}: holds a JSON {type(meta).__name__}, not an object")
    if meta.get("format") != FORMAT:
        raise ConfigError("data.path", f"{file} is format {meta.get('format')!r}, this moe_lab reads {FORMAT!r}")
    _field(file, meta, "vocab_size", int)
    _field(file, meta, "tokenizer", str)
    splits = _field(file, meta, "splits", dict)
    for split in SPLITS:
        counts = _field(file, splits, f"splits.{split}", dict)
        for count in COUNTS:
            _field(file, counts, f"splits.{split}.{count}", int)
    return meta


def _field(file: Path, owner: dict, name: str, kind: type):
    """The value of field ``name`` (dotted: inside ``owner``, its last part) of meta.json, of type ``kind``."""
    key = name.rpartition(".")[2]
    if key not in owner:
        raise _damaged(f'{file}: "{name}" is missing')
    value = owner[key]
    if not isinstance(value, kind) or isinstance(value, bool):  # JSON's true is no count
        raise _damaged(f'{file}: "{name}" must be {KINDS[kind]}, got {reprlib.repr(value)}')
    return value


@dataclass
class Piece:
    """Tokens [start, start + length) of one document, as a sample holds them."""

    document: int
    start: int
    length: int


class TokenSplit:
    """One split's documents, memory-mapped: ``index`` rows are (shard, first token, length)."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.index = np.load(directory / INDEX, mmap_mode="r")
        self.lengths = np.asarray(self.index[:, 2], dtype=np.int64)
        self.tokens = int(self.lengths.sum())
        self._shards: dict[int, np.memmap] = {}

    def read(self, piece: Piece) -> np.ndarray:
        shard, first, _ = (int(v) for v in self.index[piece.document])
        if shard not in self._shards:
            self._shards[shard] = np.memmap(self.directory / shard_name(shard), dtype=np.uint32, mode="r")
        return self._shards[shard][first + piece.start : first + piece.start + piece.length]


class Packing:
    """Documents concatenated in a given order, cut into samples of ``sample_len`` tokens: sample k is tokens
    [k * sample_len, (k + 1) * sample_len) of the concatenation (the tail that fills no sample is left out)."""

    def __init__(self, lengths: np.ndarray, order: np.ndarray, sample_len: int):
        self.order, self.sample_len = order, sample_len
        self.ends = np.cumsum(lengths[order])  # where each document of the order ends in the concatenation
        self.samples = int(self.ends[-1]) // sample_len if len(order) else 0

    def pieces(self, sample: int) -> list[Piece]:
        start, end = sample * self.sample_len, (sample + 1) * self.sample_len
        pieces = []
        i = int(np.searchsorted(self.ends, start, side="right"))  # the document holding token `start`
        while start < end:
            doc_start = int(self.ends[i - 1]) if i else 0
            stop = min(end, int(self.ends[i]))
            pieces.append(Piece(int(self.order[i]), start - doc_start, stop - start))
            start, i = stop, i + 1
        return pieces


class TokenData(DataSource):
    """Packed samples of a prepared token dataset (``python -m moe_lab.data.prepare``).

    Training samples: each epoch concatenates the train split's documents in an order drawn from (seed, epoch) and
    cuts the concatenation into samples of ``seq_len + 1`` tokens (inputs and their next-token labels); a document
    may continue into the next sample. Global sample g of the run is sample g mod n of epoch g div n. Step s's
    global batch is the ``grad_accum * dp_size * batch_size`` samples after those of the steps before, and
    micro-batch m of rank r takes the ``batch_size`` consecutive ones from (m * dp_size + r) * batch_size on: any
    split of the global batch sees the same samples, and every batch is a function of (seed, position). ``state_dict`` / ``load_state_dict`` carry the position, so a resumed run goes on with the
    next unseen sample, also with another global batch size.

    Held-out samples (``eval_batch``) come from the eval split in its stored order.

    ``document_mask=true``: each batch carries its documents (``moe_lab.models.qwen3_moe.Documents``): attention
    stays inside each document and RoPE positions restart at its first token in the sample. ``false``: plain causal
    attention over the whole sample. Either way the last token of a document is trained to predict the first of the
    next (its end-of-document token marks the boundary).
    """

    def __init__(self, path: str, seq_len: int, batch_size: int, seed: int = 0, document_mask: bool = False):
        self.path, self.seq_len, self.batch_size = Path(path), seq_len, batch_size
        self.seed, self.document_mask = seed, document_mask
        self.meta = read_meta(self.path)
        self._splits: dict[str, TokenSplit] = {}
        self._epoch: tuple[int, Packing] | None = None  # the training epoch last read from (one at a time)
        self._eval: Packing | None = None
        self.resume_step, self.resume_sample = 0, 0  # the position a resumed run starts from
        self.next_step, self.next_sample = 0, 0  # the position after the last batch handed out

    def validate(self, cfg, target) -> None:
        for name in SPLITS:
            self.check_split_files(name)
        vocab = self.meta["vocab_size"]
        if vocab > cfg.model.vocab_size:
            raise ConfigError(
                "data.path",
                f"its tokenizer's vocabulary ({vocab} ids, {self.meta['tokenizer']}) is larger than model.vocab_size={cfg.model.vocab_size}",
            )
        need = self.seq_len + 1
        train = self.meta["splits"]["train"]["tokens"]
        if train < need:
            raise ConfigError(
                "data.seq_len",
                f"a sample takes seq_len + 1 = {need} tokens; the train split of {self.path} holds {train}",
            )
        held_out = self.meta["splits"]["eval"]["tokens"]
        if cfg.trainer.eval_every > 0 and held_out < need:
            raise ConfigError(
                "trainer.eval_every",
                f"the eval split of {self.path} holds {held_out} tokens, fewer than one sample of seq_len + 1 = {need} (prepare it with a larger --eval-fraction, or set trainer.eval_every=0)",
            )

    def check_split_files(self, name: str) -> None:
        """A split's index and token shards against each other and meta.json, before a step reads them: the index
        lists the documents and tokens meta.json counts, and every shard exists and holds exactly the tokens of
        the documents the index places in it (a shard deleted, or cut short by a copy that stopped)."""
        directory, counts = self.path / name, self.meta["splits"][name]
        try:
            index = np.load(directory / INDEX, mmap_mode="r")
        except (OSError, ValueError) as e:
            raise _damaged(f"{directory / INDEX} is unreadable ({e})") from None
        if index.ndim != 2 or index.shape[1] != 3:
            raise _damaged(f"{directory / INDEX} has shape {index.shape}, not (documents, 3)")
        shards, ends, lengths = index[:, 0], index[:, 1] + index[:, 2], index[:, 2]
        number_of_shards = int(shards.max()) + 1 if len(index) else 0
        listed = {"documents": len(index), "tokens": int(lengths.sum()), "shards": number_of_shards}
        for key, value in listed.items():
            if counts[key] != value:
                raise _damaged(f"{directory / INDEX} lists {value} {key}, {self.path / META} says {counts[key]}")
        held = np.bincount(shards, weights=lengths, minlength=number_of_shards).astype(np.int64)  # tokens per shard
        reach = np.zeros(number_of_shards, dtype=np.int64)  # where each shard's last document ends
        np.maximum.at(reach, shards, ends)
        for number in range(number_of_shards):
            shard = directory / shard_name(number)
            if not shard.is_file():
                raise _damaged(f"{shard} is missing ({INDEX} places {held[number]} tokens in it)")
            size = shard.stat().st_size
            if size != held[number] * np.dtype(np.uint32).itemsize:
                raise _damaged(f"{shard} holds {size} bytes; {INDEX} places {held[number]} uint32 tokens in it")
            if reach[number] > held[number]:  # its documents overlap: one ends past the shard's tokens
                raise _damaged(
                    f"{directory / INDEX} places a document of {shard.name} to end at token {reach[number]}; the shard "
                    f"holds {held[number]} tokens"
                )

    def split(self, name: str) -> TokenSplit:
        if name not in self._splits:
            self._splits[name] = TokenSplit(self.path / name)
        return self._splits[name]

    def batch(self, step: int, dp_rank: int, dp_size: int, micro_batch: int = 0, micro_batches: int = 1) -> Batch:
        """Micro-batch ``micro_batch`` (of ``micro_batches``) of rank ``dp_rank``'s [batch_size, seq_len] share of
        step ``step``'s global batch, on the CPU."""
        global_batch = self.batch_size * dp_size * micro_batches
        first = self.resume_sample + (step - self.resume_step) * global_batch
        self.next_step, self.next_sample = step + 1, first + global_batch
        first += (micro_batch * dp_size + dp_rank) * self.batch_size
        return self._batch([self._train_pieces(g) for g in range(first, first + self.batch_size)])

    def eval_batch(self, index: int, dp_rank: int, dp_size: int, micro_batch: int = 0, micro_batches: int = 1) -> Batch:
        """Micro-batch ``micro_batch`` of rank ``dp_rank``'s share of held-out batch ``index`` (the eval split's
        samples in order, wrapping; split as a step's batch is)."""
        if self._eval is None:
            lengths = self.split("eval").lengths
            self._eval = Packing(lengths, np.arange(len(lengths)), self.seq_len + 1)
        packing = self._eval
        first = (index * micro_batches + micro_batch) * dp_size * self.batch_size + dp_rank * self.batch_size
        return self._batch([packing.pieces(g % packing.samples) for g in range(first, first + self.batch_size)], "eval")

    def state_dict(self) -> dict:
        """Where the next step's batch starts (its step and its first global sample), and over what: the seed, the
        sample length and the corpus (``corpus``: its vocabulary and training split's size)."""
        return {
            "step": self.next_step,
            "sample": self.next_sample,
            "seed": self.seed,
            "seq_len": self.seq_len,
            "corpus": self._corpus(),
        }

    def load_state_dict(self, state: dict) -> None:
        state = dict(state)
        corpus = state.pop("corpus", None)  # a checkpoint written before 2026-12-07 names no corpus
        refuse_another_sources_state(state, set(self.state_dict()) - {"corpus"}, "tokens")
        for key in ("seed", "seq_len"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"the saved data position was made with data.{key}={state[key]}, this run has {getattr(self, key)}"
                )
        if corpus is not None and corpus != self._corpus():
            raise ValueError(
                f"the saved data position is in another corpus than data.path={self.path}: {_described(corpus)} there, "
                f"{_described(self._corpus())} here"
            )
        self.resume_step, self.resume_sample = state["step"], state["sample"]
        self.next_step, self.next_sample = state["step"], state["sample"]

    def _corpus(self) -> dict:
        train = self.meta["splits"]["train"]
        return {"vocab_size": self.meta["vocab_size"], "documents": train["documents"], "tokens": train["tokens"]}

    def _train_pieces(self, sample: int) -> list[Piece]:
        split = self.split("train")
        per_epoch = split.tokens // (self.seq_len + 1)
        epoch, k = divmod(sample, per_epoch)
        if self._epoch is None or self._epoch[0] != epoch:
            order = np.random.default_rng([self.seed, epoch]).permutation(len(split.lengths))
            self._epoch = (epoch, Packing(split.lengths, order, self.seq_len + 1))
        return self._epoch[1].pieces(k)

    def _batch(self, samples: list[list[Piece]], split_name: str = "train") -> Batch:
        split = self.split(split_name)
        read = [[split.read(p) for p in pieces] for pieces in samples]
        tokens = np.stack([np.concatenate(pieces) for pieces in read])
        if (largest := int(tokens.max(initial=0))) >= self.meta["vocab_size"]:  # else an embedding's bare IndexError
            damaged = [
                p
                for pieces, values in zip(samples, read)
                for p, v in zip(pieces, values)
                if v.max(initial=0) >= self.meta["vocab_size"]
            ]
            shards = sorted({shard_name(int(split.index[p.document][0])) for p in damaged})
            raise ValueError(
                f"data.path={self.path}: token id {largest} in {split_name} shard(s) {', '.join(shards)} is past its "
                f"vocabulary of {self.meta['vocab_size']} ids: the shard is damaged (prepare it again)"
            )
        tokens = torch.from_numpy(tokens.astype(np.int64))
        documents = None
        if self.document_mask:
            ids = np.stack([np.repeat(np.arange(len(pieces)), [p.length for p in pieces]) for pieces in samples])
            positions = np.stack([np.concatenate([np.arange(p.length) for p in pieces]) for pieces in samples])
            documents = Documents(torch.from_numpy(ids[:, :-1].astype(np.int32)), torch.from_numpy(positions[:, :-1]))
        return Batch(tokens[:, :-1], tokens[:, 1:], documents)


def _described(corpus: dict) -> str:
    return f"{corpus['documents']:,} training documents of {corpus['tokens']:,} tokens, {corpus['vocab_size']:,} ids"
