"""Agent episodes end to end on a tiny model: a short SFT teaches it the call format, then RL runs episodes in an
environment written as TRL's documentation writes one (reset, a tool method, get_reward) (the built-in python
tool is tested on its own). One process logs turns, tool calls and the environment's reward and writes the episodes as
conversations; 2-process DDP (full fine-tuning, killed with -9 in step 5 and resumed), FSDP2 (full) and ZeRO-3
with CPU offload (LoRA, two steps) draw the same episodes, refill the same flat groups (dynamic sampling) and give the same losses, rewards
and final weights; DAPO's dynamic sampling refills flat groups and logs it;
the app's rule confines tools and environments as it does reward functions."""

from __future__ import annotations

import json

import pytest
import yaml
from test_rl import assert_rl_run

from conftest import ROOT, TINY_ARCH, TOKENIZER, train_inprocess
from launching import (
    CKPT_AT,
    STEPS,
    TWO_RANKS,
    assert_same_weights,
    kill_and_resume,
    launch,
    rows,
    with_checkpoint_of,
)

TEMPLATE = str(ROOT / "data/tools/chatml_tools.jinja")
ENV = '''\
class Counter:
    """Press the button as many times as asked."""

    def reset(self, target=1, **kwargs):
        self.count, self.target = 0, int(target)
        return None

    def press(self) -> str:
        """Press the button once.

        Returns:
            How many times it was pressed so far.
        """
        self.count += 1
        return str(self.count)

    def get_reward(self) -> float:
        return 1.0 if self.count == self.target else -0.5 * abs(self.count - self.target)
'''
PRESS = {"type": "function", "function": {"name": "press", "arguments": {}}}
ASK = [{"role": "user", "content": "Press the button."}]


