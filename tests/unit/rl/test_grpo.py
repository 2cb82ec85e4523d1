"""Online RL, piece by piece: each loss type (and its gradient) equals TRL's GRPOTrainer._compute_loss on the
same log-probabilities, advantages and masks; advantages follow the GRPO/RLOO formulas; the keyed sampler
draws from the softmax (temperature, top-p) and repeats itself for the same key whatever the batch; the
built-in and user reward functions, a reward model (equal to its own score in plain transformers, rendered
as TRL renders them), and every way a reward function or reward model can be wrong."""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoTokenizer
from trl.data_utils import apply_chat_template
from trl.trainer.grpo_trainer import GRPOTrainer

from conftest import own_scores, save_reward_model
from training.config import RLSection, parse_recipe
from training.core.errors import RecipeError
from training.generation.keyed import KeyedSampler, sample_seed, top_p_filter
from training.generation.transformers_engine import TransformersEngine
from training.rl import rewards as rewards_module
from training.rl.advantages import advantages
from training.rl.loss import normaliser, summed_loss, token_losses
from training.rl.rewards import RewardError, load_rewards, score

N, T = 6, 7


def rl(**kw) -> RLSection:
    return RLSection(rewards=[{"function": "length_penalty"}], **kw)


@pytest.fixture(scope="module")
def rollout():
    g = torch.Generator().manual_seed(1)
    mask = torch.ones(N, T)
    for i, n in enumerate([7, 3, 5, 1, 6, 4]):
        mask[i, n:] = 0
    return SimpleNamespace(
        logps=-torch.rand(N, T, generator=g, dtype=torch.float64) * 3,
        old=-torch.rand(N, T, generator=g, dtype=torch.float64) * 3,  # far from logps: clipping happens
        ref=-torch.rand(N, T, generator=g, dtype=torch.float64) * 3,
        adv=torch.randn(N, generator=g, dtype=torch.float64),
        mask=mask.double(),
    )


def trl_loss(
    cfg: RLSection, r, logps: torch.Tensor, metrics: dict | None = None, weight=None
) -> torch.Tensor:
    """TRL's GRPOTrainer._compute_loss on these log-probabilities (its model forward replaced by them), with
    `r.old` as the old_per_token_logps of num_iterations > 1; `metrics`: filled with what it logs; `weight`:
    its importance_sampling_ratio (vllm_importance_sampling_correction, already truncated)."""
    fake = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (logps, torch.zeros_like(logps), None),
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=None,
        importance_sampling_level="token",
        beta=cfg.beta,
        args=SimpleNamespace(delta=None, use_bias_correction_kl=False, steps_per_generation=1),
        loss_type=cfg.loss_type,
        epsilon_low=cfg.epsilon,
        epsilon_high=cfg.epsilon_high,
        use_vllm=weight is not None,
        vllm_importance_sampling_correction=True,
        model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1,
        steps_per_generation=1,
        max_completion_length=cfg.max_new_tokens,
        accelerator=SimpleNamespace(
            num_processes=1, reduce=lambda t, reduction: t, gather=lambda t: t, sync_gradients=True
        ),
        _entropy_bonus_enabled=False,
        aux_loss_enabled=False,
        _metrics={"train": metrics if metrics is not None else defaultdict(list)},
    )
    inputs = {
        "prompt_ids": torch.zeros(N, 1, dtype=torch.long),
        "prompt_mask": torch.ones(N, 1, dtype=torch.long),
        "completion_ids": torch.zeros(N, T, dtype=torch.long),
        "completion_mask": r.mask,
        "advantages": r.adv,
        "old_per_token_logps": r.old,
        "ref_per_token_logps": r.ref,
        "num_items_in_batch": r.mask.sum(),
        "importance_sampling_ratio": weight,
    }
    return GRPOTrainer._compute_loss(fake, None, inputs)


