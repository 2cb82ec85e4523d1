"""Online RL end to end on tiny models: one process is the reference; 2-process DDP (LoRA, and full
fine-tuning with the KL to a frozen copy of the initial model), FSDP2 (full) and ZeRO-3 with CPU offload
(LoRA) give the same completions, rewards, losses and final weights, also through a kill -9 and resume (the
frozen copy stays the initial model); the user's reward function gets the extra columns; a reward model
scores the rollouts; bad reward functions, reward models and prompt files end with exit 2 and a message that
names them."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from transformers import AutoTokenizer

from conftest import ROOT, TINY_ARCH, TOKENIZER, deep_update, own_scores, run_cli, train_inprocess
from launching import (
    CKPT_AT,
    STEPS,
    TWO_RANKS,
    assert_same_weights,
    kill_and_resume,
    launch,
    rows,
    weights,
    with_checkpoint_of,
)

REWARD = """\
def varied(prompts, completions, completion_ids, answer, kind, **kw):
    assert len(answer) == len(kind) == len(completions) == len(prompts), "one column value per completion"
    assert all(isinstance(a, str) for a in answer), "the answer column arrives as given"
    return [(sum(ids) % 7) / 6 + (0.5 if k == "sum" else 0.0) for ids, k in zip(completion_ids, kind)]
