"""Fuzzing: hundreds of invalid recipes and malformed data files. Every one must be refused with a
RecipeError/DataError (exit code 2 through the CLI) whose message names the problem; none may raise
anything else (which would print a traceback)."""

import json
import random
import re

import pytest
import yaml

from conftest import train_inprocess
from training.config import apply_overrides, parse_recipe, resolve_precision
from training.core.errors import DataError, RecipeError
from training.core.machine import auto_precision
from training.data.load import load_raw

VALID = {
    "output_dir": "runs/fuzz",
    "model": {"name_or_path": "some/model"},
    "data": {"train": "data/alpaca_tiny.jsonl", "format": "instruction"},
    "method": {"type": "lora", "lora": {"r": 8}},
    "train": {"lr": 1e-4, "batch_size": 2, "max_steps": 10},
}

# (dotted key, bad value) pairs: wrong types, bad enums, negative or zero sizes, out-of-range numbers
BAD_VALUES = [
    ("seed", "abc"),
    ("seed", [1]),
    ("precision", "fp8"),
    ("precision", 16),
    ("resume", 5),
    ("output_dir", None),
    ("output_dir", {"a": 1}),
    ("model", "gpt2"),
    ("model", None),
    ("model.dtype", "float8"),
    ("model.attn_implementation", "flash3"),
    ("model.gradient_checkpointing", "sometimes"),
    ("model.name_or_path", 42),
    ("data", []),
    ("data.train", 5),
    ("data.train", None),
    ("data.format", "xml"),
    ("data.max_length", 0),
    ("data.max_length", -5),
    ("data.max_length", "long"),
    ("data.eval_fraction", 1.5),
    ("data.eval_fraction", -0.1),
    ("method.type", "prefix"),
    ("method.lora.r", 0),
    ("method.lora.r", -1),
    ("method.lora.alpha", -2),
    ("method.lora.dropout", 1.0),
    ("method.lora.dropout", "x"),
    ("method.quantization.bits", 3),
    ("method.quantization.quant_type", "int4"),
    ("train.lr", 0),
    ("train.lr", -1e-4),
    ("train.lr", "fast"),
    ("train.lr", float("nan")),
    ("train.batch_size", 0),
    ("train.batch_size", 2.5),
    ("train.grad_accum", -1),
    ("train.max_steps", 0),
    ("train.epochs", -1),
    ("train.scheduler", "step"),
    ("train.optimizer", "sgd"),
    ("train.warmup_steps", -3),
    ("train.warmup_ratio", 2),
    ("train.weight_decay", -0.1),
    ("train.max_grad_norm", -1),
    ("train.betas", [0.9]),
    ("train.betas", "0.9,0.99"),
    ("train.log_every", 0),
    ("train.on_nonfinite", "ignore"),
    ("eval.every_steps", 0),
    ("eval.max_batches", -1),
    ("eval.at_start", "maybe"),
    ("checkpoint.every_steps", -2),
    ("checkpoint.keep_last", 0),
    ("train", [1, 2]),
    ("eval", "often"),
]
INCOMPATIBLE = [
    [
        "train.epochs=2",
        "train.max_steps=3",
    ],  # both on the command line (one alone replaces the file's max_steps)
    ["train.warmup_steps=5", "train.warmup_ratio=0.1"],
    ["model.from_scratch={hidden_size: 64, num_attention_heads: 4}"],  # with name_or_path
    ["model.attn_implementation=flash_attention_2"],  # fp32
]


def mutations(rng: random.Random):
    """Yield (dotted key, value): the bad values above, then random unknown keys in every section."""
    yield from BAD_VALUES
    words = ["lrate", "batchsize", "epoch", "modle", "dataset", "lora_r", "optim", "Train", "ouput_dir", "x"]
    sections = ["", "model.", "data.", "method.", "method.lora.", "train.", "eval.", "checkpoint."]
    for _ in range(200):
        yield (
            rng.choice(sections) + rng.choice(words) + str(rng.randint(0, 99)),
            rng.choice([1, "a", None, [1], {"k": 1}, 2.5]),
        )


def set_key(raw: dict, dotted: str, value):
    node = raw
    parts = dotted.split(".")
    for p in parts[:-1]:
        if not isinstance(node.get(p), dict):
            node[p] = {}
        node = node[p]
    node[parts[-1]] = value
    return raw