def our_loss(cfg: RLSection, r, logps: torch.Tensor) -> torch.Tensor:
    """What the step minimises: the summed loss over the normaliser (one process, one micro-batch)."""
    losses, _, _, _ = token_losses(logps, r.old, r.ref, r.adv, cfg)
    return summed_loss(losses, r.mask, cfg.loss_type) / normaliser(r.mask, cfg.loss_type, cfg.max_new_tokens)


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_loss_and_gradient_equal_trl(rollout, loss_type, beta):
    cfg = rl(loss_type=loss_type, beta=beta, epsilon=0.2, epsilon_high=0.28, max_new_tokens=T)
    ours_in = rollout.logps.clone().requires_grad_(True)
    trl_in = rollout.logps.clone().requires_grad_(True)
    ours, theirs = our_loss(cfg, rollout, ours_in), trl_loss(cfg, rollout, trl_in)
    ours.backward()
    theirs.backward()
    assert ours.item() == pytest.approx(theirs.item(), abs=1e-6, rel=1e-6)
    torch.testing.assert_close(ours_in.grad, trl_in.grad, atol=1e-6, rtol=1e-6)
    assert ours_in.grad.abs().sum() > 0


@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_the_truncated_importance_weight_of_rl_async_weighs_the_surrogate_as_trl(rollout, beta):
    """rl.async: the surrogate of each token (not its KL term) times min(p_current / p_generating, cap), as
    TRL's vllm_importance_sampling_correction (token_truncate): the same loss and gradient."""
    cfg = rl(loss_type="dapo", beta=beta, max_new_tokens=T)
    noise = torch.rand(N, T, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    generating = rollout.logps - 2 * noise  # ratios from 1 to e^2: some over the cap of 3
    weight = torch.exp(rollout.logps - generating).clamp(max=cfg.importance_sampling_cap)
    assert (weight == cfg.importance_sampling_cap).any() and (weight < cfg.importance_sampling_cap).any()
    ours_in = rollout.logps.clone().requires_grad_(True)
    trl_in = rollout.logps.clone().requires_grad_(True)
    losses, *_ = token_losses(ours_in, ours_in.detach(), rollout.ref, rollout.adv, cfg, weight)
    ours = summed_loss(losses, rollout.mask, "dapo") / normaliser(rollout.mask, "dapo", T)
    r = SimpleNamespace(**{**vars(rollout), "old": rollout.logps})
    theirs = trl_loss(cfg, r, trl_in, weight=weight)
    ours.backward()
    theirs.backward()
    assert ours.item() == pytest.approx(theirs.item(), abs=1e-6, rel=1e-6)
    torch.testing.assert_close(ours_in.grad, trl_in.grad, atol=1e-6, rtol=1e-6)
    plain, *_ = token_losses(rollout.logps, rollout.logps, rollout.ref, rollout.adv, cfg)
    assert not torch.allclose(losses.detach(), plain)  # the weight changed the loss


def test_clipping_is_active_and_counted_as_trl_counts_it(rollout):
    """Old log-probabilities of an earlier policy (num_iterations > 1): the low, high and region clip
    fractions are TRL's clip_ratio/low_mean, /high_mean, /region_mean (both sides clip here)."""
    cfg = rl(epsilon=0.2, epsilon_high=0.28)
    _, low, high, _ = token_losses(rollout.logps, rollout.old, rollout.ref, rollout.adv, cfg)
    m = rollout.mask
    assert (low * m).sum() > 0 and (high * m).sum() > 0 and ((low | high) * m).sum() < m.sum()
    trl = defaultdict(list)
    trl_loss(cfg, rollout, rollout.logps.clone(), trl)
    for name, ours in [("low", low), ("high", high), ("region", low | high)]:
        assert (ours * m).sum().item() / m.sum().item() == pytest.approx(trl[f"clip_ratio/{name}_mean"][0])
    _, low, high, _ = token_losses(rollout.logps, rollout.logps, rollout.ref, rollout.adv, cfg)
    assert not (low | high).any()  # one update per rollout: the ratio is 1


def test_advantages_follow_grpo_and_rloo():
    r = torch.tensor([[1.0, 0.0, 0.5, 0.5], [2.0, 2.0, 2.0, 2.0]], dtype=torch.float64)
    mean = r.mean(1, keepdim=True)
    torch.testing.assert_close(advantages(r, "grpo", "none"), r - mean)
    loo = torch.stack(
        [torch.stack([r[i, j] - (r[i].sum() - r[i, j]) / 3 for j in range(4)]) for i in range(2)]
    )
    torch.testing.assert_close(advantages(r, "rloo", "none"), loo)
    scaled = advantages(r, "grpo", "group")
    torch.testing.assert_close(scaled[0], (r[0] - mean[0]) / (r[0].std() + 1e-4))
    assert (scaled[1] == 0).all()  # a group with one reward teaches nothing
    torch.testing.assert_close(advantages(r, "grpo", "batch", torch.tensor(2.0)), (r - mean) / 2.0001)


# ----------------------------------------------------------------------------- sampling


def test_keyed_gumbel_draw_follows_the_softmax_with_temperature_and_top_p():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -3.0]])
    for temperature, top_p in ((1.0, 1.0), (0.5, 1.0), (1.0, 0.8)):
        want = top_p_filter(logits / temperature, top_p).softmax(-1)[0]
        counts = torch.zeros(5)
        for k in range(4000):
            g = torch.Generator().manual_seed(sample_seed(0, 1, k, 0))
            out = KeyedSampler([g], temperature, top_p)(None, logits)
            counts[out[0].argmax()] += 1
        freq = counts / counts.sum()
        assert (freq[want == 0] == 0).all()  # outside the nucleus: never drawn
        torch.testing.assert_close(freq, want, atol=0.025, rtol=0)


