"""verifiers environments run unchanged (rl.environment: verifiers:...): data/environments/echo_verifiers.py, a
two-turn MultiTurnEnv with a two-function rubric, written as the Environments Hub writes them, runs in the
verifiers Python (.venv-verifiers, `make verifiers`) and calls the policy on 127.0.0.1 while it trains. Its prompts
come from `python -m training.verifiers_data`; its rubric functions are the run's rewards (by name, weighted as
the rubric weighs them); the tokens that train are the ones the policy drew; the episodes are keyed (a 2-process
DDP run killed in step 5 and resumed equals one process); what cannot run is refused with exit 2."""

from __future__ import annotations

import json

import pytest
import yaml

from conftest import ROOT, run_cli, train_inprocess
from launching import CKPT_AT, STEPS, TWO_RANKS, assert_same_weights, kill_and_resume, rows

ENV = "data/environments/echo_verifiers.py"
FP32 = 'precision="no"'


@pytest.fixture(scope="module")
def work(tmp_path_factory, tiny_model_dir):
    """The environment's prompts written by training.verifiers_data, a recipe on them, and its run in process."""
    w = tmp_path_factory.mktemp("verifiers")
    made = run_cli("training.verifiers_data", ENV, "--out", w / "prompts.jsonl", "--args", '{"size": 16}')
    assert made.returncode == 0, made.stderr
    assert f"wrote 16 prompt records of {ENV} (train)" in made.stdout
    recipe = {
        "output_dir": str(w / "unused"),
        "seed": 0,
        "model": {"name_or_path": str(tiny_model_dir)},
        "data": {"train": str(w / "prompts.jsonl"), "max_length": 64},
        "rl": {
            "num_generations": 2,
            "max_new_tokens": 5,
            "environment": f"verifiers:{ENV}",
            "environment_args": {"size": 16},
        },
        "train": {"lr": 1e-3, "batch_size": 4, "max_steps": STEPS, "warmup_steps": 0},
        "eval": {"at_start": False},
        "checkpoint": {"every_steps": CKPT_AT, "keep_last": 5},
    }
    (w / "r.yaml").write_text(yaml.safe_dump(recipe))
    assert train_inprocess(w / "r.yaml", f"output_dir={w / 'ref'}", FP32) == 0
    return w


def test_prompts_are_the_environments_rows(work):
    first = json.loads((work / "prompts.jsonl").read_text().splitlines()[0])
    assert first == {"prompt": [{"role": "user", "content": "Say the word apple."}], "answer": "apple"}


def test_the_rubric_scores_each_episode_by_its_functions_and_weights(work):
    """reward = says_word x 1 + brevity x 0.5 (num_turns, weight 0, logged only); each episode ran the
    environment's two turns, its second prompt the environment's own message."""
    for step, m in rows(work / "ref", "reward").items():
        assert m["reward"] == pytest.approx(m["reward/says_word"] + 0.5 * m["reward/brevity"]), step
        assert m["reward/num_turns"] == 2.0 and m["turns"] == 2.0
        assert 0 < m["reward/brevity"] < 1
    sample = json.loads((work / "ref" / "samples.jsonl").read_text().splitlines()[0])
    roles = [m["role"] for m in sample["messages"]]
    assert roles == ["assistant", "user", "assistant"]
    assert sample["messages"][1]["content"] == "Say the word once more."
    assert sample["reward"] == pytest.approx(sample["says_word"] + 0.5 * sample["brevity"])


def test_the_same_seed_draws_the_same_episodes(work, tmp_path):
    assert train_inprocess(work / "r.yaml", f"output_dir={tmp_path}", FP32, "train.max_steps=2") == 0
    got, want = rows(tmp_path, "reward"), rows(work / "ref", "reward")
    for s in (1, 2):
        for key in ("loss", "reward", "reward/brevity", "completion_length"):
            assert got[s][key] == want[s][key], (s, key)


@pytest.mark.slow
def test_ddp_equals_one_process_through_kill_and_resume(work, tmp_path):
    """2 ranks x batch 1 x 2 accumulation, each rank serving its own policy to its own environment worker;
    killed in step 5, resumed from step 3: the losses, rewards and final weights of one process."""
    out = tmp_path / "ddp"
    proc = kill_and_resume("ddp.yaml", work / "r.yaml", out, *TWO_RANKS, FP32)
    assert (
        "the verifiers environment verifiers:data/environments/echo_verifiers.py (TwoTurnEnv)" in proc.stderr
    )
    got, want = rows(out, "reward"), rows(work / "ref", "reward")
    assert sorted(got) == list(range(1, STEPS + 1))
    for s in got:
        for key in ("loss", "reward", "reward/says_word", "reward/brevity", "completion_length"):
            assert got[s][key] == pytest.approx(want[s][key], rel=1e-4, abs=1e-5), (s, key)
    assert_same_weights(out, work / "ref")


