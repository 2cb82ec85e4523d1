"""Reward-model training (preference.objective=reward): the Bradley-Terry loss on a one-score head; a tiny
model learns the sign-off pairs and its final/ scores held-out pairs in a fresh process with plain
transformers; 2-process DDP (through kill -9 and resume), FSDP2 and ZeRO-3 equal one process; a LoRA
reward model merges into a plain sequence classifier that online RL reads as a reward; what a reward model
cannot do (chat, GGUF) is refused with the reason."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
import yaml

from conftest import ROOT, TINY_ARCH, TOKENIZER, deep_update, run_cli, train_inprocess
from launching import CKPT_AT, STEPS, assert_same_run, kill_and_resume, launch
from training.config import parse_recipe
from training.core.errors import RecipeError
from training.objectives.preference import reward_loss

TWO = ["train.batch_size=1", "train.grad_accum=2", "eval.at_start=false"]


def test_the_loss_is_bradley_terry_with_trls_centring_term():
    sc, sr = torch.tensor([1.5, -0.2, 0.3]), torch.tensor([0.5, 0.4, 0.3])
    want = -torch.log(torch.sigmoid(sc - sr))
    torch.testing.assert_close(reward_loss(sc, sr, 0.0), want)
    torch.testing.assert_close(reward_loss(sc, sr, 0.01), want + 0.01 * (sc + sr) ** 2)
    # TRL's RewardTrainer: -logsigmoid(chosen - rejected).mean() + coefficient * mean((chosen + rejected)^2)
    trl = -F.logsigmoid(sc - sr).mean() + 0.01 * torch.mean((sc + sr) ** 2)
    assert reward_loss(sc, sr, 0.01).mean().item() == pytest.approx(trl.item(), rel=1e-6)


BASE = {
    "output_dir": "runs/x",
    "model": {"name_or_path": "some/model"},
    "data": {"train": "data/signoff/train.jsonl"},
    "preference": {"objective": "reward"},
}


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"preference": {"objective": "reward", "beta": 0.1}}, "beta is not a setting of objective reward"),
        (
            {"preference": {"objective": "dpo", "center_rewards": 0.01}},
            "center_rewards is a setting of objective reward",
        ),
        (
            {"preference": {"objective": "reward", "reference": "precomputed"}},
            "objective reward is reference-free",
        ),
        (
            {"model": {"vision": {"image_size": 32}}, "data": {"format": "pairwise"}},
            "model.vision trains on chat or sharegpt records",  # not pairs: no image reward model
        ),
        ({"eval": {"harness_tasks": ["dates_exact_match"]}}, "a reward model .* scores text"),
    ],
)
def test_recipe_refuses_what_a_reward_model_does_not_take(extra, message):
    with pytest.raises((RecipeError, ValueError), match=message):
        parse_recipe(deep_update(json.loads(json.dumps(BASE)), extra))


def write_recipe(path, out, **extra):
    recipe = {
        "output_dir": str(out),
        "seed": 0,
        "model": {"tokenizer": TOKENIZER, "from_scratch": dict(TINY_ARCH)},
        "data": {
            "train": str(ROOT / "data/signoff/train.jsonl"),
            "eval": str(ROOT / "data/signoff/eval.jsonl"),
            "max_length": 64,
            "max_examples": 48,
        },
        "preference": {"objective": "reward"},
        "train": {"lr": 3e-3, "batch_size": 4, "max_steps": STEPS, "warmup_steps": 1, "optimizer": "adamw"},
        "eval": {"at_start": True, "every_steps": CKPT_AT, "batch_size": 4},
        "checkpoint": {"every_steps": CKPT_AT, "keep_last": 5},
    }
    if "name_or_path" in extra.get("model", {}):
        recipe["model"] = {}
    path.write_text(yaml.safe_dump(deep_update(recipe, extra)))
    return path


def metric_rows(run, key):
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if key in r}


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("reward")


@pytest.fixture(scope="module")
def single(work):
    """A tiny from-scratch reward model, full fine-tuning, one process, batch 4: the reference run."""
    recipe = write_recipe(work / "recipe.yaml", work / "unused")
    out = work / "single"
    assert train_inprocess(recipe, f"output_dir={out}") == 0
    return out


SCORE = """
import json, sys
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer
final, pairs = sys.argv[1], sys.argv[2]
tok = AutoTokenizer.from_pretrained(final)
model = AutoModelForSequenceClassification.from_pretrained(final).eval()
right = n = margin = 0
for line in open(pairs):
    p = json.loads(line)
    texts = [tok.apply_chat_template([{"role": "user", "content": p["prompt"]},
                                      {"role": "assistant", "content": p[k]}], tokenize=False)
             for k in ("chosen", "rejected")]
    with torch.no_grad():
        s = [model(**tok(t, return_tensors="pt")).logits[0, 0].item() for t in texts]
    right += s[0] > s[1]
    margin += s[0] - s[1]
    n += 1
