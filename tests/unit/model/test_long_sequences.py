"""Long sequences on one device: the tiled MLP (exact, one tile's intermediates at a time, the layer norms
tiled with it, MoE blocks left whole), activation offloading's hooks (driven on the CPU with stand-in moves;
the CUDA path skips without a GPU), and RoPE scaling from the recipe (written into final/, refused where the
architecture has no RoPE to scale)."""

from __future__ import annotations

import copy
import json
import logging

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import (
    AutoModelForCausalLM,
    BloomConfig,
    GPT2Config,
    LlamaConfig,
    LlamaForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from conftest import ROOT, train_inprocess
from training.config import RopeScaling, parse_recipe
from training.core.errors import RecipeError
from training.data.tokenizer import load_tokenizer
from training.generation import load_for_chat
from training.model.build import build_model
from training.model.offload import ActivationOffload, install
from training.model.rope import rope_refusal, scale_rope
from training.model.tiled_mlp import apply_tiled_mlp, tile_count

WIDTH = 176  # the MLP's intermediate size: no other tensor of these models is this wide
SMALL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=100)


def llama(**extra) -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(intermediate_size=WIDTH, **SMALL, **extra))


class WidestIntermediate(TorchDispatchMode):
    """The most tokens any MLP-intermediate tensor (last dimension WIDTH) created while it is open spans."""

    def __init__(self):
        super().__init__()
        self.tokens = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-1] == WIDTH:
                self.tokens = max(self.tokens, t.numel() // WIDTH)
        return out


def step(model, ids) -> tuple[torch.Tensor, dict[str, torch.Tensor], int]:
    """One forward and backward: (loss, gradients, widest intermediate in tokens)."""
    model.zero_grad()
    with WidestIntermediate() as widest:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, widest.tokens


IDS = torch.randint(0, 100, (2, 300), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("checkpointing", [False, True])
def test_tiled_mlp_gives_the_same_loss_and_gradients_with_one_tiles_intermediates_at_a_time(checkpointing):
    plain = llama()
    if checkpointing:  # the tiles' checkpoints nest inside each layer's
        plain.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    loss, grads, widest = step(plain, IDS)
    assert widest == 600  # batch 2 x 300 tokens at once
    assert apply_tiled_mlp(plain, 4) == 2
    tiled_loss, tiled_grads, tiled_widest = step(plain, IDS)
    assert tiled_widest == 150  # 2 x 75 tokens: one tile, in the forward and in the backward's recompute
    assert torch.equal(tiled_loss, loss)  # each token's MLP is the same computation
    for name, g in grads.items():  # weight gradients: the same sums, added tile by tile
        torch.testing.assert_close(tiled_grads[name], g, rtol=1e-5, atol=1e-7, msg=name)


def saved_by(module, ids, model) -> list[torch.Tensor]:
    """The tensors autograd saves while `module` runs in model's forward."""
    saved, inside = [], []
    hooks = [
        module.register_forward_pre_hook(lambda *_: inside.append(True)),
        module.register_forward_hook(lambda *_: inside.clear()),
    ]
    pack = lambda t: (saved.append(t) if inside else None) or t  # noqa: E731
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids, labels=ids)
    for h in hooks:
        h.remove()
    return saved


def test_tiled_mlp_tiles_the_layers_norms_which_then_keep_only_their_input():
    """Once the MLP is tiled, the norms' fp32 working copies and backward temporaries are the layer's largest
    remainder: the layer's RMSNorm / LayerNorm children are tiled too (Llama's and GPT-2's)."""
    model = llama()
    norm = model.model.layers[0].post_attention_layernorm
    whole = saved_by(norm, IDS, model)
    assert any(t.numel() == IDS.numel() * 64 and t.untyped_storage().nbytes() > 0 for t in whole)
    apply_tiled_mlp(model, 4)
    mine = {m for m in model.modules() if hasattr(m, "_tiled")}
    assert {n for n, m in model.named_modules() if m in mine} == {
        f"model.layers.{i}.{name}"
        for i in (0, 1)
        for name in ("input_layernorm", "post_attention_layernorm", "mlp")
    }
    tiles = saved_by(norm, IDS, model)
    # each tile's checkpoint keeps only its input: views of the norm's input, nothing of its own
    assert len(tiles) == 4 and {t.shape[1] for t in tiles} == {75}
    assert len({t.untyped_storage().data_ptr() for t in tiles}) == 1
    torch.manual_seed(0)
    no_dropout = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    gpt2 = AutoModelForCausalLM.from_config(
        GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=100, **no_dropout)
    )
    loss, grads, _ = step(gpt2, IDS)
    apply_tiled_mlp(gpt2, 2)
    assert {n for n, m in gpt2.named_modules() if hasattr(m, "_tiled")} == {
        f"transformer.h.{i}.{name}" for i in (0, 1) for name in ("ln_1", "ln_2", "mlp")
    }
    # GPT-2's Conv1D `view`s its input: each tile of a 2-row batch (a strided view) is made contiguous first
    tiled_loss, tiled_grads, _ = step(gpt2, IDS)
    assert torch.equal(tiled_loss, loss)
    for name, g in grads.items():
        torch.testing.assert_close(tiled_grads[name], g, rtol=1e-5, atol=1e-7, msg=name)