def test_a_single_turn_environment_trains_with_its_system_prompt_and_rubric(work, tmp_path):
    """data/environments/reverse_verifiers.py, a SingleTurnEnv with a parser and a two-function rubric: its
    prompts carry its system prompt; each episode is one reply scored reversed_word x 1 + short x 0.2."""
    env = "data/environments/reverse_verifiers.py"
    made = run_cli("training.verifiers_data", env, "--out", tmp_path / "rev.jsonl")
    assert made.returncode == 0, made.stderr
    assert json.loads((tmp_path / "rev.jsonl").read_text().splitlines()[0])["prompt"][0] == {
        "role": "system",
        "content": "Answer with the reversed word only.",
    }
    overrides = [
        f"data.train={tmp_path / 'rev.jsonl'}",
        f"rl.environment=verifiers:{env}",
        "rl.environment_args={}",
    ]
    assert (
        train_inprocess(
            work / "r.yaml", f"output_dir={tmp_path / 'run'}", FP32, "train.max_steps=2", *overrides
        )
        == 0
    )
    for m in rows(tmp_path / "run", "reward").values():
        assert m["reward"] == pytest.approx(m["reward/reversed_word"] + 0.2 * m["reward/short"])
        assert m["turns"] == 1.0
    sample = json.loads((tmp_path / "run" / "samples.jsonl").read_text().splitlines()[0])
    assert [m["role"] for m in sample["messages"]] == ["assistant"]


def test_the_policy_mask_covers_the_tokens_the_policy_drew_and_nothing_else(work, tiny_model_dir):
    """The runner in this process on the two-turn environment: the tokens under the policy mask, span by span,
    are the replies' (as the environment saw them), and the spans between hold the environment's message."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from training.config import RLSection
    from training.rl.verifiers_env import VerifiersRunner, Worker

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    worker = Worker(ENV, {"size": 4})
    try:
        cfg = RLSection(environment=f"verifiers:{ENV}", max_new_tokens=6)
        runner = VerifiersRunner(worker, tok, cfg, 0, [tok.eos_token_id], {})
        (row,) = worker.rows(n=1)
        episodes = runner.run(model, [(row["prompt"], {"answer": row["answer"]}, 0)], 1, 2, None)
    finally:
        worker.close()
    assert len(episodes) == 2
    for e in episodes:
        spans, cur = [], None
        for t, p in zip(e.tokens, e.policy):
            if cur is None or cur[0] != p:
                spans.append(cur := (p, []))
            cur[1].append(t)
        assert [p for p, _ in spans] == [1, 0, 1]
        replies = [m["content"] for m in e.completion if m["role"] == "assistant"]
        drawn = [tok.decode(ids, skip_special_tokens=True) for p, ids in spans if p == 1]
        assert [d.strip() for d in drawn] == [r.strip() for r in replies]
        assert "Say the word once more." in tok.decode(spans[1][1])
        rendered = tok.apply_chat_template(row["prompt"], add_generation_prompt=True, return_dict=True)
        assert e.prompt_ids == list(rendered["input_ids"])


def test_a_lora_policy_is_served_with_its_adapter_not_its_base(tiny_model_dir):
    """The loopback server draws with the adapter being trained: served without its name, a peft model's
    adapters were disabled, and every verifiers episode (training and held out) came from the base model."""
    import httpx
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from training.config import RLSection
    from training.rl.verifiers_env import VerifiersRunner

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir),
        LoraConfig(r=4, target_modules=["q_proj", "v_proj"]),
    )
    with torch.no_grad():  # an adapter that changes what greedy draws
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 2.0)
    runner = VerifiersRunner(None, tok, RLSection(environment=f"verifiers:{ENV}"), 0, [tok.eos_token_id], {})
    url, key = runner.endpoint(model)
    messages = [{"role": "user", "content": "Say the word: garden"}]
    body = {
        "model": "policy",
        "messages": messages,
        "max_tokens": 8,
        "temperature": 0,
        "return_token_ids": True,
    }
    r = httpx.post(
        f"{url}/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=60
    )
    served = r.json()["choices"][0]["token_ids"]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        adapted = model.generate(**ids, max_new_tokens=8, do_sample=False)[0, ids["input_ids"].shape[1] :]
        with model.disable_adapter():
            base = model.generate(**ids, max_new_tokens=8, do_sample=False)[0, ids["input_ids"].shape[1] :]
    runner.server.close()
    assert adapted.tolist() != base.tolist()  # the adapter matters here
    assert served == adapted.tolist()[: len(served)] and len(served) > 0


def test_without_the_verifiers_python_the_run_is_refused_with_the_command_that_installs_it(work, tmp_path):
    done = run_cli(
        "training.train",
        work / "r.yaml",
        f"output_dir={tmp_path}",
        env={"LLM_FORGE_VERIFIERS_PYTHON": str(tmp_path / "no-python")},
        fresh=False,  # read by our code when it runs
    )
    assert done.returncode == 2, done.stderr
    assert (
        "rl.environment: a verifiers environment needs verifiers in a Python of its own: run `make verifiers`"
        in (done.stderr)
    )
    assert "Traceback" not in done.stderr


def test_an_environment_that_needs_a_missing_package_is_refused_naming_it(work, tmp_path):
    env = tmp_path / "needs.py"
    env.write_text("import not_installed_env_lib\n\ndef load_environment(**kw):\n    pass\n")
    done = run_cli(
        "training.train", work / "r.yaml", f"output_dir={tmp_path / 'run'}", f"rl.environment=verifiers:{env}"
    )
    assert done.returncode == 2, done.stderr
    assert "needs the module 'not_installed_env_lib', which the verifiers Python" in done.stderr
    assert "-m pip install PACKAGE" in done.stderr and "Traceback" not in done.stderr


UNREACHABLE = """\
import verifiers as vf
from datasets import Dataset


