"""Formats and label masking: loss on assistant tokens only; alpaca, chat, ShareGPT and column mapping
all give the same tokens; too-long examples are truncated or dropped with counts."""

import json
import logging

import pytest

from conftest import TOKENIZER
from training.config import ModelSection, parse_recipe
from training.core.batch import IGNORE
from training.data import build_datasets
from training.data.tokenize import tokenize_chat
from training.data.tokenizer import load_tokenizer

CONV = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Italy?"},
    {"role": "assistant", "content": "Rome, of course."},
]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(ModelSection(name_or_path=TOKENIZER))


def recipe(tmp_path, **data):
    return parse_recipe(
        {
            "output_dir": str(tmp_path / "run"),
            "model": {"name_or_path": TOKENIZER},
            "data": {"max_length": 256, "cache": False, **data},
        }
    )


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def labelled_text(tok, row) -> list[str]:
    """The labelled tokens of an example, decoded per contiguous run."""
    runs, cur = [], []
    for t, y in zip(row["input_ids"], row["labels"]):
        if y != IGNORE:
            assert y == t  # labels are aligned with input_ids (the model shifts)
            cur.append(t)
        elif cur:
            runs.append(tok.decode(cur))
            cur = []
    if cur:
        runs.append(tok.decode(cur))
    return runs


def test_loss_only_on_assistant_turns(tok):
    row = tokenize_chat(CONV, tok)
    assert labelled_text(tok, row) == ["Paris.<|im_end|>\n", "Rome, of course.<|im_end|>\n"]
    # and every other token (system, user, role headers) is masked
    assert sum(y != IGNORE for y in row["labels"]) == len(
        tok("Paris.<|im_end|>\nRome, of course.<|im_end|>\n")["input_ids"]
    )


def test_chat_sharegpt_alpaca_and_mapped_columns_agree(tmp_path, tok):
    chat = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONV}])
    roles = {"system": "system", "user": "human", "assistant": "gpt"}
    share = write_jsonl(
        tmp_path / "share.jsonl",
        [{"conversations": [{"from": roles[m["role"]], "value": m["content"]} for m in CONV]}],
    )
    mapped = write_jsonl(
        tmp_path / "mapped.jsonl", [{"dialog": [{"speaker": m["role"], "text": m["content"]} for m in CONV]}]
    )
    a = build_datasets(recipe(tmp_path, train=chat, format="chat"), tok)[0][0]
    b = build_datasets(recipe(tmp_path, train=share, format="sharegpt"), tok)[0][0]
    c = build_datasets(
        recipe(
            tmp_path,
            train=mapped,
            format="chat",
            columns={"messages": "dialog", "role": "speaker", "content": "text"},
        ),
        tok,
    )[0][0]
    assert a == b == c
    assert labelled_text(tok, a) == ["Paris.<|im_end|>\n", "Rome, of course.<|im_end|>\n"]

    alpaca = write_jsonl(tmp_path / "alpaca.jsonl", [{"q": "Add.", "ctx": "2 3", "a": "5"}])
    d = build_datasets(
        recipe(
            tmp_path,
            train=alpaca,
            format="instruction",
            system_prompt="Be brief.",
            columns={"instruction": "q", "input": "ctx", "output": "a"},
        ),
        tok,
    )[0][0]
    assert labelled_text(tok, d) == ["5<|im_end|>\n"]
    assert "Add.\n\n2 3" in tok.decode(d["input_ids"])


def test_sharegpt_system_column_becomes_system_message(tmp_path, tok):
    share = write_jsonl(
        tmp_path / "s.jsonl",
        [
            {
                "system": "Be brief.",
                "conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"}],
            }
        ],
    )
    row = build_datasets(recipe(tmp_path, train=share, format="sharegpt"), tok)[0][0]
    assert tok.decode(row["input_ids"]).startswith("<|im_start|>system\nBe brief.<|im_end|>")


def test_too_long_truncate_or_drop_with_counts(tmp_path, tok, caplog):
    short = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}
    long = {
        "messages": [{"role": "user", "content": "word " * 200}, {"role": "assistant", "content": "ok " * 50}]
    }
    path = write_jsonl(tmp_path / "d.jsonl", [short, long, short, long, long])
    caplog.set_level(logging.INFO)
    ds, _ = build_datasets(recipe(tmp_path, train=path, max_length=120, too_long="truncate"), tok)
    assert len(ds) == 2  # the long ones lose every answer token when cut at 120, so they go too
    assert "3 truncated to max_length=120" in caplog.text
    assert "3 dropped with no assistant token left to learn" in caplog.text

    caplog.clear()
    ds, _ = build_datasets(recipe(tmp_path, train=path, max_length=250, too_long="truncate"), tok)
    assert len(ds) == 5 and max(len(x) for x in ds["input_ids"]) == 250
    assert "3 truncated to max_length=250" in caplog.text
    assert labelled_text(tok, ds[1])[0].startswith("ok ok")  # truncation keeps the start of the answer

    caplog.clear()
    ds, _ = build_datasets(recipe(tmp_path, train=path, max_length=250, too_long="drop"), tok)
    assert len(ds) == 2
    assert "5 examples, 2 kept" in caplog.text
    assert "3 dropped as longer than max_length=250" in caplog.text


def test_packing_logs_efficiency(tmp_path, tok, caplog):
    caplog.set_level(logging.INFO)
    r = recipe(
        tmp_path,
        train="data/dates/train.jsonl",
        format="chat",
        max_length=512,
        packing=True,
        max_examples=200,
    )
    train, _ = build_datasets(r, tok)
    assert set(train.column_names) == {"input_ids", "labels", "position_ids"}
    assert "packing efficiency" in caplog.text
    line = next(x for x in caplog.text.splitlines() if "packing efficiency" in x)
    eff = float(line.split("packing efficiency ")[1].split("%")[0])
    assert eff == pytest.approx(100 * sum(map(len, train["input_ids"])) / (len(train) * 512), abs=0.05)
    assert eff > 85


def test_packing_rejected_for_text_format(tmp_path):
    from training.core.errors import RecipeError

    with pytest.raises(RecipeError, match="packing applies to instruction/chat/sharegpt"):
        parse_recipe(
            {
                "output_dir": "x",
                "model": {"name_or_path": TOKENIZER},
                "data": {"train": "data/tiny_stories.txt", "format": "text", "packing": True},
            }
        )
    with pytest.raises(RecipeError, match="columns: unknown standard name"):
        parse_recipe(
            {
                "output_dir": "x",
                "model": {"name_or_path": TOKENIZER},
                "data": {"train": "a.jsonl", "columns": {"question": "q"}},
            }
        )
