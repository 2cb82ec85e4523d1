"""Makes tests/tokenizer/, the tiny models' tokenizer: SmolLM2's, cut to the 3,749 tokens that data/ uses.

    .venv/bin/python tests/small_vocab.py   # writes tests/tokenizer/ again (the files are committed)

A tiny model's cost is its vocabulary: with SmolLM2's 49,152 ids, the LM head of a 64-wide model is ~97% of
its FLOPs, and a training step of 4 x 128 tokens took 506 ms where the same model over 4,096 ids took 46 ms
(one thread, 2-core Xeon, 2026-12-02). Loading the cut tokenizer takes a few ms where the whole one took
~0.2 s, paid ~1,000 times a run of the suite.

The cut keeps SmolLM2's byte-level BPE, only smaller, so that the suite's data tokenize as they did: the
special tokens (ids 0-16, <|im_start|> and <|im_end|> among them; the chat template is SmolLM2's), the 256
bytes, its first 1,024 ids, every token SmolLM2 makes of the files in data/ (of each file's text, of each
string in its JSON records, and of the chat template's system prompt), and the tokens each of those is merged
from, down to the bytes; the merges among them, in SmolLM2's order. A text of data/ is the same tokens as under
SmolLM2 (the ids from 1,024 on renumbered, in SmolLM2's order); any other text still encodes (any byte is a
token) and decodes to itself. The files are committed, not made by each run, so that a new file in data/
changes no pinned loss.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from transformers import AutoTokenizer

from training.run.sources import pretrained_source

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests/tokenizer"
FIRST = 1024  # SmolLM2's first ids, kept whatever data/ holds: the common words of a text a test writes
TEXTS = (".jsonl", ".json", ".txt", ".csv", ".md", ".py")
CHUNK = 100_000  # characters tokenized at a time


def main(source: str = "bundled:smollm2-135m-instruct") -> None:
    src = Path(pretrained_source(source))
    whole = json.loads((src / "tokenizer.json").read_text())
    used = used_tokens(AutoTokenizer.from_pretrained(src))
    OUT.mkdir(exist_ok=True)
    (OUT / "tokenizer.json").write_text(json.dumps(cut(whole, used), ensure_ascii=False, indent=1) + "\n")
    for name in ("tokenizer_config.json", "chat_template.jinja"):
        (OUT / name).write_bytes((src / name).read_bytes())


def used_tokens(tok) -> set[int]:
    """The ids SmolLM2 makes of every text file in data/ (and of each string in its JSON records, as a run
    reads them) and of its chat template around a message."""
    texts = [tok.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False)]
    for path in sorted((ROOT / "data").rglob("*")):
        if path.suffix in TEXTS:
            text = path.read_text(errors="ignore")
            texts.append(text)
            texts.extend(json_strings(text, path.suffix))
    chunks = (text[start : start + CHUNK] for text in texts for start in range(0, len(text), CHUNK))
    return {i for chunk in chunks for i in tok(chunk).input_ids}


def json_strings(text: str, suffix: str) -> list[str]:
    """Every string in the records of a .json or .jsonl file's `text` (none for another file, or not JSON)."""
    if suffix not in (".json", ".jsonl"):
        return []
    lines = text.splitlines() if suffix == ".jsonl" else [text]
    out: list[str] = []
    for line in filter(str.strip, lines):
        try:
            strings(json.loads(line), out)
        except ValueError:
            continue
    return out


def strings(value, out: list[str]) -> None:
    if isinstance(value, str):
        out.append(value)
    elif isinstance(value, dict | list):
        for v in value.values() if isinstance(value, dict) else value:
            strings(v, out)


def cut(tokenizer: dict, used: set[int]) -> dict:
    """A byte-level BPE tokenizer.json with only the `used` ids, the first FIRST and the bytes, the tokens they
    are merged from, and the merges among them; ids renumbered from 0 in the old order."""
    model = tokenizer["model"]
    piece_of = {i: piece for piece, i in model["vocab"].items()}
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    parts_of: dict[str, list[str]] = {}
    for a, b in merges:
        parts_of.setdefault(a + b, []).extend((a, b))
    kept = {piece for i, piece in piece_of.items() if i < FIRST or i in used}
    todo = list(kept)
    while todo:
        for part in parts_of.get(todo.pop(), []):
            if part not in kept:
                kept.add(part)
                todo.append(part)
    order = sorted(kept, key=model["vocab"].__getitem__)
    assert all(t["id"] < FIRST for t in tokenizer["added_tokens"]), "an added token past the first ids"
    model["vocab"] = {piece: new for new, piece in enumerate(order)}
    model["merges"] = [[a, b] for a, b in merges if a in kept and b in kept and a + b in kept]
    return tokenizer


if __name__ == "__main__":
    main(*sys.argv[1:])
