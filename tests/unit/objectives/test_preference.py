"""Preference tuning: each objective's loss equals TRL's implementation (or the paper's formula) on the
same log-probabilities; the LoRA reference is the base model exactly; 2-process DDP (batch 1 x 2
accumulation) equals one process (batch 4), through a kill -9 and resume; the recipe schema refuses
nonsense combinations."""

from __future__ import annotations

import json
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
import yaml

from conftest import ROOT, TINY_ARCH, TOKENIZER, deep_update, train_inprocess
from training.config import PreferenceSection, parse_recipe
from training.core.errors import RecipeError
from training.objectives.preference import (
    AdapterDisabled,
    dpo_loss,
    example_losses,
    kto_loss,
    orpo_loss,
    sequence_logps,
    simpo_loss,
)

B, L = 4, 9


@pytest.fixture(scope="module")
def batch():
    """Per-token log-probabilities of B chosen over B rejected completions (zero outside the completion),
    the completion masks, and reference sums: what both implementations are given."""
    g = torch.Generator().manual_seed(0)
    mask = torch.zeros(2 * B, L, dtype=torch.long)
    for i, start in enumerate([3, 4, 2, 5, 3, 6, 2, 4]):
        mask[i, start : L - (i % 3)] = 1
    per_token = -torch.rand(2 * B, L - 1, generator=g, dtype=torch.float64) * 2 * mask[:, 1:]
    ref = -torch.rand(2 * B, generator=g, dtype=torch.float64) * 6 - 2
    return SimpleNamespace(
        per_token=per_token, mask=mask, sums=per_token.sum(1), n=mask[:, 1:].sum(1), ref=ref
    )


def identity_accelerator():
    return SimpleNamespace(
        device=torch.device("cpu"),
        gather=lambda t: t,
        gather_for_metrics=lambda t: t,
        unwrap_model=lambda m: m,
    )


def fake_outputs(per_token):
    z = torch.zeros_like(per_token)
    return SimpleNamespace(log_probs=per_token, entropy=z, mean_logits=z, is_top1=z.bool())


def trl_dpo(batch, loss_type: str, beta: float) -> torch.Tensor:
    """TRL's DPOTrainer._compute_loss on a model that returns the batch's per-token log-probabilities."""
    from trl import DPOTrainer

    trainer = SimpleNamespace(
        model=SimpleNamespace(training=True),
        accelerator=identity_accelerator(),
        aux_loss_enabled=False,
        ld_alpha=None,
        precompute_ref_logps=True,
        f_divergence_type="reverse_kl",
        loss_types=[loss_type],
        loss_weights=[1.0],
        beta=beta,
        label_smoothing=0.0,
        use_weighting=False,
        _metrics=defaultdict(lambda: defaultdict(list)),
        _total_train_tokens=0,
        _tp_size=1,
    )
    inputs = {
        "input_ids": torch.zeros(2 * B, L, dtype=torch.long),
        "attention_mask": torch.ones(2 * B, L, dtype=torch.long),
        "completion_mask": batch.mask,
        "ref_chosen_logps": batch.ref[:B],
        "ref_rejected_logps": batch.ref[B:],
    }
    return DPOTrainer._compute_loss(trainer, lambda **kw: fake_outputs(batch.per_token), inputs, False)


@pytest.mark.parametrize("objective,loss_type", [("dpo", "sigmoid"), ("ipo", "ipo")])
def test_dpo_and_ipo_equal_trl(batch, objective, loss_type):
    cfg = PreferenceSection(objective=objective, beta=0.3)
    ours, _, _ = example_losses(cfg, batch.sums, batch.n, batch.ref)
    want = trl_dpo(batch, loss_type, 0.3)
    assert ours.mean().item() == pytest.approx(want.item(), abs=1e-5)
    assert ours.mean().item() > 0.01  # a real value, not a degenerate zero


def test_dpo_label_smoothing_is_the_cdpo_formula(batch):
    pc, pr, rc, rr = batch.sums[:B], batch.sums[B:], batch.ref[:B], batch.ref[B:]
    beta, eps = 0.2, 0.1
    ours = dpo_loss(pc, pr, rc, rr, beta, eps)
    h = beta * ((pc - rc) - (pr - rr))
    want = -(1 - eps) * torch.log(torch.sigmoid(h)) - eps * torch.log(
        torch.sigmoid(-h)
    )  # cDPO (Mitchell 2023)
    torch.testing.assert_close(ours, want, atol=1e-6, rtol=0)
    assert not torch.allclose(ours, dpo_loss(pc, pr, rc, rr, beta, 0.0))