class Remote(vf.MultiTurnEnv):
    async def env_response(self, messages, state, **kwargs):
        raise vf.SandboxError("cannot reach sandbox.example.com")


def load_environment(**kw):
    rows = [{"question": "hi", "answer": "x"}] * 4
    return Remote(dataset=Dataset.from_list(rows), rubric=vf.Rubric(funcs=[lambda completion, **k: 1.0]), max_turns=3)
"""


def test_an_environment_whose_service_is_out_of_reach_is_refused_before_training(work, tmp_path):
    """The check before training (one episode of the first prompt) meets the environment's own error."""
    env = tmp_path / "remote.py"
    env.write_text(UNREACHABLE)
    done = run_cli(
        "training.train", work / "r.yaml", f"output_dir={tmp_path / 'run'}", f"rl.environment=verifiers:{env}"
    )
    assert done.returncode == 2, done.stderr
    assert (
        f"every episode of verifiers:{env} ended in an error: SandboxError: cannot reach sandbox.example.com"
        in (done.stderr)
    )
    assert "training 6 steps" not in done.stderr and "Traceback" not in done.stderr


def test_an_installed_environment_loads_by_its_id(tmp_path):
    """verifiers:word-echo is the module word_echo on the verifiers Python's path, as `prime env install` or
    pip puts an Environments Hub package there."""
    package = tmp_path / "site" / "word_echo"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text((ROOT / ENV).read_text())
    done = run_cli(
        "training.verifiers_data",
        "word-echo",
        "--out",
        tmp_path / "p.jsonl",
        "--split",
        "eval",
        env={"PYTHONPATH": f"{tmp_path / 'site'}:{ROOT}"},
        fresh=False,  # read by the verifiers Python the command starts, not by this one
    )
    assert done.returncode == 0, done.stderr
    assert json.loads((tmp_path / "p.jsonl").read_text().splitlines()[0])["answer"] == "piano"


def test_an_environment_file_without_load_environment_is_refused(work, tmp_path):
    env = tmp_path / "empty.py"
    env.write_text("X = 1\n")
    done = run_cli("training.verifiers_data", env, "--out", tmp_path / "p.jsonl")
    assert done.returncode == 2, done.stderr
    assert (
        f"ENV {env}: verifiers:{env}: LookupError: {env} defines no load_environment(**args)" in done.stderr
    )


def test_settings_the_environment_owns_are_refused(work, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        train_inprocess(work / "r.yaml", f"output_dir={tmp_path}", "rl.tools=[python]", "rl.max_turns=3")
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert "tools: a verifiers environment runs its own episodes (its tools, its turns: pass them in " in err
    assert "leave tools, max_turns unset" in err
