"""Train a byte-level BPE tokenizer on a corpus (the `tokenizers` library), once, and cache it.

Used by `model.train_tokenizer` for pretraining from scratch. The result is a plain
`PreTrainedTokenizerFast` directory (saved with the run's final model), with `<|endoftext|>` as
BOS/EOS/padding and a ChatML template, so the pretrained model can later be chat-tuned.
The cache key covers the corpus contents and every training setting; an entry appears atomically
(fs.atomic_dir) under a file lock.
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
from collections.abc import Iterator
from pathlib import Path

from filelock import FileLock
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from training.core.errors import DataError
from training.core.fs import atomic_dir, file_digest
from training.data.formats import CHATML

log = logging.getLogger(__name__)

EOS = "<|endoftext|>"
SPECIAL_TOKENS = [EOS, "<|im_start|>", "<|im_end|>"]
VERSION = 1  # bump when the training recipe below changes


def corpus_files(patterns: list[str]) -> list[Path]:
    files: list[Path] = []
    for pat in patterns:
        matches = sorted(glob.glob(pat)) if any(c in pat for c in "*?[") else [pat]
        for m in matches:
            p = Path(m)
            if not p.is_file():
                raise DataError(
                    f"model.train_tokenizer.files: {p} does not exist (a tokenizer is trained on local files)"
                )
            if p.suffix not in (".txt", ".text", ".jsonl", ".json"):
                raise DataError(f"model.train_tokenizer.files: {p}: use .txt, .jsonl or .json files")
            if p.stat().st_size == 0:
                raise DataError(f"model.train_tokenizer.files: {p} is empty")
            files.append(p)
    if not files:
        raise DataError(f"model.train_tokenizer.files: no files match {', '.join(patterns)}")
    return files


def _strings(value) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)


def iter_texts(files: list[Path]) -> Iterator[str]:
    """Lines of text files; every string value of JSON records (whatever the data format)."""
    for p in files:
        if p.suffix in (".txt", ".text"):
            with p.open(encoding="utf-8", errors="replace") as f:
                yield from f
        elif p.suffix == ".json":
            yield from _strings(json.loads(p.read_text()))
        else:
            with p.open(encoding="utf-8") as f:
                for lineno, line in enumerate(f, 1):
                    if line.strip():
                        try:
                            yield from _strings(json.loads(line))
                        except json.JSONDecodeError as e:
                            raise DataError(f"{p} line {lineno}: not valid JSON ({e.msg})") from None


def tokenizer_key(files: list[Path], vocab_size: int, min_frequency: int) -> str:
    h = hashlib.sha256(json.dumps({"v": VERSION, "vocab": vocab_size, "min_freq": min_frequency}).encode())
    for p in files:
        h.update(file_digest(p).encode())
    return h.hexdigest()[:16]


def train_bpe(files: list[Path], vocab_size: int, min_frequency: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer (GPT-2 style: no unknown tokens) trained on the files."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(iter_texts(files), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOS, eos_token=EOS, pad_token=EOS)
    fast.chat_template = CHATML
    return fast


def trained_tokenizer(cfg, cache_root: Path):
    """The tokenizer that `model.train_tokenizer` describes: loaded from the cache, or trained and cached."""
    if not cfg.files:
        raise DataError(
            "model.train_tokenizer.files: no corpus to train the tokenizer on (defaults to data.train)"
        )
    files = corpus_files(cfg.files)
    key = tokenizer_key(files, cfg.vocab_size, cfg.min_frequency)
    out = cache_root / "tokenizers" / f"bpe-{cfg.vocab_size}-{key}"
    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out) + ".lock"):  # several processes or launches: one trains, the others wait and load
        if not (out / "tokenizer.json").is_file():
            size = sum(p.stat().st_size for p in files)
            log.info(
                "training a byte-level BPE tokenizer (vocab %d) on %.1f MB of text; cached in %s",
                cfg.vocab_size,
                size / 1e6,
                out,
            )
            tok = train_bpe(files, cfg.vocab_size, cfg.min_frequency)
            with atomic_dir(out) as tmp:
                tok.save_pretrained(tmp)
        else:
            log.info("tokenizer: reusing the BPE tokenizer trained on this corpus (%s)", out)
    return AutoTokenizer.from_pretrained(out)
