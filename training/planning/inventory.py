"""The planner's view of the model: built from its config alone on the meta device (accelerate's
init_empty_weights; no weights, no network), with LoRA adapters added the same way; the parameter, gradient
and optimizer-state sizes counted from those tensors (training.planning.memory turns them into bytes per
device)."""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from accelerate import init_empty_weights
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoModelForSequenceClassification,
)

from training.config import Recipe
from training.config.architectures import has_vision_part
from training.core.dtypes import DTYPES
from training.core.errors import RecipeError
from training.data.tokenizer import load_tokenizer
from training.model.adapters import embedding_parameters, lora_config
from training.model.build import model_config_only
from training.model.optim import muon_split
from training.model.vision import (
    freeze_untrained_parts,
    image_text_lora_targets,
    image_text_parts,
    unquantized_parts,
)
from training.run.sources import pretrained_source

# ----------------------------------------------------------------------------- the model, on the meta device


@dataclass
class ModelInventory:
    """Tensor sizes of the model the recipe trains, counted on the meta device."""

    config: object
    param_numel: int
    param_bytes: int  # as stored: weight dtype, or 4/8-bit packing for QLoRA
    trainable_numel: int
    trainable_bytes: int
    trainable_tensors: int
    trainable_8bit_numel: int  # trainable tensors big enough for 8-bit optimizer state (>= 4096 elements)
    buffer_bytes: int
    largest_layer_numel: int  # one decoder layer: what FSDP/ZeRO-3 gather at a time
    largest_trainable_bytes: int = 0  # the largest trainable tensor (AdamW's per-tensor temporaries on CPU)
    # trainable nn.Linear weights other than the output head: autocast caches its copies of these (leaves that
    # require grad) until the forward's autocast region ends, also under gradient checkpointing
    autocast_cached_numel: int = 0
    lora_ranks: int = 0  # sum of adapter ranks per decoder layer
    lora_inputs: int = 0  # sum of adapted modules' input features per decoder layer
    # the part of the counts above that the model's tensor-parallel plan shards (divided by tp_size)
    tp_param_numel: int = 0
    tp_param_bytes: int = 0
    tp_trainable_numel: int = 0
    tp_trainable_bytes: int = 0
    tp_trainable_8bit_numel: int = 0
    tp_largest_layer_numel: int = 0
    # train.optimizer=muon: the hidden matrices Muon updates (one momentum buffer each; AdamW the rest)
    muon_numel: int = 0
    muon_bytes: int = 0
    muon_tensors: int = 0
    # RL's reward models (reward_model_bytes): whole on every device, whatever the backend shards
    reward_model_bytes: int = 0
    # a distillation teacher computed on the fly (teacher_bytes): sharded like the student by FSDP2/ZeRO-3
    teacher_bytes: int = 0
    # an image-text model's vision encoder config, and whether it trains (its activations are then kept)
    vision: object = None
    tower_trains: bool = False


def tp_inventory(inv: ModelInventory, tp: int) -> ModelInventory:
    """What one tensor-parallel rank holds: the tensors the TP plan shards divided by tp, the rest whole."""
    if tp <= 1:
        return inv

    def split(total: int, sharded: int) -> int:
        return total - sharded + sharded // tp

    return dataclasses.replace(
        inv,
        param_numel=split(inv.param_numel, inv.tp_param_numel),
        param_bytes=split(inv.param_bytes, inv.tp_param_bytes),
        trainable_numel=split(inv.trainable_numel, inv.tp_trainable_numel),
        trainable_bytes=split(inv.trainable_bytes, inv.tp_trainable_bytes),
        trainable_8bit_numel=split(inv.trainable_8bit_numel, inv.tp_trainable_8bit_numel),
        largest_layer_numel=split(inv.largest_layer_numel, inv.tp_largest_layer_numel),
    )


