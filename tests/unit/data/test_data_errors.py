"""Bad data: each case gives one clear message naming the file and line (or key), exit code 2, no traceback."""

import json

import pytest

from conftest import TINY_ARCH, TOKENIZER, run_cli
from training.config import ModelSection, parse_recipe
from training.core.errors import DataError
from training.data import build_datasets
from training.data.tokenizer import load_tokenizer

GOOD = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(ModelSection(name_or_path=TOKENIZER))


def build(tmp_path, tok, **data):
    r = parse_recipe(
        {
            "output_dir": str(tmp_path / "run"),
            "model": {"name_or_path": TOKENIZER},
            "data": {"max_length": 64, "cache": False, **data},
        }
    )
    return build_datasets(r, tok)


def lines(path, *rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


CASES = [
    # (file name, lines, data options, expected message fragment)
    ("bad.jsonl", [GOOD, GOOD, '{"messages": [oops'], {}, "bad.jsonl line 3: not valid JSON"),
    (
        "cols.jsonl",
        [GOOD, {"conversation": []}],
        {},
        "cols.jsonl line 2: missing non-empty list field 'messages' (format: chat); the record has 'conversation'",
    ),
    (
        "role.jsonl",
        [GOOD, {"messages": [{"role": "robot", "content": "x"}]}],
        {},
        "role.jsonl line 2: messages[0] has unknown role 'robot'",
    ),
    (
        "share.jsonl",
        [{"conversations": [{"from": "human", "value": "a"}, {"from": "bot", "value": "b"}]}],
        {"format": "sharegpt"},
        "share.jsonl line 1: conversations[1] has unknown role 'bot' (expected one of",
    ),
    (
        "noans.jsonl",
        [{"messages": [{"role": "user", "content": "x"}]}],
        {},
        "noans.jsonl line 1: no assistant message",
    ),
    (
        "content.jsonl",
        [{"messages": [{"role": "user", "content": 3}]}],
        {},
        "messages[0] must be an object with 'role' and string 'content'",
    ),
    (
        "alpaca.jsonl",
        [{"instruction": "x", "answer": "y"}],
        {"format": "instruction"},
        "alpaca.jsonl line 1: missing string field 'output'",
    ),
    (
        "mapped.jsonl",
        [{"prompt": "x"}],
        {"format": "text", "columns": {"text": "body"}},
        "mapped.jsonl line 1: missing string field 'body' (data.columns: text -> body) (format: text); the record has 'prompt'",
    ),
    ("blank.jsonl", ["", "  "], {}, "blank.jsonl: no records"),
    ("notobj.jsonl", ["[1, 2]"], {}, "notobj.jsonl line 1: expected a JSON object"),
]


@pytest.mark.parametrize("name,rows,opts,message", CASES, ids=[c[0] for c in CASES])
def test_bad_records_name_file_and_line(tmp_path, tok, name, rows, opts, message):
    path = lines(tmp_path / name, *rows)
    with pytest.raises(DataError) as e:
        build(tmp_path, tok, train=path, **opts)
    assert message in str(e.value)


def test_empty_missing_and_wrong_type_files(tmp_path, tok):
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(DataError, match=r"data.train: data file .*empty.jsonl is empty"):
        build(tmp_path, tok, train=str(tmp_path / "empty.jsonl"))
    with pytest.raises(DataError, match=r"data.train: data file .*nope.jsonl does not exist"):
        build(tmp_path, tok, train=str(tmp_path / "nope.jsonl"))
    (tmp_path / "t.txt").write_text("hello\n")
    with pytest.raises(DataError, match="set data.format=text"):
        build(tmp_path, tok, train=str(tmp_path / "t.txt"))
    (tmp_path / "bin.jsonl").write_bytes(b'{"text": "\xff\xfe"}\n')
    with pytest.raises(DataError, match="bin.jsonl: not UTF-8 text"):
        build(tmp_path, tok, train=str(tmp_path / "bin.jsonl"), format="text")


def test_csv_rows_are_named_by_line(tmp_path, tok):
    (tmp_path / "d.csv").write_text("instruction,output\nAdd 2 and 2,4\nSay hi,\n")
    with pytest.raises(DataError, match=r"d.csv line 3: missing string field 'output'"):
        build(tmp_path, tok, train=str(tmp_path / "d.csv"), format="instruction")


def test_everything_too_long_with_drop_is_explained(tmp_path, tok):
    path = lines(
        tmp_path / "long.jsonl",
        {"messages": [{"role": "user", "content": "word " * 100}, {"role": "assistant", "content": "ok"}]},
    )
    with pytest.raises(DataError, match="longer than max_length with too_long=drop"):
        build(tmp_path, tok, train=path, too_long="drop")


def test_cli_exits_2_with_the_message_and_no_traceback(tmp_path):
    path = lines(tmp_path / "bad.jsonl", GOOD, '{"messages": [oops')
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        json.dumps(
            {
                "output_dir": str(tmp_path / "run"),
                "model": {"tokenizer": TOKENIZER, "from_scratch": dict(TINY_ARCH)},
                "data": {"train": path, "format": "chat", "cache": False},
            }
        )
    )
    res = run_cli("training.train", recipe, timeout=300)
    assert res.returncode == 2, res.stderr[-2000:]
    assert f"{path} line 2: not valid JSON" in res.stderr
    assert "Traceback" not in res.stderr
