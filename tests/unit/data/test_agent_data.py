"""Post-training data of today: tool calls, reasoning traces, and which turns carry the loss.

Label masks are checked token by token (the labelled runs, decoded, and their token count); bad records
are named by file and line; templates that cannot render what the data holds are refused before training.
"""

import json

import datasets
import pytest

from conftest import ROOT, TINY_ARCH, TOKENIZER, run_cli
from training.config import ModelSection, parse_recipe
from training.core.batch import IGNORE
from training.core.errors import DataError, RecipeError
from training.data import build_datasets
from training.data.examples import tokenize_split
from training.data.formats import RecordFormat
from training.data.load import load_raw
from training.data.shards import units_of
from training.data.tokenizer import load_tokenizer

TOOLS_TEMPLATE = str(ROOT / "data/tools/chatml_tools.jinja")
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CALC = {
    "type": "function",
    "function": {
        "name": "calculate",
        "description": "Arithmetic.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}, "digits": {"type": "integer"}},
        },
    },
}


def call(name, arguments):
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


TOOL_CHAT = {
    "tools": [WEATHER, CALC],
    "messages": [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [call("get_weather", {"city": "Oslo"})]},
        {"role": "tool", "name": "get_weather", "content": "SECRET-RESULT 3C"},
        {"role": "assistant", "content": "It is 3C in Oslo."},
    ],
}
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call><|im_end|>\n'


@pytest.fixture(scope="module")
def base_tok():
    return load_tokenizer(ModelSection(name_or_path=TOKENIZER))


@pytest.fixture
def tok(base_tok):
    """The bundled tokenizer, its own template restored after each test (data.chat_template replaces it)."""
    template = base_tok.chat_template
    yield base_tok
    base_tok.chat_template = template


def recipe(tmp_path, **data):
    return parse_recipe(
        {
            "output_dir": str(tmp_path / "run"),
            "model": {"name_or_path": TOKENIZER},
            "data": {"max_length": 1024, "cache": False, **data},
        }
    )


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def build(tmp_path, tok, rows, **data):
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    return build_datasets(recipe(tmp_path, train=path, **data), tok)[0]


def labelled(tok, row) -> list[str]:
    """The labelled tokens, decoded per contiguous run; asserts the labels are the ids where set."""
    runs, cur = [], []
    for t, y in zip(row["input_ids"], row["labels"]):
        if y != IGNORE:
            assert y == t
            cur.append(t)
        elif cur:
            runs.append(tok.decode(cur))
            cur = []
    if cur:
        runs.append(tok.decode(cur))
    return runs


def assert_labels(tok, row, runs):
    """Exactly these runs carry labels, token for token (and nothing else does)."""
    assert labelled(tok, row) == runs
    n = sum(y != IGNORE for y in row["labels"])
    assert n == sum(len(tok(r, add_special_tokens=False)["input_ids"]) for r in runs)


# ----------------------------------------------------------------------------- tool calls


def test_calls_and_answers_are_labelled_tool_results_never(tmp_path, tok):
    row = build(tmp_path, tok, [TOOL_CHAT], chat_template=TOOLS_TEMPLATE)[0]
    text = tok.decode(row["input_ids"])
    assert '"name": "get_weather", "description": "Weather in a city."' in text  # tools= reached the template
    assert "<|im_start|>tool\n<tool_response>\nSECRET-RESULT 3C\n</tool_response>" in text
    assert_labels(tok, row, [CALL_TEXT, "It is 3C in Oslo.<|im_end|>\n"])


def test_bundled_tool_chats_train_on_calls(tmp_path, tok):
    rows = build_datasets(
        recipe(tmp_path, train=str(ROOT / "data/tools/tool_calls.jsonl"), chat_template=TOOLS_TEMPLATE), tok
    )[0]
    assert len(rows) == 48
    for row in rows:
        runs = labelled(tok, row)
        assert not any("tool_response" in r or "<|im_start|>" in r for r in runs)
    both = labelled(tok, rows[2])  # weather, then the calculator, then the answer
    assert [r.split('"name": "')[1].split('"')[0] for r in both[:2]] == ["get_weather", "calculate"]
    assert both[2].startswith("It is ")