"""


def write_recipe(path, out, reward_file, **extra):
    held_out = path.with_name("eval8.jsonl")  # the first 8 held-out prompts: generating is eval's cost
    lines = (ROOT / "data/rl/eval.jsonl").read_text().splitlines(keepends=True)
    held_out.write_text("".join(lines[:8]))
    recipe = {
        "output_dir": str(out),
        "seed": 0,
        "model": {"tokenizer": TOKENIZER, "from_scratch": dict(TINY_ARCH)},
        "data": {
            "train": str(ROOT / "data/rl/train.jsonl"),
            "eval": str(held_out),
            "max_length": 128,  # the prompts are chats with a worked example (about 70 tokens)
            "max_examples": 24,
        },
        "rl": {
            "num_generations": 3,
            "max_new_tokens": 5,
            "scale_rewards": "batch",  # a collective over the global batch: must equal one process too
            "rewards": [
                {"function": f"{reward_file}:varied"},
                {"function": "length_penalty", "weight": 0.5, "args": {"max_chars": 8}},
            ],
        },
        "train": {"lr": 1e-3, "batch_size": 4, "max_steps": STEPS, "warmup_steps": 0},
        "eval": {"at_start": False, "every_steps": CKPT_AT, "batch_size": 4},  # all 8 held-out prompts
        "checkpoint": {"every_steps": CKPT_AT, "keep_last": 5},
    }
    if "name_or_path" in extra.get("model", {}):
        recipe["model"] = {}
    path.write_text(yaml.safe_dump(deep_update(recipe, extra)))
    return path


LORA = {"method": {"type": "lora", "lora": {"r": 4, "dropout": 0.0}}}
KL = {"rl": {"beta": 0.5}}  # full fine-tuning: rl.reference auto = frozen_copy


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    w = tmp_path_factory.mktemp("rl")
    (w / "rewards.py").write_text(REWARD)
    return w


@pytest.fixture(scope="module")
def recipes(work, tiny_model_dir):
    return {
        "full": write_recipe(work / "full.yaml", work / "unused", work / "rewards.py"),
        "lora": write_recipe(
            work / "lora.yaml",
            work / "unused",
            work / "rewards.py",
            model={"name_or_path": str(tiny_model_dir)},
            **LORA,
        ),
        "full-kl": write_recipe(work / "full_kl.yaml", work / "unused", work / "rewards.py", **KL),
    }


@pytest.fixture(scope="module")
def single(work, recipes):
    """One process, batch 4, for full fine-tuning (without and with the KL term) and for LoRA: the reference
    runs."""
    out = {}
    for kind, recipe in recipes.items():
        out[kind] = work / f"single-{kind}"
        assert train_inprocess(recipe, f"output_dir={out[kind]}") == 0
    return out


def test_one_process_run_logs_rewards_samples_and_eval(single):
    run = single["full"]
    train = rows(run, "reward")
    assert sorted(train) == list(range(1, STEPS + 1))
    for r in train.values():
        assert r["reward_std"] > 0 and 0 <= r["frac_reward_zero_std"] < 1  # rewards vary: a real signal
        assert r["reward/varied"] >= 0 and r["reward/length_penalty"] <= 0
        assert 1 <= r["completion_length"] <= 5 and r["generation_tokens_per_s"] > 0
        assert r["clip_fraction"] == 0.0  # one update per rollout: the ratio is 1
    assert any(r["grad_norm"] > 0 for r in train.values())
    evals = rows(run, "eval_reward")
    assert sorted(evals) == [CKPT_AT, STEPS] and all(0 <= e["eval_pass_rate"] <= 1 for e in evals.values())
    samples = [json.loads(x) for x in (run / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [s for s in range(1, STEPS + 1) for _ in range(2)]
    first = samples[0]
    assert {"prompt", "completion", "reward", "advantage", "varied", "length_penalty"} <= set(first)
    assert first["prompt"][-1]["content"].endswith("Reply with the answer alone.")  # the conversation
    assert (run / "final" / "model.safetensors").is_file()


def test_kl_to_the_frozen_copy_is_zero_at_the_first_step_only(single):
    """The reference is the initial policy: at step 1 policy and reference are the same model (KL 0); the
    policy then moves away from it, and the KL term changes the losses and the weights."""
    kl = {s: r["kl"] for s, r in rows(single["full-kl"], "kl").items()}
    assert sorted(kl) == list(range(1, STEPS + 1))
    assert kl[1] == pytest.approx(0.0, abs=1e-7)
    assert all(kl[s] > 1e-5 for s in range(2, STEPS + 1)), kl
    assert "kl" not in rows(single["full"], "reward")[1]  # beta 0: no reference, no kl metric
    with_kl, without = weights(single["full-kl"]), weights(single["full"])
    assert any(not torch.equal(with_kl[k], without[k]) for k in with_kl)


def test_a_resumed_run_keeps_the_initial_model_as_the_reference(work, recipes, single, tmp_path):
    """Resumed from the step-3 checkpoint, the frozen copy is made from the initial weights again (before the
    checkpoint loads): steps 4-6 (kl included) and the final weights equal the uninterrupted run. A copy of
    the resumed weights would give kl 0 at step 4."""
    out = with_checkpoint_of(single["full-kl"], CKPT_AT, tmp_path / "resumed")
    assert train_inprocess(recipes["full-kl"], f"output_dir={out}") == 0
    assert_rl_run(out, single["full-kl"], steps=range(CKPT_AT + 1, STEPS + 1))


def test_a_bf16_lora_run_draws_from_the_merged_copy_and_resumes_exactly(work, recipes, tmp_path, capfd):
    """precision bf16 on the CPU: a LoRA policy's rollouts and held-out completions come from a copy of the base
    with the adapter merged (training/generation/merged.py; the start-up line says so), merged again after each
    step; resumed from the step-3 checkpoint (the copy made again from the loaded adapter), steps 4-6, the held-out
    rewards and the final weights equal the uninterrupted run."""
    ref = work / "single-lora-bf16"
    assert train_inprocess(recipes["lora"], f"output_dir={ref}", "precision=bf16") == 0
    assert (
        "each context computed once, on a copy of the base with the adapter merged)" in capfd.readouterr().err
    )
    out = with_checkpoint_of(ref, CKPT_AT, tmp_path / "resumed")
    assert train_inprocess(recipes["lora"], f"output_dir={out}", "precision=bf16") == 0
    assert_rl_run(out, ref, steps=range(CKPT_AT + 1, STEPS + 1))
    assert len({r["reward"] for r in rows(ref, "reward").values()}) > 1  # the steps drew other completions


@pytest.mark.slow
def test_ddp_full_with_kl_two_processes_equal_one_process(work, recipes, single):
    """Full fine-tuning with beta > 0 under DDP: each rank keeps its own frozen copy of the initial model;
    it equals one process (kl included). The frozen copy after a resume is the in-process test above; the
    kill -9 resume under DDP is the num_iterations test below (the harder case: a mid-cycle checkpoint)."""
    out = work / "ddp-full-kl"
    proc = launch("ddp.yaml", recipes["full-kl"], f"output_dir={out}", *TWO_RANKS)
    assert "KL beta 0.5 to a frozen copy of the initial model" in proc.stderr
    assert_rl_run(out, single["full-kl"])


@pytest.mark.slow
def test_ddp_lora_two_processes_equal_one_process(work, recipes, single):
    """2 ranks x batch 1 x 2 accumulation == 1 rank x batch 4 under LoRA (the same completions, keyed by
    row; the KL reference is the adapter-disabled base). The exact resume after kill -9 is proven by the
    num_iterations test below, with the same sampling."""
    out = work / "ddp-lora"
    proc = launch("ddp.yaml", recipes["lora"], f"output_dir={out}", *TWO_RANKS)
    assert "2 process(es), MULTI_CPU" in proc.stderr
    assert_rl_run(out, single["lora"])


@pytest.mark.slow
@pytest.mark.parametrize(
    "config, kind, method", [("fsdp.yaml", "FSDP", "full"), ("zero3_offload.yaml", "DEEPSPEED", "lora")]
)
def test_sharded_two_processes_equal_one_process(work, recipes, single, config, kind, method):
    """FSDP2 and ZeRO-3 (CPU offload) gather the weights whole once per generation call, each rank then
    generating on its own (training.parallel.frozen.whole_for_generation). The first
    DeepSpeed run of a fresh environment JIT-compiles DeepSpeed's CPU ops (~3 min on 2 cores)."""
    out = work / f"{config.removesuffix('.yaml')}-{method}"
    proc = launch(config, recipes[method], f"output_dir={out}", *TWO_RANKS)
    assert f"2 process(es), {kind}" in proc.stderr
    assert_rl_run(out, single[method])


