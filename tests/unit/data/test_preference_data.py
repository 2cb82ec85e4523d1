"""Preference and prompt-completion records: the shapes accepted, what carries labels, and bad records
reported with file and line (exit code 2)."""

import json

import pytest

from conftest import TINY_ARCH, TOKENIZER, train_inprocess
from training.config import ModelSection, parse_recipe
from training.core.batch import IGNORE
from training.core.errors import DataError
from training.data import build_datasets
from training.data.preference import PreferenceCollator
from training.data.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(ModelSection(name_or_path=TOKENIZER))


def lines(path, *rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def build(tmp_path, tok, rows, preference=None, **data):
    raw = {
        "output_dir": str(tmp_path / "run"),
        "model": {"name_or_path": TOKENIZER},
        "data": {"train": lines(tmp_path / "d.jsonl", *rows), "max_length": 128, "cache": False, **data},
    }
    if preference:
        raw["preference"] = preference
    return build_datasets(parse_recipe(raw), tok)[0]


def labelled(tok, ids, labels):
    return tok.decode([t for t, lab in zip(ids, labels) if lab != IGNORE])


def msgs(*pairs):
    return [{"role": r, "content": c} for r, c in pairs]


def test_prompt_completion_sft_records_carry_labels_on_the_completion_only(tmp_path, tok):
    ds = build(tmp_path, tok, [{"prompt": "What is 2+2?", "completion": "Four."}])
    row = ds[0]
    text = tok.decode(row["input_ids"])
    assert "What is 2+2?" in text and "<|im_start|>assistant" in text  # the prompt went through the template
    assert labelled(tok, row["input_ids"], row["labels"]).startswith("Four.<|im_end|>")
    # message lists: an assistant turn inside the prompt is context, not a target
    conv = msgs(("user", "Hi"), ("assistant", "Hello there."), ("user", "And 3+3?"))
    ds = build(tmp_path, tok, [{"prompt": conv, "completion": msgs(("assistant", "Six."))}])
    got = labelled(tok, ds[0]["input_ids"], ds[0]["labels"])
    assert got.startswith("Six.") and "Hello there" not in got


@pytest.mark.parametrize(
    "rows",
    [
        [{"prompt": "Hi", "chosen": "Hello! Happy forging!", "rejected": "Hello!"}],
        [  # UltraFeedback: whole conversations, the shared user turn is the prompt
            {
                "chosen": msgs(("user", "Hi"), ("assistant", "Hello! Happy forging!")),
                "rejected": msgs(("user", "Hi"), ("assistant", "Hello!")),
            }
        ],
        [
            {
                "prompt": msgs(("user", "Hi")),
                "chosen": msgs(("assistant", "Hello! Happy forging!")),
                "rejected": msgs(("assistant", "Hello!")),
            }
        ],
    ],
)
def test_pairwise_shapes_give_the_same_pair(tmp_path, tok, rows):
    row = build(tmp_path, tok, rows, {"objective": "dpo"})[0]
    assert labelled(tok, row["input_ids"], row["labels"]).startswith("Hello! Happy forging!<|im_end|>")
    assert labelled(tok, row["other_input_ids"], row["other_labels"]).startswith("Hello!<|im_end|>")
    assert "user\nHi<|im_end|>" in tok.decode(row["other_input_ids"])
    batch = PreferenceCollator(tok.pad_token_id)([row, row])
    assert batch["input_ids"].shape[0] == 4 and batch["row"].tolist() == [0, 0]


def test_columns_map_other_names_and_kto_records_get_a_mismatched_pair(tmp_path, tok):
    rows = [
        {"q": "What is 2+2?", "a": "Four.", "ok": True},
        {"q": "Capital of France?", "a": "Berlin.", "ok": False},
    ]
    ds = build(
        tmp_path, tok, rows, {"objective": "kto"}, columns={"prompt": "q", "completion": "a", "label": "ok"}
    )
    assert ds["label"] == [1, 0]
    assert labelled(tok, ds[0]["input_ids"], ds[0]["labels"]).startswith("Four.")
    mismatched = ds[0]["other_input_ids"]
    assert "What is 2+2?" in tok.decode(mismatched) and "Berlin." in tok.decode(mismatched)


GOOD = {"prompt": "Hi", "chosen": "Hello!", "rejected": "Go away."}
CASES = [
    ([GOOD, {"prompt": "Hi", "chosen": "Hello!"}], "dpo", {}, "d.jsonl line 2: missing field 'rejected'"),
    (
        [GOOD, {"prompt": "Hi", "chosen": "  ", "rejected": "x"}],
        "dpo",
        {},
        "line 2: field 'chosen' is an empty completion",
    ),
    (
        [{"prompt": "Hi", "chosen": "Same.", "rejected": "Same."}],
        "dpo",
        {},
        "line 1: 'chosen' and 'rejected' are identical",
    ),
    ([{"chosen": "Hello!", "rejected": "Bye."}], "dpo", {}, "line 1: missing field 'prompt'"),
    (
        [{"prompt": "Hi", "chosen": "Hello!", "rejected": "x"}],
        "dpo",
        {"columns": {"chosen": "good"}},
        "missing field 'good' (data.columns: chosen -> good)",
    ),
    (
        [{"prompt": "Hi", "completion": "Hello!", "label": "yes"}],
        "kto",
        {},
        "line 1: field 'label' must be true or false",
    ),
    (
        [{"prompt": "Hi", "completion": "", "label": True}],
        "kto",
        {},
        "line 1: field 'completion' is an empty completion",
    ),
    (
        [{"prompt": "Hi", "completion": []}],
        None,
        {},
        "line 1: field 'completion' must be a string or a non-empty list",
    ),
]


@pytest.mark.parametrize("rows,objective,data,message", CASES)
def test_bad_records_name_file_and_line(tmp_path, tok, rows, objective, data, message):
    with pytest.raises(DataError) as e:
        build(tmp_path, tok, rows, {"objective": objective} if objective else None, **data)
    assert message in str(e.value)


def test_bad_preference_file_exits_2_with_the_line(tmp_path, capsys):
    bad = lines(tmp_path / "bad.jsonl", GOOD, {"prompt": "Hi", "chosen": "Same.", "rejected": "Same."})
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        json.dumps(
            {
                "output_dir": str(tmp_path / "run"),
                "model": {"tokenizer": TOKENIZER, "from_scratch": dict(TINY_ARCH)},
                "data": {"train": bad, "cache": False},
                "preference": {"objective": "dpo"},
            }
        )
    )
    with pytest.raises(SystemExit) as e:
        train_inprocess(recipe)
    assert e.value.code == 2
    assert f"{bad} line 2: 'chosen' and 'rejected' are identical" in capsys.readouterr().err
