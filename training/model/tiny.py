"""Models built tiny from their own transformers config: the config class's defaults (or a checkpoint's
config.json), shrunk generically, so that every check of the support matrix (training.planning.support,
python -m training.support, benchmarks.models) runs in seconds on a CPU.

The common size keys are set small under each family's own names (SHRINK), lists per layer are cut to one
layer of each kind, special tokens are put in the tiny vocabulary; a family whose config needs more says so
in OVERRIDES (or CONFIG_ARGS, for the config class itself), with the reason. An image-text model's
sub-configs are shrunk the same way, its vision encoder to IMAGE x IMAGE pixels in PATCH x PATCH patches
(VISION), its encoder's output to the language model's width; IMAGE_TEXT_OVERRIDES as above.

Rule: configs and models only: no data, no training, no files.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import re

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedConfig
from transformers.integrations.heterogeneity.configuration_utils import _get_explicit_per_layer_overrides

IMAGE, PATCH = 32, 8  # each picture resized to 32 x 32: 4 x 4 patches
# DeepSeek-OCR-2's view: its encoder always gives 12 x 12 learned queries (144 tokens, the released 768 px view's),
# whatever the picture, and its processor counts a view's tokens as its side / patch / 4 (the SAM neck's two
# stride-2 convolutions) squared: a view of 12 x 4 tiny patches (384 px) is the one whose count is the encoder's
DEEPSEEK_OCR2_VIEW = 12 * 4 * PATCH

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
SHRINK[256] += ("unpadded_vocab_size",)  # Inkling2's head: the vocabulary less the checkpoint's padding
# encoder-decoder types listed as causal LMs (their decoder is the causal LM)
SHRINK[2] += ("encoder_layers", "decoder_layers", "num_encoder_layers", "num_decoder_layers")
SHRINK[4] += ("encoder_attention_heads", "decoder_attention_heads")
SHRINK[128] += ("encoder_ffn_dim", "decoder_ffn_dim")
KV_KEYS = ("num_key_value_heads", "n_head_kv", "num_kv_heads", "multi_query_group_num")
TOPK_KEYS = ("num_experts_per_tok", "moe_topk", "top_k")
# per-layer lists (one entry per decoder layer), cut together so that they stay aligned layer by layer
PER_LAYER = ("layer_types", "mlp_layer_types", "block_types", "layers_block_type", "hybrid_override_pattern")
# per-layer lists of layer indices (Mistral Large 4's: the earlier layer whose keys and values each layer reuses)
LAYER_INDEX_LISTS = ("kv_source_layers",)
# head sizes that are 0 where the part is off (GLM-5-Next's NoPE attention: qk_rope_head_dim and head_dim 0)
OFF_WHEN_ZERO = (*SHRINK[8], *SHRINK[16], *SHRINK[32])
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


# the vision encoder's sizes, under its config's names (set where the default config has the attribute)
VISION = (
    (IMAGE, ("image_size",)),
    (PATCH, ("patch_size",)),
    (2, ("depth", "spatial_merge_size", "merge_size")),  # a temporal patch stays the family's (2 or 1 frames)
    (4 * PATCH, ("window_size",)),  # Qwen2.5-VL's windows: 2 x 2 merged patches
)
OUT_WIDTH = ("out_hidden_size", "text_hidden_size", "projection_dim")  # the encoder's output: the LM's width
# Other widths follow a sub-config's width where their default is one (Dots3's adapters in and out, WavTokenizer's
# codebook vectors: the configs refuse any other); any name ending so that no rule above sets.
WIDTH_NAME = re.compile(r"(_dim|_size|_width)$")
# Lists of stage channels whose last stage is a sub-config's width (a SAM neck's downsample_channels, [512, 1024]
# into DeepSeek-OCR's 1024-wide encoder: the config classes leave them at the default): the tiny width, each
# earlier stage half the next ([32, 64])
CHANNELS_NAME = re.compile(r"_channels$")
# Families whose config, tokenizer or processor needs more than the generic shrink (each with why).
IMAGE_TEXT_OVERRIDES: dict[str, dict] = {
    # its encoder is timm's FastViT (fastvit_mci3), built whole by its architecture name: its features are as
    # wide as that network makes them (3072), whatever the config says; the projector maps them to the model's
    "fast_vlm": {"vision_config.hidden_size": 3072},
    # 4 x 4 patches pooled to 2 x 2 image tokens (the default pools 64 x 64 to 16 x 16)
    "gemma3": {"mm_tokens_per_image": 4},
    # its encoder is timm's MobileNetV5 (mobilenetv5_300m_enc), built by architecture name: its features are
    # 2048 wide whatever the config says (the embedder maps them to the model's width), its fusion adapter
    # resizes them to msfa_output_resolution^2 soft tokens (16 x 16 = 256 by default; 4 x 4 here, the
    # processor's 16 per picture), its channels an eighth of the released (300M parameters -> 16M)
    "gemma3n": {
        "vision_config.hidden_size": 2048,
        "vision_config.model_args": {"channel_multiplier": 0.125, "msfa_output_resolution": IMAGE // PATCH},
        "vision_soft_tokens_per_image": (IMAGE // PATCH) ** 2,
    },
    # Qwen2.5-VL's encoder attends whole in the listed blocks, windowed in the others (block 1 of 2)
    "qwen2_5_vl": {"vision_config.fullatt_block_indexes": [1]},
    # Idefics3's connector folds scale_factor^2 patches into one token: 16 patches -> 4 tokens
    "idefics3": {"scale_factor": 2},
    "smolvlm": {"scale_factor": 2},
    # VipLLaVA reads 5 encoder layers by index (-2, -5, -8, -11, 6): the 2 of the tiny encoder's
    "vipllava": {"vision_feature_layers": [-2, -1]},
    "shieldgemma2": {"mm_tokens_per_image": 4},  # Gemma 3's, as above
    # its processor writes 256 tokens per picture whatever it is given (a class constant that its __init__ and
    # its saved config do not carry): the encoder's 64 x 64 patches, which its projector's two stride-2
    # convolutions fold to 16 x 16 tokens; the image processor resizes to this side (tiny_processor.py)
    "got_ocr2": {"vision_config.image_size": 64 * PATCH},
    # its pixel shuffle (ratio 0.5) folds 4 patches of the encoder's width into the adapter's input; the
    # adapter's and the projector's widths are the model's (4096 by default)
    "llama4": {
        "vision_config.intermediate_size": 256,
        "vision_config.projector_input_dim": 64,
        "vision_config.projector_output_dim": 64,
        "vision_config.vision_output_dim": 64,
    },
    # its expert counts default to None (the released config sets them)
    "diffusion_gemma": {
        "text_config.num_experts": 4,
        "text_config.top_k_experts": 2,
        "text_config.moe_intermediate_size": 16,
        "text_config.per_layer_config": {"01": {"head_dim": 32}},  # as gemma4_text's
    },
    # its full-attention layers' own head size, keyed by layer index (layer 1 once shrunk), as gemma4_text's
    "gemma4_unified": {
        "text_config.per_layer_config": {"01": {"head_dim": 32}},
        "text_config.num_kv_shared_layers": 0,
    },
    # its encoder's MLP width is hidden_size * mlp_ratio, recomputed when the config loads: 64 * 2 = 128
    # and its language model builds a sliding-window mask on every forward, which needs the window (the
    # default is None; the released config sets one)
    "step3p7": {"vision_config.mlp_ratio": 2.0, "text_config.sliding_window": 64},
    # its rotary sections default to [16, 24, 24] in the model (for heads of 128) where the config names none:
    # the tiny head's 8 rotary pairs split so (as mrope_sections does for the kin that name them)
    "paddleocr_vl": {
        "text_config.rope_parameters": {
            "rope_type": "default",
            "rope_theta": 500000.0,
            "mrope_section": [4, 2, 2],
        }
    },
    # its sections are height, width, time, the first two interleaved (so equal): the tiny head's 8 rotary pairs
    "ernie4_5_vl_moe": {
        "text_config.rope_parameters": {
            "rope_type": "default",
            "rope_theta": 500000.0,
            "mrope_section": [3, 3, 2],
        }
    },
    # its high-resolution (SAM) encoder's first global-attention layer gives the features it reads: of 2 layers
    "deepseek_vl_hybrid": {"high_res_vision_config.global_attn_indexes": [1]},
    # its encoder's output is its last layer and the listed intermediate ones (5 of 32) side by side: 1 of 2
    "mllama": {
        "vision_config.intermediate_layers_indices": [1],
        "vision_config.vision_output_dim": 2 * 64,
        "vision_config.num_global_layers": 2,
    },
    # Aria's processor makes pictures of 980 pixels (its call's default; its image processor takes 490 or 980
    # only): 70-pixel patches (14 x 14), which its projector's queries (keyed by the patch count) make 4 tokens
    "aria": {
        "vision_config.image_size": 980,
        "vision_config.patch_size": 70,
        "projector_patch_to_query_dict": {196: 4},
        "max_value_projector_patch_to_query_dict": 4,
    },
    # its pictures are codes of a VQ tokenizer (IBQ), each code the vocabulary id offset + code, the audio codes
    # after them (the config checks that both ranges fit the vocabulary): 32 codes each, at the end of the tiny
    # vocabulary; the tokenizer downsamples 8 times (3 stages, 32 px -> 4 x 4 codes), attention at the last
    "apertus1p5": {
        "vision_config.codebook_size": 32,
        "vision_config.base_channels": 32,
        "vision_config.latent_channels": 64,
        "vision_config.channel_multiplier": [1, 1, 2, 2],
        "vision_config.num_res_blocks": 1,
        "vision_config.resolution": IMAGE,
        "vision_config.attn_resolutions": [IMAGE // 8],
        "audio_config.codebook_size": 32,
        "image_token_offset": 192,
        "audio_token_offset": 224,
    },
    # VQ image tokenizers (the codes' tokens: tiny_processor's VQ_CODES): 32 codes; 3 downsamplings (32 px -> 4 x 4
    # codes; Chameleon's 4 made 32 x 32 of 512 px), channels in groups of 32 (its GroupNorm's)
    "chameleon": {
        "vq_config.num_embeddings": 32,
        "vq_config.base_channels": 32,
        "vq_config.latent_channels": 64,
        "vq_config.channel_multiplier": [1, 1, 2, 2],
        "vq_config.num_res_blocks": 1,
        "vq_config.resolution": IMAGE,
    },
    "emu3": {  # its attention's width is the last stage's channels (32 x 4)
        "vq_config.codebook_size": 32,
        "vq_config.base_channels": 32,
        "vq_config.num_res_blocks": 1,
        "vq_config.hidden_size": 128,
    },
    # its position table, one row per patch, is sized from the default picture when the config is made (27 x 27)
    "molmo2": {"vision_config.num_position_embeddings": (IMAGE // PATCH) ** 2},
    # its per-layer MLP kinds default to None (the released config: a dense first layer, then MoE)
    # and its SAM neck's last channels are the encoder's width (default [512, 896], the released 896-wide Qwen2
    # encoder's, where the encoder config's default is 4096 wide: the generic CHANNELS_NAME rule cannot see it)
    # and its SAM encoder sees a view of DEEPSEEK_OCR2_VIEW pixels (its position table is sized for it)
    "deepseek_ocr2": {
        "text_config.mlp_layer_types": ["dense", "sparse"],
        "vision_config.sam_config.downsample_channels": [32, 64],
        "vision_config.sam_config.image_size": DEEPSEEK_OCR2_VIEW,
    },
    # its projectors' layout defaults to None (released: 4 vision layers into LM layers 9, 6, 3, 0 and the last
    # one's 4 spatial offset groups into 12, 15, 18, 21, windows of 8 patches queried by 4): one vision layer into
    # LM layer 0, the 4 groups into layers 1-4 (5 layers, so that every projector feeds one), 2-patch windows
    "granite4_vision": {
        "downsample_rate": "1/2",
        "deepstack_layer_map": [[-1, 0]],
        "spatial_target_layers": [1, 2, 3, 4],
        "text_config.num_hidden_layers": 5,
    },
    # its encoder is timm's Perception Encoder, built by architecture name from model_args (None by default;
    # released: vit_pe_core_large_patch14_336 at 448 px), its projector pooling 2 x 2 patches into one token
    "perception_lm": {
        "vision_config.architecture": "vit_pe_core_tiny_patch16_384",
        "vision_config.model_args": {
            "embed_dim": 64,
            "depth": 2,
            "num_heads": 4,
            "img_size": [IMAGE, IMAGE],
            "patch_size": PATCH,
            "ref_feat_shape": [IMAGE // PATCH, IMAGE // PATCH],
            "global_pool": "",
        },
        "projector_pooling_ratio": 2,
    },
}


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


def tiny_config(model_type: str, config: PreTrainedConfig | None = None):
    """The type's config class with its defaults, or a checkpoint's `config` (copied), shrunk (see the module
    doc), its sub-configs too (the text and vision configs of a composite model)."""
    if config is None:
        cfg = AutoConfig.for_model(model_type, **CONFIG_ARGS.get(model_type, {}))
    else:
        cfg = checkpoint_config(config)
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
    tiny vocabulary; a heterogeneous config's per-layer overrides too, on the layers kept."""
    overrides = layer_overrides(cfg)
    layers, heads = get(cfg, "num_hidden_layers"), get(cfg, "num_attention_heads")
    mha = [k for k in KV_KEYS if isinstance(heads, int) and get(cfg, k) == heads]  # Dots3's text: MHA only
    for value, names in SHRINK.items():
        for name in names:
            if get(cfg, name) == 0 and name in OFF_WHEN_ZERO:
                continue
            if isinstance(get(cfg, name), int) or (name == "head_dim" and name in cfg.to_dict()):
                put(cfg, name, value)  # head_dim too where it defaults to None (hidden / heads)
    for name in (*KV_KEYS, *TOPK_KEYS):  # set where the default is None too (None: as many as the heads)
        if isinstance(v := get(cfg, name), int) or (v is None and name in cfg.to_dict()):
            put(cfg, name, cfg.num_attention_heads if name in mha else 2)
    rope, nope = get(cfg, "qk_rope_head_dim"), get(cfg, "qk_nope_head_dim")
    if isinstance(rope, int) and isinstance(nope, int):  # sizes a latent-attention config derives
        put(cfg, "qk_head_dim", nope + rope)
        put(cfg, "head_dim", cfg.qk_rope_head_dim)
        put(cfg, "num_key_value_heads", cfg.num_attention_heads)  # keys come whole from the latent
    shrink_mamba(cfg)
    keep = cut_layers(cfg, layers)
    if overrides:
        kept = {new: shrink_overrides(overrides[old]) for new, old in enumerate(keep) if old in overrides}
        put(cfg, "per_layer_config", kept)
    for name, value in {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}.items():
        if hasattr(cfg, name):
            put(cfg, name, value)


