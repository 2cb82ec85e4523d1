"""Fine-tuning methods on a tiny random Llama: LoRA/QLoRA train only their adapters, LoRA options reach
peft, adapters continue from a previous run, 8-bit optimizers step, bad combinations are refused."""

from __future__ import annotations

import json

import bitsandbytes as bnb
import pytest
import torch
from safetensors.torch import load_file

from conftest import ROOT, train_inprocess
from training.config import parse_recipe
from training.core.errors import RecipeError
from training.data.tokenizer import load_tokenizer
from training.launch.backend import Backend
from training.launch.refusals import refusal
from training.model.adapters import quantization_config
from training.model.build import build_model
from training.model.optim import build_optimizer
from training.objectives.next_token import token_loss

CPU = torch.device("cpu")


def recipe_for(model_dir, method: dict, **train) -> object:
    return parse_recipe(
        {
            "output_dir": "unused",
            "model": {"name_or_path": str(model_dir)},
            "data": {"train": ["unused.jsonl"]},
            "method": method,
            "train": {"lr": 1e-2, **train},
        }
    )


@pytest.fixture(scope="module")
def batch(tiny_model_dir):
    tok = load_tokenizer(recipe_for(tiny_model_dir, {"type": "lora"}).model)
    text = (ROOT / "data/tiny_stories.txt").read_text()[:4000]
    ids = torch.tensor(tok(text)["input_ids"][: 4 * 32]).view(4, 32)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def train_steps(model, optimizer, batch, n: int) -> list[float]:
    losses = []
    for _ in range(n):
        s, count, _ = token_loss(model, batch)
        loss = s / count
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def snapshot(model) -> dict[str, torch.Tensor]:
    """Every tensor of the model's state (parameters and buffers, quantised bytes included), copied."""
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def is_adapter(name: str) -> bool:
    return "lora_" in name or "modules_to_save" in name