# ----------------------------------------------------------------------------- rl.num_iterations


MU2 = "rl.num_iterations=2"  # steps 1-2, 3-4, 5-6 share rollouts: the step-3 checkpoint is mid-cycle


@pytest.fixture(scope="module")
def single_mu2(work, recipes):
    """One process, full fine-tuning, each batch of rollouts used for two optimizer steps."""
    out = work / "single-full-mu2"
    assert train_inprocess(recipes["full"], f"output_dir={out}", MU2) == 0
    return out


def test_num_iterations_reuses_each_batch_of_rollouts_for_mu_steps(single_mu2):
    """Steps 1, 3, 5 sample; 2, 4, 6 train on the same completions of the same prompts again, with the ratio
    to the policy that sampled them (its log-probabilities kept): the loss of a reused batch differs from
    its first step's, which a ratio of 1 would repeat. Six steps read three windows of prompts, none skipped."""
    train = rows(single_mu2, "reward")
    assert sorted(train) == list(range(1, STEPS + 1))
    samples = {}
    for s in map(json.loads, (single_mu2 / "samples.jsonl").read_text().splitlines()):
        samples.setdefault(s["step"], []).append((s["row"], s["completion"], s["reward"], s["advantage"]))
    for first in (1, 3, 5):
        assert samples[first + 1] == samples[first]  # the same prompts, completions, rewards, advantages
        for key in ("reward", "reward_std", "completion_length", "frac_reward_zero_std"):
            assert train[first + 1][key] == train[first][key]
        assert train[first]["generation_s"] > 0 and train[first + 1]["generation_s"] == 0
        assert train[first]["clip_ratio/region_mean"] == 0.0  # sampled by the current policy: ratio 1
        assert train[first + 1]["loss"] != pytest.approx(train[first]["loss"], rel=1e-6, abs=1e-9)
    assert samples[3] != samples[1] and samples[5] != samples[3]
    assert {r for r, *_ in samples[3]} != {r for r, *_ in samples[1]}  # the next window of prompts


@pytest.mark.slow
@pytest.mark.parametrize("config, kind", [("fsdp.yaml", "FSDP"), ("zero3.yaml", "DEEPSPEED")])
def test_sharded_num_iterations_two_processes_equal_one_process(work, recipes, single_mu2, config, kind):
    """FSDP2 and ZeRO-3 with rl.num_iterations=2: the reused rollouts' old log-probabilities come from the
    sharded policy, every rank stepping together; each step equals the one-process run. These runs keep the
    weights sharded while they generate (rl.gather_for_generation=false: each decoding step gathers each layer,
    every rank stepping together); the other sharded runs gather them once per call."""
    out = work / f"{config.removesuffix('.yaml')}-full-mu2"
    partitioned = "rl.gather_for_generation=false"
    proc = launch(config, recipes["full"], f"output_dir={out}", *TWO_RANKS, MU2, partitioned)
    assert f"2 process(es), {kind}" in proc.stderr
    # ranks in step make only the forward passes they all make: no prefill of their own (prefix_cache.py)
    assert "contexts computed again at each call: ZeRO-3/FSDP ranks generate in step" in proc.stderr
    assert_rl_run(out, single_mu2)


def test_num_iterations_resumes_mid_cycle_from_the_kept_rollouts(recipes, single_mu2, tmp_path):
    """The step-3 checkpoint keeps step 3's rollouts and old log-probabilities (sampling them again after
    the update would draw other completions): steps 4-6 and the final weights equal the uninterrupted run."""
    out = with_checkpoint_of(single_mu2, CKPT_AT, tmp_path / "resumed")
    assert train_inprocess(recipes["full"], f"output_dir={out}", MU2) == 0
    assert_rl_run(out, single_mu2, steps=range(CKPT_AT + 1, STEPS + 1))
    kept = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    want = [json.loads(x) for x in (single_mu2 / "samples.jsonl").read_text().splitlines()]
    assert kept == [s for s in want if s["step"] > CKPT_AT]