def layer_overrides(cfg) -> dict[int, dict]:
    """A heterogeneous config's per-layer overrides (Dots3's sliding-window layers: heads and latent sizes of
    their own), taken off the config so that its global values can be read and shrunk; {} for most configs."""
    if not get(cfg, "is_heterogeneous"):
        return {}
    spec = cfg._heterogeneity_spec  # each overridden layer with all its per-layer values (set or global), so
    explicit = _get_explicit_per_layer_overrides(cfg)  # that they shrink together (SWA head = nope + rope)
    overrides = {i: explicit[i] for i in spec.per_layer_overrides}
    put(cfg, "per_layer_config", None)
    return overrides


def shrink_overrides(values: dict) -> dict:
    """One layer's overrides shrunk by SHRINK's keys (MHA heads stay MHA, as in shrink)."""
    sizes = {name: value for value, names in SHRINK.items() for name in names}
    out = dict(values)
    for name, v in values.items():
        if name in sizes and isinstance(v, int) and not (v == 0 and name in OFF_WHEN_ZERO):
            out[name] = sizes[name]
        elif name in KV_KEYS and isinstance(v, int):
            out[name] = sizes["num_attention_heads"] if v == values.get("num_attention_heads") else 2
    return out


def cut_layers(cfg, layers=None) -> list[int]:
    """One layer of each kind (a hybrid keeps its attention and its other layers): the layers where a kind first
    shows in any per-layer list, at least two, every list cut to those layers (transformers checks on saving
    that each has num_hidden_layers entries; cut one by one, layer_types and mlp_layer_types disagreed).
    Per-layer lists are PER_LAYER's and any list of `layers` (the config's layer count before the shrink)
    entries (Mistral Large 4's indexer kinds, rope flags, KV sources; Muse Spark's audio stages); kinds come
    from lists of names or 0/1 flags, and a list of layer indices is renumbered among the kept layers."""
    per_layer = {name: get(cfg, name) for name in PER_LAYER}
    if isinstance(layers, int) and layers > 2:
        per_layer |= {
            k: get(cfg, k) for k, v in cfg.to_dict().items() if isinstance(v, list) and len(v) == layers
        }
    lists = {k: v for k, v in per_layer.items() if isinstance(v, list | tuple | str) and len(v) > 2}
    if not lists:
        return list(range(get(cfg, "num_hidden_layers") or 0))
    kinds = [
        v
        for k, v in lists.items()
        if k not in LAYER_INDEX_LISTS and all(x in (0, 1) or isinstance(x, str) for x in v)
    ]
    keep = sorted({v.index(kind) for v in kinds for kind in dict.fromkeys(v)})
    keep += [i for i in range(3) if i not in keep][: max(0, 2 - len(keep))]
    keep.sort()
    for name, v in lists.items():
        cut = [v[i] for i in keep if i < len(v)]
        if name in LAYER_INDEX_LISTS:  # a layer whose source is cut owns its keys and values
            cut = [keep.index(s) if s in keep else n for n, s in enumerate(cut)]
        put(cfg, name, "".join(cut) if isinstance(v, str) else type(v)(cut))
    if isinstance(get(cfg, "num_hidden_layers"), int):
        put(cfg, "num_hidden_layers", len(keep))
    return keep


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