def test_top_p_keeps_the_smallest_set_reaching_the_mass():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    kept = top_p_filter(probs.log(), 0.8).isfinite()[0].tolist()
    assert kept == [True, True, False, False]
    assert top_p_filter(probs.log(), 0.1).isfinite()[0].tolist() == [True, False, False, False]


def test_sample_seed_depends_on_every_part_of_the_key():
    seeds = {
        sample_seed(*key) for key in [(0, 1, 2, 3), (1, 1, 2, 3), (0, 2, 2, 3), (0, 1, 3, 3), (0, 1, 2, 4)]
    }
    assert len(seeds) == 5 and all(0 <= s < 2**63 for s in seeds)


def test_completions_are_the_same_for_the_same_key(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    s = TransformersEngine(
        seed=3, max_new_tokens=8, temperature=1.0, top_p=1.0, eos_token_ids=[2], pad_token_id=2
    )
    prompt = [1, 50, 60, 70]
    a = s.group(model, prompt, step=5, row=11, n=4, device="cpu")
    s.group(model, [1, 9, 9], step=5, row=12, n=3, device="cpu")  # other draws in between change nothing
    b = s.group(model, prompt, step=5, row=11, n=4, device="cpu")
    c = s.group(model, prompt, step=6, row=11, n=4, device="cpu")
    assert torch.equal(a.ids, b.ids) and torch.equal(a.mask, b.mask)
    assert not torch.equal(a.ids, c.ids)  # another step, other completions
    assert len({tuple(x) for x in a.ids.tolist()}) > 1  # the group's completions differ from each other


# ----------------------------------------------------------------------------- rewards


def rewards_of(*specs, **cfg):
    return load_rewards(RLSection(rewards=list(specs), **cfg))


def test_builtin_rewards():
    completions = ["Paris", " paris. ", "The capital is Paris.", "<answer>42</answer>", "x" * 30]
    cols = {"answer": ["Paris", "Paris", "Paris", "42", "Paris"]}
    r = rewards_of(
        {"function": "exact_match"},
        {"function": "exact_match", "name": "tagged", "args": {"answer_tag": "answer"}},
        {"function": "regex", "args": {"pattern": r"<answer>\d+</answer>"}},
        {"function": "length_penalty", "args": {"max_chars": 10}},
        {"function": "math_equal", "args": {"answer_tag": "answer"}},
    )
    got = score(r, ["q"] * 5, completions, [[1]] * 5, cols)
    assert got[:, 0].tolist() == [1, 1, 0, 0, 0]
    assert got[:, 1].tolist() == [0, 0, 0, 1, 0]
    assert got[:, 2].tolist() == [0, 0, 0, 1, 0]
    assert got[:, 3].tolist() == [0, 0, -1.0, -0.9, -1.0]
    assert got[:, 4].tolist() == [0, 0, 0, 1, 0]
    half = score(rewards_of({"function": "math_equal"}), ["q"], ["so it is 1/2"], [[1]], {"answer": ["0.5"]})
    assert half.item() == 1.0  # equivalent forms are equal


def test_user_reward_function_by_file_path_gets_the_columns(tmp_path):
    f = tmp_path / "my_rewards.py"
    f.write_text(
        "def scored(prompts, completions, completion_ids, answer, kind, **kw):\n"
        "    return [len(c) + (10 if a == 'x' else 0) + len(k) for c, a, k in zip(completions, answer, kind)]\n"
    )
    r = rewards_of({"function": f"{f}:scored", "weight": 2.0})
    assert r[0].name == "scored" and r[0].weight == 2.0
    got = score(r, ["p", "p"], ["ab", "abc"], [[1], [1]], {"answer": ["x", "y"], "kind": ["k", "kk"]})
    assert got[:, 0].tolist() == [13, 5]


def test_user_reward_function_by_module_name():
    r = rewards_of({"function": "os.path:basename", "name": "base"})  # a module on sys.path
    assert r[0].name == "base" and callable(r[0].fn)


@pytest.mark.parametrize(
    "body, message",
    [
        ("raise ValueError('bad answer')", "rl.rewards[0] (bad) raised ValueError: bad answer"),
        ("return [1.0]", "rl.rewards[0] (bad) returned 1 values for 2 completions"),
        (
            "return [1.0, 'high']",
            "rl.rewards[0] (bad) returned 'high' (str) for completion 1, not a finite number",
        ),
        ("return [1.0, float('nan')]", "returned nan (float) for completion 1, not a finite number"),
        ("return None", "rl.rewards[0] (bad) returned NoneType (None), not a list of numbers"),
    ],
)
def test_a_wrong_reward_function_is_named_with_what_it_did(tmp_path, body, message):
    f = tmp_path / "r.py"
    f.write_text(f"def bad(prompts, completions, **kw):\n    {body}\n")
    r = rewards_of({"function": f"{f}:bad"})
    with pytest.raises(
        RewardError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")
    ):
        score(r, ["p", "p"], ["a", "b"], [[1], [1]], {})


def test_reward_functions_that_cannot_be_loaded_are_named(tmp_path):
    with pytest.raises(RecipeError, match=r"rl.rewards\[0\].function: reward file .*nope.py does not exist"):
        rewards_of({"function": f"{tmp_path}/nope.py:f"})
    (tmp_path / "r.py").write_text("x = 1\n")
    with pytest.raises(RecipeError, match=r"rl.rewards\[0\].function: .*r.py has no function 'f'"):
        rewards_of({"function": f"{tmp_path}/r.py:f"})
    (tmp_path / "broken.py").write_text("import no_such_module_here\n")
    with pytest.raises(RecipeError, match="importing .*broken.py raised ModuleNotFoundError"):
        rewards_of({"function": f"{tmp_path}/broken.py:f"})
    with pytest.raises(RecipeError, match="cannot import 'no_such_pkg.rewards'"):
        rewards_of({"function": "no_such_pkg.rewards:f"})


# ----------------------------------------------------------------------------- a reward model


def test_a_reward_model_scores_prompt_and_completion(tiny_reward_model_dir, monkeypatch):
    """Plain prompts: prompt + completion; batches of unequal lengths (right-padded, 3 texts per forward
    here) score each text as it scores alone."""
    monkeypatch.setattr(rewards_module, "REWARD_MODEL_BATCH", 3)
    r = rewards_of({"function": "reward_model", "args": {"path": str(tiny_reward_model_dir)}, "weight": 2.0})
    assert r[0].name == "reward_model" and r[0].weight == 2.0
    prompts = ["What is 2 + 2?"] * 2 + ["Name a colour of the sky on a clear day."] * 2
    completions = ["4", " Four, of course.", " blue", " It is blue; at sunset it turns orange and red."]
    got = score(r, prompts, completions, [[1]] * 4, {"answer": ["4"] * 4})[:, 0]
    want = own_scores(tiny_reward_model_dir, [p + c for p, c in zip(prompts, completions)])
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), atol=1e-5, rtol=1e-5)
    assert len(set(got.tolist())) == 4  # a real score of each text