def dequantized_4bit(state: dict[str, torch.Tensor], key: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, the scale of each weight's absmax) of the bitsandbytes 4-bit weight `key`, rebuilt from a state
    dict the way transformers loads a quantised checkpoint. The scale is the block's absmax, or with double
    quantisation the largest absmax of the group of blocks whose absmaxes are quantised together (an 8-bit
    code's rounding is relative to that)."""
    fn = bnb.functional
    parts = {k[len(key) + 1 :]: v for k, v in state.items() if k.startswith(key + ".")}
    qs = fn.QuantState.from_dict(parts, CPU)
    absmax = fn.dequantize_blockwise(qs.absmax, qs.state2) + qs.offset if qs.nested else qs.absmax.float()
    if qs.nested:  # each group's largest, for each of its blocks
        groups = absmax.split(qs.state2.blocksize)
        absmax = torch.cat([g.abs().max().expand(len(g)) for g in groups])
    weights = fn.dequantize_4bit(state[key], qs).float()
    return weights, absmax.repeat_interleave(qs.blocksize)[: weights.numel()].view(weights.shape)


# How far a frozen 4-bit weight may appear to move: one bf16 epsilon of its absmax's scale (dequantized_4bit).
# On CPUs with AVX512-BF16, bitsandbytes (0.50) repacks a 4-bit layer for its fast CPU kernel on some forward
# passes and then holds absmax in bf16 (rounding <= eps/2); the state dict re-encodes it (re-applying the
# 8-bit double quantisation, whose rounding is relative to the group's largest absmax: measured <= 0.66 eps
# of that in total; against the block's own absmax it reached 1.08 eps, 2026-12-02). The 4-bit codes
# themselves never change; an optimizer step on the base would change them. Other CPUs keep the state bit
# for bit.
ABSMAX_ROUNDING = torch.finfo(torch.bfloat16).eps


@pytest.mark.parametrize(
    "method",
    [
        pytest.param({"type": "lora"}, id="lora"),
        pytest.param({"type": "qlora", "quantization": {"bits": 4, "quant_type": "nf4"}}, id="qlora-nf4"),
        pytest.param(
            {"type": "qlora", "quantization": {"bits": 4, "quant_type": "fp4", "double_quant": False}},
            id="qlora-fp4",
        ),
        pytest.param({"type": "qlora", "quantization": {"bits": 8}}, id="qlora-int8"),
    ],
)
def test_adapter_training_changes_only_adapter_weights(tiny_model_dir, batch, method):
    recipe = recipe_for(tiny_model_dir, {**method, "lora": {"r": 8, "alpha": 16, "dropout": 0.0}}, lr=1e-2)
    tok = load_tokenizer(recipe.model)
    torch.manual_seed(0)
    model = build_model(recipe, tok, CPU)
    if method["type"] == "qlora":
        q = recipe.method.quantization
        kinds = {type(m).__name__ for m in model.modules()}
        assert ("Linear4bit" if q.bits == 4 else "Linear8bitLt") in kinds
        # the quantised linear weights are stored packed: uint8 (4-bit) or int8 (8-bit)
        assert any(p.dtype in (torch.uint8, torch.int8) for p in model.parameters())
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(is_adapter(n) for n in trainable)

    before = snapshot(model)
    optimizer = build_optimizer(model, recipe.train, CPU)
    losses = train_steps(model, optimizer, batch, 8)
    after = snapshot(model)

    assert losses[-1] < losses[0] - 0.3, losses  # 0.43-0.50 on every variant (tiny random model, 8 steps)
    names = {id(p): n for n, p in model.named_parameters()}
    optimized = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    assert optimized and all(is_adapter(n) for n in optimized)  # the optimizer never holds a base weight
    assert all(is_adapter(names[id(p)]) for p in optimizer.state)

    four_bit = [f"{n}.weight" for n, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert bool(four_bit) == (method["type"] == "qlora" and recipe.method.quantization.bits == 4)
    for k in four_bit:
        assert torch.equal(before[k], after[k]), f"4-bit codes of {k} changed"
        w_before, absmax = dequantized_4bit(before, k)
        w_after, _ = dequantized_4bit(after, k)
        moved = (w_after - w_before).abs()
        assert (moved <= ABSMAX_ROUNDING * absmax).all(), f"base weight {k} moved by {moved.max():.2e}"
    quant_state = tuple(k + "." for k in four_bit)  # absmax, quant_map, ...: compared dequantised above
    base_keys = [k for k in before if not is_adapter(k) and not k.startswith(quant_state)]
    assert len(base_keys) > 10
    for k in base_keys:
        assert torch.equal(before[k], after[k]), f"base tensor {k} changed"
    lora_b = [k for k in before if "lora_B" in k]
    assert lora_b and all(not torch.equal(before[k], after[k]) for k in lora_b)


def test_lora_options_reach_peft_and_modules_to_save_train(tiny_model_dir, batch):
    method = {
        "type": "lora",
        "lora": {
            "r": 4,
            "alpha": 8,
            "target_modules": ["q_proj", "v_proj"],
            "use_rslora": True,
            "use_dora": True,
            "modules_to_save": ["embed_tokens", "lm_head"],
        },
    }
    recipe = recipe_for(tiny_model_dir, method)
    model = build_model(recipe, load_tokenizer(recipe.model), CPU)
    cfg = model.peft_config["default"]
    assert (cfg.r, cfg.lora_alpha, cfg.use_rslora, cfg.use_dora) == (4, 8, True, True)
    assert set(cfg.target_modules) == {"q_proj", "v_proj"}
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert any("lora_magnitude_vector" in n for n in names)  # DoRA
    assert not any("k_proj" in n or "mlp" in n for n in names)
    assert any("embed_tokens.modules_to_save" in n for n in names)
    # rsLoRA scales by alpha / sqrt(r) = 8 / 2 = 4 (plain LoRA would be alpha / r = 2)
    q_proj = model.base_model.model.model.layers[0].self_attn.q_proj
    assert q_proj.scaling["default"] == pytest.approx(4.0)

    embed = model.base_model.model.model.embed_tokens
    original, trained = (
        embed.original_module.weight.detach().clone(),
        embed.modules_to_save["default"].weight.detach().clone(),
    )
    train_steps(model, build_optimizer(model, recipe.train, CPU), batch, 2)
    assert torch.equal(embed.original_module.weight, original)
    assert not torch.equal(embed.modules_to_save["default"].weight, trained)
    # the tied output head follows the trained embedding copy
    assert (
        model.get_output_embeddings().weight.data_ptr() == embed.modules_to_save["default"].weight.data_ptr()
    )


def test_lora_run_saves_adapter_and_init_from_continues_it(tiny_model_dir, make_recipe, tmp_path):
    method = {"type": "lora", "lora": {"r": 8, "alpha": 16, "dropout": 0.0}}
    recipe = make_recipe(
        model={"name_or_path": str(tiny_model_dir)}, method=method, train={"lr": 1e-2, "max_steps": 6}
    )
    assert train_inprocess(recipe) == 0
    run = tmp_path / "run"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert losses[-1] < losses[0]
    final = run / "final"
    cfg = json.loads((final / "adapter_config.json").read_text())
    assert cfg["base_model_name_or_path"] == str(tiny_model_dir)  # a loadable local directory
    saved = load_file(final / "adapter_model.safetensors")
    assert saved and all("lora_" in k for k in saved)
    assert not (final / "model.safetensors").exists()

    # continue from the run directory: the new model starts from exactly the saved adapter
    follow = recipe_for(tiny_model_dir, {"type": "lora", "lora": {"r": 2, "init_from": str(run)}})
    model = build_model(follow, load_tokenizer(follow.model), CPU)
    assert model.peft_config["default"].r == 8  # the adapter's own rank wins
    state = {k.replace(".default", ""): v for k, v in model.state_dict().items() if "lora_" in k}
    assert set(state) == set(saved)
    for k, v in saved.items():
        assert torch.equal(state[k], v), k
    assert all(p.requires_grad for n, p in model.named_parameters() if "lora_" in n)


@pytest.mark.parametrize("name", ["adamw_8bit", "paged_adamw_8bit", "paged_adamw_32bit"])
def test_bitsandbytes_optimizer_step_changes_weights(tiny_model_dir, batch, name):
    recipe = recipe_for(tiny_model_dir, {"type": "full"}, optimizer=name, lr=1e-3)
    model = build_model(recipe, load_tokenizer(recipe.model), CPU)
    optimizer = build_optimizer(model, recipe.train, CPU)
    assert (
        type(optimizer).__name__
        == {
            "adamw_8bit": "AdamW8bit",
            "paged_adamw_8bit": "PagedAdamW8bit",
            "paged_adamw_32bit": "PagedAdamW32bit",
        }[name]
    )
    embed = model.get_input_embeddings().weight
    before = embed.detach().clone()
    losses = train_steps(model, optimizer, batch, 3)
    assert not torch.equal(before, embed)
    assert losses[-1] < losses[0]
    state_dtype = optimizer.state[embed][
        "state1"
    ].dtype  # the 49152 x 64 embedding: big enough for 8-bit state
    assert state_dtype == (torch.float32 if name == "paged_adamw_32bit" else torch.uint8)


def test_adamw_is_fused_on_cuda_only(tiny_model_dir):
    recipe = recipe_for(tiny_model_dir, {"type": "lora"}, weight_decay=0.1)
    model = build_model(recipe, load_tokenizer(recipe.model), CPU)
    cpu_opt = build_optimizer(model, recipe.train, CPU)
    assert isinstance(cpu_opt, torch.optim.AdamW) and not cpu_opt.defaults["fused"]
    assert build_optimizer(model, recipe.train, torch.device("cuda")).defaults["fused"] is True
    assert [g["weight_decay"] for g in cpu_opt.param_groups] == [0.1, 0.0]


@pytest.mark.parametrize(
    "method, extra, message",
    [
        (
            {"type": "lora", "lora": {"target_modules": "q_proj"}},
            {},
            "must be 'all-linear' or a list of module names",
        ),
        ({"type": "lora", "lora": {"target_modules": []}}, {}, "target_modules is an empty list"),
        ({"type": "lora", "lora": {"rank": 8}}, {}, "method.lora.rank: unknown key"),
        ({"type": "qlora", "quantization": {"bits": 8, "quant_type": "fp4"}}, {}, "fp4 is a 4-bit data type"),
        (
            {"type": "qlora", "quantization": {"bits": 8, "quant_storage": "bfloat16"}},
            {},
            "quant_storage applies to 4-bit",
        ),
        ({"type": "qlora", "quantization": {"bits": 3}}, {}, "method.quantization.bits"),
        (
            {"type": "qlora", "quantization": {"quant_storage": "bfloat16"}},
            {},
            "differs from model.dtype=float32",
        ),
        ({"type": "full", "lora": {"init_from": "runs/x"}}, {}, "init_from continues an adapter"),
        ({"type": "lora"}, {"train": {"optimizer": "sgd"}}, "train.optimizer"),
    ],
)
def test_bad_method_combinations_are_refused(make_recipe, tiny_model_dir, capsys, method, extra, message):
    recipe = make_recipe(model={"name_or_path": str(tiny_model_dir)}, method=method, **extra)
    with pytest.raises(SystemExit) as exit_info:
        train_inprocess(recipe)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_qlora_storage_matching_model_dtype_is_accepted(tiny_model_dir):
    recipe = parse_recipe(
        {
            "output_dir": "unused",
            "model": {"name_or_path": str(tiny_model_dir), "dtype": "bfloat16"},
            "data": {"train": ["unused.jsonl"]},
            "method": {"type": "qlora", "quantization": {"quant_storage": "bfloat16"}},
        }
    )
    assert quantization_config(recipe).bnb_4bit_quant_storage == torch.bfloat16
    assert (
        quantization_config(recipe_for(tiny_model_dir, {"type": "qlora"})).bnb_4bit_quant_storage
        == torch.uint8
    )


def test_build_time_errors_name_the_key(tiny_model_dir):
    tok = load_tokenizer(recipe_for(tiny_model_dir, {"type": "lora"}).model)
    with pytest.raises(RecipeError, match=r"method.lora: .*linear layers in this model: .*q_proj"):
        build_model(
            recipe_for(tiny_model_dir, {"type": "lora", "lora": {"target_modules": ["attn_q"]}}), tok, CPU
        )
    with pytest.raises(RecipeError, match="method.lora.init_from: .* holds no adapter_config.json"):
        build_model(
            recipe_for(tiny_model_dir, {"type": "lora", "lora": {"init_from": str(tiny_model_dir)}}), tok, CPU
        )
    with pytest.raises(
        RecipeError, match="under FSDP/DeepSpeed ZeRO-3 needs bits=4 and method.quantization.quant_storage"
    ):
        raise refusal(recipe_for(tiny_model_dir, {"type": "qlora"}), Backend("fsdp", "", "fsdp"), cuda=True)


def test_an_attention_the_models_class_does_not_have_is_refused_naming_the_key(tmp_path):
    """BLOOM has no SDPA: transformers raises ValueError in from_pretrained, which the trainer turns into a recipe
    error naming model.attn_implementation (exit 2), not a traceback."""
    from transformers import AutoTokenizer, BloomConfig, BloomForCausalLM

    from conftest import TOKENIZER
    from training.config import ModelSection

    tok = load_tokenizer(ModelSection(tokenizer=TOKENIZER, from_scratch={"hidden_size": 32}))
    config = BloomConfig(vocab_size=len(tok), hidden_size=32, n_layer=1, n_head=2)
    BloomForCausalLM(config).save_pretrained(tmp_path / "bloom")
    tok.save_pretrained(tmp_path / "bloom")
    recipe = parse_recipe(
        {
            "output_dir": "unused",
            "model": {"name_or_path": str(tmp_path / "bloom"), "attn_implementation": "sdpa"},
            "data": {"train": ["unused.jsonl"]},
        }
    )
    with pytest.raises(
        RecipeError, match="model.attn_implementation: sdpa is refused for .*bloom.*does not support"
    ):
        build_model(recipe, AutoTokenizer.from_pretrained(tmp_path / "bloom"), CPU)
    recipe.model.attn_implementation = "eager"
    assert (
        build_model(recipe, AutoTokenizer.from_pretrained(tmp_path / "bloom"), CPU).config.model_type
        == "bloom"
    )