def checkpoint_config(config: PreTrainedConfig) -> PreTrainedConfig:
    """A copy of a checkpoint's config to shrink: without its quantization (a tiny model is built plain)."""
    cfg = copy.deepcopy(config)
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    return cfg


def build(cfg: PreTrainedConfig):
    """The tiny causal LM of a shrunk config, fp32, seeded, with SDPA attention where its class has it (as the
    trainer picks on CPU), else eager; the config is copied (building sets attributes on it)."""
    for attn in ("sdpa", "eager"):
        torch.manual_seed(0)
        try:
            return AutoModelForCausalLM.from_config(copy.deepcopy(cfg), attn_implementation=attn).float()
        except ValueError:
            if attn == "eager":
                raise
    raise AssertionError("unreachable")


def sub_configs(cfg) -> list:
    """cfg and every config inside it (text, vision, and deeper: an encoder's own sub-configs)."""
    out = [cfg]
    for value in vars(cfg).values():
        if isinstance(value, PreTrainedConfig):
            out += sub_configs(value)
    return out


def tiny_image_text_config(model_type: str, config: PreTrainedConfig | None = None):
    """The type's config, shrunk: every sub-config as the text matrix shrinks, the encoder's sizes (VISION)
    and its output to the language model's width, then OVERRIDES (a dotted name sets a sub-config's)."""
    args = {"text_config": CONFIG_ARGS[f"{model_type}_text"]} if f"{model_type}_text" in CONFIG_ARGS else {}
    cfg = (
        AutoConfig.for_model(model_type, **args) if config is None else checkpoint_config(config)
    )  # Gemma 3n
    vision = getattr(type(cfg), "sub_configs", {}).get("vision_config")
    if config is None and vision is not None and get(cfg, "vision_config") is None:  # Gemma 4's default: none
        put(cfg, "vision_config", vision())
    width = next(v for v, names in SHRINK.items() if "hidden_size" in names)
    follow = width_followers(cfg)
    for sub in sub_configs(cfg):
        shrink(sub)
        for value, names in VISION:
            for name in names:
                if isinstance(get(sub, name), int):
                    put(sub, name, value)
                elif (
                    isinstance(get(sub, name), list | tuple) and len(get(sub, name)) == 2
                ):  # InternVL's (h, w)
                    put(sub, name, [value, value])
    for sub in sub_configs(cfg):
        for name, factor in follow[id(sub)].items():
            if isinstance(value := get(sub, name), int):
                put(sub, name, width * factor)
            # stage channels (CHANNELS_NAME): halving back from the width
            elif isinstance(value, list | tuple):
                put(sub, name, type(value)(width * factor >> (len(value) - 1 - i) for i in range(len(value))))
    if isinstance(get(cfg, "image_grid_pinpoints"), list):  # LLaVA-NeXT's tiles: one, the picture's size
        put(cfg, "image_grid_pinpoints", [[IMAGE, IMAGE]])
    for sub in sub_configs(cfg):
        mrope_sections(sub)
    feature_layers(cfg)
    apply_overrides(cfg, model_type, IMAGE_TEXT_OVERRIDES)
    cfg.use_cache = False
    return rederived(cfg)