def test_a_checkpoint_resumes_only_with_the_num_iterations_that_wrote_it(
    recipes, single_mu2, tmp_path, capsys
):
    """A mid-cycle checkpoint of a num_iterations=2 run keeps its rollouts: resumed with num_iterations 1
    (which keeps none) or 3 (another prompt order), the run is refused with exit 2 and the key named: by the
    recipe check first (training.run.resume), and, where the change is accepted on purpose, by what the
    checkpoint keeps."""
    for mu, said in (
        ("rl.num_iterations=1", "trained differently: rl.num_iterations: 2 -> 1. Resuming would not"),
        (
            "rl.num_iterations=1 resume_changes=[rl]",
            "this run keeps 1 (the learning-rate schedule): the recipe changed what a checkpoint keeps",
        ),
        ("rl.num_iterations=3 resume_changes=[rl]", "written with rl.num_iterations=2"),
    ):
        out = with_checkpoint_of(single_mu2, CKPT_AT, tmp_path / mu.replace(" ", "_"))
        with pytest.raises(SystemExit) as e:
            train_inprocess(recipes["full"], f"output_dir={out}", *mu.split())
        err = capsys.readouterr().err
        assert e.value.code == 2 and said in err, err[-2000:]
        assert not (out / "final").exists()


@pytest.mark.slow
def test_ddp_num_iterations_two_processes_equal_one_process_through_kill_and_resume(
    work, recipes, single_mu2
):
    """2 ranks x batch 1 x 2 accumulation with num_iterations 2, killed in step 5 and resumed from the step-3
    checkpoint, whose per-rank kept rollouts step 4 reuses: equal to one process."""
    out = work / "ddp-full-mu2"
    proc = kill_and_resume("ddp.yaml", recipes["full"], out, *TWO_RANKS, MU2)
    assert "no kept rollouts" not in proc.stderr  # step 4 reused the checkpoint's, not sampled anew
    assert_rl_run(out, single_mu2)


def assert_rl_run(run, ref, steps=range(1, STEPS + 1)):
    """Same losses, rewards, lengths, KL and held-out rewards at every step (of `steps`: a run resumed in a
    fresh directory logs only those), and the same final weights."""
    got, want = rows(run, "reward"), rows(ref, "reward")
    assert sorted(got) == list(steps)
    for s in got:
        keys = ["loss", "lr", "reward", "reward_std", "completion_length", "frac_reward_zero_std"]
        for key in keys + (["kl"] if "kl" in want[s] else []):
            assert got[s][key] == pytest.approx(want[s][key], rel=1e-4, abs=1e-5), (s, key)
    got_eval, want_eval = rows(run, "eval_reward"), rows(ref, "eval_reward")
    assert set(want_eval) == {CKPT_AT, STEPS} and set(got_eval) == {s for s in want_eval if s in steps}
    for s in got_eval:
        assert got_eval[s]["eval_reward"] == pytest.approx(want_eval[s]["eval_reward"], rel=1e-4, abs=1e-5)
    assert_same_weights(run, ref)


def test_a_reward_model_scores_the_rollouts(work, tmp_path, tiny_reward_model_dir):
    """rl.rewards: reward_model in a run: each logged sample's reward is the model's own score of its prompt
    + completion (plain transformers, in this process); held-out prompts are scored by it too."""
    run = tmp_path / "run"
    rm = {"function": "reward_model", "args": {"path": str(tiny_reward_model_dir)}}
    recipe = write_recipe(
        tmp_path / "r.yaml",
        run,
        work / "rewards.py",
        rl={"rewards": [rm]},
        train={"max_steps": 2},
        eval={"every_steps": 2},
        checkpoint={"every_steps": 2},
    )
    assert train_inprocess(recipe) == 0
    train = rows(run, "reward")
    assert sorted(train) == [1, 2] and all(r["reward_std"] > 0 for r in train.values())
    assert all(r["reward/reward_model"] == r["reward"] for r in train.values())
    assert "eval_reward/reward_model" in rows(run, "eval_reward")[2]
    samples = [json.loads(x) for x in (run / "samples.jsonl").read_text().splitlines()]
    tok = AutoTokenizer.from_pretrained(tiny_reward_model_dir)  # the prompts are chats: rendered as TRL does
    texts = [
        tok.apply_chat_template(
            s["prompt"] + [{"role": "assistant", "content": s["completion"]}], tokenize=False
        )
        for s in samples
    ]
    want = own_scores(tiny_reward_model_dir, texts)
    assert [s["reward_model"] for s in samples] == pytest.approx(want, abs=1e-5)


