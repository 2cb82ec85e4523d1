"""The recipe's model section: where the model comes from (pretrained, a new architecture, an image-text
composition), its dtype, attention and the memory switches for long sequences."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, PositiveFloat, PositiveInt, ValidationInfo, field_validator, model_validator

from training.config.architectures import ARCH_KEYS, MOE_EXAMPLES, MOE_KEYS, config_class
from training.config.fields import ModelSource, PathStr, Section


class Architecture(Section):
    """A new model built from a transformers config (random init) for pretraining from scratch.

    `type` is any transformers causal-LM model type. The size keys are the common ones, given to that
    type's config class under its own names (GPT-2: n_embd, n_layer, n_head, n_inner, n_positions);
    a key the type has not got is refused when set and skipped when left at its default. `extra` passes
    any other setting of the config class; transformers' own config validation checks the whole.
    """

    type: str = Field(
        "llama", description="transformers causal-LM model type: llama, mistral, qwen3, gpt2, mixtral, ..."
    )
    hidden_size: PositiveInt = Field(256, description="Width of the residual stream (GPT-2: n_embd)")
    intermediate_size: PositiveInt = Field(688, description="MLP width (GPT-2: n_inner)")
    num_hidden_layers: PositiveInt = Field(4, description="Decoder layers (GPT-2: n_layer)")
    num_attention_heads: PositiveInt = Field(4, description="Attention heads; must divide hidden_size")
    num_key_value_heads: PositiveInt | None = Field(None, description="Defaults to num_attention_heads")
    max_position_embeddings: PositiveInt = Field(
        2048, description="Longest sequence the model is made for, in tokens (GPT-2: n_positions)"
    )
    rope_theta: PositiveFloat = Field(
        10000.0, description="RoPE base wavelength (larger for longer contexts)"
    )
    tie_word_embeddings: bool = Field(
        True, description="The output head shares the input embedding's weights"
    )
    vocab_size: PositiveInt | None = Field(None, description="Defaults to the tokenizer's vocabulary size")
    num_experts: PositiveInt | None = Field(
        None, description="Mixture-of-Experts types (mixtral, qwen3_moe, olmoe, ...): experts per MoE layer"
    )
    num_experts_per_tok: PositiveInt | None = Field(
        None, description="MoE: experts each token is routed to (top-k); at most num_experts"
    )
    expert_intermediate_size: PositiveInt | None = Field(
        None,
        description="MoE: width of each expert's MLP (qwen3_moe: moe_intermediate_size; mixtral and "
        "olmoe experts are intermediate_size wide)",
    )
    extra: dict[str, Any] = Field(
        default_factory=dict,
        description="Other settings of the type's config class, e.g. {head_dim: 32} or "
        "{norm_topk_prob: true, decoder_sparse_step: 1}",
    )

    # Validators run on given values only (not defaults): the default llama never imports transformers.
    @field_validator("type")
    @classmethod
    def _known_type(cls, v: str) -> str:
        config_class(v)
        return v

    @field_validator(*ARCH_KEYS)
    @classmethod
    def _type_has_key(cls, v, info: ValidationInfo):
        model_type = info.data.get("type")  # absent when `type` itself was refused
        if v is not None and model_type not in (None, "llama"):
            c = config_class(model_type)
            if c.own_name(info.field_name) is None:
                raise ValueError(f"transformers' {c.cls.__name__} ({model_type}) has no such setting")
        return v

    @field_validator(*MOE_KEYS)
    @classmethod
    def _type_has_experts(cls, v, info: ValidationInfo):
        model_type = info.data.get("type")
        if v is not None and model_type is not None:
            c = config_class(model_type)
            if c.moe_name("num_experts") is None:
                raise ValueError(
                    f"transformers' {c.cls.__name__} ({model_type}) is a dense model type; "
                    f"use a Mixture-of-Experts type, e.g. {MOE_EXAMPLES}"
                )
            if c.moe_name(info.field_name) is None:
                raise ValueError(
                    f"transformers' {c.cls.__name__} ({model_type}) has no separate expert width: "
                    f"its experts are intermediate_size wide, set that"
                )
        return v

    @field_validator("extra")
    @classmethod
    def _extra_keys(cls, v: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        model_type = info.data.get("type")
        if model_type is not None:
            c = config_class(model_type)
            for key in v:
                if (problem := c.extra_problem(key)) is not None:
                    raise ValueError(f"{key}: {problem}")
        return v

    @model_validator(mode="after")
    def _heads(self):
        if self.hidden_size % self.num_attention_heads:
            raise ValueError("hidden_size must be divisible by num_attention_heads")
        kv = self.num_key_value_heads or self.num_attention_heads
        if self.num_attention_heads % kv:
            raise ValueError("num_attention_heads must be divisible by num_key_value_heads")
        if self.type != "llama" or self.extra:  # the default llama needs no more than the checks above
            cls = config_class(self.type).cls
            try:
                ids = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)  # the tokenizer's, later
                built = cls(**self.config_kwargs(self.vocab_size or 32000), **ids)
            except Exception as e:  # noqa: BLE001 (transformers' strict-dataclass errors have no common base)
                reason = " ".join(str(e).split())
                raise ValueError(f"transformers' {cls.__name__} refuses these settings: {reason}") from None
            experts, top_k = getattr(built, "num_experts", None), getattr(built, "num_experts_per_tok", None)
            if isinstance(experts, int) and isinstance(top_k, int) and top_k > experts:
                raise ValueError(
                    f"num_experts_per_tok={top_k} routes each token to more experts than num_experts={experts}"
                )
        return self

    def config_kwargs(self, vocab_size: int) -> dict[str, Any]:
        """Keyword arguments for the type's config class, under its own names (token ids not included)."""
        c = config_class(self.type)
        given = dict(self.extra)
        out: dict[str, Any] = {}
        for key in ARCH_KEYS:
            name = c.own_name(key)
            value = {"vocab_size": vocab_size, "num_key_value_heads": self.num_key_value_heads}.get(
                key, getattr(self, key)
            )
            if key == "num_key_value_heads":
                value = value or self.num_attention_heads
            if name is None:  # a default the type has no use for (set ones were refused above)
                continue
            if name == "rope_parameters":
                value = {"rope_type": "default", "rope_theta": value, **given.pop("rope_parameters", {})}
            out[name] = value
        # qwen3, mistral, ... default head_dim to 128 whatever hidden_size is: the sizes given mean
        # hidden_size / num_attention_heads per head unless extra.head_dim says otherwise
        if "head_dim" in c.settings:
            out["head_dim"] = self.hidden_size // self.num_attention_heads
        for key in MOE_KEYS:
            if (value := getattr(self, key)) is not None:
                out[c.moe_name(key)] = value
        return out | given