def test_a_reward_model_scores_conversations_with_its_chat_template(tiny_reward_model_dir):
    """Conversational prompts: the messages and the assistant's completion, rendered as TRL renders them
    for reward models (trl.data_utils.apply_chat_template of {"messages": prompt + completion})."""
    r = rewards_of({"function": "reward_model", "args": {"path": str(tiny_reward_model_dir)}})
    prompts = [[{"role": "user", "content": "What is 2 + 2?"}]] * 2 + [
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    ]
    completions = [[{"role": "assistant", "content": c}] for c in ("4", "It is four.", "Blue")]
    got = score(r, prompts, completions, [[1]] * 3, {})[:, 0]
    tok = AutoTokenizer.from_pretrained(tiny_reward_model_dir)
    texts = [apply_chat_template({"messages": p + c}, tok)["text"] for p, c in zip(prompts, completions)]
    assert texts[0].endswith(
        "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n"
    )
    want = own_scores(tiny_reward_model_dir, texts)
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), atol=1e-5, rtol=1e-5)


def test_a_bad_reward_model_is_named_with_its_path(tmp_path, tiny_model_dir):
    good = {"function": "length_penalty"}
    missing = tmp_path / "no-such-model"
    with pytest.raises(
        RecipeError, match=rf"rl.rewards\[1\].args.path: reward model {missing} does not exist"
    ):
        rewards_of(good, {"function": "reward_model", "args": {"path": str(missing)}})
    with pytest.raises(RecipeError) as e:  # a causal LM: AutoModelForSequenceClassification would add a head
        rewards_of({"function": "reward_model", "args": {"path": str(tiny_model_dir)}})
    assert (
        f"rl.rewards[0].args.path: reward model {tiny_model_dir} is not a sequence-classification model"
        in (str(e.value))
    )
    assert "(architectures: LlamaForCausalLM)" in str(e.value)
    two = save_reward_model(tmp_path / "two-labels", num_labels=2)
    with pytest.raises(RecipeError) as e:
        rewards_of({"function": "reward_model", "args": {"path": str(two)}})
    assert f"rl.rewards[0].args.path: reward model {two} has num_labels=2" in str(e.value)
    (tmp_path / "empty").mkdir()
    with pytest.raises(RecipeError, match="reward model .*empty cannot be read"):
        rewards_of({"function": "reward_model", "args": {"path": str(tmp_path / "empty")}})


