"""Tokenise a text dataset into the token format ``data=tokens`` reads (``moe_lab.data.tokens``).

    python -m moe_lab.data.prepare --dataset <saved dataset dir | files.jsonl/json/parquet/txt ...> \\
        --tokenizer <Hugging Face tokenizer dir> --out <dir> [--text-field text] [--eval-fraction 0.01]

The dataset is read with the ``datasets`` library: a directory written by ``Dataset.save_to_disk`` (its ``train``
split, or its only one, for a ``DatasetDict``), or local files of one kind (json/jsonl, parquet, txt; a txt file is
one document, or one per paragraph or line with ``--text-unit``). Each document is tokenised with
``transformers.AutoTokenizer`` (no special tokens added) and ends with the tokenizer's end-of-sequence token.
``--eval-fraction`` of the documents, drawn with ``--seed``, form the held-out split. ``--train-tokenizer VOCAB``
instead trains a byte-level BPE tokenizer of that vocabulary size on the training documents (``tokenizers``) and
saves it in ``<out>/tokenizer``: a corpus with no tokenizer of its own can be prepared offline.

A corpus that cannot make a dataset is refused, naming the file and what is wrong, before anything is written: an
empty file, one that is not of its kind (bytes that are not UTF-8 text, a line that is not JSON), a dataset with no
document or none with a token. Everything is written beside ``--out`` first and moved there at the end: a directory
is complete or absent.
"""

from __future__ import annotations

import argparse
import codecs
import fcntl
import glob
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from moe_lab.data.tokens import FORMAT, INDEX, META, SPLITS, shard_name
from moe_lab.runtime.files import current_umask

EXTENSIONS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".txt": "text"}
TRAINED_EOS = "<|endoftext|>"
WORK_LOCK, CACHE = ".lock", ".cache"  # in the work directory, removed before it becomes out


class SplitWriter:
    """Appends documents to uint32 shards of at most ``shard_tokens`` tokens (a longer document gets a shard of its
    own) and records each document's (shard, first token, length)."""

    def __init__(self, directory: Path, shard_tokens: int):
        self.directory, self.shard_tokens = directory, shard_tokens
        directory.mkdir(parents=True)
        self.rows: list[tuple[int, int, int]] = []
        self.shard, self.filled, self.file = -1, 0, None

    def append(self, tokens: np.ndarray) -> None:
        if self.file is None or (self.filled and self.filled + len(tokens) > self.shard_tokens):
            self._next_shard()
        self.rows.append((self.shard, self.filled, len(tokens)))
        self.file.write(tokens.astype(np.uint32).tobytes())
        self.filled += len(tokens)

    def _next_shard(self) -> None:
        if self.file is not None:
            self.file.close()
        self.shard, self.filled = self.shard + 1, 0
        self.file = open(self.directory / shard_name(self.shard), "wb")

    def close(self) -> dict:
        if self.file is not None:
            self.file.close()
        index = np.array(self.rows, dtype=np.int64).reshape(-1, 3)
        np.save(self.directory / INDEX, index)
        return {"documents": len(index), "tokens": int(index[:, 2].sum()), "shards": self.shard + 1}


def write_token_dir(
    out: Path, documents: Iterator[tuple[str, np.ndarray]], meta: dict, shard_tokens: int = 2**28
) -> dict:
    """Write ``(split, tokens)`` documents (each already ending with its end-of-document id) and ``meta.json`` (the
    caller's ``meta`` plus format and per-split counts) into the new directory ``out``; returns the metadata."""
    writers = {split: SplitWriter(out / split, shard_tokens) for split in SPLITS}
    for split, tokens in documents:
        writers[split].append(tokens)
    meta = {"format": FORMAT, **meta, "splits": {split: writer.close() for split, writer in writers.items()}}
    (out / META).write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def load_texts(sources: list[str], text_field: str, text_unit: str, cache_dir: str):
    """The dataset's texts as a ``datasets.Dataset`` with the column ``text_field``."""
    import datasets

    datasets.disable_progress_bars()
    first = Path(sources[0])
    if len(sources) == 1 and first.is_dir():
        dataset = datasets.load_from_disk(str(first))
        if isinstance(dataset, datasets.DatasetDict):
            if "train" not in dataset and len(dataset) != 1:
                raise SystemExit(
                    f"--dataset {first}: a DatasetDict with splits {sorted(dataset)}; it needs a train split or just one"
                )
            dataset = dataset["train"] if "train" in dataset else next(iter(dataset.values()))
    else:
        kinds = {EXTENSIONS.get(Path(s).suffix) for s in sources}
        if None in kinds or len(kinds) != 1:
            raise SystemExit(
                f"--dataset: files of one kind ({', '.join(EXTENSIONS)}) or one saved dataset directory, got {sources}"
            )
        missing = [s for s in sources if not Path(s).is_file()]
        if missing:
            raise SystemExit(f"--dataset: no such file: {', '.join(missing)}")
        empty = [s for s in sources if Path(s).stat().st_size == 0]
        if empty:
            raise SystemExit(f"--dataset {empty[0]}: the file is empty")
        kind = kinds.pop()
        options = {"sample_by": text_unit} if kind == "text" else {}

        def load(files: list[str]):
            return datasets.load_dataset(kind, data_files=files, split="train", cache_dir=cache_dir, **options)

        try:
            dataset = load(sources)
        except Exception as e:  # the datasets library names no file: find the one that fails alone
            raise SystemExit(_why_unreadable(load, sources, kind, e)) from None
        if kind == "text":
            text_field = "text"
    if len(dataset) == 0:
        raise SystemExit(f"--dataset {' '.join(sources)}: holds no document")
    if text_field not in dataset.column_names:
        raise SystemExit(f"--text-field {text_field}: the dataset's columns are {dataset.column_names}")
    dataset = dataset.select_columns([text_field])
    return dataset if text_field == "text" else dataset.rename_column(text_field, "text")