def rederived(cfg):
    """The shrunk config made again from its dict, as a load of the saved checkpoint makes it: sizes its class
    derives when made (RADIO's patch_dim from patch_size) are then those of the shrunk sizes, so that the
    model built and the model reloaded agree (Nemotron-H Omni's patch projection was built for 16-pixel
    patches and reloaded for 8)."""
    return type(cfg).from_dict(cfg.to_dict())


def width_followers(cfg) -> dict[int, dict[str, int]]:
    """Per sub-config (by id), its widths to set after the shrink, as multiples of the tiny width: the encoder's
    output (OUT_WIDTH), merge_size^2 times it where its default is the encoder's width that many times (Muse
    Spark's 2 x 2 patches folded into channels, 6144 = 1536 x 4; not where that is the language model's width
    as well: then it is the LM's); and size keys that no shrink rule sets whose
    default is the width (hidden_size) of any of the model's sub-configs (WIDTH_NAME), and lists of stage
    channels that end at one (CHANNELS_NAME)."""
    widths = {w for sub in sub_configs(cfg) if isinstance(w := get(sub, "hidden_size"), int) and w > 64}
    ruled = {*(n for names in SHRINK.values() for n in names), *(n for _, names in VISION for n in names)}
    ruled |= {*OUT_WIDTH, *KV_KEYS}
    vision = get(cfg, "vision_config")
    merge = get(vision, "merge_size") or get(vision, "spatial_merge_size")
    merged = get(vision, "hidden_size") * merge**2 if isinstance(merge, int) and merge > 1 else None
    # not where that is the language model's width too (HunYuan-V4-VL's: 1536 x 4 is its LM's 6144)
    if merged == get(get(cfg, "text_config"), "hidden_size"):
        merged = None
    tiny_merge = next(v for v, names in VISION if "merge_size" in names)
    follow = {}
    for sub in sub_configs(cfg):
        out = {k: tiny_merge**2 if get(sub, k) == merged else 1 for k in OUT_WIDTH}
        follow[id(sub)] = out | {
            k: 1
            for k, v in vars(sub).items()
            if type(v) is int and v in widths and WIDTH_NAME.search(k) and k not in ruled
        }
        follow[id(sub)] |= {k: 1 for k, v in vars(sub).items() if ends_at_width(k, v, widths)}
    return follow


