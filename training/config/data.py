"""The recipe's data section: the files (or a weighted mixture of sources), their format and how they
become token rows; and what the data pipeline needs of an image-text model (ImageTokens)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, PositiveFloat, PositiveInt, PrivateAttr, field_validator, model_validator

from training.config.fields import FilePath, PathStr, Section

REASONING_GYM = "reasoning_gym:"  # data.train/data.eval: reasoning_gym:TASK, prompts made by reasoning-gym
# a data file or hub dataset, or reasoning_gym:TASK (generated prompts, not a path)
DataPath = Annotated[str, FilePath(prefixes=(REASONING_GYM,))]


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


class WorkedExample(Section):
    """One question and the reply wanted, shown before each generated question as an earlier turn."""

    question: str = Field(min_length=1, description="The example's question (the user's turn)")
    answer: str = Field(min_length=1, description="The reply wanted (the assistant's turn)")


class ReasoningGymSection(Section):
    """How the prompts of data.train/data.eval given as reasoning_gym:TASK are generated (offline, by
    reasoning_gym.create_dataset(TASK, size=, seed=, **config)); held-out sets take another seed."""

    size: PositiveInt = Field(1000, description="Prompts generated for data.train")
    seed: int = Field(0, ge=0, description="The generator's seed for data.train")
    eval_size: PositiveInt = Field(100, description="Prompts generated for each held-out set (data.eval)")
    eval_seed: int | None = Field(
        None,
        ge=0,
        description="The generator's seed for the held-out sets; default seed + size. reasoning-gym draws "
        "entry i of seed s with Random(s + i), so seeds closer than size share prompts (refused)",
    )
    config: dict[str, Any] = Field(
        default_factory=dict,
        description="The task's own settings (the fields of its reasoning-gym config, e.g. {min_words: 3, "
        "max_words: 5} for letter_counting); size and seed are the keys beside this one",
    )
    example: WorkedExample | None = Field(
        None,
        description="A worked example shown before every question as an earlier chat turn (user, then "
        "assistant): the prompt becomes that chat, which shows a small model the reply's shape",
    )

    @field_validator("config")
    @classmethod
    def _not_size_or_seed(cls, v: dict) -> dict:
        if taken := sorted({"size", "seed"} & set(v)):
            raise ValueError(f"config: {', '.join(taken)} are set by reasoning_gym.size/seed/eval_seed")
        return v

    @model_validator(mode="after")
    def _held_out_seed(self):
        if self.eval_seed is None:
            self.eval_seed = self.seed + self.size
        return self

    def overlap(self) -> bool:
        """Whether held-out entries are drawn with seeds training draws (entry i of seed s: Random(s + i))."""
        return self.eval_seed < self.seed + self.size and self.seed < self.eval_seed + self.eval_size


def generated_task(patterns: list[str] | None) -> str | None:
    """TASK where a split is reasoning_gym:TASK, else None."""
    found = [p for p in patterns or [] if p.startswith(REASONING_GYM)]
    return found[0][len(REASONING_GYM) :] if found else None


class DataSection(Section):
    train: list[DataPath] | list[DataSource] = Field(
        description="Data files (jsonl/json/csv/parquet/txt, globs allowed) or a hub dataset name; or a "
        "weighted mixture of sources [{path: ..., weight: 0.7}, ...]; or reasoning_gym:TASK, RL prompts "
        "generated by reasoning-gym (data.reasoning_gym)"
    )
    eval: list[DataPath] | dict[str, list[DataPath]] | None = Field(
        None,
        description="Held-out files; or named held-out sets {web: web_eval.jsonl, code: code/*.jsonl}, each "
        "evaluated on its own (eval_loss/NAME; eval_loss covers them all); if unset, eval_fraction of train "
        "is held out; reasoning_gym:TASK: prompts generated with data.reasoning_gym.eval_seed",
    )
    reasoning_gym: ReasoningGymSection | None = Field(
        None,
        description="Size, seeds and task settings of the splits given as reasoning_gym:TASK (RL prompts "
        "with the task's answer and metadata, scored by the reasoning_gym reward)",
    )
    eval_fraction: float = Field(
        0.0,
        ge=0.0,
        lt=1.0,
        description="Hold out this share of data.train for evaluation (when data.eval is not set)",
    )
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
    max_length: PositiveInt = Field(
        512,
        description="Longest example in tokens; longer ones are truncated (the start-up log says how many)",
    )
    too_long: Literal["truncate", "drop"] = Field(
        "truncate",
        description="Examples longer than max_length: cut at max_length, or leave out (counts are logged)",
    )
    packing: bool = Field(
        False,
        description="Pack several examples into each max_length sequence (position ids restart, no attention "
        "across examples); instruction/chat/sharegpt formats",
    )
    packed_batch: Literal["examples", "rows"] = Field(
        "examples",
        description="With packing, what train.batch_size (and eval.batch_size) counts: examples (a micro-batch "
        "takes the packed rows that hold about that many examples, so a step does the work of an unpacked one) "
        "or packed rows of max_length tokens; streams and pipeline parallelism count rows",
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

    @property
    def split_patterns(self) -> dict[str, list[str]]:
        """The recipe's patterns by split: "train" (not for a mixture), "eval" or "eval.NAME"."""
        named = isinstance(self.eval, dict)
        train = {} if self.is_mixture else {"train": list(self.train)}
        return train | {f"eval.{n}" if named else "eval": p for n, p in self.eval_sets.items()}

    @property
    def generated(self) -> dict[str, str]:
        """{split: TASK} of the splits given as reasoning_gym:TASK."""
        return {s: task for s, p in self.split_patterns.items() if (task := generated_task(p)) is not None}

    @model_validator(mode="after")
    def _reasoning_gym(self):
        for i, src in enumerate(self.sources if self.is_mixture else []):
            if generated_task(src.path) is not None:
                raise ValueError(
                    f"train[{i}].path: reasoning_gym:TASK makes RL prompts, not a mixture source"
                )
        for split, patterns in self.split_patterns.items():
            task = generated_task(patterns)
            if task is not None and (len(patterns) > 1 or not task.strip()):
                raise ValueError(
                    f"{split}: reasoning_gym:TASK names one task (e.g. reasoning_gym:letter_counting) and is "
                    f"the whole split, with no files beside it; got {', '.join(patterns)}"
                )
        gen = self.generated
        if gen and self.reasoning_gym is None:
            self.reasoning_gym = ReasoningGymSection()
        if not gen and self.reasoning_gym is not None:
            raise ValueError("reasoning_gym: applies to data.train/data.eval given as reasoning_gym:TASK")
        rg = self.reasoning_gym
        same = [s for s, t in gen.items() if s != "train" and t == gen.get("train")]
        if same and rg.overlap():
            raise ValueError(
                f"reasoning_gym.eval_seed: reasoning-gym draws entry i of seed s with Random(s + i), so "
                f"{same[0]}'s seeds {rg.eval_seed}..{rg.eval_seed + rg.eval_size - 1} would repeat training "
                f"prompts of {gen['train']} (seeds {rg.seed}..{rg.seed + rg.size - 1}); use eval_seed >= "
                f"{rg.seed + rg.size} (the default: seed + size)"
            )
        return self

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