def tp_sharded_parameters(model) -> set[int]:
    """ids of the parameters of the modules the model's transformers tensor-parallel plan names
    (`model.tp_plan`, e.g. "model.layers.*.mlp.up_proj": "colwise"); empty for a model without a plan."""
    plan = getattr(model, "tp_plan", None) or {}
    patterns = [re.compile("^" + re.escape(k).replace(r"\*", r"\d+") + "$") for k in plan]
    ids = set()
    for name, module in model.named_modules():
        if any(p.match(name) for p in patterns):
            ids |= {id(p) for p in module.parameters()}
    return ids


def _bytes_per_quantized(numel: int, rows: int, recipe: Recipe) -> int:
    """bitsandbytes storage for one quantized Linear weight (4-bit blocks of 64, optional double quant; 8-bit rows)."""
    q = recipe.method.quantization
    if q.bits == 8:
        return numel + rows * 4  # int8 weight + fp32 row scales
    blocks = math.ceil(numel / 64)
    absmax = blocks + math.ceil(blocks / 256) * 4 + 256 * 4 + 4 if q.double_quant else blocks * 4
    return math.ceil(numel / 2) + absmax + 256 * 4  # packed nibbles + scales + the 16-value code table


def model_config(recipe: Recipe, tokenizer=None):
    """The recipe's model config; a new or composed model takes its vocabulary from `tokenizer` (the run's,
    else the recipe's, loaded here). RecipeError when a pretrained model's config cannot be read offline."""
    try:
        if tokenizer is None and (recipe.model.from_scratch is not None or recipe.composes_image_text):
            tokenizer = load_tokenizer(recipe.model)
        return model_config_only(recipe, tokenizer)
    except OSError as e:
        raise RecipeError(
            f"model.name_or_path: cannot read the model config of {recipe.model.name_or_path!r} without network "
            f"({str(e).splitlines()[0]}); use a local model directory or a model already in the Hugging Face cache"
        ) from None


def inventory(recipe: Recipe, config=None) -> ModelInventory:
    """Build the recipe's model (and LoRA adapters) on the meta device and count its tensors.

    An image-text model is counted whole (vision encoder and projector included), its frozen parts frozen;
    its activations are the language model's over data.max_length tokens, image tokens included, and a
    trained encoder's (tower_activation_bytes)."""
    config = config if config is not None else model_config(recipe)
    image_text = has_vision_part(config)
    model, tp_sharded = meta_model(recipe, config, image_text)
    counts = parameter_counts(model, Storage.of(model, recipe), tp_sharded)
    largest, ranks, inputs, largest_tp = layer_sizes(model, recipe, tp_sharded, counts["param_numel"])
    hidden = muon_split(model)[0] if recipe.train.optimizer == "muon" else []
    # a VQ image tokenizer (Chameleon's, Emu3's: no vision_config) makes codes, with no gradient through it
    vision = getattr(config, "vision_config", None) if image_text else None
    tower = model.get_encoder("image") if vision is not None else None
    return ModelInventory(
        config=config.get_text_config() if image_text else config,  # Chameleon's is its own text config
        **counts,
        buffer_bytes=sum(b.numel() * b.element_size() for b in model.buffers()),
        largest_layer_numel=largest,
        autocast_cached_numel=autocast_cached_numel(model),
        lora_ranks=ranks,
        lora_inputs=inputs,
        tp_largest_layer_numel=largest_tp,
        muon_numel=sum(p.numel() for p in hidden),
        muon_bytes=sum(p.numel() * p.element_size() for p in hidden),
        muon_tensors=len(hidden),
        reward_model_bytes=reward_model_bytes(recipe),
        teacher_bytes=teacher_bytes(recipe),
        vision=vision,
        tower_trains=tower is not None and any(p.requires_grad for p in tower.parameters()),
    )