def test_simpo_equals_trl_cpo_simpo(batch):
    from trl.experimental.cpo import CPOTrainer

    beta, gamma = 2.0, 0.8
    avg = batch.sums / batch.n
    trainer = SimpleNamespace(
        beta=beta,
        simpo_gamma=gamma,
        label_smoothing=0.0,
        loss_type="simpo",
        alpha=0.0,
        accelerator=identity_accelerator(),
    )
    want, _, _ = CPOTrainer.cpo_loss(trainer, avg[:B], avg[B:])
    ours = simpo_loss(batch.sums[:B], batch.sums[B:], batch.n[:B], batch.n[B:], beta, gamma)
    torch.testing.assert_close(ours, want, atol=1e-5, rtol=0)


def test_orpo_equals_trl_odds_ratio_plus_the_papers_nll(batch):
    from trl.experimental.orpo import ORPOTrainer

    beta = 0.25
    avg = batch.sums / batch.n
    trainer = SimpleNamespace(beta=beta, accelerator=identity_accelerator())
    ratio_term, _, _, _, _ = ORPOTrainer.odds_ratio_loss(trainer, avg[:B], avg[B:])
    ours = orpo_loss(batch.sums[:B], batch.sums[B:], batch.n[:B], batch.n[B:], beta)
    nll = -avg[:B]  # L_SFT: the chosen completion's mean per-token negative log-likelihood (eq. 6)
    torch.testing.assert_close(ours, nll - ratio_term.double(), atol=1e-5, rtol=0)
    # the odds ratio of the paper, written with probabilities (eq. 4)
    p_c, p_r = avg[:B].exp(), avg[B:].exp()
    odds = (p_c / (1 - p_c)) / (p_r / (1 - p_r))
    torch.testing.assert_close(
        ours, nll - beta * torch.log(torch.sigmoid(torch.log(odds))), atol=1e-5, rtol=0
    )


def test_kto_equals_trl(batch):
    from trl import KTOTrainer

    beta, wd, wu = 0.2, 1.0, 1.5
    label = torch.tensor([True, False, True, False])
    kl_policy, kl_ref = batch.sums[B:], batch.ref[B:]  # the mismatched completions
    trainer = SimpleNamespace(
        model=SimpleNamespace(training=True),
        accelerator=identity_accelerator(),
        aux_loss_enabled=False,
        precompute_ref_logps=True,
        calculate_KL=True,
        loss_type="kto",
        beta=beta,
        desirable_weight=wd,
        undesirable_weight=wu,
        _metrics=defaultdict(lambda: defaultdict(list)),
        _total_train_tokens=0,
        _tp_size=1,
        _compute_kl_logps=lambda model, inputs: kl_policy,
    )
    inputs = {
        "input_ids": torch.zeros(B, L, dtype=torch.long),
        "attention_mask": torch.ones(B, L, dtype=torch.long),
        "completion_mask": batch.mask[:B],
        "label": label,
        "ref_logps": batch.ref[:B],
        "ref_KL_logps": kl_ref,
    }
    want = KTOTrainer._compute_loss(trainer, lambda **kw: fake_outputs(batch.per_token[:B]), inputs, False)
    z0 = (kl_policy - kl_ref).mean().clamp(min=0)
    ours = kto_loss(batch.sums[:B], batch.ref[:B], label, z0, beta, wd, wu)
    assert ours.mean().item() == pytest.approx(want.item(), abs=1e-5)