class TokenizerTraining(Section):
    """Train a byte-level BPE tokenizer (the `tokenizers` library) on the corpus, for pretraining from scratch."""

    vocab_size: PositiveInt = Field(
        8192, ge=300, description="Target vocabulary size (256 bytes + merges + special tokens)"
    )
    min_frequency: PositiveInt = Field(2, description="A merge must occur at least this often")
    files: list[PathStr] | None = Field(
        None, description="Training text (txt/jsonl/json, globs allowed); defaults to data.train"
    )


class VisionSection(Section):
    """An image-text model composed LLaVA-style (transformers' LlavaForConditionalGeneration): a SigLIP
    vision encoder built from these sizes, a two-layer projector, and the language model of
    model.name_or_path (a pretrained causal LM: "bring your own language model") or model.from_scratch.
    Each image becomes (image_size / patch_size)^2 tokens of model.vision.image_token in the text."""

    image_size: PositiveInt = Field(224, description="Images are resized to image_size x image_size pixels")
    patch_size: PositiveInt = Field(16, description="Pixels per side of one patch (one image token)")
    hidden_size: PositiveInt = Field(768, description="Width of the vision encoder")
    intermediate_size: PositiveInt = Field(3072, description="MLP width of the vision encoder")
    num_hidden_layers: PositiveInt = Field(12, description="Layers of the vision encoder")
    num_attention_heads: PositiveInt = Field(12, description="Attention heads of the vision encoder")
    tower: Literal["trained", "frozen"] | None = Field(
        None,
        description="Whether the vision encoder trains: default trained for a composed model (its encoder is "
        "new), frozen for a pretrained image-text checkpoint; the language model trains as method.type says",
    )
    projector: Literal["trained", "frozen"] = Field(
        "trained",
        description="Whether the projector (the layers between the encoder and the language model) trains; "
        "a composed model's is new and must",
    )
    image_token: str = Field(
        "<image>", description="The placeholder of one image in the text (added to the tokenizer)"
    )

    SIZES: ClassVar[tuple[str, ...]] = (
        "image_size",
        "patch_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
    )  # the composed encoder's: a pretrained image-text checkpoint has its own

    @property
    def tokens_per_image(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @model_validator(mode="after")
    def _sizes(self):
        if self.image_size % self.patch_size:
            raise ValueError(
                f"image_size={self.image_size} must be a multiple of patch_size={self.patch_size}"
            )
        if self.hidden_size % self.num_attention_heads:
            raise ValueError("hidden_size must be divisible by num_attention_heads")
        if not self.image_token.strip():
            raise ValueError("image_token must not be blank")
        return self


class RopeScaling(Section):
    """RoPE scaling, to train (and then run) at longer sequences than the model was pretrained for: the rotary
    frequencies of the pretrained model are stretched by `factor`. Written into the model's config, so final/
    and exports carry it."""

    type: Literal["linear", "dynamic", "yarn"] = Field(
        "yarn",
        description="yarn (YaRN: per-frequency interpolation and attention scaling), linear (positions divided "
        "by factor), dynamic (NTK-aware, stretches only past the pretrained length)",
    )
    factor: float = Field(gt=1.0, description="How many times the pretrained context length (e.g. 4.0)")
    original_max_position_embeddings: PositiveInt | None = Field(
        None,
        description="The pretrained context length (default: the model config's max_position_embeddings)",
    )


class ModelSection(Section):
    @property
    def converted_text_model(self) -> bool:
        """name_or_path is the bundled SmolLM2 or a GGUF file: converted to a text-only causal LM."""
        name = self.name_or_path or ""
        return name.startswith("bundled:") or name.endswith(".gguf")

    name_or_path: ModelSource | None = Field(
        None,
        description="Local model directory, hub name, a .gguf file, or 'bundled:smollm2-135m-instruct'",
    )
    tokenizer: ModelSource | None = Field(None, description="Tokenizer source; defaults to name_or_path")
    train_tokenizer: TokenizerTraining | None = Field(
        None, description="Train a new byte-level BPE tokenizer on the corpus (from_scratch only; cached)"
    )
    from_scratch: Architecture | None = Field(None, description="Build a new model from this architecture")
    vision: VisionSection | None = Field(
        None,
        description="Make an image-text model: a vision encoder and projector in front of this language model "
        "(chat data whose messages carry images)",
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="dtype of the weights as loaded (mixed precision is set by `precision`)"
    )
    attn_implementation: Literal["auto", "sdpa", "flash_attention_2", "eager"] = Field(
        "auto",
        description="Attention kernel: auto = flash_attention_2 on CUDA when installed, else sdpa "
        "(eager for a model class without it)",
    )
    gradient_checkpointing: bool = Field(
        False,
        description="Keep only each decoder layer's input in the forward and recompute the layer in the "
        "backward (about 25% slower, activations one layer deep)",
    )
    tiled_mlp: bool | Annotated[int, Field(ge=2)] = Field(
        False,
        description="Run each decoder layer's MLP and norms over sequence tiles, each recomputed in the backward, "
        "so their intermediate activations exist for one tile at a time: true (tiles of about hidden_size tokens) "
        "or a tile count; for long sequences",
    )
    activation_offloading: bool = Field(
        False,
        description="Move the activations saved for the backward (with gradient checkpointing: each layer's "
        "input) to pinned host memory during the forward and back for the backward; GPU only",
    )
    rope_scaling: RopeScaling | None = Field(
        None,
        description="Stretch a pretrained model's RoPE to train at longer sequences than it was made for",
    )
    liger_kernels: bool = Field(
        False, description="Liger's fused Triton kernels (RMSNorm, RoPE, SwiGLU); CUDA + liger-kernel only"
    )
    trust_remote_code: bool = Field(
        False, description="Run the model repository's own Python code (only for models you trust)"
    )
    revision: str | None = Field(
        None, description="Hub branch, tag or commit of name_or_path (default: main)"
    )

    @field_validator("tiled_mlp", mode="before")
    @classmethod
    def _tile_count(cls, v):
        if isinstance(v, int) and not isinstance(v, bool) and v < 2:
            raise ValueError(f"a tile count is at least 2 (got {v}); true tiles by hidden_size, false is off")
        return v

    @model_validator(mode="after")
    def _source(self):
        if (self.name_or_path is None) == (self.from_scratch is None):
            raise ValueError(
                "set exactly one of model.name_or_path (pretrained) or model.from_scratch (new model)"
            )
        if self.rope_scaling is not None and self.from_scratch is not None:
            raise ValueError(
                "model.rope_scaling stretches a pretrained model's positions; a new model (model.from_scratch) "
                "learns its own at data.max_length: set model.from_scratch.max_position_embeddings instead"
            )
        if self.train_tokenizer is not None and (self.tokenizer is not None or self.from_scratch is None):
            raise ValueError("model.train_tokenizer is for model.from_scratch, instead of model.tokenizer")
        if self.from_scratch is not None and self.tokenizer is None and self.train_tokenizer is None:
            raise ValueError(
                "model.from_scratch needs model.tokenizer (an existing tokenizer to reuse) or model.train_tokenizer"
            )
        return self