def meta_model(recipe: Recipe, config, image_text: bool):
    """(the model training builds, on the meta device in the recipe's dtype, with its LoRA adapters; the ids
    of the parameters its tensor-parallel plan shards, taken before the adapters, which stay whole)."""
    with init_empty_weights(include_buffers=True):
        auto = AutoModelForImageTextToText if image_text else AutoModelForCausalLM
        model = auto.from_config(config, dtype=DTYPES[recipe.model.dtype])
        tp_sharded = tp_sharded_parameters(model)
        if image_text:  # full training freezes what does not train whole, as training does
            freeze_untrained_parts(model, recipe)
        if recipe.method.type in ("lora", "qlora"):
            # imported here, not at the top: importing peft loads bitsandbytes, whose start-up is noisy
            from peft import get_peft_model

            # the adapters training will build (an image-text checkpoint's: on its language model only)
            targets = image_text_lora_targets(model, recipe) if recipe.image_text_checkpoint else None
            model = get_peft_model(model, lora_config(recipe, model, targets))
    return model, tp_sharded


def quantized_weights(model, recipe: Recipe) -> set[int]:
    """ids of the weights QLoRA stores 4/8-bit: transformers quantizes every nn.Linear of the base model
    except the output head, and an image-text checkpoint's tower and projector
    (training.model.vision.unquantized_parts)."""
    if recipe.method.type != "qlora":
        return set()
    kept = unquantized_parts(image_text_parts(model)) if recipe.image_text_checkpoint else []
    return {
        id(mod.weight)
        for name, mod in model.named_modules()
        if not any(k in name for k in kept)
        and isinstance(mod, torch.nn.Linear)
        and "lora_" not in name
        and not name.endswith("lm_head")
    }


@dataclass(frozen=True)
class Storage:
    """How training stores each parameter of the model: QLoRA's quantized weights packed (`quantized`: their
    ids), and with quant_storage uint8 (training.model.adapters.kbit_prepared) the other floating weights
    upcast: prepare_model_for_kbit_training casts them to fp32, except the embedding and head (`embeddings`),
    which keep the compute dtype (method.quantization.embeddings_dtype)."""

    recipe: Recipe
    quantized: set[int]
    embeddings: set[int]
    upcast: bool
    embedding_size: int

    @classmethod
    def of(cls, model, recipe: Recipe) -> Storage:
        q = recipe.method.quantization
        return cls(
            recipe,
            quantized=quantized_weights(model, recipe),
            embeddings={id(p) for p in embedding_parameters(model)},
            upcast=recipe.method.type == "qlora" and q.quant_storage == "uint8",
            embedding_size=DTYPES[recipe.quantization_compute_dtype].itemsize
            if q.embeddings_dtype == "compute"
            else 4,
        )

    def element_size(self, p) -> int:
        """Bytes per element as training holds the parameter (and its gradient)."""
        if self.upcast and p.is_floating_point() and id(p) not in self.quantized:
            return self.embedding_size if id(p) in self.embeddings else 4
        return p.element_size()

    def stored_bytes(self, p) -> int:
        """The parameter's bytes as stored: bitsandbytes' packing for a quantized weight."""
        if id(p) in self.quantized:
            return _bytes_per_quantized(p.numel(), p.shape[0], self.recipe)
        return p.numel() * self.element_size(p)


TP_COUNTED = ("param_numel", "param_bytes", "trainable_numel", "trainable_bytes", "trainable_8bit_numel")


def parameter_counts(model, storage: Storage, tp_sharded: set[int]) -> dict[str, int]:
    """ModelInventory's parameter counts, over unique tensors (tied embeddings count once): all and trainable
    parameters, the trainable ones big enough for 8-bit optimizer state (>= 4096 elements), the largest
    trainable tensor, and the tp_ part of each that the tensor-parallel plan shards (`tp_sharded`)."""
    fields = ("trainable_tensors", "largest_trainable_bytes", *TP_COUNTED, *(f"tp_{k}" for k in TP_COUNTED))
    counts = dict.fromkeys(fields, 0)
    for p in model.parameters():
        one = parameter_count(p, storage)
        for k in TP_COUNTED:
            counts[k] += one.get(k, 0)
            counts[f"tp_{k}"] += one.get(k, 0) if id(p) in tp_sharded else 0
        if p.requires_grad:
            counts["trainable_tensors"] += 1
            counts["largest_trainable_bytes"] = max(counts["largest_trainable_bytes"], one["trainable_bytes"])
    return counts