def sft_records(env_file) -> list[dict]:
    """A tool-calling chat in our tools data format, with the tool's schema as the RL prompt shows it: call
    press, read the result, answer."""
    import importlib.util

    from transformers.utils import get_json_schema

    spec = importlib.util.spec_from_file_location("agent_env", env_file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    schema = get_json_schema(module.Counter().press)
    chat = [
        *ASK,
        {"role": "assistant", "content": "", "tool_calls": [PRESS]},
        {"role": "tool", "content": "1"},
        {"role": "assistant", "content": "Done."},
    ]
    return [{"tools": [schema], "messages": chat}] * 16


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """The SFT model (about 15 s) and the RL recipe on it."""
    w = tmp_path_factory.mktemp("agent")
    (w / "env.py").write_text(ENV)
    (w / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in sft_records(w / "env.py")))
    sft = {
        "output_dir": str(w / "sft"),
        "seed": 0,
        "precision": "no",
        "model": {"tokenizer": TOKENIZER, "from_scratch": dict(TINY_ARCH, max_position_embeddings=512)},
        "data": {"train": str(w / "sft.jsonl"), "max_length": 256, "chat_template": TEMPLATE},
        "train": {"lr": 5e-3, "batch_size": 4, "max_steps": 120, "warmup_steps": 0},
        "checkpoint": {"every_steps": 1000},
    }
    (w / "sft.yaml").write_text(yaml.safe_dump(sft))
    assert train_inprocess(str(w / "sft.yaml")) == 0
    prompts = [{"prompt": ASK, "target": 1 + i % 2} for i in range(16)]
    (w / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))
    (w / "eval.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts[:4]))
    rl = {
        "output_dir": str(w / "unused"),
        "seed": 0,
        "precision": "no",
        "model": {"name_or_path": str(w / "sft" / "final")},
        "data": {
            "train": str(w / "prompts.jsonl"),
            "eval": str(w / "eval.jsonl"),
            "max_length": 256,
            "chat_template": TEMPLATE,
        },
        "rl": {
            "num_generations": 2,
            "max_new_tokens": 64,
            "max_turns": 3,
            "environment": f"{w / 'env.py'}:Counter",
            "temperature": 0.7,
            "dynamic_sampling": 1,  # the refill rounds run on every rank together: proven under each backend
            "rewards": [{"function": "overlong_penalty", "weight": 0.1, "args": {"buffer": 16}}],
        },
        "train": {"lr": 2e-4, "batch_size": 4, "max_steps": STEPS, "warmup_steps": 0},
        "eval": {"at_start": False, "every_steps": CKPT_AT, "batch_size": 4},
        "checkpoint": {"every_steps": CKPT_AT, "keep_last": 5},
    }
    (w / "rl.yaml").write_text(yaml.safe_dump(rl))
    return w


# ZeRO-3 with CPU offload: its LoRA run (and the reference) is kept to two steps (the six of the others took 130 s
# on 2 cores when ZeRO-3 generated on partitioned weights; gathered once per call, a step generates in 1.2-2 s)
LORA_STEPS = 2
LORA = ("method.type=lora", "method.lora.r=4", "method.lora.dropout=0.0", f"train.max_steps={LORA_STEPS}")


@pytest.fixture(scope="module")
def single(work):
    """One process, batch 4: the reference runs, full fine-tuning and LoRA."""
    out = {"full": work / "single", "lora": work / "single-lora"}
    assert train_inprocess(str(work / "rl.yaml"), f"output_dir={out['full']}") == 0
    assert train_inprocess(str(work / "rl.yaml"), f"output_dir={out['lora']}", *LORA) == 0
    return out


def test_one_process_runs_episodes_with_tools_and_the_environments_reward(single):
    single = single["full"]
    train = rows(single, "reward")
    assert sorted(train) == list(range(1, STEPS + 1))
    assert all(r["turns"] > 1 and r["tool_calls"] > 0 and r["tool_tokens"] > 0 for r in train.values())
    assert all("reward/Counter" in r and "reward/overlong_penalty" in r for r in train.values())
    assert any(r["reward_std"] > 0 for r in train.values())
    samples = [json.loads(x) for x in (single / "samples.jsonl").read_text().splitlines()]
    roles = [m["role"] for m in samples[0]["messages"]]
    assert roles[:2] == ["assistant", "tool"] and samples[0]["messages"][0]["tool_calls"][0]["function"][
        "name"
    ] == ("press")
    assert set(rows(single, "eval_reward")) == {CKPT_AT, STEPS}


SAME = [  # what every backend's run logs as the one process does
    "loss",
    "reward",
    "reward/Counter",
    "completion_length",
    "turns",
    "tool_calls",
    "tool_tokens",
    "resampled_groups",
    "flat_after_resampling",
]


def assert_same_episodes(run, ref, steps=range(1, STEPS + 1)):
    got, want = rows(run, "reward"), rows(ref, "reward")
    assert sorted(got) == list(steps)
    for s in got:
        for key in SAME:
            assert got[s][key] == pytest.approx(want[s][key], rel=1e-4, abs=1e-5), (s, key)
    assert_same_weights(run, ref)


def test_continuous_batching_draws_the_episodes_batched_turns_draw(work, single, tmp_path, monkeypatch):
    """rl.batching: continuous hands each episode's next turn in as its tool answers (transformers' continuous
    batching, paged attention); keyed by (seed, step, row, generation, turn), it draws what turn-by-turn batches
    draw: the same episodes, losses and weights (fp32, CPU)."""
    from training.generation.cb_engine import ContinuousBatchingEngine

    streams, stream = [], ContinuousBatchingEngine.stream
    monkeypatch.setattr(
        ContinuousBatchingEngine,
        "stream",
        lambda self, *a, **k: streams.append(a[1:]) or stream(self, *a, **k),
    )
    run = tmp_path / "continuous"
    overrides = (*LORA, "eval.every_steps=1")  # two steps of the LoRA run, an evaluation (greedy) after each
    assert (
        train_inprocess(str(work / "rl.yaml"), f"output_dir={run}", *overrides, "rl.batching=continuous") == 0
    )
    # every step's episodes and each evaluation's ran through one stream each (sampled, then greedy)
    assert len(streams) >= 2 * LORA_STEPS and {greedy for *_, greedy in streams} == {False, True}
    assert_same_episodes(run, single["lora"], range(1, LORA_STEPS + 1))


def test_refill_ahead_draws_what_the_refill_rounds_draw(work, single, tmp_path):
    """rl.refill_ahead: the window's groups and each one's replacement for every try drawn in one call (one generate
    call a turn, where the rounds made one a turn per round) pick and draw what dynamic sampling's rounds did: the
    same episodes, refills, losses and weights (fp32, CPU)."""
    out = tmp_path / "ahead"
    assert train_inprocess(str(work / "rl.yaml"), f"output_dir={out}", "rl.refill_ahead=true") == 0
    refilled = sum(r["resampled_groups"] for r in rows(single["full"], "reward").values())
    assert refilled > 0  # the rounds it is compared with did refill
    assert_same_episodes(out, single["full"])


@pytest.mark.slow
def test_ddp_two_processes_equal_one_process_through_kill_and_resume(work, single):
    out = work / "ddp"
    proc = kill_and_resume("ddp.yaml", work / "rl.yaml", out, *TWO_RANKS)
    assert "episodes: up to 3 turns" in proc.stderr
    assert "generate (batched, keyed, each context computed once)" in proc.stderr  # prefix reuse
    assert_same_episodes(out, single["full"])


@pytest.mark.slow
@pytest.mark.parametrize(
    "config, kind, method", [("fsdp.yaml", "FSDP", "full"), ("zero3_offload.yaml", "DEEPSPEED", "lora")]
)
def test_sharded_two_processes_equal_one_process(work, single, config, kind, method):
    """Each rank runs as many generate calls as the others: one per turn while any of its episodes goes on,
    idle ones while another rank's go on (a mismatch would hang the collective gathering of each call; the idle
    path is exercised by tests/unit/rl/test_episodes.py: with every turn one batched call, the ranks here end their
    last episodes at the same turn). Each call gathers the weights whole, so each rank prefills its own contexts
    and goes on from its episodes' kept turns (prefix_cache.py), as one process does. FSDP's run draws its refills
    ahead (rl.refill_ahead), ZeRO-3's in rounds."""
    out = work / f"{config.removesuffix('.yaml')}-{method}"
    overrides = LORA if method == "lora" else ("rl.refill_ahead=true",)
    proc = launch(config, work / "rl.yaml", f"output_dir={out}", *TWO_RANKS, *overrides)
    assert f"2 process(es), {kind}" in proc.stderr
    assert "each context computed once" in proc.stderr
    assert_same_episodes(out, single[method], range(1, (LORA_STEPS if method == "lora" else STEPS) + 1))
    # the count of idle calls each step made to keep the ranks in step is logged
    assert all(r["idle_calls"] >= 0 for r in rows(out, "reward").values())


def test_dynamic_sampling_refills_flat_groups_and_logs_it(work, tmp_path):
    """With temperature 0.01 the SFT model makes the same episode in every generation: every group is flat.
    Dynamic sampling tries other prompts for each (logged), and the groups still flat are counted."""
    out = tmp_path / "run"
    assert (
        train_inprocess(
            str(work / "rl.yaml"),
            f"output_dir={out}",
            "rl.temperature=0.01",
            "rl.dynamic_sampling=2",
            "train.max_steps=1",
        )
        == 0
    )
    (r,) = rows(out, "reward").values()
    assert r["frac_reward_zero_std"] == 1.0 and r["flat_after_resampling"] == 4
    assert r["resampled_groups"] == 8  # 4 flat groups x 2 tries


def test_async_episodes_with_an_environment_under_lora_resume_exactly(work, tmp_path):
    """Agent episodes (an environment's tools and reward, dynamic sampling's refills run by each rank's own
    rounds) drawn ahead by a LoRA copy that shares the frozen base: the checkpoint keeps step 4's episodes
    (their environments dropped once scored), and the resumed run equals the uninterrupted one."""
    recipe, lora = work / "rl.yaml", ("method.type=lora", "method.lora.r=4", "method.lora.dropout=0.0")
    out = tmp_path / "agent-async"
    assert train_inprocess(recipe, f"output_dir={out}", "rl.async=1", *lora) == 0
    got = rows(out, "reward")
    assert [got[s]["staleness"] for s in sorted(got)] == [0.0] + [1.0] * (STEPS - 1)
    assert all(r["turns"] > 1 and r["tool_calls"] > 0 for r in got.values())
    assert got[1]["importance_ratio/mean"] == 1.0  # (step 1 may have no signal: then step 2's ratio is 1 too)
    assert any(got[s]["importance_ratio/mean"] != 1.0 for s in range(2, STEPS + 1))
    resumed = with_checkpoint_of(out, CKPT_AT, tmp_path / "resumed")
    assert train_inprocess(recipe, f"output_dir={resumed}", "rl.async=1", *lora) == 0
    assert_rl_run(resumed, out, steps=range(CKPT_AT + 1, STEPS + 1))