def test_arguments_as_json_string_or_dict_give_the_same_tokens(tmp_path, tok):
    as_string = json.loads(json.dumps(TOOL_CHAT))
    as_string["messages"][1]["tool_calls"][0]["function"]["arguments"] = '{"city": "Oslo"}'
    as_string["tools"] = json.dumps(TOOL_CHAT["tools"])  # TRL stores tools as a JSON string
    a, b = build(tmp_path, tok, [TOOL_CHAT, as_string], chat_template=TOOLS_TEMPLATE)
    assert a == b


def test_records_with_different_arguments_render_as_written(tmp_path, tok):
    """Arrow merges the keys of every record's arguments (and schemas) into one struct; the rendered
    text must still hold each record's own, on the pre-tokenized path and on the streaming path."""
    other = {
        "tools": [CALC],
        "messages": [
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "", "tool_calls": [call("calculate", '{"expression": "2+2"}')]},
            {"role": "tool", "content": "4"},
            {"role": "assistant", "content": "4."},
        ],
    }
    r = recipe(
        tmp_path, train=write_jsonl(tmp_path / "d.jsonl", [TOOL_CHAT, other]), chat_template=TOOLS_TEMPLATE
    )
    built = build_datasets(r, tok)[0]
    fmt = RecordFormat("chat")
    streamed, _ = tokenize_split(
        datasets.Dataset.from_list([fmt.arrow_safe(x) for x in (TOOL_CHAT, other)]), r.data, tok
    )
    for ds in (built, streamed):
        text = tok.decode(ds[1]["input_ids"])
        assert '"arguments": {"expression": "2+2"}' in text
        assert "null" not in text and "city" not in text and '"digits": {"type": "integer"}' in text
    assert built[:] == streamed[:]


def test_template_that_cannot_render_tools_is_refused(tmp_path, tok):
    with pytest.raises(DataError) as e:
        build(tmp_path, tok, [TOOL_CHAT])  # SmolLM2's own template knows nothing of tools
    msg = str(e.value)
    assert "the chat template of tokenizer" in msg and "cannot render them" in msg
    assert "tool definitions passed as tools= do not appear" in msg
    assert "bring a template" in msg.lower() and "data.chat_template: PATH" in msg


