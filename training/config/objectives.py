"""The post-training objectives' sections of the recipe: preference tuning, online RL (its rewards) and
distillation."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, PositiveFloat, PositiveInt, model_validator

from training.config.fields import CodeReference, ModelSource, PathStr, Section, _is_set, verifiers_target

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


# rl.rewards built-ins -> the keyword arguments each takes (training/rl/rewards.py holds them)
BUILTIN_REWARDS = {
    "exact_match": ("column", "answer_tag"),
    "math_equal": ("column", "answer_tag"),
    "math_verify": ("column", "answer_tag"),  # math_equal's other name (it scores with math-verify)
    "reasoning_gym": ("answer_tag",),
    "regex": ("pattern",),
    "length_penalty": ("max_chars",),
    "overlong_penalty": ("buffer",),
    "reward_model": ("path",),
}


class RewardArgs(Section):
    """The built-in rewards' settings, each typed (a reward model's checkpoint is a path like any other)."""

    column: str | None = Field(
        None,
        description="exact_match, math_equal (math_verify): the prompt records' column holding the answer "
        "(default answer)",
    )
    answer_tag: str | None = Field(
        None,
        description="exact_match, math_equal (math_verify), reasoning_gym: score only the text inside the last "
        "<TAG>...</TAG>",
    )
    pattern: str | None = Field(None, description="regex: the expression the whole completion must match")
    max_chars: PositiveInt | None = Field(
        None, description="length_penalty: characters before the penalty starts (default 200)"
    )
    path: PathStr | None = Field(
        None,
        description="reward_model: a sequence-classification checkpoint (num_labels 1) with its tokenizer",
    )
    buffer: PositiveInt | None = Field(
        None,
        description="overlong_penalty: the last tokens before rl.max_new_tokens over which the penalty grows from "
        "0 to -1 (DAPO's soft overlong punishment; default a quarter of max_new_tokens)",
    )

    def given(self) -> dict[str, Any]:
        """The settings the recipe gave, as keyword arguments of the built-in."""
        return self.model_dump(exclude_none=True)


class RewardSpec(Section):
    """One reward function of online RL, weighted: a built-in, or the user's own function."""

    function: Annotated[str, CodeReference(builtins=tuple(BUILTIN_REWARDS))] = Field(
        description="A built-in (exact_match, math_equal or its other name math_verify, reasoning_gym, regex, "
        "length_penalty, overlong_penalty, reward_model) or your own "
        "function: path/to/file.py:name or package.module:name, called as f(prompts=..., completions=..., "
        "completion_ids=..., **extra columns) -> one number per completion"
    )
    weight: float = Field(1.0, description="Weight of this reward in the total (advantages use the total)")
    name: str | None = Field(None, description="Name in the metrics (reward/NAME); default: the function's")
    args: RewardArgs = Field(
        default_factory=RewardArgs,
        description="Built-ins' settings: exact_match/math_equal {column: answer, answer_tag: answer}, "
        "reasoning_gym {answer_tag: answer}, "
        "regex {pattern: ...}, length_penalty {max_chars: 200}, reward_model {path: a "
        "sequence-classification checkpoint with num_labels 1 and its tokenizer}",
    )

    @model_validator(mode="before")
    @classmethod
    def _args_of_the_function(cls, data: Any) -> Any:
        """Each built-in takes its own settings only; your own function takes none (it gets the columns)."""
        if not isinstance(data, dict) or not isinstance(args := data.get("args"), dict):
            return data
        f = data.get("function")
        given = sorted(k for k, v in args.items() if v is not None)
        if f in BUILTIN_REWARDS and (unknown := [k for k in given if k not in BUILTIN_REWARDS[f]]):
            raise ValueError(
                f"args: {', '.join(unknown)} not a setting of {f} (it takes "
                f"{', '.join(BUILTIN_REWARDS[f]) or 'none'})"
            )
        if isinstance(f, str) and ":" in f and given:
            raise ValueError(
                f"args: {', '.join(given)}: args are the built-ins' settings; your own function {f} is called "
                "with the prompt records' columns instead"
            )
        return data

    @model_validator(mode="after")
    def _builtin_args(self):
        f, args = self.function, self.args
        if ":" not in f:
            if f not in BUILTIN_REWARDS:
                raise ValueError(
                    f"function {f!r} is not a built-in reward ({', '.join(BUILTIN_REWARDS)}); name your own "
                    "as path/to/file.py:function or package.module:function"
                )
            if f == "regex" and args.pattern is None:
                raise ValueError("regex needs args.pattern, a regular expression the completion must match")
            if f == "reward_model" and not (args.path or "").strip():
                raise ValueError(
                    "reward_model needs args.path, a sequence-classification checkpoint (num_labels 1) "
                    "with its tokenizer"
                )
            if f == "regex":
                try:
                    re.compile(args.pattern)
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

    # `async` is a Python keyword: the field is async_, read and written as `async`
    model_config = ConfigDict(extra="forbid", validate_assignment=True, serialize_by_alias=True)

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
    rewards: list[RewardSpec] = Field(
        default_factory=list,
        description="Reward functions, weighted and summed (at least one, unless rl.environment gives its own)",
    )
    pass_reward: float | None = Field(
        None,
        description="Held-out pass rate: the share of prompts whose total reward reaches this; "
        "default: the sum of the positive weights (every built-in reward at its best)",
    )
    log_samples: int = Field(
        2, ge=0, description="Prompt/completion/reward triples written to samples.jsonl per logged step"
    )
    generator: Literal["transformers", "vllm", "server"] = Field(
        "transformers",
        description="What samples the completions: transformers' generate with a KV cache (CPU and GPU), a "
        "vLLM engine colocated in each process (CUDA GPUs with the vllm package; the policy's weights pushed "
        "into it before each rollout), or a server on another process or machine (python -m training.serve, at "
        "rl.server_url; the policy's weights pushed to it before each step's rollouts); all keyed by (seed, "
        "step, prompt, generation)",
    )
    batching: Literal["static", "continuous"] = Field(
        "static",
        description="rl.generator=transformers: how the requests share the model: static (each call's requests in "
        "one left-padded generate; an episode's next turn waits for every episode's turn; measured the faster when "
        "the requests arrive together, on CPU and on GPU: docs/benchmarks.md) or continuous (transformers' "
        "continuous batching, paged attention: an episode's next turn is handed in as soon as its tools answer, "
        "while the others are drawn; for tools that take their time). Both draw the same tokens by key",
    )
    server_url: str | None = Field(
        None,
        description="rl.generator=server: the server's OpenAI base URL, e.g. http://127.0.0.1:8000/v1 (its API key, "
        "if it has one, from LLM_FORGE_API_KEY)",
    )
    server_model: str | None = Field(
        None, description="rl.generator=server: the served model's name (default: the one the server serves)"
    )
    server_push: Literal["weights", "adapter"] = Field(
        "weights",
        description="rl.generator=server: how the policy reaches the server before each step's draws: weights "
        "(the weights training changes, a LoRA adapter merged in, POSTed to /v1/weights: python -m "
        "training.serve) or adapter (LoRA only: the adapter saved under the run directory and loaded by the "
        "server from there through vLLM's POST /v1/load_lora_adapter, then drawn by its name: vllm serve "
        "--enable-lora with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True, or python -m training.serve; a server on "
        "another machine must see the run directory at the same path)",
    )
    tools: list[Annotated[str, CodeReference(builtins=("python",))]] = Field(
        default_factory=list,
        description="Tools the policy may call in an episode: python (the built-in sandboxed interpreter) or your "
        "own functions, path/to/file.py:name or package.module:name; their JSON schemas (from type hints and "
        "docstring, transformers' get_json_schema) go into the prompt through the chat template",
    )
    environment: Annotated[str, CodeReference()] | None = Field(
        None,
        description="An environment, path/to/file.py:Class or package.module:Class, as TRL's environment_factory: "
        "reset(**columns) -> str | None before each episode, its public methods are the episode's tools, an "
        "optional get_reward() -> float is one more reward, an optional done attribute ends the episode; or an "
        "OpenEnv environment (a subclass of openenv's Environment, MCP or plain, the envs extra), run unchanged; "
        "or verifiers:ID or verifiers:path/to/env.py, a verifiers environment (its load_environment) run "
        "unchanged in an interpreter of its own (make verifiers), its rubric the rewards",
    )
    environment_args: dict = Field(
        default_factory=dict,
        description="rl.environment=verifiers:...: the keyword arguments of its load_environment(**args)",
    )
    max_turns: PositiveInt | None = Field(
        None,
        description="With tools or an environment: the most assistant replies in an episode (default 4); the "
        "episode also ends on a reply without a tool call, or at max_new_tokens after the prompt (tool output "
        "included)",
    )
    tool_timeout_s: PositiveFloat = Field(
        10.0, description="The python tool: wall-clock seconds a call may run (CPU seconds are limited too)"
    )
    tool_output_chars: PositiveInt = Field(
        2000, description="A tool result longer than this many characters is cut (the episode is told so)"
    )
    dynamic_sampling: int = Field(
        0,
        ge=0,
        description="DAPO's dynamic sampling: a group whose rewards are all equal (no signal) is replaced by the "
        "group of another training prompt, drawn by (seed, step, row, try), up to this many tries; 0: off",
    )
    refill_ahead: bool = Field(
        False,
        description="Dynamic sampling draws every try's replacement groups in the step's first generation call, "
        "beside the groups they may replace (verl's oversampling): one call instead of up to 1 + dynamic_sampling "
        "rounds, each waiting for the last. The same groups are chosen (each is drawn by its own key); the price "
        "is the replacements no flat group needs. Pays where generation waits on its decoding steps more than on "
        "its batch's size (CPUs, small batches)",
    )
    gather_for_generation: bool = Field(
        True,
        description="Under ZeRO-3 and FSDP2 the policy's sharded weights are gathered whole once per generation "
        "call, each process then generating on its own (TRL's ds3_gather_for_generation): false keeps them "
        "sharded, every decoding step gathering each layer's weights (for a model too big to hold whole on one "
        "process; 12x slower on the agent test's tiny model under ZeRO-3)",
    )
    async_: int = Field(
        0,
        ge=0,
        alias="async",
        description="Asynchronous, off-policy steps: the rollouts of step N + K are generated (in the "
        "background, on a copy of the policy) while steps N .. N + K - 1 train, so each step trains on "
        "completions of weights exactly min(K, N - 1) updates old (logged as staleness); the loss corrects for "
        "the generating policy with truncated importance sampling (importance_sampling_cap). 0: off "
        "(synchronous, on-policy). Stale updates want a smaller train.lr (docs/rl.md)",
    )
    importance_sampling_cap: PositiveFloat = Field(
        3.0,
        description="rl.async: the importance weight p_current / p_generating of each token is truncated at "
        "this (TIS, TRL's vllm_importance_sampling_clip_max)",
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
        if self.pass_reward is None and self.environment is None:  # an environment's own reward: at set-up
            self.pass_reward = sum(r.weight for r in self.rewards if r.weight > 0)
        for i, r in enumerate(self.rewards):
            if r.function == "overlong_penalty" and (r.args.buffer or 0) > self.max_new_tokens:
                raise ValueError(
                    f"rewards[{i}].args.buffer: {r.args.buffer} is more than max_new_tokens={self.max_new_tokens}"
                )
        if self.beta > 0 and self.reference == "none":
            raise ValueError("beta > 0 penalises the KL to a reference: set reference=auto, or beta=0")
        if self.beta == 0 and self.reference in ("adapter_disabled", "frozen_copy"):
            raise ValueError(f"reference={self.reference} is the KL reference: set beta > 0 or remove it")
        if not self.episodes and self.max_turns is not None:
            raise ValueError(
                "max_turns: episodes of several turns need tools or an environment (rl.tools, rl.environment)"
            )
        if not self.rewards and self.environment is None:
            raise ValueError("rewards: at least one reward function (or an rl.environment with get_reward)")
        self._verifiers_settings()
        if self.episodes and self.max_turns is None and verifiers_target(self.environment) is None:
            self.max_turns = 4
        if self.batching == "continuous" and self.generator != "transformers":
            raise ValueError(
                f"batching: continuous is transformers' continuous batching; generator {self.generator} schedules "
                "its own requests: remove batching, or use generator: transformers"
            )
        if (self.generator == "server") != (self.server_url is not None):
            raise ValueError("generator: server draws from the server at server_url: give both, or neither")
        if self.server_push != "weights" and self.generator != "server":
            raise ValueError(
                f"server_push: {self.server_push} is how weights reach generator: server; remove it"
            )
        if self.refill_ahead and not self.dynamic_sampling:
            raise ValueError(
                "refill_ahead: draws dynamic sampling's replacements ahead: set dynamic_sampling > 0"
            )
        if self.async_ and self.num_iterations > 1:
            raise ValueError(
                "async: rollouts reused for num_iterations > 1 steps are already off-policy; use one of them"
            )
        if self.async_ and self.generator == "vllm":
            raise ValueError(
                "async: generates on a copy of the policy with transformers' generate; the colocated vLLM "
                "engine holds the one copy: use generator: transformers, or async: 0"
            )
        return self

    def _verifiers_settings(self) -> None:
        """A verifiers environment owns its rollout loop: its tools, turns and model calls are its own."""
        if verifiers_target(self.environment) is None:
            if self.environment_args:
                raise ValueError("environment_args: the arguments of a verifiers environment (verifiers:...)")
            return
        clash = [
            k
            for k, on in (
                ("tools", bool(self.tools)),
                ("max_turns", self.max_turns is not None),
                ("async", bool(self.async_)),
                ("generator", self.generator != "transformers"),
            )
            if on
        ]
        if clash:
            raise ValueError(
                f"{clash[0]}: a verifiers environment runs its own episodes (its tools, its turns: pass them in "
                "environment_args), calling the policy as it trains through a server on 127.0.0.1; leave "
                f"{', '.join(clash)} unset"
            )

    @property
    def episodes(self) -> bool:
        """Rollouts are episodes of several turns (tools or an environment), not single replies."""
        return bool(self.tools) or self.environment is not None

    @property
    def needs_reference(self) -> bool:
        return self.beta > 0

    def columns(self) -> list[str]:
        """The data columns the built-in rewards read (every prompt record must have them)."""
        compare = ("exact_match", "math_equal", "math_verify")
        columns = {r.args.column or "answer" for r in self.rewards if r.function in compare}
        if any(r.function == "reasoning_gym" for r in self.rewards):
            columns.add("reasoning_gym")  # the records data.train: reasoning_gym:TASK makes
        return sorted(columns)


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