def test_tiled_mlp_tiles_by_hidden_size_when_on_and_leaves_short_sequences_whole():
    assert tile_count(True, 300, 64) == 5 and tile_count(True, 64, 64) == 1 and tile_count(8, 5, 64) == 5
    model = llama()
    apply_tiled_mlp(model, True)
    assert step(model, IDS)[2] == 2 * 60  # ceil(300 / 64) = 5 tiles of 60 tokens
    assert step(model, IDS[:, :64])[2] == 2 * 64  # one tile: the MLP as it was


def test_a_deep_copy_of_a_tiled_model_runs_its_own_weights():
    """RL's reference model is a deep copy: its tiled MLPs must use the copy's weights, not the policy's."""
    model = llama()
    apply_tiled_mlp(model, 3)
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for p in model.model.layers[0].mlp.parameters():
            p.mul_(2)
        assert not torch.equal(model(input_ids=IDS).logits, ref(input_ids=IDS).logits)
        assert torch.equal(ref(input_ids=IDS).logits, copy.deepcopy(ref)(input_ids=IDS).logits)


def test_tiled_mlp_leaves_moe_blocks_whole_and_refuses_a_model_without_a_dense_mlp(caplog):
    torch.manual_seed(0)
    qwen = Qwen3MoeForCausalLM(
        Qwen3MoeConfig(
            intermediate_size=WIDTH,
            moe_intermediate_size=32,
            num_experts=4,
            num_experts_per_tok=2,
            num_key_value_heads=2,
            mlp_only_layers=[0],  # layer 0 dense, layer 1 Mixture-of-Experts
            **SMALL,
        )
    )
    with caplog.at_level(logging.INFO, logger="training.model.tiled_mlp"):
        assert apply_tiled_mlp(qwen, 3) == 1
    assert "; 1 Mixture-of-Experts blocks are left whole: they route tokens" in caplog.text
    assert step(qwen, IDS)[2] == 200  # the dense layer's intermediates: 2 x 100 tokens
    mixtral = MixtralForCausalLM(MixtralConfig(intermediate_size=WIDTH, num_local_experts=4, **SMALL))
    with pytest.raises(
        RecipeError,
        match=r"model.tiled_mlp: mixtral has no dense MLP .*\(2 Mixture-of-Experts blocks are left whole",
    ):
        apply_tiled_mlp(mixtral, True)
    bloom = AutoModelForCausalLM.from_config(BloomConfig(hidden_size=64, n_layer=2, n_head=4, vocab_size=100))
    with pytest.raises(RecipeError, match=r"\(the forward of BloomMLP takes more than the hidden states\)$"):
        apply_tiled_mlp(bloom, True)  # its MLP adds the residual itself: (hidden_states, residual)


def stand_in_offload() -> tuple[ActivationOffload, list]:
    """The hooks with moves that copy on the CPU and record what moved (`host="meta"`: CPU tensors count
    as accelerator tensors here)."""
    shapes = []

    def to_host(t):
        shapes.append(tuple(t.shape))
        return t.clone()

    return ActivationOffload(
        min_bytes=1024, to_host=to_host, to_device=lambda h, d: h.to(d), host="meta"
    ), shapes


def test_offloading_moves_each_checkpointed_layers_input_and_changes_nothing():
    model = llama()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    loss, grads, _ = step(model, IDS)
    offload, shapes = stand_in_offload()
    install(model, offload)
    moved_loss, moved_grads, _ = step(model, IDS)
    assert torch.equal(moved_loss, loss)
    assert all(torch.equal(moved_grads[n], g) for n, g in grads.items())  # the same tensors came back
    assert shapes.count((2, 300, 64)) >= 2  # each of the 2 layers' inputs (and the head's)
    assert not any(s == tuple(p.shape) for s in shapes for p in model.parameters() if p.dim() == 2)
    assert offload.moved["tensors"] == len(shapes) and offload.moved["bytes"] > 2 * 600 * 64 * 4
    with torch.no_grad():  # nothing is saved without gradients: nothing moves
        model(input_ids=IDS)
    assert offload.moved["tensors"] == len(shapes)