def test_template_that_renders_tools_but_drops_calls_is_refused(tmp_path, tok):
    no_calls = tmp_path / "no_calls.jinja"
    no_calls.write_text(
        "{% for t in tools or [] %}{{ t.function.name }}\n{% endfor %}"
        "{% for m in messages %}{{ '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    )
    with pytest.raises(
        DataError,
        match=f"data.chat_template {no_calls} cannot render them: an assistant message's tool_calls",
    ):
        build(tmp_path, tok, [TOOL_CHAT], chat_template=str(no_calls))


def test_cli_refuses_a_template_without_tools_with_exit_2(tmp_path):
    path = write_jsonl(tmp_path / "tools.jsonl", [TOOL_CHAT])
    r = tmp_path / "r.yaml"
    r.write_text(
        json.dumps(
            {
                "output_dir": str(tmp_path / "run"),
                "model": {"tokenizer": TOKENIZER, "from_scratch": dict(TINY_ARCH)},
                "data": {"train": path, "cache": False},
            }
        )
    )
    res = run_cli("training.train", r, timeout=300)
    assert res.returncode == 2, res.stderr[-2000:]
    assert "data.chat_template: PATH" in res.stderr and "Traceback" not in res.stderr


BAD = [
    # (what, record, message fragment)
    (
        "arguments not JSON",
        {
            **TOOL_CHAT,
            "messages": [
                TOOL_CHAT["messages"][0],
                {"role": "assistant", "content": "", "tool_calls": [call("get_weather", "{city: Oslo")]},
            ],
        },
        "messages[1].tool_calls[0] (get_weather): arguments must be a JSON object or a string holding one",
    ),
    (
        "unknown tool",
        {**TOOL_CHAT, "tools": [CALC]},
        "messages[1] calls tool 'get_weather', which is not in tools (the record's tools are calculate)",
    ),
    (
        "no tools at all",
        {"messages": TOOL_CHAT["messages"]},
        "messages[1] calls tool 'get_weather', which is not in tools (the record has no tools)",
    ),
    (
        "tool_calls not a list",
        {
            **TOOL_CHAT,
            "messages": [
                TOOL_CHAT["messages"][0],
                {"role": "assistant", "content": "", "tool_calls": {"name": "x"}},
            ],
        },
        "messages[1].tool_calls must be a non-empty list of calls, not dict",
    ),
    (
        "call without a name",
        {
            **TOOL_CHAT,
            "messages": [
                TOOL_CHAT["messages"][0],
                {"role": "assistant", "content": "", "tool_calls": [{"arguments": {}}]},
            ],
        },
        'messages[1].tool_calls[0] must be a call {"type": "function", "function": {"name": ...',
    ),
    (
        "tool result with no call",
        {
            "messages": [
                {"role": "user", "content": "x"},
                {"role": "tool", "content": "42"},
                {"role": "assistant", "content": "y"},
            ]
        },
        "messages[1] is a tool result with no call before it",
    ),
    (
        "more results than calls",
        {
            **TOOL_CHAT,
            "messages": TOOL_CHAT["messages"][:3]
            + [{"role": "tool", "content": "again"}, TOOL_CHAT["messages"][3]],
        },
        "messages[3] is a tool result with no call before it",
    ),
    (
        "tools not a list",
        {**TOOL_CHAT, "tools": {"name": "get_weather"}},
        "field 'tools' must be a list of tool definitions, not dict",
    ),
    (
        "tools string not JSON",
        {**TOOL_CHAT, "tools": "[{oops"},
        "field 'tools' is a string but not valid JSON",
    ),
    (
        "null content without calls",
        {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": None}]},
        "messages[1] must be an object with 'role' and string 'content'",
    ),
    (
        "calls on a user message",
        {**TOOL_CHAT, "messages": [{"role": "user", "content": "", "tool_calls": [call("get_weather", {})]}]},
        "messages[0] has tool_calls but role 'user'; only assistant messages call tools",
    ),
    (
        "train mark not a bool",
        {
            "messages": [
                {"role": "user", "content": "x"},
                {"role": "assistant", "content": "y", "train": "no"},
            ]
        },
        "messages[1].train must be true or false, not 'no'",
    ),
    (
        "train mark on a tool result",
        {
            **TOOL_CHAT,
            "messages": TOOL_CHAT["messages"][:2] + [{"role": "tool", "content": "r", "train": True}],
        },
        "messages[2].train marks assistant turns only (tool messages never carry labels)",
    ),
    (
        "reasoning not a string",
        {
            "messages": [
                {"role": "user", "content": "x"},
                {"role": "assistant", "content": "y", "reasoning_content": 3},
            ]
        },
        "messages[1].reasoning_content must be a string on an assistant message",
    ),
]


@pytest.mark.parametrize("what,record,message", BAD, ids=[b[0] for b in BAD])
def test_malformed_tool_records_are_named_by_file_and_line(tmp_path, what, record, message):
    path = write_jsonl(tmp_path / "agent.jsonl", [TOOL_CHAT, TOOL_CHAT, record])
    with pytest.raises(DataError) as e:
        load_raw([path], "chat", "data.train")
    assert f"agent.jsonl line 3: {message}" in str(e.value)


def test_sharegpt_function_calls_and_observations(tmp_path, tok):
    share = {
        "tools": json.dumps([WEATHER]),  # LLaMA-Factory writes tools as a JSON string
        "conversations": [
            {"from": "human", "value": "Weather in Oslo?"},
            {
                "from": "function_call",
                "value": json.dumps({"name": "get_weather", "arguments": {"city": "Oslo"}}),
            },
            {"from": "observation", "value": "SECRET-RESULT 3C"},
            {"from": "gpt", "value": "It is 3C in Oslo."},
        ],
    }
    chat = {**TOOL_CHAT, "tools": [WEATHER]}
    a = build(tmp_path, tok, [share], format="sharegpt", chat_template=TOOLS_TEMPLATE)[0]
    b = build(tmp_path, tok, [chat], chat_template=TOOLS_TEMPLATE)[0]
    assert a == b
    assert_labels(tok, a, [CALL_TEXT, "It is 3C in Oslo.<|im_end|>\n"])
    bad = {
        **share,
        "conversations": share["conversations"][:1]
        + [{"from": "function_call", "value": "get_weather(Oslo)"}],
    }
    path = write_jsonl(tmp_path / "share.jsonl", [share, bad])
    with pytest.raises(
        DataError,
        match="share.jsonl line 2: conversations\\[1\\]: a function_call turn holds its call as JSON",
    ):
        load_raw([path], "sharegpt", "data.train")


# ----------------------------------------------------------------------------- reasoning

TRACE = "7 + 10 = 17. 17 - 2 = 15."
THINKING = {
    "messages": [
        {"role": "user", "content": "Ben has 7, buys 10 and gives 2 away. How many?"},
        {"role": "assistant", "reasoning_content": TRACE, "content": "15."},
    ]
}


@pytest.mark.parametrize("template", ["native", "inlined"])
def test_reasoning_train_or_mask(tmp_path, tok, template):
    """A template that renders reasoning_content (the bundled ChatML-with-tools one) shows it itself; for one
    that does not (SmolLM2's own), the trace goes into the content as <think>...</think>. Either way mask
    takes the trace and its tags out of the labels and keeps the answer's."""
    opts = {"chat_template": TOOLS_TEMPLATE} if template == "native" else {}
    trained = build(tmp_path, tok, [THINKING], **opts)[0]
    masked = build(tmp_path, tok, [THINKING], reasoning="mask", **opts)[0]
    assert trained["input_ids"] == masked["input_ids"]
    assert f"<|im_start|>assistant\n<think>\n{TRACE}\n</think>\n\n15.<|im_end|>" in tok.decode(
        trained["input_ids"]
    )
    assert_labels(tok, trained, [f"<think>\n{TRACE}\n</think>\n\n15.<|im_end|>\n"])
    assert_labels(tok, masked, ["15.<|im_end|>\n"])


def test_think_tags_in_content_are_a_trace_too(tmp_path, tok):
    inline = {
        "messages": [
            THINKING["messages"][0],
            {"role": "assistant", "content": f"<think>\n{TRACE}\n</think>\n\n15."},
        ]
    }
    a = build(tmp_path, tok, [inline], reasoning="mask")[0]
    b = build(tmp_path, tok, [THINKING], reasoning="mask")[0]
    assert a == b
    assert_labels(tok, a, ["15.<|im_end|>\n"])


def test_bundled_reasoning_data_masks_every_trace(tmp_path, tok):
    rows = build_datasets(
        recipe(tmp_path, train=str(ROOT / "data/reasoning/reasoning.jsonl"), reasoning="mask"), tok
    )[0]
    assert len(rows) == 64
    for row in rows:
        runs = labelled(tok, row)
        assert len(runs) == 1 and "think" not in runs[0] and runs[0].endswith(".<|im_end|>\n")


def test_template_that_drops_earlier_reasoning_is_refused_unless_last_only(tmp_path, tok):
    """A Qwen3-style template shows the reasoning of assistant turns after the last user message only: an
    earlier turn renders differently once the conversation goes on, so its tokens cannot be found."""
    qwen3ish = tmp_path / "qwen3ish.jinja"
    qwen3ish.write_text(
        "{% set ns = namespace(last=0) %}{% for m in messages %}{% if m.role == 'user' %}"
        "{% set ns.last = loop.index0 %}{% endif %}{% endfor %}"
        "{% for m in messages %}{{ '<|im_start|>' + m.role + '\n' }}"
        "{% if m.role == 'assistant' and m.reasoning_content and loop.index0 > ns.last %}"
        "{{ '<think>\n' + m.reasoning_content + '\n</think>\n\n' }}{% endif %}"
        "{{ m.content + '<|im_end|>\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    )
    two = {
        "messages": THINKING["messages"]
        + [
            {"role": "user", "content": "And 3 more?"},
            {"role": "assistant", "reasoning_content": "15 + 3 = 18.", "content": "18."},
        ]
    }
    with pytest.raises(DataError, match="renders assistant message 1 differently once later messages follow"):
        build(tmp_path, tok, [two], chat_template=str(qwen3ish))
    row = build(tmp_path, tok, [two], chat_template=str(qwen3ish), train_on="last")[0]
    assert TRACE not in tok.decode(row["input_ids"])  # the template's own choice: earlier traces dropped
    assert_labels(tok, row, ["<think>\n15 + 3 = 18.\n</think>\n\n18.<|im_end|>\n"])


# ----------------------------------------------------------------------------- which turns carry the loss

MARKED = {
    "messages": [
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "A-one"},
        {"role": "user", "content": "q2"},
        {"role": "assistant", "content": "A-two", "train": True},
        {"role": "user", "content": "q3"},
        {"role": "assistant", "content": "A-three", "train": False},
        {"role": "user", "content": "q4"},
        {"role": "assistant", "content": "A-four"},
    ]
}
EXPECTED = {
    "all": ["A-one", "A-two", "A-four"],  # every turn, less the one marked false
    "last": ["A-two", "A-four"],  # the last turn, and the one marked true
    "marked": ["A-two"],  # only the one marked true
}


@pytest.mark.parametrize("train_on", ["all", "last", "marked"])
def test_train_on_chat_and_sharegpt(tmp_path, tok, train_on):
    chat = build(tmp_path, tok, [MARKED], train_on=train_on)[0]
    roles = {"user": "human", "assistant": "gpt"}
    share = {
        "conversations": [
            {
                "from": roles[m["role"]],
                "value": m["content"],
                **({"train": m["train"]} if "train" in m else {}),
            }
            for m in MARKED["messages"]
        ]
    }
    assert build(tmp_path, tok, [share], format="sharegpt", train_on=train_on)[0] == chat
    assert_labels(tok, chat, [f"{a}<|im_end|>\n" for a in EXPECTED[train_on]])


def test_train_on_last_with_tool_calls_and_instruction(tmp_path, tok):
    row = build(tmp_path, tok, [TOOL_CHAT], chat_template=TOOLS_TEMPLATE, train_on="last")[0]
    assert_labels(tok, row, ["It is 3C in Oslo.<|im_end|>\n"])
    alpaca = {"instruction": "Add.", "input": "2 3", "output": "5"}
    for train_on in ("all", "last"):
        row = build(tmp_path, tok, [alpaca], format="instruction", train_on=train_on)[0]
        assert_labels(tok, row, ["5<|im_end|>\n"])


def test_nothing_to_learn_under_train_on_is_named(tmp_path):
    plain = {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]}
    path = write_jsonl(tmp_path / "m.jsonl", [MARKED, plain])
    with pytest.raises(DataError, match='m.jsonl line 2: no assistant message is marked "train": true'):
        load_raw([path], RecordFormat("chat", train_on="marked"), "data.train")
    off = {
        "messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y", "train": False}]
    }
    path = write_jsonl(tmp_path / "o.jsonl", [plain, off])
    with pytest.raises(
        DataError,
        match='o.jsonl line 2: every assistant message that data.train_on: last trains is marked "train"',
    ):
        load_raw([path], RecordFormat("chat", train_on="last"), "data.train")


