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
from typing import Annotated, Any, Literal

from pydantic import (
    Field,
    PositiveFloat,
    PositiveInt,
    PrivateAttr,
    field_validator,
    model_validator,
)

from training.config.data import (  # noqa: F401 (re-exported: the data section)
    CHAT_TEMPLATE_ARGS,
    DATA_FIELDS,
    REASONING_GYM,
    DataSection,
    DataSource,
    ImageTokens,
    ReasoningGymSection,
    WorkedExample,
    generated_task,
)
from training.config.fields import (  # noqa: F401 (re-exported: the schema's types)
    CodeRef,
    CodeReference,
    FilePath,
    ModelSource,
    PathStr,
    Section,
    _is_set,
    verifiers_target,
)
from training.config.model import (  # noqa: F401 (re-exported: the model section)
    Architecture,
    ModelSection,
    RopeScaling,
    TokenizerTraining,
    VisionSection,
)
from training.config.objectives import (  # noqa: F401 (re-exported: the objectives' sections)
    BUILTIN_REWARDS,
    OBJECTIVES,
    REFERENCE_FREE,
    DistillSection,
    PreferenceSection,
    RewardArgs,
    RewardSpec,
    RLSection,
)
from training.core.machine import auto_precision

log = logging.getLogger("training.config")


def matmul_dtype(precision: str, weight_dtype: str) -> str:
    """The dtype a run's matmuls compute in: its mixed precision's (bf16, fp16), else its weights' (model.dtype)."""
    if precision == "bf16" or (precision != "fp16" and weight_dtype == "bfloat16"):
        return "bfloat16"
    if precision == "fp16" or weight_dtype == "float16":
        return "float16"
    return "float32"


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
    compute_dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "auto",
        description="dtype the quantised weights are dequantised to for each matmul (and of the embedding and head, "
        "see embeddings_dtype): auto = the dtype the run's other matmuls compute in: precision's (bf16, fp16), else "
        "model.dtype's (precision no with float32 weights: float32, where a CPU without native bf16 would emulate "
        "bfloat16 matmuls, many times slower)",
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


class TrainSection(Section):
    """Optimisation."""

    optimizer: Literal["adamw", "adamw_8bit", "paged_adamw_8bit", "paged_adamw_32bit", "muon"] = Field(
        "adamw",
        description="adamw: torch (fused on CUDA); adamw_8bit, paged_adamw_8bit, paged_adamw_32bit: bitsandbytes; "
        "muon: torch Muon for the hidden matrices (at train.lr, AdamW-matched) + AdamW for embeddings, head, "
        "norms and biases (full training, one process or DDP)",
    )
    lr: PositiveFloat = Field(
        2e-4, description="Peak learning rate (after warm-up); LoRA usually 1e-4-5e-4, full 1e-5-5e-5"
    )
    scheduler: Literal["cosine", "linear", "constant"] = Field(
        "cosine", description="Learning-rate decay after warm-up, to 0 at the last step (constant: none)"
    )
    warmup_steps: int = Field(0, ge=0, description="Optimizer steps of linear warm-up from 0 to train.lr")
    warmup_ratio: float = Field(
        0.0, ge=0.0, lt=1.0, description="Warm-up as a share of all steps (used when warmup_steps is 0)"
    )
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW's decoupled weight decay (e.g. 0.01-0.1)")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW's (beta1, beta2) moment decay rates")
    batch_size: PositiveInt = Field(8, description="Micro-batch size per device")
    grad_accum: PositiveInt = Field(1, description="Micro-batches per optimizer step")
    max_steps: PositiveInt | None = Field(None, description="Optimizer steps; exclusive with epochs")
    epochs: PositiveFloat | None = Field(
        None, description="Passes over the training data (fractions allowed); or set max_steps instead"
    )
    max_grad_norm: PositiveFloat | None = Field(
        1.0, description="Clip gradients to this norm; null = no clipping"
    )
    log_every: PositiveInt = Field(1, description="Write a metrics row (and a progress line) every N steps")
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
    max_batches: PositiveInt | None = Field(
        None, description="Evaluate on at most this many batches of each eval set (empty: all)"
    )
    batch_size: PositiveInt | None = Field(
        None,
        description="Defaults to train.batch_size (online RL: train.batch_size x rl.num_generations prompts, "
        "as many rows as a step draws)",
    )
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
    keep_last: PositiveInt = Field(2, description="Complete checkpoints kept; older ones are deleted")
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
class Recipe(Section):
    output_dir: PathStr = Field(
        description="The run directory: checkpoints, final/, metrics.jsonl, train.log"
    )
    seed: int = Field(42, description="Seed of the initialisation, data order, dropout and sampling")
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
    resume_changes: list[str] | None = Field(
        None,
        description="Keys (or whole sections) that may differ from the recipe that wrote the checkpoint, on "
        "purpose, e.g. [train.lr] or [train]; any other change that alters the training is refused on resume",
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
    def eval_batch_size(self) -> int:
        """The held-out loaders' batch: eval.batch_size, else train.batch_size; for online RL train.batch_size x
        rl.num_generations prompts (one greedy completion or episode each: as many rows as a step draws)."""
        if self.eval.batch_size is not None:
            return self.eval.batch_size
        if self.rl is not None:
            return self.train.batch_size * self.rl.num_generations
        return self.train.batch_size

    @property
    def quantization_compute_dtype(self) -> str:
        """method.quantization.compute_dtype with `auto` decided: the dtype the run's other matmuls compute in
        (matmul_dtype), `precision: auto` as this machine resolves it."""
        chosen = self.method.quantization.compute_dtype
        if chosen != "auto":
            return chosen
        precision = self.precision if self.precision != "auto" else auto_precision()[0]
        return matmul_dtype(precision, self.model.dtype)

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
        if self.model.rope_scaling is not None:  # training.model.rope scales text-only configs
            raise ValueError(
                f"model.rope_scaling with {what}: RoPE scaling is applied to text-only models for now (an "
                "image-text model's language config would be left unscaled)"
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
            if d.generated:
                split, task = next(iter(d.generated.items()))
                raise ValueError(
                    f"data.{split}: reasoning_gym:{task} makes RL prompt records: add an rl section (rl.rewards, "
                    "e.g. the reasoning_gym reward)"
                )
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
        if r.server_push == "adapter" and full:
            raise ValueError(
                "rl.server_push=adapter pushes the policy's LoRA adapter: it needs method.type=lora or qlora; full "
                "fine-tuning pushes its weights (rl.server_push=weights)"
            )
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