print(type(model).__name__, model.config.num_labels, right / n, margin / n)
"""


def test_a_tiny_reward_model_learns_the_sign_off_and_scores_held_out_pairs_in_a_fresh_process(single):
    """Six steps on 48 pairs: the held-out margin (score chosen - score rejected) grows from the random
    head's ~0 to over 0.1, and the held-out loss falls; final/ is a plain sequence classifier that
    transformers loads in a fresh process, where it ranks the 64 held-out pairs, rendered by the chat
    template alone, with the same kind of margin."""
    evals = metric_rows(single, "eval_preference_accuracy")
    assert sorted(evals) == [0, CKPT_AT, STEPS]
    assert abs(evals[0]["eval_rewards_margin"]) < 0.02  # a new head: no preference yet
    assert evals[STEPS]["eval_rewards_margin"] > 0.1 and evals[STEPS]["eval_preference_accuracy"] >= 0.9
    assert evals[STEPS]["eval_loss"] < evals[0]["eval_loss"] - 0.08
    train = metric_rows(single, "rewards_margin")
    assert train[STEPS]["loss"] < train[1]["loss"]
    assert train[1]["flops_per_logits_position"] == 6 * TINY_ARCH["hidden_size"]  # a one-score head, trained
    config = json.loads((single / "final" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForSequenceClassification"] and len(config["id2label"]) == 1
    proc = subprocess.run(
        [sys.executable, "-c", SCORE, str(single / "final"), str(ROOT / "data/signoff/eval.jsonl")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    name, labels, accuracy, margin = proc.stdout.split()
    assert name == "LlamaForSequenceClassification" and labels == "1"
    assert float(accuracy) >= 0.9 and float(margin) > 0.1
    card = (single / "final" / "README.md").read_text()
    assert "pipeline_tag: text-classification" in card and "reward_model" in card


@pytest.mark.slow
def test_ddp_two_processes_equal_one_process_through_kill_and_resume(work, single):
    """2 ranks x batch 1 x 2 accumulation == 1 rank x batch 4; killed in step 5 and resumed from step 3."""
    recipe = write_recipe(work / "recipe.yaml", work / "unused")
    out = work / "ddp"
    proc = kill_and_resume("ddp.yaml", recipe, out, *TWO)
    assert "2 process(es), MULTI_CPU" in proc.stderr
    assert_same_run(out, single)


@pytest.mark.slow
@pytest.mark.parametrize("config, kind", [("fsdp.yaml", "FSDP"), ("zero3_offload.yaml", "DEEPSPEED")])
def test_sharded_two_processes_equal_one_process(work, single, config, kind):
    """FSDP2 and ZeRO-3 with CPU offload: the score head and the model sharded, equal to one process."""
    recipe = write_recipe(work / "recipe.yaml", work / "unused")
    out = work / config.removesuffix(".yaml")
    proc = launch(config, recipe, f"output_dir={out}", *TWO)
    assert f"2 process(es), {kind}" in proc.stderr
    assert_same_run(out, single)


def test_a_lora_reward_model_merges_into_a_reward_for_online_rl_and_refuses_chat_and_gguf(
    work, tiny_model_dir
):
    """LoRA on a pretrained model: the adapter (peft's SEQ_CLS task, the new score head saved whole) merges
    with `export --merge` into a sequence classifier that rl.rewards' reward_model loads and scores with;
    chatting with it, or converting it to GGUF, is refused with the reason (exit 2)."""
    from training.rl.rewards import load_reward_model

    out = work / "lora"
    recipe = write_recipe(
        work / "lora.yaml",
        out,
        model={"name_or_path": str(tiny_model_dir)},
        method={"type": "lora", "lora": {"r": 4, "dropout": 0.0}},
        data={"max_examples": 8},
        train={"lr": 1e-2, "max_steps": 2},
        checkpoint={"every_steps": None},
        eval={"at_start": False, "every_steps": None, "max_batches": 1},
    )
    assert train_inprocess(recipe) == 0
    adapter = json.loads((out / "final" / "adapter_config.json").read_text())
    assert adapter["task_type"] == "SEQ_CLS" and "score" in adapter["modules_to_save"]

    merged = out / "merged"
    proc = run_cli("training.export", str(out), "--merge", "--out", str(merged))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "load with AutoModelForSequenceClassification.from_pretrained" in proc.stdout
    reward = load_reward_model(str(merged), "rl.rewards[0].args.path", torch.device("cpu"))
    scores = reward(["Hi"] * 2, ["Sure. Happy forging!", "Sure."])
    assert len(scores) == 2 and all(s == s for s in scores)

    chat = run_cli("training.chat", str(out), "--prompt", "Hi")
    assert chat.returncode == 2 and "is a reward model" in chat.stderr and "reward_model" in chat.stderr
    gguf = run_cli("training.export", str(out), "--gguf")
    assert gguf.returncode == 2 and "is a reward model" in gguf.stderr and "Traceback" not in gguf.stderr