# ----------------------------------------------------------------------------- templates and their arguments

PERSONA = (
    "{{ '[' + (persona | default('plain')) + ']\n' }}"
    "{% for m in messages %}{{ '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
PLAIN_CHAT = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Ahoy"}]}


def test_chat_template_file_replaces_the_tokenizers(tmp_path, tok):
    (tmp_path / "persona.jinja").write_text(PERSONA)
    row = build(tmp_path, tok, [PLAIN_CHAT], chat_template=str(tmp_path / "persona.jinja"))[0]
    assert tok.decode(row["input_ids"]).startswith("[plain]\n<|im_start|>user\nHi")
    assert tok.chat_template == PERSONA  # so the trained model's tokenizer is saved with it
    assert_labels(tok, row, ["Ahoy<|im_end|>\n"])


def test_chat_template_file_problems(tmp_path, tok):
    with pytest.raises(
        DataError, match=r"data.chat_template: .*missing.jinja does not exist; name a Jinja chat template"
    ):
        build(tmp_path, tok, [PLAIN_CHAT], chat_template=str(tmp_path / "missing.jinja"))
    (tmp_path / "broken.jinja").write_text("{% for m in messages %}{{ m.content }")
    with pytest.raises(
        DataError, match=r"data.chat_template: .*broken.jinja cannot render a chat \(TemplateSyntaxError"
    ):
        build(tmp_path, tok, [PLAIN_CHAT], chat_template=str(tmp_path / "broken.jinja"))


def test_chat_template_kwargs_reach_the_template_and_the_cache_key(tmp_path, tok):
    (tmp_path / "persona.jinja").write_text(PERSONA)
    opts = {"chat_template": str(tmp_path / "persona.jinja")}
    pirate = build(tmp_path, tok, [PLAIN_CHAT], chat_template_kwargs={"persona": "pirate"}, **opts)[0]
    assert tok.decode(pirate["input_ids"]).startswith("[pirate]\n")
    assert_labels(tok, pirate, ["Ahoy<|im_end|>\n"])
    raw = datasets.Dataset.from_list([PLAIN_CHAT])
    keys = {
        units_of([(raw, "digest")], recipe(tmp_path, train="x.jsonl", cache=True, **extra).data, tok)[0][3]
        for extra in (
            {},
            {"chat_template_kwargs": {"persona": "pirate"}},
            {"reasoning": "mask"},
            {"train_on": "last"},
        )
    }
    assert len(keys) == 4  # each option is part of the per-shard cache key


def test_recipe_keys_are_checked(tmp_path):
    for data, message in [
        ({"format": "text", "train_on": "last"}, "train_on: applies to data rendered with a chat template"),
        ({"format": "pairwise", "reasoning": "mask"}, "reasoning: applies to instruction/chat/sharegpt data"),
        ({"format": "instruction", "train_on": "marked"}, "format=instruction has a single answer"),
        ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs: tools is set by the data pipeline"),
        ({"train_on": "first"}, "train_on"),
    ]:
        with pytest.raises(RecipeError, match=message):
            recipe(tmp_path, train="x.jsonl", **data)


# ----------------------------------------------------------------------------- replies read back (the Chat tab)

CALL = '<tool_call>\n{"name": "calculate", "arguments": {"expression": "17 - 2"}}\n</tool_call>'


@pytest.mark.parametrize(
    "text, want",
    [
        ("15 books.", {"content": "15 books."}),
        ("<think>7 + 10", {"reasoning_content": "7 + 10", "content": ""}),  # still streaming
        (
            f"<think>\n7 + 10 = 17\n</think>\n\n{CALL}",
            {
                "reasoning_content": "7 + 10 = 17",
                "content": "",
                "tool_calls": [
                    {
                        "type": "function",
                        "function": {"name": "calculate", "arguments": {"expression": "17 - 2"}},
                    }
                ],
            },
        ),
        (  # Llama-style "parameters"
            'Sure. <tool_call>{"name": "get_weather", "parameters": {"city": "Perth"}}</tool_call>',
            {
                "content": "Sure.",
                "tool_calls": [
                    {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Perth"}}}
                ],
            },
        ),
        ("<tool_call>{not json}</tool_call>", {"content": "<tool_call>{not json}</tool_call>"}),  # as written
        ('<tool_call>{"name": "calc', {"content": '<tool_call>{"name": "calc'}),  # an unfinished call
    ],
)
def test_a_reply_is_read_back_into_its_answer_reasoning_and_tool_calls(text, want):
    from training.data.turns import parse_reply

    assert parse_reply(text) == {"role": "assistant", **want}


def test_a_reply_is_read_with_the_tokenizers_response_template_where_it_has_one():
    """transformers' parse_response with the tokenizer's response_template (here one that knows only
    <think>): its fields are the message's; a tokenizer without one is read by the tags."""
    from training.data.turns import parse_reply

    tok = load_tokenizer(ModelSection(tokenizer=TOKENIZER, from_scratch={"hidden_size": 64}))
    text = f"<think>7 + 10 = 17</think>\n\n{CALL}"
    assert "tool_calls" in parse_reply(text, tok)  # no response_template: the tags
    tok.response_template = {
        "start_anchor": "<|im_start|>assistant\n",
        "fields": {"reasoning_content": {"open": "<think>", "close": "</think>"}, "content": {}},
    }
    got = parse_reply(text, tok, prefix="<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert got == {"role": "assistant", "reasoning_content": "7 + 10 = 17", "content": CALL}
