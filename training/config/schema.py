"""The recipe: one YAML file, validated into a typed object that the rest of the code receives.

Unknown keys are rejected, incompatible options are rejected with a reason, and any key can be
overridden from the command line with `dotted.key=value` (the value is parsed as YAML). A command-line
key wins over the file's key it excludes (`train.max_steps` over `train.epochs`, and the reverse).

Every field that names a file or directory says so in its type (`PathStr`, or `Annotated[str,
FilePath(...)]`); `recipe_paths` finds them by walking the schema, so the app confines each one to its
workspace without a hand-kept list.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PositiveFloat,
    PositiveInt,
    PrivateAttr,
    ValidationInfo,
    field_validator,
    model_validator,
)

from training.config.architectures import ARCH_KEYS, MOE_EXAMPLES, MOE_KEYS, config_class

log = logging.getLogger("training.config")


@dataclass(frozen=True)
class FilePath:
    """Type marker: this str (or each str of this list) names a file or directory.

    `keywords` are whole values, and `prefixes` beginnings of values, that name something else
    (`resume: auto`, `bundled:NAME`); a hub name such as "org/model" is treated as a path.
    """

    keywords: tuple[str, ...] = ()
    prefixes: tuple[str, ...] = ()

    def names_path(self, value: str) -> bool:
        return bool(value.strip()) and value not in self.keywords and not value.startswith(self.prefixes)


PathStr = Annotated[str, FilePath()]
ModelSource = Annotated[str, FilePath(prefixes=("bundled:",))]


@dataclass(frozen=True)
class ImageTokens:
    """What the data pipeline needs of an image-text model (set on DataSection by the recipe, from
    model.vision or from a pretrained image-text checkpoint's processor).

    token: the placeholder of one image in the records' text (model.vision.image_token).
    A composed model (model.vision's sizes): each image becomes `per_image` copies of `token`, its pixels
    resized to image_size x image_size by the SigLIP processor.
    A pretrained checkpoint: `processor` is its source (AutoProcessor), which decides how many tokens each
    image becomes and makes its pixels; `rendered` is what the checkpoint's chat template writes for an
    image part (e.g. <|vision_start|><|image_pad|><|vision_end|>), which stands in the text for each image,
    and `model_token` the one token of it the processor expands (<|image_pad|>)."""

    token: str
    per_image: int = 0
    image_size: int = 0
    processor: str | None = None
    revision: str | None = None  # of the processor's checkpoint
    trust_remote_code: bool = False
    rendered: str = ""
    model_token: str = ""

    @property
    def in_text(self) -> str:
        """What stands in a normalised record's text for each image."""
        return self.rendered or self.token

    @property
    def expanded(self) -> str:
        """The token that the model fills with image features (the one counted and expanded)."""
        return self.model_token or self.token


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


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
    hidden_size: PositiveInt = 256
    intermediate_size: PositiveInt = Field(688, description="MLP width (GPT-2: n_inner)")
    num_hidden_layers: PositiveInt = 4
    num_attention_heads: PositiveInt = 4
    num_key_value_heads: PositiveInt | None = Field(None, description="Defaults to num_attention_heads")
    max_position_embeddings: PositiveInt = 2048
    rope_theta: PositiveFloat = 10000.0
    tie_word_embeddings: bool = True
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
    attn_implementation: Literal["auto", "sdpa", "flash_attention_2", "eager"] = "auto"
    gradient_checkpointing: bool = False
    liger_kernels: bool = Field(
        False, description="Liger's fused Triton kernels (RMSNorm, RoPE, SwiGLU); CUDA + liger-kernel only"
    )
    trust_remote_code: bool = False
    revision: str | None = None

    @model_validator(mode="after")
    def _source(self):
        if (self.name_or_path is None) == (self.from_scratch is None):
            raise ValueError(
                "set exactly one of model.name_or_path (pretrained) or model.from_scratch (new model)"
            )
        if self.train_tokenizer is not None and (self.tokenizer is not None or self.from_scratch is None):
            raise ValueError("model.train_tokenizer is for model.from_scratch, instead of model.tokenizer")
        if self.from_scratch is not None and self.tokenizer is None and self.train_tokenizer is None:
            raise ValueError(
                "model.from_scratch needs model.tokenizer (an existing tokenizer to reuse) or model.train_tokenizer"
            )
        return self


DATA_FIELDS = (
    "text",
    "instruction",
    "input",
    "output",
    "messages",
    "conversations",
    "role",
    "content",
    "from",
    "value",
    "system",
    "prompt",  # prompt-completion (chat format) and preference records
    "completion",
    "chosen",
    "rejected",
    "label",
    "tools",  # chat/sharegpt records: the tool definitions
)
CHAT_TEMPLATE_ARGS = ("conversation", "messages", "tools", "documents", "add_generation_prompt", "tokenize")


class DataSource(Section):
    """One source of a weighted mixture: data.train: [{path: a/*.jsonl, weight: 0.7}, {path: b.txt, weight: 0.3}]."""

    path: list[PathStr] = Field(description="Data files of this source (globs allowed) or a hub dataset name")
    weight: PositiveFloat = Field(1.0, description="Share of the training tokens drawn from this source")
    name: str | None = Field(
        None, description="Name in metrics.jsonl (data_tokens/NAME); default: the file stem"
    )

    @field_validator("path", mode="before")
    @classmethod
    def _one_path(cls, v):
        return [v] if isinstance(v, str) else v


class DataSection(Section):
    train: list[PathStr] | list[DataSource] = Field(
        description="Data files (jsonl/json/csv/parquet/txt, globs allowed) or a hub dataset name; or a "
        "weighted mixture of sources [{path: ..., weight: 0.7}, ...]"
    )
    eval: list[PathStr] | dict[str, list[PathStr]] | None = Field(
        None,
        description="Held-out files; or named held-out sets {web: web_eval.jsonl, code: code/*.jsonl}, each "
        "evaluated on its own (eval_loss/NAME; eval_loss covers them all); if unset, eval_fraction of train "
        "is held out",
    )
    eval_fraction: float = Field(0.0, ge=0.0, lt=1.0)
    format: Literal["text", "instruction", "chat", "sharegpt", "pairwise", "unpaired", "prompts"] = Field(
        "chat",
        description="text: raw text; instruction: alpaca instruction/input/output; chat: messages lists "
        "(role/content) or prompt/completion records; sharegpt: conversations lists (from/value); "
        "pairwise: prompt/chosen/rejected (preference tuning); unpaired: prompt/completion/label (KTO); "
        "prompts: prompt (+ any columns the rewards read) for online RL",
    )
    columns: dict[str, str] = Field(
        default_factory=dict,
        description="Column mapping, standard name -> name in your data, e.g. {messages: dialog, role: speaker}",
    )
    max_length: PositiveInt = 512
    too_long: Literal["truncate", "drop"] = Field(
        "truncate",
        description="Examples longer than max_length: cut at max_length, or leave out (counts are logged)",
    )
    packing: bool = Field(
        False,
        description="Pack several examples into each max_length sequence (position ids restart, no attention "
        "across examples); instruction/chat/sharegpt formats",
    )
    system_prompt: str | None = Field(None, description="System message added to instruction-format examples")
    chat_template: PathStr | None = Field(
        None,
        description="A Jinja chat template file that replaces the tokenizer's (e.g. one that renders tools, "
        "or a prefix-preserving training template); the trained model's tokenizer is saved with it",
    )
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="Keyword arguments passed to the chat template on every render, "
        "e.g. {enable_thinking: false}",
    )
    train_on: Literal["all", "last", "marked"] = Field(
        "all",
        description="Assistant turns that carry the loss: all, only the last, or only those marked "
        '"train": true; a message\'s own "train": true/false wins over this in every mode',
    )
    reasoning: Literal["train", "mask"] = Field(
        "train",
        description="Reasoning traces (reasoning_content, or <think>...</think> opening the content): learn "
        "them, or mask their tokens (and tags) out of the labels while the rest of the answer keeps its labels",
    )
    max_examples: PositiveInt | None = Field(None, description="Use only the first N training examples")
    cache: bool = Field(
        True, description="Cache the tokenized (and packed) data on disk; a second launch reuses it"
    )
    cache_dir: PathStr | None = Field(
        None, description="Where the data cache lives; defaults to ~/.cache/llm-forge/data"
    )
    num_proc: PositiveInt | None = Field(
        None, description="Processes that tokenize and pack; default: every core available"
    )
    streaming: bool = Field(
        False,
        description="Read, tokenize and pack the training data on the fly (never the whole corpus in memory "
        "or on disk); resumes at the exact token; needs train.max_steps",
    )
    stream_window: PositiveInt = Field(
        10000,
        description="Streaming: records read, tokenized, packed and shuffled together (a multiple of 1000 "
        "for format text); larger windows shuffle better and hold more in memory and in checkpoints",
    )

    # set by Recipe (model.vision or an image-text checkpoint)
    _images: ImageTokens | None = PrivateAttr(None)

    @property
    def images(self) -> ImageTokens | None:
        """The image tokens of an image-text run (model.vision), None for a text-only run."""
        return self._images

    @model_validator(mode="before")
    @classmethod
    def _listify(cls, v: Any):
        if isinstance(v, dict):
            for k in ("train", "eval"):
                if isinstance(v.get(k), str):
                    v = {**v, k: [v[k]]}
            if isinstance(v.get("eval"), dict):
                for name in v["eval"]:
                    if not re.fullmatch(r"[A-Za-z0-9_.-]+", str(name)):
                        raise ValueError(
                            f"eval.{name}: a held-out set's name is letters, digits, '_', '-' or '.' "
                            "(it names metrics eval_loss/NAME)"
                        )
                v = {**v, "eval": {n: [p] if isinstance(p, str) else p for n, p in v["eval"].items()}}
            train = v.get("train")
            if isinstance(train, list) and any(isinstance(x, dict) for x in train):
                for i, src in enumerate(train):
                    if not isinstance(src, dict):
                        raise ValueError(
                            f"train[{i}]: a mixture lists sources as {{path: ..., weight: ...}}; got {src!r}"
                        )
                    w = src.get("weight", 1.0)
                    if not isinstance(w, int | float) or isinstance(w, bool) or not w > 0:
                        raise ValueError(f"train[{i}].weight must be a positive number (got {w!r})")
        return v

    @property
    def sources(self) -> list[DataSource]:
        """The training sources: the mixture's, or one source (weight 1, named 'train') for a plain list."""
        if self.train and isinstance(self.train[0], DataSource):
            return list(self.train)
        return [DataSource(path=list(self.train), name="train")]

    @property
    def is_mixture(self) -> bool:
        return bool(self.train) and isinstance(self.train[0], DataSource)

    @property
    def eval_sets(self) -> dict[str, list[str]]:
        """The held-out sets by name: {} without data.eval, {"eval": files} for a plain list."""
        if isinstance(self.eval, dict):
            return dict(self.eval)
        return {"eval": list(self.eval)} if self.eval else {}

    @property
    def eval_files(self) -> list[str]:
        """Every held-out path (of every named set)."""
        return [p for paths in self.eval_sets.values() for p in paths]

    @property
    def train_files(self) -> list[str]:
        """Every training path (of every source)."""
        return [p for s in self.sources for p in s.path]

    @model_validator(mode="after")
    def _options(self):
        unknown = sorted(set(self.columns) - set(DATA_FIELDS))
        if unknown:
            raise ValueError(
                f"columns: unknown standard name(s) {', '.join(unknown)} (use {', '.join(DATA_FIELDS)})"
            )
        chat_keys = {
            "chat_template": self.chat_template is not None,
            "chat_template_kwargs": bool(self.chat_template_kwargs),
            "train_on": self.train_on != "all",
            "reasoning": self.reasoning != "train",
        }
        for k, is_set in chat_keys.items():
            if is_set and self.format == "text":
                raise ValueError(f"{k}: applies to data rendered with a chat template, not format=text")
        for k in ("train_on", "reasoning"):
            if chat_keys[k] and self.format in ("pairwise", "unpaired"):
                raise ValueError(
                    f"{k}: applies to instruction/chat/sharegpt data; preference pairs learn their "
                    "completions"
                )
        if self.train_on == "marked" and self.format == "instruction":
            raise ValueError(
                'train_on: marked trains only messages marked "train": true, and format=instruction has a '
                "single answer with no marks; use all"
            )
        reserved = sorted(set(self.chat_template_kwargs) & set(CHAT_TEMPLATE_ARGS))
        if reserved:
            raise ValueError(
                f"chat_template_kwargs: {', '.join(reserved)} is set by the data pipeline itself "
                f"(a record's messages and tools), not here"
            )
        if self.packing and self.format == "text":
            raise ValueError(
                "packing applies to instruction/chat/sharegpt data; format=text is always cut into full blocks"
            )
        if self.is_mixture:
            names = set()
            for i, src in enumerate(self.sources):
                if src.name is None:
                    src.name = Path(src.path[0]).stem.replace("*", "") or f"source{i}"
                if src.name in names:
                    src.name = f"{src.name}{i}"
                names.add(src.name)
        if (self.streaming or self.is_mixture) and self.eval_fraction > 0:
            what = "streaming" if self.streaming else "a mixture"
            raise ValueError(f"eval_fraction: with {what} hold-out data comes from data.eval; set data.eval")
        if (self.streaming or self.is_mixture) and self.max_examples:
            raise ValueError(
                "max_examples: only for a single pre-tokenized source (not streaming or mixtures)"
            )
        if self.streaming and self.format == "text" and self.stream_window % 1000:
            raise ValueError(
                f"stream_window: for format text a multiple of 1000 (documents are cut into blocks 1000 "
                f"at a time, as in pre-tokenized runs); got {self.stream_window}"
            )
        return self


class Lora(Section):
    """LoRA adapters (peft) on a frozen base model."""

    r: PositiveInt = Field(16, description="Rank of the low-rank update")
    alpha: PositiveFloat = Field(
        32, description="The update is scaled by alpha/r (alpha/sqrt(r) with use_rslora)"
    )
    dropout: float = Field(0.05, ge=0.0, lt=1.0, description="Dropout on the adapter input")
    target_modules: str | list[str] = Field(
        "all-linear",
        description="'all-linear' (every linear layer but the output head) or a list of module names",
    )
    target_parameters: list[str] | None = Field(
        None,
        description="Parameters (not modules) to adapt, e.g. the fused 3-D expert weights of a Mixture-of-Experts "
        "model: [mlp.experts.gate_up_proj, mlp.experts.down_proj] (peft target_parameters)",
    )
    use_rslora: bool = Field(
        False, description="Rank-stabilised LoRA: scale by alpha/sqrt(r), for large ranks"
    )
    use_dora: bool = Field(False, description="DoRA: learn a magnitude vector besides the low-rank direction")
    modules_to_save: list[str] | None = Field(
        None,
        description="Modules trained in full and saved with the adapter, e.g. [embed_tokens, lm_head] after adding tokens",
    )
    init_from: PathStr | None = Field(
        None,
        description="Continue training an existing adapter: a directory with adapter_config.json (e.g. a run's final/) "
        "or a run directory; its rank, alpha and targets replace the ones above",
    )

    @model_validator(mode="after")
    def _targets(self):
        if isinstance(self.target_modules, str) and self.target_modules != "all-linear":
            raise ValueError(
                f"target_modules must be 'all-linear' or a list of module names, e.g. [q_proj, v_proj] "
                f"(got the string {self.target_modules!r})"
            )
        if isinstance(self.target_modules, list) and not self.target_modules:
            raise ValueError("target_modules is an empty list: name at least one module, or use 'all-linear'")
        if self.target_parameters is not None and not self.target_parameters:
            raise ValueError("target_parameters is an empty list: leave it out (null) or name parameters")
        if self.modules_to_save is not None and not self.modules_to_save:
            raise ValueError("modules_to_save is an empty list: leave it out (null) or name modules")
        return self


class Quantization(Section):
    """How the frozen base is quantised for QLoRA (bitsandbytes)."""

    bits: Literal[4, 8] = Field(4, description="4-bit (NF4/FP4) or 8-bit (LLM.int8) base weights")
    quant_type: Literal["nf4", "fp4"] = Field(
        "nf4", description="4-bit data type; NF4 suits normally distributed weights"
    )
    double_quant: bool = Field(
        True, description="4-bit: also quantise the quantisation constants (~0.4 bit/param saved)"
    )
    compute_dtype: Literal["bfloat16", "float16", "float32"] = Field(
        "bfloat16", description="4-bit: dtype the weights are dequantised to for each matmul"
    )
    quant_storage: Literal["uint8", "bfloat16", "float16", "float32"] = Field(
        "uint8",
        description="4-bit: dtype the packed weights are stored in (bnb_4bit_quant_storage). Set it to model.dtype "
        "to shard a quantised model under FSDP or DeepSpeed ZeRO-3 (every parameter must share one dtype)",
    )
    embeddings_dtype: Literal["compute", "float32"] = Field(
        "compute",
        description="dtype of the unquantised input embedding and output head: compute = compute_dtype (half "
        "the memory of fp32: 2 GiB less for a Llama-3-8B); float32 = peft's prepare_model_for_kbit_training default",
    )

    @model_validator(mode="after")
    def _four_bit_only(self):
        if self.bits == 8 and self.quant_type != "nf4":
            raise ValueError(
                f"quant_type={self.quant_type} is a 4-bit data type; bits=8 uses LLM.int8 (remove quant_type)"
            )
        if self.bits == 8 and self.quant_storage != "uint8":
            raise ValueError(
                "quant_storage applies to 4-bit weights only; 8-bit models cannot be sharded by FSDP/ZeRO-3 (use bits=4)"
            )
        return self


class QAT(Section):
    """Quantization-aware training (torchao): the linear layers' weights (all but the output head) are
    fake-quantized in every forward, so the model learns weights that keep their accuracy once quantized;
    final/ holds them in float, and loading it with transformers' TorchAoConfig of the same scheme gives the
    quantized model that training computed (docs/methods.md)."""

    scheme: Literal["int8-int4", "int4", "int8", "float8"] = Field(
        "int8-int4",
        description="int8-int4: int8 dynamic activations and int4 weights (the ExecuTorch/XNNPACK scheme); "
        "int4 or int8: weight-only; float8: FP8 training instead (torchao float8 matmuls with dynamic "
        "scaling, on CUDA GPUs with FP8 tensor cores: Ada/Hopper and newer)",
    )
    group_size: PositiveInt = Field(32, description="Weights share one scale per this many input columns")

    def load_snippet(self, path: str = "final") -> str:
        """Python that loads final/ quantized as QAT trained it (for the model card and the docs); FP8
        training leaves a plain float model."""
        g = self.group_size
        if self.scheme == "float8":
            return f"model = AutoModelForCausalLM.from_pretrained({path!r})  # float weights, trained in FP8"
        if self.scheme == "int8-int4":
            name = "Int8DynamicActivationIntxWeightConfig"
            scheme = f"{name}(weight_dtype=torch.int4, weight_granularity=PerGroup({g}))"
        else:
            name = "IntxWeightOnlyConfig"
            scheme = f"{name}(weight_dtype=torch.{self.scheme}, granularity=PerGroup({g}))"
        return "\n".join(
            [
                "import torch",
                "from transformers import AutoModelForCausalLM, TorchAoConfig",
                f"from torchao.quantization import {name}",
                "from torchao.quantization.granularity import PerGroup",
                f"config = TorchAoConfig({scheme}, modules_to_not_convert=['lm_head'])",
                f"model = AutoModelForCausalLM.from_pretrained({path!r}, quantization_config=config)",
            ]
        )


class MethodSection(Section):
    type: Literal["full", "lora", "qlora"] = Field(
        "full",
        description="full: train every weight; lora: adapters on a frozen base; qlora: adapters on a quantised base",
    )
    lora: Lora = Lora()
    quantization: Quantization = Quantization()
    qat: QAT | None = Field(
        None,
        description="Quantization-aware training of the full model with torchao (int4/int8 fake-quantized "
        "weights); null = none",
    )

    @model_validator(mode="after")
    def _qat_trains_the_weights(self):
        if self.qat is not None and self.type != "full":
            raise ValueError(
                f"method.qat with method.type={self.type}: QAT fake-quantizes the weights that train, and "
                f"{self.type} freezes them; use method.type: full"
            )
        return self


# Keys of a section that exclude each other: a recipe sets at most one of each pair (0 counts as unset).
# On the command line, one replaces the other from the recipe file (see `apply_overrides`).
EXCLUSIVE = {"train": (("max_steps", "epochs"), ("warmup_steps", "warmup_ratio"))}


def _is_set(value: Any) -> bool:
    return value is not None and value != 0


class TrainSection(Section):
    """Optimisation."""

    optimizer: Literal["adamw", "adamw_8bit", "paged_adamw_8bit", "paged_adamw_32bit", "muon"] = Field(
        "adamw",
        description="adamw: torch (fused on CUDA); adamw_8bit, paged_adamw_8bit, paged_adamw_32bit: bitsandbytes; "
        "muon: torch Muon for the hidden matrices (at train.lr, AdamW-matched) + AdamW for embeddings, head, "
        "norms and biases (full training, one process or DDP)",
    )
    lr: PositiveFloat = 2e-4
    scheduler: Literal["cosine", "linear", "constant"] = "cosine"
    warmup_steps: int = Field(0, ge=0)
    warmup_ratio: float = Field(0.0, ge=0.0, lt=1.0)
    weight_decay: float = Field(0.0, ge=0.0)
    betas: tuple[float, float] = (0.9, 0.999)
    batch_size: PositiveInt = Field(8, description="Micro-batch size per device")
    grad_accum: PositiveInt = Field(1, description="Micro-batches per optimizer step")
    max_steps: PositiveInt | None = Field(None, description="Optimizer steps; exclusive with epochs")
    epochs: PositiveFloat | None = None
    max_grad_norm: PositiveFloat | None = Field(
        1.0, description="Clip gradients to this norm; null = no clipping"
    )
    log_every: PositiveInt = 1
    router_aux_loss_coef: float | None = Field(
        None,
        ge=0.0,
        description="Mixture-of-Experts models: weight of the router's load-balancing loss added to the loss; "
        "null = the model config's router_aux_loss_coef, 0 = none (expert load is still logged)",
    )
    torch_compile: bool = Field(
        False, description="Compile the model with torch.compile (inductor) through accelerate"
    )
    group_by_length: Literal["auto", True, False] = Field(
        "auto",
        description="Batches of examples of similar length (less padding; the Trainer's group_by_length), "
        "in an order still shuffled per epoch, grouped by the global batch (the same on every backend); "
        "auto: where random batches would waste a quarter of the compute on padding (said at start-up); "
        "no effect with data.packing or text pretraining",
    )
    on_nonfinite: Literal["stop", "skip"] = Field(
        "stop", description="Non-finite loss/grad norm: stop (keep last checkpoint) or skip the step"
    )
    loss_impl: Literal["auto", "chunked", "full"] = Field(
        "auto",
        description="chunked: the loss from the output head in chunks, never holding [tokens x vocab] logits "
        "(fused kernels on CUDA when installed); full: from the model's logits; auto: chunked where it applies",
    )

    collective_timeout_s: PositiveFloat | None = Field(
        None,
        description="Seconds a collective (gradient all-reduce, barrier, gather) waits for the other processes "
        "before the run ends with a one-line 'lost a peer' message (exit 3; restarts, where allowed, resume from "
        "the last checkpoint), from the first step to the last (start-up and the final save keep torch's default, "
        "30 min on gloo/CPU, 10 min on NCCL, which is also the default here). Keep it above the longest time one "
        "process works alone while training (a checkpoint write)",
    )

    @model_validator(mode="after")
    def _length(self):
        for a, b in EXCLUSIVE["train"]:
            if _is_set(getattr(self, a)) and _is_set(getattr(self, b)):
                raise ValueError(f"set either train.{a} or train.{b}, not both")
        if self.max_steps is None and self.epochs is None:
            self.epochs = 1.0
        return self


class EvalSection(Section):
    every_steps: PositiveInt | None = Field(
        None, description="Evaluate every N steps (and always at the end)"
    )
    at_start: bool = Field(True, description="Also evaluate before the first step")
    max_batches: PositiveInt | None = None
    batch_size: PositiveInt | None = Field(None, description="Defaults to train.batch_size")
    harness_tasks: list[str] = Field(
        default_factory=list,
        description="lm-evaluation-harness tasks scored on final/ after training (python -m training.evaluate), "
        "e.g. dates_exact_match (bundled, training/eval_tasks/); results in output_dir/eval_results.json",
    )

    @field_validator("harness_tasks", mode="before")
    @classmethod
    def _tasks_as_list(cls, value):
        """Left empty is no task; one name, or names separated by commas, is a list."""
        if value is None:
            return []
        if isinstance(value, str):
            return [n.strip() for n in value.split(",") if n.strip()]
        return value


class CheckpointSection(Section):
    every_steps: PositiveInt | None = Field(None, description="Save a resumable checkpoint every N steps")
    keep_last: PositiveInt = 2
    async_save: bool = Field(
        False,
        description="Save in the background (also spelled `async`): the loop writes the checkpoint to fast "
        "node-local storage (checkpoint.staging_dir) and goes on; a background thread copies it into "
        "checkpoints/ and completes it. At most one save in flight; the last one is waited for at the end",
    )
    staging_dir: str | None = Field(
        None,
        description="Async saves: where each node stages a checkpoint before it is copied (needs room for "
        "the node's share of one checkpoint). Default /dev/shm (host memory until copied), else the temp dir",
    )

    @model_validator(mode="before")
    @classmethod
    def _async_keyword(cls, v: Any):
        """`checkpoint.async: true` (the name people write; a Python keyword, so the field is async_save)."""
        if isinstance(v, dict) and "async" in v:
            if "async_save" in v:
                raise ValueError("checkpoint: give async or async_save, not both (they are one setting)")
            v = {("async_save" if k == "async" else k): val for k, val in v.items()}
        return v


# objective -> (default beta, what beta means)
OBJECTIVES = {
    "dpo": (0.1, "DPO: strength of the KL tie to the reference (beta)"),
    "ipo": (0.1, "IPO: regularisation tau; the target margin is 1/(2 tau)"),
    "simpo": (2.0, "SimPO: reward scale on the length-normalised log-probability"),
    "orpo": (0.1, "ORPO: weight lambda of the odds-ratio term next to the SFT loss"),
    "kto": (0.1, "KTO: strength of the KL tie to the reference (beta)"),
    "reward": (None, "reward model: no beta (its score is the reward)"),
}
REFERENCE_FREE = ("simpo", "orpo", "reward")


class PreferenceSection(Section):
    """Preference tuning: train on chosen/rejected pairs (or KTO's labelled completions) instead of SFT.

    Log-probabilities are summed over completion tokens (SimPO and IPO average them); the loss is a mean
    over the pairs of the global batch. The reference model of DPO/IPO/KTO is the base with the adapter
    disabled (LoRA/QLoRA) or log-probabilities computed once before training and kept with the run
    (full fine-tuning); SimPO and ORPO need none.
    """

    objective: Literal["dpo", "ipo", "simpo", "orpo", "kto", "reward"] = Field(
        "dpo",
        description="dpo: sigmoid DPO; ipo: squared-margin IPO; simpo: reference-free, length-normalised; "
        "orpo: reference-free odds ratio + SFT; kto: unpaired desirable/undesirable completions; reward: "
        "a reward model (the causal LM with a one-score head, AutoModelForSequenceClassification) trained on "
        "the pairs with the Bradley-Terry loss -log sigmoid(r_chosen - r_rejected), for rl.rewards reward_model",
    )
    beta: PositiveFloat | None = Field(
        None, description="Objective's temperature; default dpo/ipo/kto/orpo 0.1, simpo 2.0"
    )
    label_smoothing: float = Field(
        0.0, ge=0.0, lt=0.5, description="dpo only: probability that a pair's labels are flipped (cDPO)"
    )
    simpo_gamma: float | None = Field(
        None, ge=0.0, description="simpo only: target reward margin gamma (default 1.0)"
    )
    desirable_weight: PositiveFloat | None = Field(
        None, description="kto only: weight of the desirable (label true) examples (default 1.0)"
    )
    undesirable_weight: PositiveFloat | None = Field(
        None, description="kto only: weight of the undesirable (label false) examples (default 1.0)"
    )
    center_rewards: float | None = Field(
        None,
        ge=0.0,
        description="reward only: weight of (r_chosen + r_rejected)^2 in the loss, keeping scores near 0 "
        "(TRL's center_rewards_coefficient, e.g. 0.01; default 0)",
    )
    reference: Literal["auto", "adapter_disabled", "precomputed"] = Field(
        "auto",
        description="dpo/ipo/kto reference: auto (lora/qlora: adapter_disabled; full: precomputed), "
        "adapter_disabled (the base model under the adapter, each step), precomputed (once, before training)",
    )

    @model_validator(mode="after")
    def _settings_of_objective(self):
        o = self.objective
        own = {
            "label_smoothing": "dpo",
            "simpo_gamma": "simpo",
            "desirable_weight": "kto",
            "undesirable_weight": "kto",
            "center_rewards": "reward",
        }
        for key, objective in own.items():
            if _is_set(getattr(self, key)) and o != objective:
                raise ValueError(f"{key} is a setting of objective {objective}, not {o}; remove it")
        if o in REFERENCE_FREE and self.reference != "auto":
            raise ValueError(f"objective {o} is reference-free: remove reference={self.reference}")
        if o == "reward" and self.beta is not None:
            raise ValueError("beta is not a setting of objective reward (its score is the reward); remove it")
        if o == "reward" and self.center_rewards is None:
            self.center_rewards = 0.0
        if self.beta is None and o != "reward":
            self.beta = OBJECTIVES[o][0]
        if o == "simpo" and self.simpo_gamma is None:
            self.simpo_gamma = 1.0
        if o == "kto" and self.desirable_weight is None:
            self.desirable_weight = 1.0
        if o == "kto" and self.undesirable_weight is None:
            self.undesirable_weight = 1.0
        return self

    @property
    def needs_reference(self) -> bool:
        return self.objective not in REFERENCE_FREE


# rl.rewards built-ins -> the keyword arguments each takes (training/objectives/rewards.py holds them)
BUILTIN_REWARDS = {
    "exact_match": ("column", "answer_tag"),
    "math_equal": ("column", "answer_tag"),
    "regex": ("pattern",),
    "length_penalty": ("max_chars",),
    "reward_model": ("path",),
}


class RewardSpec(Section):
    """One reward function of online RL, weighted: a built-in, or the user's own function."""

    function: str = Field(
        description="A built-in (exact_match, math_equal, regex, length_penalty, reward_model) or your own "
        "function: path/to/file.py:name or package.module:name, called as f(prompts=..., completions=..., "
        "completion_ids=..., **extra columns) -> one number per completion"
    )
    weight: float = Field(1.0, description="Weight of this reward in the total (advantages use the total)")
    name: str | None = Field(None, description="Name in the metrics (reward/NAME); default: the function's")
    args: dict[str, Any] = Field(
        default_factory=dict,
        description="Built-ins' settings: exact_match/math_equal {column: answer, answer_tag: answer}, "
        "regex {pattern: ...}, length_penalty {max_chars: 200}, reward_model {path: a "
        "sequence-classification checkpoint with num_labels 1 and its tokenizer}",
    )

    @model_validator(mode="after")
    def _builtin_args(self):
        f = self.function
        if ":" not in f:
            if f not in BUILTIN_REWARDS:
                raise ValueError(
                    f"function {f!r} is not a built-in reward ({', '.join(BUILTIN_REWARDS)}); name your own "
                    "as path/to/file.py:function or package.module:function"
                )
            unknown = sorted(set(self.args) - set(BUILTIN_REWARDS[f]))
            if unknown:
                raise ValueError(
                    f"args: {', '.join(unknown)} not a setting of {f} (it takes "
                    f"{', '.join(BUILTIN_REWARDS[f]) or 'none'})"
                )
            if f == "regex" and not isinstance(self.args.get("pattern"), str):
                raise ValueError("regex needs args.pattern, a regular expression the completion must match")
            if f == "reward_model" and not (isinstance(p := self.args.get("path"), str) and p.strip()):
                raise ValueError(
                    "reward_model needs args.path, a sequence-classification checkpoint (num_labels 1) "
                    "with its tokenizer"
                )
            if f == "regex":
                try:
                    re.compile(self.args["pattern"])
                except re.error as e:
                    raise ValueError(f"args.pattern is not a regular expression ({e})") from None
        elif not f.split(":")[-1].isidentifier():
            raise ValueError(f"function {f!r}: after ':' comes the function's name")
        if self.name is None:
            self.name = f.split(":")[-1] if ":" in f else f
        return self


class RLSection(Section):
    """Online reinforcement learning (GRPO and its relatives): completions sampled from the policy for each
    prompt, scored by reward functions, and the policy moved towards the better ones of each group."""

    loss_type: Literal["grpo", "dr_grpo", "dapo"] = Field(
        "dapo",
        description="grpo: each completion's token mean, then the mean over completions (the paper); "
        "dr_grpo: token sum / (completions x max_new_tokens) (Dr. GRPO); dapo: token mean over every "
        "completion token of the global batch (DAPO, TRL's default)",
    )
    advantage: Literal["grpo", "rloo"] = Field(
        "grpo",
        description="grpo: reward minus its group's mean; rloo: minus the mean of the group's other completions",
    )
    scale_rewards: Literal["group", "batch", "none"] = Field(
        "group",
        description="Divide advantages by the reward std of the group, of the whole batch, or not "
        "(Dr. GRPO: none)",
    )
    num_generations: int = Field(4, ge=2, description="Completions sampled per prompt (the group)")
    max_new_tokens: PositiveInt = Field(64, description="Longest completion, in tokens")
    temperature: PositiveFloat = Field(
        1.0, description="Sampling temperature (also divides the logits of the loss)"
    )
    top_p: float = Field(
        1.0, gt=0.0, le=1.0, description="Nucleus sampling: smallest set of tokens of this mass"
    )
    num_iterations: PositiveInt = Field(
        1,
        description="Optimizer steps per batch of rollouts (the GRPO paper's mu, TRL's num_iterations): the "
        "completions of a step are reused by the next num_iterations - 1 steps, with the log-probabilities of "
        "the policy that sampled them kept for the clipped ratio; each reuse counts as a step (max_steps)",
    )
    epsilon: PositiveFloat = Field(0.2, description="PPO clip range of the probability ratio (lower side)")
    epsilon_high: PositiveFloat | None = Field(
        None, description="Upper clip range (DAPO's clip-higher, e.g. 0.28); default: epsilon"
    )
    beta: float = Field(
        0.0, ge=0.0, description="Weight of the KL penalty to the reference (0: no reference is kept)"
    )
    reference: Literal["auto", "adapter_disabled", "frozen_copy", "none"] = Field(
        "auto",
        description="KL reference when beta > 0: auto = adapter_disabled for lora/qlora (the base under the "
        "adapter, no second copy), frozen_copy for full fine-tuning (a frozen copy of the initial model, "
        "made before training; not under FSDP or ZeRO-3); none when beta = 0",
    )
    rewards: list[RewardSpec] = Field(min_length=1, description="Reward functions, weighted and summed")
    pass_reward: float | None = Field(
        None,
        description="Held-out pass rate: the share of prompts whose total reward reaches this; "
        "default: the sum of the positive weights (every built-in reward at its best)",
    )
    log_samples: int = Field(
        2, ge=0, description="Prompt/completion/reward triples written to samples.jsonl per logged step"
    )
    generator: Literal["transformers", "vllm"] = Field(
        "transformers",
        description="What samples the completions: transformers' generate with a KV cache (CPU and GPU), or a "
        "vLLM engine colocated in each process (CUDA GPUs with the vllm package; the policy's weights pushed "
        "into it before each rollout); both keyed by (seed, step, prompt, generation)",
    )
    vllm_gpu_memory_utilization: float = Field(
        0.3,
        gt=0.0,
        lt=1.0,
        description="rl.generator=vllm: the share of each GPU's memory vLLM takes for its weights and KV cache "
        "(the rest is training's)",
    )

    @model_validator(mode="after")
    def _settings(self):
        if self.epsilon_high is None:
            self.epsilon_high = self.epsilon
        names = [r.name for r in self.rewards]
        if dups := sorted({n for n in names if names.count(n) > 1}):
            raise ValueError(f"rewards: two rewards named {dups[0]}; give one a name (rewards[i].name)")
        if self.pass_reward is None:
            self.pass_reward = sum(r.weight for r in self.rewards if r.weight > 0)
        if self.beta > 0 and self.reference == "none":
            raise ValueError("beta > 0 penalises the KL to a reference: set reference=auto, or beta=0")
        if self.beta == 0 and self.reference in ("adapter_disabled", "frozen_copy"):
            raise ValueError(f"reference={self.reference} is the KL reference: set beta > 0 or remove it")
        return self

    @property
    def needs_reference(self) -> bool:
        return self.beta > 0

    def columns(self) -> list[str]:
        """The data columns the built-in rewards read (every prompt record must have them)."""
        return sorted(
            {
                r.args.get("column", "answer")
                for r in self.rewards
                if r.function in ("exact_match", "math_equal")
            }
        )


class DistillSection(Section):
    """Knowledge distillation from a teacher that shares the student's tokenizer: next-token cross-entropy
    plus a divergence to the teacher's distribution, on the labelled tokens of the data."""

    teacher: ModelSource = Field(
        description="The teacher: a model directory, a run's final/, bundled:NAME or a hub name (a causal LM "
        "with the student's tokenizer)"
    )
    ce_weight: float = Field(
        0.5,
        ge=0.0,
        le=1.0,
        description="Weight of the cross-entropy to the labels; the divergence gets 1 - it",
    )
    beta: float = Field(
        0.0,
        ge=0.0,
        le=1.0,
        description="GKD's generalised JSD: 0 = forward KL(teacher || student), 1 = reverse KL(student || "
        "teacher), between = the JSD with that mixture weight",
    )
    temperature: PositiveFloat = Field(1.0, description="Both distributions are taken at this temperature")
    top_k: PositiveInt | None = Field(
        None,
        description="Precompute the teacher's top-k log-probabilities once (cached beside the tokenized data, "
        "keyed by the data, the teacher's files, k and the temperature) and train without the teacher in "
        "memory; the divergence is then taken over those k tokens and one bucket for the rest of each "
        "distribution. null: the teacher's whole distribution, computed on the fly",
    )
    lmbda: float = Field(
        0.0,
        ge=0.0,
        le=1.0,
        description="GKD's lambda (TRL's lmbda): the share of steps, drawn by (seed, step), on which the student "
        "completes the data's prompts itself (on-policy distillation: the teacher scores the student's own "
        "completions); 0 = the data's completions only, 1 = the student's always",
    )
    max_new_tokens: PositiveInt = Field(
        128, description="On-policy steps (lmbda > 0): the longest completion the student generates"
    )


class Recipe(Section):
    output_dir: PathStr
    seed: int = 42
    precision: Literal["auto", "no", "fp16", "bf16"] = Field(
        "auto",
        description="Mixed precision: auto = bf16 on a GPU with bf16 or a CPU with native bf16 (AVX512-BF16/AMX), "
        "else no (fp32); no, fp16 (GPU), bf16",
    )
    # why `auto` resolved as it did (start-up log); set by training.config.io.resolve_precision, which the
    # training set-up calls for this machine and the planner for the machine it plans for
    _source: str = PrivateAttr("<recipe>")  # the file (or form) it was read from, for messages
    _precision_auto: str | None = PrivateAttr(None)
    # model.name_or_path is an image-text checkpoint: its processor's image tokens (set by
    # training.model.vision.resolve_image_text, which reads the checkpoint; None until then or for others)
    _image_text_checkpoint: ImageTokens | None = PrivateAttr(None)
    _checkpoint_read: bool = PrivateAttr(False)  # resolve_image_text ran: model.vision without it is composed
    resume: Annotated[str, FilePath(keywords=("auto", "none"))] = Field(
        "auto", description="auto (newest complete checkpoint), none, or a checkpoint path"
    )
    model: ModelSection
    data: DataSection
    method: MethodSection = MethodSection()
    train: TrainSection = TrainSection()
    eval: EvalSection = EvalSection()
    checkpoint: CheckpointSection = CheckpointSection()
    preference: PreferenceSection | None = Field(
        None, description="Preference tuning (DPO, IPO, SimPO, ORPO, KTO) instead of supervised fine-tuning"
    )
    rl: RLSection | None = Field(
        None, description="Online RL (GRPO, Dr. GRPO, DAPO, RLOO) on prompts with reward functions"
    )
    distill: DistillSection | None = Field(
        None,
        description="Knowledge distillation: cross-entropy plus a divergence to a teacher's distribution",
    )
    report_to: list[Literal["tensorboard", "mlflow", "wandb", "trackio"]] = Field(
        default_factory=list,
        description="Experiment trackers that get the recipe and every metrics row (accelerate's trackers): "
        "tensorboard (output_dir/tensorboard), mlflow (local store output_dir/mlruns unless "
        "MLFLOW_TRACKING_URI), wandb (offline without an API key), trackio (local)",
    )

    @property
    def trains_reward_model(self) -> bool:
        """preference.objective=reward: the model is a sequence classifier (one score), not a causal LM."""
        return self.preference is not None and self.preference.objective == "reward"

    @field_validator("report_to", mode="before")
    @classmethod
    def _trackers_as_list(cls, value):
        """`report_to:` left empty (or an empty form box) is no tracker; one name alone is a list of one."""
        if value is None:
            return []
        return [value] if isinstance(value, str) else value

    @model_validator(mode="after")
    def _compatible(self):
        if self.model.train_tokenizer is not None and self.model.train_tokenizer.files is None:
            self.model.train_tokenizer.files = list(self.data.train_files)
        if (self.data.streaming or self.data.is_mixture) and self.train.max_steps is None:
            raise ValueError(
                "train.max_steps: a streamed corpus (or a mixture) has no known length; set train.max_steps "
                "(tokens trained = max_steps x tokens per step, logged at start-up)"
            )
        if self.method.type in ("lora", "qlora") and self.model.from_scratch is not None:
            raise ValueError(
                f"method.type={self.method.type} needs a pretrained model; use method.type=full with from_scratch"
            )
        if (
            self.model.attn_implementation == "flash_attention_2"
            and self.precision == "no"
            and self.model.dtype == "float32"
        ):
            raise ValueError(
                "model.attn_implementation=flash_attention_2 needs half precision: set precision=bf16 (or model.dtype=bfloat16)"
            )
        return self

    @model_validator(mode="after")
    def _method_fits_model(self):
        q = self.method.quantization
        if self.method.type == "qlora" and q.bits == 4 and q.quant_storage not in ("uint8", self.model.dtype):
            raise ValueError(
                f"method.quantization.quant_storage={q.quant_storage} differs from model.dtype={self.model.dtype}: "
                f"a floating quant_storage is for FSDP/ZeRO-3 sharding, where every parameter must share one dtype; "
                f"set model.dtype: {q.quant_storage} (or quant_storage: uint8 when not sharding)"
            )
        if self.method.type == "full" and self.method.lora.init_from is not None:
            raise ValueError("method.lora.init_from continues an adapter: set method.type=lora or qlora")
        return self

    @property
    def image_text_checkpoint(self) -> bool:
        """model.name_or_path is a pretrained image-text model (known once training.model.vision's
        resolve_image_text has read its config)."""
        return self._image_text_checkpoint is not None

    @property
    def composes_image_text(self) -> bool:
        """model.vision builds a new LLaVA-style model around the language model."""
        return self.model.vision is not None and self._image_text_checkpoint is None

    @model_validator(mode="after")
    def _vision_fits(self):
        v, d, checkpoint = self.model.vision, self.data, self._image_text_checkpoint
        if v is None and checkpoint is None:
            d._images = None
            return self
        what = "model.vision" if checkpoint is None else f"the image-text model {self.model.name_or_path}"
        if d.format not in ("chat", "sharegpt"):
            raise ValueError(
                f"{what} trains on chat or sharegpt records whose messages carry images, not "
                f"data.format={d.format}"
            )
        for other in ("preference", "rl", "distill"):
            if getattr(self, other) is not None:
                raise ValueError(
                    f"{what} with {other}: image-text runs train with the next-token loss only, for now"
                )
        if d.packing:
            raise ValueError(
                f"data.packing with {what}: a packed row would need its images cut and kept with it, "
                "which is not supported; image-text examples are batched unpacked (train.group_by_length "
                "groups them by length, image tokens counted)"
            )
        if d.streaming or d.is_mixture:
            raise ValueError(f"{what} reads its records from files (not a stream or a mixture), for now")
        if checkpoint is not None:  # a pretrained image-text model: its own encoder, projector and processor
            if sizes := sorted((v.model_fields_set if v else set()) & set(VisionSection.SIZES)):
                raise ValueError(
                    f"model.vision.{sizes[0]}: {self.model.name_or_path} is already an image-text model with "
                    f"its own vision encoder and processor; model.vision takes only tower, projector and "
                    f"image_token for it (drop {', '.join(sizes)})"
                )
            d._images = checkpoint
            return self
        # a composed model for sure: around a text-only model, or once the checkpoint is read
        text_only = self.model.from_scratch is not None or self.model.converted_text_model
        if text_only or self._checkpoint_read:
            if self.method.type != "full":
                raise ValueError(
                    f"model.vision with method.type={self.method.type}: the composed model's vision encoder and "
                    f"projector are new, so they must train whole and final/ must hold them beside the language "
                    f"model, which no adapter's base holds; use method.type=full (adapters on the language model "
                    f"are for pretrained image-text checkpoints)"
                )
            if v.projector == "frozen":
                raise ValueError(
                    "model.vision.projector=frozen: a composed model's projector is new (random); it must train"
                )
        d._images = ImageTokens(v.image_token, v.tokens_per_image, v.image_size)
        return self

    @model_validator(mode="after")
    def _distill_fits(self):
        if self.distill is None:
            return self
        if self.rl is not None or self.preference is not None:
            other = "rl" if self.rl is not None else "preference"
            raise ValueError(f"distill and {other} are two objectives: keep one section")
        if self.data.format in ("pairwise", "unpaired", "prompts"):
            raise ValueError(
                f"distill trains on the labelled tokens of SFT or text data, not data.format={self.data.format}"
            )
        if self.data.streaming or self.data.is_mixture or self.data.packing:
            raise ValueError(
                "distill: streamed, mixed and packed data are not supported yet; use plain (unpacked) files"
            )
        if self.distill.lmbda > 0 and self.data.format == "text":
            raise ValueError(
                "distill.lmbda: on-policy steps complete the data's prompts, and data.format=text has none; "
                "use chat or instruction data, or lmbda: 0"
            )
        if self.distill.lmbda > 0 and self.data.images is not None:
            raise ValueError(
                "distill.lmbda: on-policy steps generate from text prompts only, not image-text data"
            )
        if self.distill.lmbda > 0 and self.distill.top_k is not None:
            raise ValueError(
                "distill.lmbda with distill.top_k: the top-k is precomputed on the data's completions, and "
                "on-policy steps need the teacher on the student's own; keep one of them"
            )
        return self

    @model_validator(mode="after")
    def _rl_fits_data(self):
        r, d = self.rl, self.data
        if r is None:
            if d.format == "prompts":
                raise ValueError("data.format=prompts is RL data: add an rl section (rl.rewards)")
            return self
        if self.preference is not None:
            raise ValueError("rl and preference are two objectives: keep one section")
        if "format" not in d.model_fields_set:
            d.format = "prompts"
        if d.format != "prompts":
            raise ValueError(f"rl trains on prompt records: set data.format=prompts (got {d.format})")
        if d.packing:
            raise ValueError("data.packing does not apply to RL prompts (completions are sampled per prompt)")
        if d.streaming or d.is_mixture:
            raise ValueError("rl reads its prompts from files or a hub dataset, not a stream or a mixture")
        if r.generator == "vllm" and self.model.from_scratch is not None:
            raise ValueError(
                "rl.generator=vllm builds its engine from a model directory: model.name_or_path must be a "
                "pretrained model, not model.from_scratch (use rl.generator=transformers)"
            )
        if r.generator == "vllm" and self.method.type == "qlora":
            raise ValueError(
                "rl.generator=vllm with method.type=qlora: the adapter would be merged into 4-bit weights to push "
                "them to vLLM, which is lossy; use method.type=lora, or rl.generator=transformers"
            )
        full = self.method.type == "full"
        if r.beta > 0 and r.reference == "auto":
            r.reference = "frozen_copy" if full else "adapter_disabled"
        if r.reference == "adapter_disabled" and full:
            raise ValueError(
                "rl.reference=adapter_disabled is the base under a LoRA adapter: it needs method.type=lora "
                "or qlora; full fine-tuning uses rl.reference=frozen_copy (or auto)"
            )
        if r.reference == "frozen_copy" and not full:
            raise ValueError(
                f"rl.reference=frozen_copy copies the whole model, for method.type=full; with "
                f"method.type={self.method.type} use rl.reference=adapter_disabled (or auto): the base under "
                f"the adapter, no second copy"
            )
        return self

    @model_validator(mode="after")
    def _preference_fits_data(self):
        p, d = self.preference, self.data
        if p is None:
            if d.format in ("pairwise", "unpaired"):
                raise ValueError(f"data.format={d.format} is preference data: add a preference section")
            return self
        wanted = "unpaired" if p.objective == "kto" else "pairwise"
        if "format" not in d.model_fields_set:
            d.format = wanted
        if d.format != wanted:
            shape = (
                "prompt/completion/label records" if wanted == "unpaired" else "prompt/chosen/rejected pairs"
            )
            raise ValueError(
                f"preference.objective={p.objective} trains on {shape}: set data.format={wanted} "
                f"(got {d.format})" + ("; KTO needs unpaired data" if p.objective == "kto" else "")
            )
        if d.packing:
            raise ValueError(
                "data.packing does not apply to preference data (each pair is scored on its own)"
            )
        if p.objective == "reward" and self.eval.harness_tasks:
            raise ValueError(
                "eval.harness_tasks score a generating model; a reward model (preference.objective=reward) "
                "scores text: remove them (its eval_preference_accuracy is the held-out measure)"
            )
        if p.reference == "adapter_disabled" and self.method.type == "full":
            raise ValueError(
                "preference.reference=adapter_disabled needs method.type=lora or qlora; full fine-tuning "
                "uses precomputed reference log-probabilities"
            )
        return self