def test_fuzzed_recipes_are_refused_naming_the_key():
    rng = random.Random(0)
    n = 0
    for key, value in mutations(rng):
        raw = set_key(json.loads(json.dumps(VALID)), key, value)
        with pytest.raises(RecipeError) as e:
            parse_recipe(raw, "fuzz.yaml")
        message = str(e.value)
        top = key.split(".")[0]
        assert "fuzz.yaml" in message and top in message, (key, value, message)
        n += 1
    for overrides in INCOMPATIBLE:
        with pytest.raises(RecipeError, match="fuzz.yaml"):  # as training takes it: precision resolved
            resolve_precision(parse_recipe(apply_overrides(VALID, overrides), "fuzz.yaml"), *auto_precision())
        n += 1
    for junk in ([], "text", 5, None, [VALID]):
        with pytest.raises(RecipeError, match="expected a mapping"):
            parse_recipe(junk, "fuzz.yaml")
        n += 1
    for bad in ("=5", "train.=3", ".lr=1", "nokey", "train.lr.x=1"):
        with pytest.raises(RecipeError, match="override"):
            apply_overrides(VALID, [bad])
        n += 1
    assert n > 250


def corrupt_lines(rng: random.Random, fmt: str):
    """Yield (file text, expected message fragment, line number) for malformed JSONL data."""
    good = {
        "instruction": {"instruction": "Say hi", "input": "", "output": "hi"},
        "chat": {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
        "text": {"text": "Once upon a time."},
    }[fmt]
    breakers = [
        (lambda r: json.dumps(r)[:-3], "not valid JSON"),
        (lambda r: "[" + json.dumps(r) + "]", "expected a JSON object"),
        (lambda r: json.dumps("just a string"), "expected a JSON object"),
        (lambda r: "{'single': 'quotes'}", "not valid JSON"),
        (
            lambda r: json.dumps({k: v for k, v in list(r.items())[1:]}) if len(r) > 1 else json.dumps({}),
            "missing",
        ),
        (lambda r: json.dumps({k: 5 for k in r}), ""),
        (lambda r: "NaN garbage", "not valid JSON"),
    ]
    if fmt == "chat":
        breakers += [
            (lambda r: json.dumps({"messages": [{"role": "robot", "content": "x"}]}), "unknown role 'robot'"),
            (lambda r: json.dumps({"messages": []}), "messages"),
            (
                lambda r: json.dumps({"messages": [{"role": "user", "content": "only a question"}]}),
                "no assistant message",
            ),
            (lambda r: json.dumps({"messages": [{"role": "user"}]}), "content"),
        ]
    for _ in range(40):
        n_good = rng.randint(0, 5)
        breaker, expected = rng.choice(breakers)
        lines = [json.dumps(good)] * n_good + [breaker(good)] + [json.dumps(good)] * rng.randint(0, 3)
        yield "\n".join(lines) + "\n", expected, n_good + 1


@pytest.mark.parametrize("fmt", ["instruction", "chat", "text"])
def test_fuzzed_jsonl_files_name_file_and_line(tmp_path, fmt):
    rng = random.Random(hash(fmt) % 1000)
    for i, (text, expected, lineno) in enumerate(corrupt_lines(rng, fmt)):
        path = tmp_path / f"{fmt}-{i}.jsonl"
        path.write_text(text)
        with pytest.raises(DataError) as e:
            load_raw([str(path)], fmt, "data.train")
        message = str(e.value)
        assert f"{path.name} line {lineno}" in message, (text, message)
        assert expected in message, (text, message)


@pytest.mark.parametrize(
    "name, content, expected",
    [
        ("empty.jsonl", "", "is empty"),
        ("blank.jsonl", "\n \n\n", "no records"),
        ("latin1.jsonl", "caf\xe9".encode("latin-1"), "not UTF-8"),
        ("list.json", '{"not": "a list"}', "expected a JSON list"),
        ("bad.json", '[{"instruction": "x", "output": "y"},', "not valid JSON"),
        ("cols.csv", "question,answer\nq,a\n", "missing string field 'instruction'"),
        ("data.xml", "<a/>", "unsupported extension"),
    ],
)
def test_malformed_files_are_refused(tmp_path, name, content, expected):
    path = tmp_path / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(DataError, match=expected):
        load_raw([str(path)], "instruction", "data.train")


def test_fuzz_cases_through_the_cli_exit_2_without_traceback(make_recipe, tmp_path, capsys):
    rng = random.Random(1)
    cases = [
        [f"{k}={yaml.safe_dump(v, default_flow_style=True).strip()}"] for k, v in rng.sample(BAD_VALUES, 6)
    ]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": \n')
    cases.append([f"data.train={bad}"])
    for overrides in cases:
        with pytest.raises(SystemExit) as e:
            train_inprocess(make_recipe(), *overrides)
        err = capsys.readouterr().err
        assert e.value.code == 2, (overrides, err)
        # the error is what is said, after at most the log's lines (a warning about a shared CPU, on a busy box)
        before, _, said = ("\n" + err).partition("\nerror: ")
        assert said and "Traceback" not in err, (overrides, err)
        assert all(re.match(r"\d\d:\d\d:\d\d (INFO|WARNING) ", line) for line in before.split("\n")[1:]), err