# ----------------------------------------------------------------------------- the schema


BASE = {
    "output_dir": "/tmp/x",
    "model": {"name_or_path": "some/model"},
    "data": {"train": "data/rl/train.jsonl"},
    "method": {"type": "lora"},
}


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"rl": {"rewards": [{"function": "nope"}]}}, "'nope' is not a built-in reward"),
        ({"rl": {"rewards": [{"function": "regex"}]}}, "regex needs args.pattern"),
        (
            {"rl": {"rewards": [{"function": "regex", "args": {"pattern": "("}}]}},
            "args.pattern is not a regular",
        ),
        (
            {"rl": {"rewards": [{"function": "exact_match", "args": {"colum": "a"}}]}},
            "args: colum not a setting",
        ),
        (
            {"rl": {"rewards": [{"function": "regex", "args": {"pattern": "a"}}] * 2}},
            "two rewards named regex",
        ),
        ({"rl": {"rewards": []}}, "rewards"),
        ({"rl": {"rewards": [{"function": "length_penalty"}], "num_generations": 1}}, "num_generations"),
        ({"rl": {"rewards": [{"function": "length_penalty"}], "num_iterations": 0}}, "num_iterations"),
        ({"rl": {"rewards": [{"function": "length_penalty"}], "beta": 0.1, "reference": "none"}}, "beta > 0"),
        (
            {
                "rl": {
                    "rewards": [{"function": "length_penalty"}],
                    "beta": 0.1,
                    "reference": "adapter_disabled",
                },
                "method": {"type": "full"},
            },
            "rl.reference=adapter_disabled is the base under a LoRA adapter: it needs method.type=lora",
        ),
        (
            {"rl": {"rewards": [{"function": "length_penalty"}], "beta": 0.1, "reference": "frozen_copy"}},
            "rl.reference=frozen_copy copies the whole model, for method.type=full; with method.type=lora",
        ),
        (
            {"rl": {"rewards": [{"function": "length_penalty"}], "reference": "frozen_copy"}},
            "reference=frozen_copy is the KL reference: set beta > 0",
        ),
        ({"rl": {"rewards": [{"function": "reward_model"}]}}, "reward_model needs args.path"),
        (
            {"rl": {"rewards": [{"function": "length_penalty"}], "async": 1, "num_iterations": 2}},
            "async: rollouts reused for num_iterations > 1 steps are already off-policy",
        ),
        (
            {"rl": {"rewards": [{"function": "length_penalty"}], "async": 1, "generator": "vllm"}},
            "async: generates on a copy of the policy with transformers' generate",
        ),
        ({"rl": {"rewards": [{"function": "length_penalty"}], "async": -1}}, "rl.async"),
        (
            {"rl": {"rewards": [{"function": "length_penalty"}], "refill_ahead": True}},
            "refill_ahead: draws dynamic sampling's replacements ahead: set dynamic_sampling > 0",
        ),
        (
            {
                "rl": {
                    "rewards": [{"function": "length_penalty"}],
                    "batching": "continuous",
                    "generator": "vllm",
                }
            },
            "batching: continuous is transformers' continuous batching; generator vllm schedules its own",
        ),
        (
            {"rl": {"rewards": [{"function": "length_penalty"}], "generator": "server"}},
            "generator: server draws from the server at server_url: give both",
        ),
        (
            {"rl": {"rewards": [{"function": "length_penalty"}], "server_url": "http://127.0.0.1:8000/v1"}},
            "generator: server draws from the server at server_url: give both",
        ),
        ({"rl": {"rewards": [{"function": "length_penalty"}], "async_": 1}}, "async_"),
        (
            {"rl": {"rewards": [{"function": "reward_model", "args": {"model": "x"}}]}},
            "args: model not a setting of reward_model",
        ),
        (
            {"rl": {"rewards": [{"function": "length_penalty"}]}, "preference": {"objective": "dpo"}},
            "rl and preference are two objectives",
        ),
        (
            {"rl": {"rewards": [{"function": "length_penalty"}]}, "data": {"format": "chat"}},
            "set data.format=prompts",
        ),
        ({"data": {"format": "prompts"}}, "data.format=prompts is RL data"),
    ],
)
def test_recipe_refuses_rl_nonsense(extra, message):
    recipe = {**BASE, **extra}
    if "data" in extra:
        recipe["data"] = {**BASE["data"], **extra["data"]}
    with pytest.raises(RecipeError, match=message.replace("(", r"\(").replace("[", r"\[")):
        parse_recipe(recipe)


def test_rl_defaults():
    r = parse_recipe(
        {
            **BASE,
            "rl": {"rewards": [{"function": "exact_match"}, {"function": "length_penalty", "weight": -1}]},
        }
    )
    assert r.data.format == "prompts" and r.rl.epsilon_high == r.rl.epsilon == 0.2
    assert r.rl.pass_reward == 1.0 and r.rl.columns() == ["answer"] and r.rl.reference == "auto"
    assert r.rl.num_iterations == 1  # one update per batch of rollouts, as TRL
    lora_kl = parse_recipe({**BASE, "rl": {"rewards": [{"function": "exact_match"}], "beta": 0.04}})
    assert lora_kl.rl.reference == "adapter_disabled"
    full = {
        **BASE,
        "method": {"type": "full"},
        "rl": {"rewards": [{"function": "exact_match"}], "beta": 0.04},
    }
    assert parse_recipe(full).rl.reference == "frozen_copy"  # a frozen copy of the initial model