def _why_unreadable(load, sources: list[str], kind: str, error: Exception) -> str:
    """What to say of files ``load`` failed on: the first that fails alone, and its root cause."""
    for source in sources if len(sources) > 1 else []:
        try:
            load([source])
        except Exception as e:
            error, sources = e, [source]
            break
    while error.__cause__ is not None or error.__context__ is not None:
        error = error.__cause__ or error.__context__
    cause = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
    what = {"text": "UTF-8 text", "json": "JSON lines or a JSON file", "parquet": "parquet"}[kind]
    return f"--dataset {' '.join(sources)}: cannot be read as {what} ({cause})"


MIN_TRAINED_VOCAB = 257  # a byte-level BPE's alphabet and its end-of-document token


def train_tokenizer(texts: Iterator[str], vocab_size: int, directory: Path):
    """A byte-level BPE tokenizer trained on ``texts``, saved as a Hugging Face tokenizer directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[TRAINED_EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=TRAINED_EOS).save_pretrained(str(directory))


def _clear_killed_work(out: Path) -> None:
    """Remove the work directories that prepares into ``out`` killed midway left beside it: those holding a prepare's
    lock file that no process holds (a prepare running now holds its own; what holds no lock file is no prepare's)."""
    for work in out.parent.glob(f".{glob.escape(out.name)}.*"):
        try:
            with open(work / WORK_LOCK) as lock:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                shutil.rmtree(work)
        except OSError:  # held by a prepare running now (BlockingIOError), or no prepare's work directory
            continue


def prepare(
    sources: list[str],
    out: Path,
    tokenizer: str | None = None,
    train_tokenizer_vocab: int | None = None,
    text_field: str = "text",
    text_unit: str = "document",
    eval_fraction: float = 0.01,
    seed: int = 0,
    shard_tokens: int = 2**28,
    batch_size: int = 1000,
) -> dict:
    """Write the token directory ``out`` (which must not exist, or be empty); returns its metadata."""
    from transformers import AutoTokenizer

    if (tokenizer is None) == (train_tokenizer_vocab is None):
        raise SystemExit("give one of --tokenizer DIR and --train-tokenizer VOCAB")
    if not 0 <= eval_fraction < 1:
        raise SystemExit(f"--eval-fraction must be in [0, 1), got {eval_fraction}")
    if tokenizer is not None and not Path(tokenizer).is_dir():  # offline: a hub name is no directory either
        raise SystemExit(f"--tokenizer {tokenizer}: no such directory (a Hugging Face tokenizer's, AutoTokenizer's)")
    if train_tokenizer_vocab is not None and train_tokenizer_vocab <= MIN_TRAINED_VOCAB:
        raise SystemExit(
            f"--train-tokenizer must exceed {MIN_TRAINED_VOCAB} (the 256 bytes and the end-of-document token: no "
            f"merge learned below it), got {train_tokenizer_vocab}"
        )
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise SystemExit(f"--out {out} is a file; choose a new directory")
    if out.exists() and any(out.iterdir()):
        raise SystemExit(f"--out {out} exists and is not empty; choose a new directory")
    out.parent.mkdir(parents=True, exist_ok=True)
    _clear_killed_work(out)
    # Everything is written in a work directory beside out, renamed to out once whole; a kill leaves only it, which
    # the next prepare into out clears (its lock is then no process's).
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    work.chmod(0o777 & ~current_umask())  # as a plain mkdir would make it (mkdtemp's is owner-only)
    with open(work / WORK_LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            # the datasets library's arrow copies of the files; refuses a corpus it cannot read, leaving nothing
            texts = load_texts(sources, text_field, text_unit, str(work / CACHE))
            count = len(texts)
            held_out = np.zeros(count, dtype=bool)
            if eval_fraction > 0 and count > 1:
                n_eval = min(count - 1, max(1, round(eval_fraction * count)))
                held_out[np.random.default_rng(seed).choice(count, n_eval, replace=False)] = True
            if train_tokenizer_vocab is not None:
                tokenizer = str(out / "tokenizer")  # where it ends up
                train_tokenizer(
                    (t for t, e in zip(_texts(texts, batch_size), held_out) if not e),
                    train_tokenizer_vocab,
                    work / "tokenizer",
                )
                tok = AutoTokenizer.from_pretrained(str(work / "tokenizer"))
            else:
                try:
                    tok = AutoTokenizer.from_pretrained(tokenizer)
                except Exception as e:  # whatever a file that is no tokenizer's raises as it is parsed (KeyError, ...)
                    raise SystemExit(
                        f"--tokenizer {tokenizer}: cannot be read as a tokenizer ({type(e).__name__}: {e})"
                    ) from None
            if tok.eos_token_id is None:
                raise SystemExit(f"--tokenizer {tokenizer}: it has no end-of-sequence token to end documents with")
            eos = np.array([tok.eos_token_id], dtype=np.uint32)

            def documents():
                for i, ids in enumerate(_token_ids(texts, tok, batch_size)):
                    if ids:  # an empty text is no document
                        yield (
                            ("eval" if held_out[i] else "train"),
                            np.concatenate([np.asarray(ids, dtype=np.uint32), eos]),
                        )

            meta = {
                "tokenizer": str(tokenizer),
                "vocab_size": len(tok),
                "eos_id": int(tok.eos_token_id),
                "sources": [str(Path(s).resolve()) for s in sources],
                "text_field": text_field,
                "text_unit": text_unit,
                "eval_fraction": eval_fraction,
                "seed": seed,
            }
            meta = write_token_dir(work, documents(), meta, shard_tokens)
            if meta["splits"]["train"]["documents"] == 0:
                raise SystemExit(
                    f"--dataset {' '.join(sources)}: none of its {count} texts held for training has a token"
                )
            shutil.rmtree(work / CACHE, ignore_errors=True)  # (a saved dataset is read in place: none)
            (work / WORK_LOCK).unlink()
            if out.exists():
                out.rmdir()
            os.replace(work, out)
        except BaseException as e:
            shutil.rmtree(work, ignore_errors=True)
            # a JSON string's bytes: the reader decodes them only as they are read, naming no file
            if isinstance(e, UnicodeDecodeError):
                raise SystemExit(f"--dataset {_not_utf8(sources)}: holds bytes that are not UTF-8 text ({e})") from None
            raise
    return meta


def _not_utf8(sources: list[str]) -> str:
    """The first of ``sources`` that is a file and does not decode as UTF-8, else all of them."""
    for source in filter(lambda s: Path(s).is_file(), sources):
        decoder = codecs.getincrementaldecoder("utf-8")()
        try:
            with open(source, "rb") as file:
                while chunk := file.read(1 << 24):
                    decoder.decode(chunk)
                decoder.decode(b"", final=True)
        except UnicodeDecodeError:
            return source
    return " ".join(sources)


def _texts(texts, batch_size: int) -> Iterator[str]:
    for rows in texts.iter(batch_size=batch_size):
        yield from rows["text"]


def _token_ids(texts, tok, batch_size: int) -> Iterator[list[int]]:
    for rows in texts.iter(batch_size=batch_size):
        yield from tok([t or "" for t in rows["text"]], add_special_tokens=False)["input_ids"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m moe_lab.data.prepare", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--dataset", nargs="+", required=True, help="a saved dataset directory, or json/jsonl/parquet/txt files"
    )
    parser.add_argument("--out", required=True, help="the token directory to write (new or empty); data.path reads it")
    tokenizers = parser.add_mutually_exclusive_group(required=True)
    tokenizers.add_argument("--tokenizer", help="a Hugging Face tokenizer directory (AutoTokenizer)")
    tokenizers.add_argument(
        "--train-tokenizer",
        type=int,
        metavar="VOCAB",
        help="train a byte-level BPE tokenizer of this vocabulary size on the training documents, saved in OUT/tokenizer",
    )
    parser.add_argument(
        "--text-field", default="text", help="the column holding the text (json/parquet/saved datasets)"
    )
    parser.add_argument(
        "--text-unit",
        choices=("document", "paragraph", "line"),
        default="document",
        help="what one document of a txt file is",
    )
    parser.add_argument(
        "--eval-fraction", type=float, default=0.01, help="share of the documents held out for trainer.eval_every"
    )
    parser.add_argument("--seed", type=int, default=0, help="draws the held-out documents")
    parser.add_argument("--shard-tokens", type=int, default=2**28, help="tokens per shard file at most (uint32: 1 GiB)")
    args = parser.parse_args(argv)
    # Local files only: never wait for a hub on a machine without network.
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    meta = prepare(
        args.dataset,
        Path(args.out),
        args.tokenizer,
        args.train_tokenizer,
        args.text_field,
        args.text_unit,
        args.eval_fraction,
        args.seed,
        args.shard_tokens,
    )
    counts = ", ".join(
        f"{split}: {s['documents']:,} documents, {s['tokens']:,} tokens" for split, s in meta["splits"].items()
    )
    print(
        f"{args.out}: vocabulary {meta['vocab_size']:,} ({meta['tokenizer']}), end-of-document id {meta['eos_id']}; {counts}"
    )


if __name__ == "__main__":
    main()
