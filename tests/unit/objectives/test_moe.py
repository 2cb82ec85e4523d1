"""Mixture-of-Experts: from-scratch MoE architectures, the router's load-balancing loss (equal to
transformers' and exact over micro-batches), expert-load metrics, LoRA on an MoE model, and expert
parallelism (accelerate_configs/ep.yaml) on 2 CPU processes: equal to one process, exact resume after
kill -9, refusals."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import yaml
from accelerate import Accelerator

from conftest import ROOT, TOKENIZER, run_cli, train_inprocess
from launching import CKPT_AT, STEPS, assert_same_run, kill_and_resume, rows

MOE_ARCH = dict(
    type="qwen3_moe",
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=256,
    num_experts=4,
    num_experts_per_tok=2,
    expert_intermediate_size=32,
)


def moe_config(type_="qwen3_moe", **over):
    from transformers import MixtralConfig, Qwen3MoeConfig

    common = dict(
        vocab_size=over.pop("vocab_size", 96),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    if type_ == "mixtral":
        return MixtralConfig(
            **common, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, **over
        )
    return Qwen3MoeConfig(
        **common, intermediate_size=64, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2, **over
    )


def moe_recipe(path: Path, output_dir: Path, **over) -> Path:
    recipe = {
        "output_dir": str(output_dir),
        "seed": 0,
        "model": {"tokenizer": TOKENIZER, "from_scratch": dict(MOE_ARCH)},
        "data": {
            "train": str(ROOT / "data/tiny_stories.txt"),
            "format": "text",
            "max_length": 32,
            "max_examples": 200,
            "eval_fraction": 0.05,
        },
        "train": {
            "lr": 3e-3,
            "batch_size": 4,
            "max_steps": STEPS,
            "warmup_steps": 2,
            "router_aux_loss_coef": 0.05,
        },
        "eval": {"at_start": False, "every_steps": CKPT_AT},
        "checkpoint": {"every_steps": CKPT_AT, "keep_last": 5},
    }
    for key, value in over.items():
        merge = isinstance(value, dict) and key != "model"  # a model section replaces the from-scratch one
        recipe[key] = {**recipe.get(key, {}), **value} if merge else value
    path.write_text(yaml.safe_dump(recipe))
    return path


# ----------------------------------------------------------------------------- recipe keys


def test_moe_keys_map_to_each_types_own_config_names():
    from training.config import Architecture

    q = Architecture(**MOE_ARCH).config_kwargs(100)
    assert (q["num_experts"], q["num_experts_per_tok"], q["moe_intermediate_size"]) == (4, 2, 32)
    m = Architecture(type="mixtral", num_experts=8, num_experts_per_tok=2).config_kwargs(100)
    assert (m["num_local_experts"], m["num_experts_per_tok"]) == (8, 2)


@pytest.mark.parametrize(
    "arch, message",
    [
        (dict(type="qwen3_moe", num_experts=2, num_experts_per_tok=3), "more experts than num_experts=2"),
        (dict(type="llama", num_experts=4), "dense model type"),
        (dict(type="mixtral", expert_intermediate_size=32), "intermediate_size wide"),
        (dict(type="mixtral", extra={"num_local_experts": 4}), "set it as model.from_scratch.num_experts"),
    ],
)
def test_bad_moe_keys_are_refused_naming_the_key(arch, message):
    from training.config import parse_recipe

    raw = {"output_dir": "x", "model": {"tokenizer": TOKENIZER, "from_scratch": arch}, "data": {"train": "t"}}
    with pytest.raises(Exception) as e:
        parse_recipe(raw)
    assert message in str(e.value) and "from_scratch" in str(e.value)


# ----------------------------------------------------------------------------- the loss and the metric


def _window_loss(balance_spec, model, window, acc):
    """Sum over the window's micro-batches of each one's aux share, as train_step adds them."""
    w = balance_spec.begin(acc, model, window)
    total = 0.0
    for batch in window:
        total = total + w.loss(model(**batch), batch)
    return total, w


@pytest.mark.parametrize("type_", ["qwen3_moe", "mixtral"])
def test_aux_loss_equals_transformers_and_is_exact_over_micro_batches(type_):
    """One micro-batch: the value of transformers' load_balancing_loss_func (padding masked) taken per
    layer and averaged over the layers. Two micro-batches with the routing pass: the same value and the
    same gradient as the whole batch, which per-micro-batch aux losses, averaged, do not give."""
    from transformers import AutoModelForCausalLM
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    from training.objectives.router_balance import RouterBalance

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(moe_config(type_, output_router_logits=True))
    ids = torch.randint(0, 96, (4, 12))
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0  # right padding
    mask[3, 5:] = 0
    batch = {"input_ids": ids, "attention_mask": mask}
    spec = RouterBalance(num_experts=4, top_k=2, coef=1.0)
    acc = Accelerator(cpu=True)

    def per_layer(router_logits, attention_mask):
        return sum(load_balancing_loss_func((x,), 4, 2, attention_mask) for x in router_logits) / len(
            router_logits
        )

    ref = per_layer(model(**batch).router_logits, mask)
    ref.backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()

    one, w = _window_loss(spec, model, [batch], acc)
    torch.testing.assert_close(one, ref, rtol=1e-6, atol=1e-7)
    assert w.finish()["aux_loss"] == pytest.approx(ref.item(), rel=1e-6)

    halves = [{k: v[:2] for k, v in batch.items()}, {k: v[2:] for k, v in batch.items()}]
    two, w = _window_loss(spec, model, halves, acc)
    two.backward()
    torch.testing.assert_close(two, ref, rtol=1e-6, atol=1e-7)
    assert w.finish()["aux_loss"] == pytest.approx(ref.item(), rel=1e-6)
    for n, g in ref_grads.items():
        torch.testing.assert_close(dict(model.named_parameters())[n].grad, g, rtol=1e-5, atol=1e-7)
    naive = sum(per_layer(model(**h).router_logits, h["attention_mask"]) for h in halves) / 2
    assert abs(naive.item() - ref.item()) > 1e-4  # what exactness is needed for


def test_expert_load_metric_from_a_hand_built_router():
    """Top-1 of 4 experts over 6 real tokens: 3 to expert 0, 2 to expert 1, 1 to expert 2 -> the busiest
    gets 3 / (6/4) = 2.0x the mean; a padded token routed to expert 3 is not counted."""
    from training.objectives.router_balance import load_ratios, route

    big = 5.0
    layer0 = torch.full((8, 4), 0.0)
    for row, expert in enumerate([0, 0, 0, 1, 1, 2, 3, 3]):
        layer0[row, expert] = big
    layer1 = torch.zeros(8, 4)
    layer1[:, 0] = 1.0  # every token to expert 0
    mask = torch.tensor([1, 1, 1, 1, 1, 1, 0, 0], dtype=torch.float32)
    counts, prob_sum, tokens = route((layer0, layer1), 1, 4, mask)
    assert counts.tolist() == [[3, 2, 1, 0], [6, 0, 0, 0]]
    assert tokens.item() == 6
    assert load_ratios(counts) == pytest.approx([2.0, 4.0])
    assert prob_sum.sum(dim=1).tolist() == pytest.approx([6.0, 6.0])  # probabilities of 6 tokens per layer


def test_the_aux_loss_is_per_layer_so_layers_cannot_collapse_onto_complementary_experts():
    """Layer 0 sends every token to expert 0, layer 1 to expert 1 (top-1 of 2, confident routers). Pooled
    over the layers (transformers' load_balancing_loss_func) that looks balanced: the loss is 1.0, its
    floor, and its gradient no longer cares about the routers. Per layer it is 2.0, the maximum."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    from training.objectives.router_balance import aux_loss, route

    layer0 = torch.tensor([[9.0, -9.0]] * 5)
    layer1 = torch.tensor([[-9.0, 9.0]] * 5)
    pooled = load_balancing_loss_func((layer0, layer1), 2, 1)
    assert pooled.item() == pytest.approx(1.0, abs=1e-6)
    counts, prob_sum, tokens = route((layer0, layer1), 1, 2, torch.ones(5))
    assert aux_loss(counts, prob_sum, tokens, 2).item() == pytest.approx(2.0, abs=1e-6)


# ----------------------------------------------------------------------------- training


@pytest.mark.slow
def test_moe_pretraining_logs_router_metrics_and_balances_the_experts(tmp_path):
    """Qwen3-MoE from scratch: the loss halves, aux loss and expert load are logged every step and on
    eval rows, and after 60 steps the busiest expert of the worst layer gets less than 1.5x the mean load
    on held-out text with the load-balancing loss; without it the routers collapse (2.0x: every token to
    the same 2 of 4 experts). Seeds 0, 1, 2 gave 1.13x, 1.30x, 1.22x (2026-11-22)."""
    aux, load = {}, {}
    for coef in (0.05, 0.0):
        out = tmp_path / f"coef{coef}"
        recipe = moe_recipe(
            tmp_path / f"r{coef}.yaml",
            out,
            train={"max_steps": 60, "batch_size": 8, "router_aux_loss_coef": coef},
            eval={"every_steps": None, "max_batches": 4},
            checkpoint={"every_steps": None},
        )
        assert train_inprocess(recipe) == 0
        train = rows(out, "loss")
        assert sorted(train) == list(range(1, 61))
        assert all(r["aux_loss"] > 0 and 1.0 <= r["expert_load_max"] <= 2.0 for r in train.values())
        assert all(len(r["expert_load_layers"]) == MOE_ARCH["num_hidden_layers"] for r in train.values())
        assert train[60]["loss"] < 0.5 * train[1]["loss"]
        load[coef] = rows(out, "eval_loss")[60]["eval_expert_load_max"]
        aux[coef] = sum(train[s]["aux_loss"] for s in range(51, 61)) / 10
    assert load[0.05] < 1.5 < load[0.0], load
    assert aux[0.05] < aux[0.0] - 0.3, aux


# ----------------------------------------------------------------------------- expert parallelism

EP_RANKS = ["train.batch_size=2", "train.grad_accum=2"]  # 2 ranks x 2 x 2 == 1 process x 4 x 2


@pytest.fixture(scope="module")
def ep_work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("moe-ep")


@pytest.fixture(scope="module")
def ep_recipe(ep_work) -> Path:
    return moe_recipe(ep_work / "recipe.yaml", ep_work / "unused", train={"grad_accum": 2})


@pytest.fixture(scope="module")
def ep_single(ep_work, ep_recipe) -> Path:
    out = ep_work / "single"
    assert train_inprocess(ep_recipe, f"output_dir={out}", "train.batch_size=4") == 0
    return out


@pytest.mark.slow
def test_expert_parallel_two_processes_match_one_process_through_kill_and_resume(
    ep_work, ep_recipe, ep_single
):
    """Experts sharded over 2 ranks (all-to-all dispatch), 2 micro-batches per step (the routing pass),
    both ranks SIGKILLed mid step 5 and relaunched: it resumes from the step-3 checkpoint (each rank's
    expert shards from torch distributed checkpoint), and the whole run has the same losses, aux losses,
    eval loss and final weights as one process; final/ is a whole model. (One killed-and-resumed run
    proves both the equality and the exact resume: an uninterrupted launch would add nothing.)"""
    from transformers import AutoModelForCausalLM

    out = ep_work / "ep"
    proc = kill_and_resume("ep.yaml", ep_recipe, out, *EP_RANKS)
    assert "sharded over 2 ranks" in proc.stderr
    assert_same_run(out, ep_single)
    got, want = rows(out, "aux_loss"), rows(ep_single, "aux_loss")
    assert sorted(got) == list(range(1, STEPS + 1))
    for step in got:
        assert got[step]["aux_loss"] == pytest.approx(want[step]["aux_loss"], rel=1e-5)
        assert got[step]["expert_load_max"] == pytest.approx(want[step]["expert_load_max"], rel=1e-6)
    model = AutoModelForCausalLM.from_pretrained(out / "final")
    assert model.model.layers[0].mlp.experts.gate_up_proj.shape[0] == MOE_ARCH["num_experts"]
    assert not model.config.output_router_logits  # training's setting is not saved


# ----------------------------------------------------------------------------- refusals


def _ep_backend(tmp_path, **edit):
    from training.launch.backend import read_backend

    raw = yaml.safe_load((ROOT / "accelerate_configs/ep.yaml").read_text())
    raw.update(edit)
    path = tmp_path / "ep_variant.yaml"
    path.write_text(yaml.safe_dump(raw))
    return read_backend(path)


@pytest.mark.parametrize(
    "arch, method, edit, message",
    [
        (dict(MOE_ARCH, num_experts=3, num_experts_per_tok=1), "full", {}, "num_experts=3 is not divisible"),
        ({"hidden_size": 64}, "full", {}, "dense model"),
        (MOE_ARCH, "full", {"num_processes": 4}, "must equal the number of processes"),
        (MOE_ARCH, "full", {"distributed_type": "FSDP"}, "not combined with fsdp"),
    ],
)
def test_expert_parallel_refusals_name_the_key(tmp_path, arch, method, edit, message):
    from training.config import parse_recipe
    from training.launch.refusals import refusal

    recipe = parse_recipe(
        {
            "output_dir": str(tmp_path / "run"),
            "model": {"tokenizer": TOKENIZER, "from_scratch": arch},
            "data": {"train": str(ROOT / "data/tiny_stories.txt")},
            "method": {"type": method},
        }
    )
    error = refusal(recipe, _ep_backend(tmp_path, **edit), cuda=False)
    assert error is not None and message in str(error)
    assert "num_experts" in str(error) or "parallelism_config_ep_size" in str(error)


def test_expert_parallel_model_checks(tmp_path):
    """Checks that need the model's config (pretrained models): a dense model, indivisible experts."""
    from transformers import LlamaConfig

    from training.core.errors import RecipeError
    from training.launch.checks import check_expert_parallel

    backend = _ep_backend(tmp_path)
    assert backend.ep_size == 2
    check_expert_parallel(moe_config("mixtral"), backend)  # 4 experts over 2 ranks: fine
    with pytest.raises(RecipeError, match="parallelism_config_ep_size=2.*dense"):
        check_expert_parallel(LlamaConfig(), backend)
    backend.ep_size = 3
    with pytest.raises(RecipeError, match="does not divide the model's 4 experts"):
        check_expert_parallel(moe_config("qwen3_moe"), backend)


def test_expert_parallel_launch_is_refused_before_loading(tmp_path):
    """The trainer refuses a dense model under ep.yaml with exit code 2 before any process group exists."""
    recipe = moe_recipe(
        tmp_path / "r.yaml", tmp_path / "run", model={"tokenizer": TOKENIZER, "from_scratch": {}}
    )
    env = {
        "WORLD_SIZE": "2",
        "LOCAL_WORLD_SIZE": "2",
        "ACCELERATE_USE_PARALLELISM_CONFIG": "true",
        "LLM_FORGE_ACCELERATE_CONFIG": str(ROOT / "accelerate_configs/ep.yaml"),
    }
    proc = run_cli("training.train", recipe, env=env, timeout=300, fresh=False)  # read when accelerate starts
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "parallelism_config_ep_size=2" in proc.stderr and "dense" in proc.stderr


def test_lora_on_moe_trains_chosen_parameters_only(tmp_path):
    """LoRA on a Qwen3-MoE: attention only (target_modules), or the fused 3-D expert weights too
    (target_parameters). The chosen adapters train, everything else stays as it was."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from training.config import ModelSection
    from training.data.tokenizer import load_tokenizer

    base = tmp_path / "base"
    tok = load_tokenizer(ModelSection(name_or_path=TOKENIZER))
    torch.manual_seed(0)
    cfg = moe_config("qwen3_moe", vocab_size=len(tok))
    AutoModelForCausalLM.from_config(cfg).save_pretrained(base)
    tok.save_pretrained(base)
    for name, lora in [
        ("attn", {"target_modules": ["q_proj", "v_proj"]}),
        ("experts", {"target_modules": ["q_proj"], "target_parameters": ["mlp.experts.gate_up_proj"]}),
    ]:
        out = tmp_path / name
        recipe = moe_recipe(
            tmp_path / f"{name}.yaml",
            out,
            model={"name_or_path": str(base)},
            method={"type": "lora", "lora": {"r": 4, "dropout": 0.0, **lora}},
            train={"max_steps": 2, "router_aux_loss_coef": 0.01},
            eval={"every_steps": None},
            checkpoint={"every_steps": None},
        )
        assert train_inprocess(recipe) == 0
        adapter = load_file(out / "final" / "adapter_model.safetensors")
        assert adapter and all("lora_" in k for k in adapter)
        adapted = {k.split(".lora_")[0] for k in adapter}
        assert any("q_proj" in k for k in adapted)
        assert any("experts" in k for k in adapted) == (name == "experts")
        assert not any("k_proj" in k or "router" in k or "gate." in k for k in adapted)
        b = [v for k, v in adapter.items() if "lora_B" in k]
        assert all(v.abs().sum() > 0 for v in b)  # every adapter trained (lora_B starts at zero)
        assert rows(out, "aux_loss")


def test_planner_counts_total_active_and_per_device_expert_parameters():
    from training.config import load_recipe
    from training.planning.report import moe_line

    recipe = load_recipe(ROOT / "training/recipes/pretrain_moe_tiny.yaml")
    line = moe_line(recipe, config=moe_config("qwen3_moe"))
    # 4 experts, 2 per token: experts 2 layers x 4 x (2*16*32 + 16*32) = 12,288 of the parameters
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(moe_config("qwen3_moe"))
    total = sum(p.numel() for p in model.parameters())
    assert f"{total / 1e6:.1f}M parameters in all" in line
    assert f"({total - 12288 + 12288 // 2:,} parameters per device)" in line and "over 2 processes" in line
    assert moe_line(recipe, config=__import__("transformers").LlamaConfig()) is None


@pytest.fixture(scope="module")
def moe_base(tmp_path_factory):
    """A tiny Qwen3-MoE saved as a pretrained model with the bundled tokenizer."""
    from transformers import AutoModelForCausalLM

    from training.config import ModelSection
    from training.data.tokenizer import load_tokenizer

    base = tmp_path_factory.mktemp("moe-base")
    tok = load_tokenizer(ModelSection(name_or_path=TOKENIZER))
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(moe_config("qwen3_moe", vocab_size=len(tok))).save_pretrained(base)
    tok.save_pretrained(base)
    return base


def test_all_linear_on_moe_with_the_default_dropout_trains_the_experts_and_leaves_the_router(
    tmp_path, moe_base, capsys
):
    """The recipe anyone writes (all-linear, the schema's default dropout) on a Qwen3-MoE: it trains (peft
    alone raised 'lora.ParamWrapper does not work with lora_dropout != 0'), the experts' adapters change, the
    router is not adapted and, like every base weight, stays as it was; the start-up line says so; the
    planner counts the same trainable parameters."""
    from safetensors.torch import load_file

    from training.config import load_recipe
    from training.planning.inventory import inventory

    out = tmp_path / "run"
    recipe = moe_recipe(
        tmp_path / "r.yaml",
        out,
        model={"name_or_path": str(moe_base)},
        method={"type": "lora", "lora": {"r": 4}},
        train={"max_steps": 2, "router_aux_loss_coef": 0.01},
        eval={"every_steps": None},
        checkpoint={"every_steps": None},
    )
    assert train_inprocess(recipe) == 0
    log = capsys.readouterr().err
    assert "method.lora.dropout 0.05 (the default) -> 0" in log
    assert re.search(
        r"LoRA adapters on \d+\.\d% of the model's .*linear layers .*experts .*router frozen", log
    )
    adapter = load_file(out / "final" / "adapter_model.safetensors")
    adapted = {k.split(".lora_")[0] for k in adapter}
    assert {k for k in adapted if "experts" in k} and not any(".gate" in k for k in adapted)
    assert all(v.abs().sum() > 0 for k, v in adapter.items() if "lora_B" in k)
    trainable = sum(v.numel() for v in adapter.values())
    assert inventory(load_recipe(recipe)).trainable_numel == trainable


def test_moe_lora_dropout_set_by_the_recipe_is_refused_and_the_router_is_adapted_only_on_purpose(moe_base):
    from transformers import AutoModelForCausalLM

    from training.config import parse_recipe
    from training.core.errors import RecipeError
    from training.model.adapters import add_lora

    def recipe(**lora):
        raw = {"output_dir": "runs/x", "model": {"name_or_path": str(moe_base)}, "data": {"train": "x.jsonl"}}
        return parse_recipe({**raw, "method": {"type": "lora", "lora": {"r": 2, **lora}}})

    base = lambda: AutoModelForCausalLM.from_pretrained(moe_base)  # noqa: E731
    with pytest.raises(
        RecipeError, match=r"method\.lora\.dropout: 0\.1 cannot apply to this Mixture-of-Experts"
    ):
        add_lora(base(), recipe(dropout=0.1))
    chosen = add_lora(
        base(), recipe(dropout=0.0, target_parameters=["mlp.experts.down_proj", "mlp.gate.weight"])
    )
    trainable = {n for n, p in chosen.named_parameters() if p.requires_grad}
    assert any(".gate.lora_A" in n for n in trainable) and any("experts.lora_A" in n for n in trainable)


def test_an_adapter_that_would_leave_the_experts_frozen_is_refused_naming_them(moe_base, monkeypatch):
    """As with an older peft or a layout the targets miss: all-linear adapting only the attention layers."""
    from transformers import AutoModelForCausalLM

    from training.config import parse_recipe
    from training.core.errors import RecipeError
    from training.model import lora_targets
    from training.model.adapters import add_lora

    monkeypatch.setattr(
        lora_targets,
        "resolve",
        lambda model, lc: lora_targets.Targets(["q_proj", "k_proj", "v_proj", "o_proj"], None, 0.0),
    )
    raw = {"output_dir": "runs/x", "model": {"name_or_path": str(moe_base)}, "data": {"train": "x.jsonl"}}
    recipe = parse_recipe({**raw, "method": {"type": "lora", "lora": {"dropout": 0.0}}})
    with pytest.raises(
        RecipeError,
        match=r"all-linear leaves this model's experts frozen \(mlp\.experts\.down_proj, "
        r"mlp\.experts\.gate_up_proj: \d+\.\d% of its parameters\)",
    ):
        add_lora(AutoModelForCausalLM.from_pretrained(moe_base), recipe)