def ends_at_width(name: str, value, widths: set[int]) -> bool:
    """A list of stage channels (CHANNELS_NAME) whose last stage is one of `widths`."""
    if not isinstance(value, list | tuple) or len(value) < 2 or not CHANNELS_NAME.search(name):
        return False
    return all(type(v) is int for v in value) and value[-1] in widths


def feature_layers(cfg) -> None:
    """The encoder layers whose outputs a projector reads (vision_feature_layer, Molmo2's adapter's [24, 18]),
    clamped into the tiny encoder's layers (its deepest, its first) where they index past them."""
    layers = get(get(cfg, "vision_config"), "num_hidden_layers")
    if not isinstance(layers, int):
        return
    clamp = lambda i: max(-layers, min(layers - 1, i))  # noqa: E731
    for sub in sub_configs(cfg):
        for name, v in vars(sub).items():
            if not name.endswith(("feature_layer", "feature_layers")):
                continue
            if isinstance(v, int) and not isinstance(v, bool):
                put(sub, name, clamp(v))
            elif isinstance(v, list | tuple) and all(isinstance(i, int) for i in v):
                put(sub, name, type(v)(clamp(i) for i in v))


def mrope_sections(cfg) -> None:
    """A multimodal-rope config (Qwen2-VL's kin: rope_parameters' mrope_section splits each head's rotary
    half among time, height and width) gets sections that fit the shrunk head: the models' defaults
    ([16, 24, 24], ...) are for heads of 128."""
    rope = get(cfg, "rope_parameters")
    if "mrope_section" not in getattr(type(cfg), "ignore_keys_at_rope_validation", ()) or not isinstance(
        rope, dict
    ):
        return
    heads = get(cfg, "num_attention_heads")
    head = get(cfg, "head_dim") or (get(cfg, "hidden_size") // heads if heads else None)
    if not isinstance(head, int):
        return
    half = int(head * rope.get("partial_rotary_factor", 1.0)) // 2
    rope["mrope_section"] = [half - 2 * (half // 3), half // 3, half // 3]
