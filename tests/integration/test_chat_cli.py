"""The chat CLI renders prompts as training does: tools passed to the chat template (refused, exit 2,
where the template cannot render them), a brought template, template variables from the flags and from
the run's own data.chat_template_kwargs. In-process, with the bundled SmolLM2-135M-Instruct."""

from __future__ import annotations

import pytest
import yaml

from conftest import ROOT
from training.chat import main
from training.run.sources import pretrained_source

MODEL = "bundled:smollm2-135m-instruct"
TOOLS_TEMPLATE = ROOT / "data/tools/chatml_tools.jinja"
TOOLS = ROOT / "data/tools/tools.json"  # the bundled chats' two tools (data/make_agent_data.py)
ECHO = (
    "{{ 'THINK=' ~ enable_thinking ~ '\\n' }}{% for m in messages %}{{ m.content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '\\nA:' }}{% endif %}"
)


def chat(capsys, *argv) -> tuple[int, str, str]:
    try:
        code = main([*map(str, argv), "--max-new-tokens", "2"])
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_tools_reach_the_template_and_one_that_cannot_render_them_is_refused(capsys):
    code, _, err = chat(capsys, MODEL, "--tools", TOOLS, "--prompt", "Weather in Oslo?")
    assert code == 2 and f"--tools {TOOLS}: this model's chat template cannot render tools" in err
    assert "--chat-template PATH" in err
    code, out, err = chat(
        capsys,
        MODEL,
        "--chat-template",
        TOOLS_TEMPLATE,
        "--tools",
        TOOLS,
        "--show-prompt",
        "--prompt",
        "Oslo?",
    )
    assert code == 0, err[-2000:]
    assert (
        "<tools>" in err and '"name": "get_weather"' in err and err.rstrip().endswith("<|im_start|>assistant")
    )
    assert out.strip()  # a reply


@pytest.mark.parametrize(
    "content, said",
    [
        ("{not json", "is a string but not valid JSON"),
        ('{"type": "function"}', "must be a list of tool definitions, not dict"),
        ('[{"type": "function", "function": {}}]', "[0] must be a tool definition"),
    ],
)
def test_a_bad_tools_file_exits_2_naming_it(tmp_path, capsys, content, said):
    tools = tmp_path / "tools.json"
    tools.write_text(content)
    code, _, err = chat(capsys, MODEL, "--chat-template", TOOLS_TEMPLATE, "--tools", tools, "--prompt", "hi")
    assert code == 2 and str(tools) in err and said in err, err[-2000:]


def test_template_variables_come_from_the_run_and_the_flags(tmp_path, capsys):
    """A run trained with data.chat_template_kwargs {enable_thinking: false} is chatted with the same way;
    --template-kwarg overrides it; a malformed one, or a missing template file, exits 2 naming the flag."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "final").symlink_to(pretrained_source(MODEL), target_is_directory=True)
    (run / "config.yaml").write_text(
        yaml.safe_dump({"data": {"chat_template_kwargs": {"enable_thinking": False}}})
    )
    echo = tmp_path / "echo.jinja"
    echo.write_text(ECHO)
    code, _, err = chat(capsys, run, "--chat-template", echo, "--show-prompt", "--prompt", "hi")
    assert code == 0 and "THINK=False\nhi\nA:" in err, err[-2000:]
    flag = ("--template-kwarg", "enable_thinking=true")
    code, _, err = chat(capsys, run, "--chat-template", echo, *flag, "--show-prompt", "--prompt", "hi")
    assert code == 0 and "THINK=True\nhi\nA:" in err, err[-2000:]
    code, _, err = chat(capsys, run, "--template-kwarg", "enable_thinking", "--prompt", "hi")
    assert code == 2 and "--template-kwarg 'enable_thinking': expected KEY=VALUE" in err
    code, _, err = chat(capsys, run, "--chat-template", tmp_path / "none.jinja", "--prompt", "hi")
    assert code == 2 and f"--chat-template: {tmp_path / 'none.jinja'} does not exist" in err