def test_lora_reference_is_the_base_model_exactly(tiny_model_dir):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    policy = get_peft_model(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32),
        LoraConfig(r=4, target_modules="all-linear", lora_dropout=0.0),
    )
    with torch.no_grad():  # a trained-looking adapter: B != 0, so the policy differs from its base
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn_like(p) * 0.5)
    ids = torch.randint(0, 1000, (4, 12), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[:, :5] = -100
    b = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
    with torch.no_grad():
        want, _ = sequence_logps(base, b)
        pol, _ = sequence_logps(policy, b)
    got = AdapterDisabled(identity_accelerator()).logps(policy, b, "train")
    assert torch.equal(got, want)
    assert not torch.allclose(pol, want)  # the adapter is on outside the reference


@pytest.mark.parametrize(
    "extra,message",
    [
        (
            {"preference": {"objective": "simpo", "reference": "precomputed"}},
            "objective simpo is reference-free",
        ),
        (
            {"preference": {"objective": "orpo", "label_smoothing": 0.1}},
            "label_smoothing is a setting of objective dpo",
        ),
        (
            {"preference": {"objective": "dpo", "simpo_gamma": 1.0}},
            "simpo_gamma is a setting of objective simpo",
        ),
        ({"preference": {"objective": "kto"}, "data": {"format": "pairwise"}}, "KTO needs unpaired data"),
        ({"preference": {"objective": "dpo"}, "data": {"format": "unpaired"}}, "set data.format=pairwise"),
        ({"preference": {"objective": "dpo"}, "data": {"packing": True}}, "data.packing does not apply"),
        ({"data": {"format": "pairwise"}}, "add a preference section"),
        ({"preference": {"reference": "adapter_disabled"}}, "needs method.type=lora or qlora"),
    ],
)
def test_recipe_refuses_nonsense_combinations(extra, message):
    raw = {"output_dir": "x", "model": {"name_or_path": TOKENIZER}, "data": {"train": "t.jsonl"}}
    for k, v in extra.items():
        raw[k] = {**raw.get(k, {}), **v}
    with pytest.raises(RecipeError, match=message):
        parse_recipe(raw)


def test_defaults_per_objective():
    assert PreferenceSection(objective="simpo").beta == 2.0
    assert PreferenceSection(objective="simpo").simpo_gamma == 1.0
    assert PreferenceSection(objective="kto").undesirable_weight == 1.0
    r = parse_recipe(
        {
            "output_dir": "x",
            "model": {"name_or_path": TOKENIZER},
            "data": {"train": "t"},
            "preference": {"objective": "kto"},
        }
    )
    assert r.data.format == "unpaired"


# ----------------------------------------------------------------------------- training runs

STEPS, CKPT_AT = 6, 3


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
        "preference": {"objective": "dpo", "beta": 0.5},
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
    return tmp_path_factory.mktemp("preference")


@pytest.fixture(scope="module")
def single(work):
    """Full fine-tuning of a tiny model with DPO, one process, batch 4: the reference run."""
    recipe = write_recipe(work / "recipe.yaml", work / "unused")
    out = work / "single"
    assert train_inprocess(recipe, f"output_dir={out}") == 0
    return out


def test_dpo_full_fine_tuning_learns_the_preference_with_a_precomputed_reference(single):
    evals = metric_rows(single, "eval_preference_accuracy")
    assert evals[0]["eval_preference_accuracy"] == 0.5  # policy == reference: every pair a tie
    assert evals[0]["eval_loss"] == pytest.approx(0.6931472, abs=1e-6)  # -log sigmoid(0)
    assert evals[STEPS]["eval_preference_accuracy"] >= 0.9
    assert evals[STEPS]["eval_rewards_margin"] > 0
    train = metric_rows(single, "rewards_margin")
    assert sorted(train) == list(range(1, STEPS + 1)) and train[STEPS]["loss"] < train[1]["loss"]
    saved = torch.load(single / "reference_logps.pt", weights_only=True)
    assert set(saved) == {"train", "eval"} and saved["train"].shape == (48, 2)
    assert (single / "final" / "model.safetensors").is_file()


@pytest.mark.parametrize("objective", ["ipo", "simpo", "orpo", "kto"])
def test_every_objective_trains_with_lora(work, tiny_model_dir, objective):
    """Two LoRA steps per objective (KTO on the unpaired records, its KL point from the mismatched pairs):
    finite losses and reward metrics, and an adapter in final/."""
    out = work / f"lora-{objective}"
    train, held_out = ("kto.jsonl", "kto_eval.jsonl") if objective == "kto" else ("train.jsonl", "eval.jsonl")
    recipe = write_recipe(
        work / f"{objective}.yaml",
        out,
        model={"name_or_path": str(tiny_model_dir)},
        method={"type": "lora", "lora": {"r": 4, "dropout": 0.0}},
        preference={"objective": objective},
        data={
            "train": str(ROOT / "data/signoff" / train),
            "eval": str(ROOT / "data/signoff" / held_out),
            "max_length": 64,
            "max_examples": 8,
        },
        train={"lr": 1e-2, "batch_size": 4, "max_steps": 2},
        checkpoint={"every_steps": None},
        eval={"at_start": False, "every_steps": None, "max_batches": 1},
    )
    assert train_inprocess(recipe) == 0
    rows = metric_rows(out, "rewards_margin")
    assert sorted(rows) == [1, 2]
    for r in rows.values():
        for key in ("loss", "rewards_chosen", "rewards_rejected", "preference_accuracy"):
            assert r[key] is not None and r[key] == r[key], (key, r)
    assert metric_rows(out, "eval_preference_accuracy")[2]["eval_loss"] is not None
    assert (out / "final" / "adapter_config.json").is_file()


@pytest.mark.slow
def test_ddp_two_processes_equal_one_process_through_kill_and_resume(work, single):
    """2 ranks x batch 1 x 2 accumulation == 1 rank x batch 4; killed in step 5 and resumed from step 3."""
    from launching import assert_same_run, kill_and_resume

    recipe = write_recipe(work / "recipe.yaml", work / "unused")
    out = work / "ddp"
    two = ["train.batch_size=1", "train.grad_accum=2", "eval.at_start=false"]
    proc = kill_and_resume("ddp.yaml", recipe, out, *two)
    assert "2 process(es), MULTI_CPU" in proc.stderr
    assert_same_run(out, single)
    got, want = metric_rows(out, "rewards_margin"), metric_rows(single, "rewards_margin")
    for s in range(1, STEPS + 1):
        # the reference was computed in other batches (other padding): ~1e-6 apart, so at steps 1-2, where
        # policy == reference (step 1 has lr 0: warm-up), rewards are float noise around 0 and their order
        # (accuracy) is arbitrary
        for key in ("rewards_chosen", "rewards_rejected") + (("preference_accuracy",) if s > 2 else ()):
            assert got[s][key] == pytest.approx(want[s][key], rel=1e-4, abs=1e-5), (s, key)


@pytest.mark.slow
@pytest.mark.parametrize("config, kind", [("zero3_offload.yaml", "DEEPSPEED"), ("fsdp.yaml", "FSDP")])
def test_sharded_two_processes_equal_one_process(work, single, config, kind):
    """DeepSpeed ZeRO-3 with CPU offload, and FSDP2: the precomputed reference is computed by the sharded
    policy, and the run equals one process. Over 60 s when it is the suite's first DeepSpeed run: DeepSpeed
    JIT-compiles its CPU ops (CPU Adam, shared-memory comm) once per environment, ~3 min on 2 cores."""
    from launching import assert_same_run, launch

    recipe = write_recipe(work / "recipe.yaml", work / "unused")
    out = work / config.removesuffix(".yaml")
    two = ["train.batch_size=1", "train.grad_accum=2", "eval.at_start=false"]
    proc = launch(config, recipe, f"output_dir={out}", *two)
    assert f"2 process(es), {kind}" in proc.stderr
    assert_same_run(out, single)


def test_lora_with_a_precomputed_reference_equals_the_adapter_disabled_one(work, tiny_model_dir):
    """Under LoRA the base with the adapter disabled is the reference; computing its log-probabilities
    once before training (reference: precomputed) gives the same run."""
    runs = {}
    for how in ("adapter_disabled", "precomputed"):
        out = work / f"lora-ref-{how}"
        recipe = write_recipe(
            work / f"lora-{how}.yaml",
            out,
            model={"name_or_path": str(tiny_model_dir)},
            method={"type": "lora", "lora": {"r": 4, "dropout": 0.0}},
            preference={"objective": "dpo", "reference": how},
            data={"max_examples": 16},
            train={"lr": 1e-2, "max_steps": 3},
            checkpoint={"every_steps": None},
            eval={"every_steps": None, "max_batches": 2},
        )
        assert train_inprocess(recipe) == 0
        runs[how] = metric_rows(out, "loss")
    assert (work / "lora-ref-precomputed" / "reference_logps.pt").is_file()
    assert not (work / "lora-ref-adapter_disabled" / "reference_logps.pt").exists()
    for step in (1, 2, 3):
        # the precomputed table comes from other batches (other padding): rewards ~4e-6 apart at step 1,
        # where policy == reference and they are float noise around 0
        for key in ("loss", "rewards_chosen", "rewards_rejected"):
            a, b = runs["adapter_disabled"][step][key], runs["precomputed"][step][key]
            assert a == pytest.approx(b, rel=1e-4, abs=1e-4), (step, key)
    assert runs["precomputed"][3]["rewards_chosen"] - runs["precomputed"][3]["rewards_rejected"] > 1e-3