# ----------------------------------------------------------------------------- bad input, exit 2


def test_a_bad_reward_model_is_named_before_training_with_exit_2(work, tmp_path, tiny_model_dir):
    not_a_reward_model = {"function": "reward_model", "args": {"path": str(tiny_model_dir)}}
    recipe = write_recipe(
        tmp_path / "r.yaml",
        tmp_path / "run",
        work / "rewards.py",
        rl={"rewards": [{"function": "length_penalty"}, not_a_reward_model]},
    )
    proc = run_cli("training.train", recipe)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert (
        f"error: rl.rewards[1].args.path: reward model {tiny_model_dir} is not a sequence-classification "
        "model (architectures: LlamaForCausalLM)" in proc.stderr
    )
    assert "Traceback" not in proc.stderr and not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.parametrize("extra", [(), ("rl.async=1",)], ids=["sync", "async"])
def test_a_reward_function_that_raises_stops_the_run_with_exit_2(work, tmp_path, extra):
    """Also when the reward is scored beside training (rl.async): its failure reaches the step that takes the
    rollouts."""
    bad = tmp_path / "bad.py"
    bad.write_text("def angry(prompts, completions, **kw):\n    raise KeyError('solution')\n")
    recipe = write_recipe(
        tmp_path / "r.yaml",
        tmp_path / "run",
        bad,
        rl={"rewards": [{"function": f"{bad}:angry"}]},
        train={"max_steps": 2},
        checkpoint={"every_steps": 1},
    )
    proc = run_cli("training.train", recipe, *extra)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "error: rl.rewards[0] (angry) raised KeyError: 'solution'" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "run" / "final").exists()


def test_a_bad_prompt_file_is_named_with_its_line(work, tmp_path, capsys):
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "What is 1 + 1?", "answer": "2"}\n{"prompt": " ", "answer": "3"}\n')
    recipe = write_recipe(
        tmp_path / "r.yaml", tmp_path / "run", work / "rewards.py", data={"train": str(data)}
    )
    with pytest.raises(SystemExit) as e:
        train_inprocess(recipe)
    assert e.value.code == 2
    assert f"{data} line 2: field 'prompt' is empty" in capsys.readouterr().err
    no_answer = tmp_path / "no_answer.jsonl"
    no_answer.write_text('{"prompt": "What is 1 + 1?", "solution": "2"}\n')
    recipe = write_recipe(
        tmp_path / "r2.yaml",
        tmp_path / "run2",
        work / "rewards.py",
        data={"train": str(no_answer), "eval": None},
        rl={"rewards": [{"function": "exact_match"}]},
    )
    proc = run_cli("training.train", recipe)
    assert proc.returncode == 2
    assert f"{no_answer} line 1: missing column 'answer', which a reward reads (rl.rewards)" in proc.stderr


def vllm_gpu() -> bool:
    import importlib.util

    return torch.cuda.is_available() and importlib.util.find_spec("vllm") is not None


@pytest.mark.gpu
@pytest.mark.skipif(not vllm_gpu(), reason="rl.generator=vllm needs a CUDA GPU and the vllm package")
def test_vllm_rollouts_train_and_draw_the_same_completions_again(work, recipes, tmp_path):
    """LoRA GRPO with completions from a colocated vLLM engine (the policy's weights pushed into it before
    each rollout): rewards logged and the held-out prompts scored as with transformers; a second run draws
    the same completions at step 1 (each request seeded by its key)."""
    runs = [tmp_path / "vllm-a", tmp_path / "vllm-b"]
    for out in runs:
        args = (
            f"output_dir={out}",
            "rl.generator=vllm",
            "rl.vllm_gpu_memory_utilization=0.2",
            "precision=bf16",
        )
        assert train_inprocess(recipes["lora"], *args) == 0
    train = rows(runs[0], "reward")
    assert sorted(train) == list(range(1, STEPS + 1))
    assert all(1 <= r["completion_length"] <= 5 and r["generation_tokens_per_s"] > 0 for r in train.values())
    assert sorted(rows(runs[0], "eval_reward")) == [CKPT_AT, STEPS]
    first = [
        [
            (s["prompt"], s["completion"])
            for s in map(json.loads, (r / "samples.jsonl").read_text().splitlines())
        ]
        for r in runs
    ]
    assert first[0][:2] == first[1][:2]