def parameter_count(p, storage: Storage) -> dict[str, int]:
    """One parameter's share of TP_COUNTED (the trainable_ ones only when it trains)."""
    counts = {"param_numel": p.numel(), "param_bytes": storage.stored_bytes(p)}
    if p.requires_grad:
        counts |= {
            "trainable_numel": p.numel(),
            "trainable_bytes": p.numel() * storage.element_size(p),
            "trainable_8bit_numel": p.numel() if p.numel() >= 4096 else 0,
        }
    return counts


def autocast_cached_numel(model) -> int:
    """Elements of the trainable nn.Linear weights other than the output head (autocast caches its copies)."""
    head = model.get_output_embeddings()
    head_ids = {id(head.weight)} if head is not None else set()
    return sum(
        m.weight.numel()
        for m in model.modules()
        if isinstance(m, torch.nn.Linear) and m.weight.requires_grad and id(m.weight) not in head_ids
    )


def layer_sizes(model, recipe: Recipe, tp_sharded: set[int], total: int) -> tuple[int, int, int, int]:
    """(parameters of the largest decoder layer, LoRA ranks and their inputs in one layer, the largest
    layer's tensor-parallel-sharded parameters)."""
    layers = [m for name, m in model.named_modules() if re.search(r"(layers|\.h)\.\d+$", name)]  # GPT-2: h.N
    largest = max((sum(p.numel() for p in m.parameters()) for m in layers), default=total)
    largest_tp = max(
        (sum(p.numel() for p in m.parameters() if id(p) in tp_sharded) for m in layers), default=0
    )
    ranks = inputs = 0
    if layers and recipe.method.type in ("lora", "qlora"):
        for name, mod in layers[0].named_modules():
            if name.endswith("lora_A") and hasattr(mod, "default"):
                ranks += mod.default.out_features
                inputs += mod.default.in_features
    return largest, ranks, inputs, largest_tp


def meta_param_bytes(auto_class, config, dtype: torch.dtype) -> int:
    """Parameter bytes of `auto_class` built from `config` in `dtype` on the meta device (no memory)."""
    with init_empty_weights(include_buffers=True):
        model = auto_class.from_config(config, dtype=dtype)
    return sum(p.numel() * p.element_size() for p in model.parameters())


def teacher_bytes(recipe: Recipe) -> int:
    """Parameters of a distillation teacher computed on the fly, as loaded (AutoModelForCausalLM in the
    student's dtype), counted on the meta device from its config; 0 with distill.top_k (none is held while
    training) or without distillation."""
    d = recipe.distill
    if d is None or d.top_k is not None:
        return 0
    try:
        config = AutoConfig.from_pretrained(pretrained_source(d.teacher))
        return meta_param_bytes(AutoModelForCausalLM, config, DTYPES[recipe.model.dtype])
    except (OSError, ValueError) as e:
        raise RecipeError(f"distill.teacher: {d.teacher} cannot be read ({str(e).splitlines()[0]})") from None


def reward_model_bytes(recipe: Recipe) -> int:
    """Parameters of the RL recipe's reward models, as loaded (AutoModelForSequenceClassification in the
    checkpoint's dtype), counted on the meta device from each checkpoint's config."""
    total = 0
    for i, spec in enumerate(recipe.rl.rewards if recipe.rl else []):
        if spec.function != "reward_model":
            continue
        path = spec.args.path
        local = Path(path).expanduser()
        try:
            config = AutoConfig.from_pretrained(str(local) if local.exists() else path)
            dtype = config.dtype if isinstance(config.dtype, torch.dtype) else DTYPES.get(config.dtype)
            total += meta_param_bytes(AutoModelForSequenceClassification, config, dtype or torch.float32)
        except (OSError, ValueError) as e:
            raise RecipeError(
                f"rl.rewards[{i}].args.path: reward model {path} cannot be read ({str(e).splitlines()[0]})"
            ) from None
    return total