def test_offloading_leaves_the_hooks_after_a_forward_that_raises():
    model = llama()
    offload, _ = stand_in_offload()
    install(model, offload)
    with pytest.raises(IndexError):
        model(input_ids=torch.full((1, 4), 10_000))  # out of the vocabulary
    x = torch.ones(1024, requires_grad=True)  # 4 KiB: moved if the hooks were still in place
    (x * x).sum().backward()  # saved outside the model's forward: no hooks left behind
    assert offload.moved["tensors"] == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_offloading_on_a_gpu_moves_to_pinned_memory_and_back_exactly():  # pragma: no cover (GPU)
    model = llama().cuda()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids = IDS.cuda()
    loss, grads, _ = step(model, ids)
    offload = ActivationOffload(min_bytes=1024)
    install(model, offload)
    moved_loss, moved_grads, _ = step(model, ids)
    assert offload.moved["tensors"] > 0
    assert torch.equal(moved_loss, loss) and all(torch.equal(moved_grads[n], g) for n, g in grads.items())


def test_rope_scaling_stretches_the_positions_and_is_refused_where_there_is_none():
    config = LlamaConfig(max_position_embeddings=256, **SMALL)
    scale_rope(config, RopeScaling(type="yarn", factor=4.0))
    assert config.rope_parameters["rope_type"] == "yarn" and config.rope_parameters["factor"] == 4.0
    assert config.rope_parameters["original_max_position_embeddings"] == 256
    assert config.max_position_embeddings == 1024
    dynamic = LlamaConfig(max_position_embeddings=256, **SMALL)
    scale_rope(dynamic, RopeScaling(type="dynamic", factor=2.0))
    assert dynamic.max_position_embeddings == 256  # where dynamic starts stretching
    assert rope_refusal(GPT2Config()) == "gpt2 has no rotary position embeddings to scale"
    already = LlamaConfig(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}, **SMALL)
    with pytest.raises(RecipeError, match=r"model.rope_scaling: llama's RoPE is already scaled \(linear"):
        scale_rope(already, RopeScaling(type="yarn", factor=2.0))


def test_a_run_with_tiled_mlp_and_rope_scaling_saves_the_scaled_config(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "run"
    args = [
        f"output_dir={out}",
        f"model.name_or_path={tiny_model_dir}",
        "model.tiled_mlp=2",
        "model.rope_scaling={type: linear, factor: 2.0}",
        "data.max_length=400",  # past the tiny model's 256 positions: scaled to 512
        "train.max_steps=2",
    ]
    recipe_file = ROOT / "training/recipes/lora.yaml"
    assert train_inprocess(recipe_file, *args) == 0
    log = capsys.readouterr().err
    assert "RoPE scaling: linear x2, from 256 to 512 positions" in log
    assert "tiled MLP: 2 decoder layers' MLPs and 4 norms run over 2 tiles per sequence" in log
    assert "past llama's context length" not in log
    base_config = json.loads((out / "final" / "base_config.json").read_text())
    assert base_config["rope_parameters"]["rope_type"] == "linear"
    assert base_config["max_position_embeddings"] == 512
    # the adapter's base is read with that config by chat and export (the run's own loaders)
    model, _ = load_for_chat(str(out / "final"), torch.device("cpu"))
    assert model.get_base_model().config.rope_parameters["factor"] == 2.0


def test_a_max_length_past_the_models_context_is_said_at_start(tiny_model_dir, caplog):
    recipe = parse_recipe(
        {
            "output_dir": "unused",
            "model": {"name_or_path": str(tiny_model_dir)},
            "data": {"train": ["unused.jsonl"], "max_length": 300},
        }
    )
    tok = load_tokenizer(recipe.model)
    with caplog.at_level(logging.WARNING, logger="training.model.rope"):
        build_model(recipe, tok, torch.device("cpu"))
    assert "data.max_length=300 is past llama's context length (max_position_embeddings=256)" in caplog.text
    assert "consider model.rope_scaling" in caplog.text


def test_rope_scaled_model_reloads_in_plain_transformers(tiny_model_dir, tmp_path):
    recipe = parse_recipe(
        {
            "output_dir": "unused",
            "model": {"name_or_path": str(tiny_model_dir), "rope_scaling": {"type": "yarn", "factor": 2.0}},
            "data": {"train": ["unused.jsonl"]},
            "method": {"type": "full"},
        }
    )
    model = build_model(recipe, load_tokenizer(recipe.model), torch.device("cpu")).eval()
    model.save_pretrained(tmp_path / "scaled")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "scaled").eval()
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    ids = torch.randint(0, 100, (1, 300))
    with torch.no_grad():
        assert torch.equal(again(input_ids=ids).logits, model(input_ids=ids).logits)
        assert not torch.allclose(plain(input_ids=ids).logits, model(input_ids=ids).logits)


def test_rope_scaling_is_refused_for_image_text_models_it_would_leave_unscaled(tiny_model_dir):
    with pytest.raises(
        RecipeError, match=r"model.rope_scaling with model.vision: RoPE scaling is applied to text-only"
    ):
        parse_recipe(
            {
                "output_dir": "unused",
                "model": {
                    "name_or_path": str(tiny_model_dir),
                    "vision": {},
                    "rope_scaling": {"type": "linear", "factor": 2.0},
                },
                "data": {"train": ["unused.jsonl"]},
                "method": {"type": "full"},
            }
        )
