"""Online RL built from a recipe and registered as an objective kind (training.objectives.registry): the
generation engine, the rewards, the episodes' tools and environment, the KL reference, the rollout stage and
the objective."""

from __future__ import annotations

import copy
import logging
import os

import torch

from training.config import Recipe, RLSection, verifiers_target
from training.core.errors import DataError, UserError
from training.core.hosts import API_KEY_ENV
from training.data.prompts import prompt_format, row_columns
from training.data.tokenize import probe_tools
from training.generation import Engine, TransformersEngine
from training.generation.cb_engine import ContinuousBatchingEngine, engine_for
from training.generation.prefix_cache import reuse_refusal
from training.generation.server_engine import AdapterPush, ServerEngine
from training.generation.transformers_engine import not_gathered
from training.generation.vllm_engine import VLLMEngine, check_vllm_installed
from training.objectives.registry import ObjectiveContext, ObjectiveKind, register
from training.rl.ahead import AheadRollouts
from training.rl.episode import EpisodeRunner, env_seed
from training.rl.objective import RLObjective
from training.rl.rewards import Reward, load_rewards
from training.rl.rollouts import RolloutStage
from training.rl.tools import check_deterministic, load_environment, load_tools
from training.rl.verifiers_env import VerifiersRunner, interpreter, rubric_rewards, start_worker
from training.run.rundir import RunDir

log = logging.getLogger(__name__)


def frozen_copy(model: torch.nn.Module) -> torch.nn.Module:
    """The KL reference of full fine-tuning: a copy of the policy as it is now, frozen (eval mode, no
    gradients; the optimizer never sees it). Taken from the prepared model's module, so it computes as the
    policy does (accelerate's autocast forward is copied with it, bound to the copy)."""
    reference = copy.deepcopy(model)
    reference.requires_grad_(False)
    return reference.eval()


def check_columns(cfg: RLSection, columns: dict) -> None:
    """Every row of every split has the columns the built-in rewards read (a cached split skips the load-time
    check)."""
    for split, (_, extras) in columns.items():
        for column in cfg.columns():
            missing = next((i for i, e in enumerate(extras) if e.get(column) is None), None)
            if missing is not None:
                raise DataError(
                    f"data.{split}: prompt row {missing} has no column '{column}', which a reward reads"
                )


def build_rl_objective(c: ObjectiveContext) -> RLObjective:
    """The recipe's RL objective; `c.splits`: {split name: tokenized prompt dataset}; `c.synced`: the model is
    sharded (ZeRO-3/FSDP), so every rank steps generation together; `c.model`: the prepared policy, still
    with its initial weights (rl.reference=frozen_copy copies it: build before resuming)."""
    recipe, accelerator, tokenizer = c.recipe, c.accelerator, c.tokenizer
    cfg = recipe.rl
    engine = make_engine(
        recipe, accelerator, tokenizer, c.synced, accelerator.unwrap_model(c.model), c.whole_for_generation
    )
    columns = {name: row_columns(ds) for name, ds in c.splits.items() if ds is not None}
    check_columns(cfg, columns)
    rewards = load_rewards(cfg, accelerator.device)
    runner = None
    if verifiers_target(cfg.environment) is not None:
        runner = verifiers_runner(recipe, tokenizer, engine)
        rewards += rubric_rewards(runner.worker)
    elif cfg.episodes:
        runner = episode_runner(recipe, tokenizer, engine, columns["train"])
        if runner.environments is not None and runner.environments.owns_reward:
            rewards.append(environment_reward(runner.environments))
    if cfg.pass_reward is None:  # an environment's rewards, known now (the schema sets it for the others)
        cfg.pass_reward = sum(r.weight for r in rewards if r.weight > 0)
    reference = None
    if cfg.reference == "frozen_copy":
        reference = frozen_copy(accelerator.unwrap_model(c.model, keep_torch_compile=False))
    in_step = isinstance(engine, TransformersEngine) and engine.in_step  # vLLM, a server: never in step
    recomputed = reuse_refusal(accelerator.unwrap_model(c.model), in_step)
    continuous = isinstance(engine, ContinuousBatchingEngine)
    with accelerator.autocast():  # rollouts off the main thread (rl.async) go through the adapter itself
        merged = type(engine) is TransformersEngine and not cfg.async_
        merged = merged and engine.merges(accelerator.unwrap_model(c.model), accelerator.device.type)
    log.info("online RL: %s", described(cfg, rewards, recomputed, continuous, merged))
    stage = RolloutStage(
        cfg,
        accelerator,
        engine,
        rewards,
        tokenizer,
        columns,
        reference=reference,
        runner=runner,
        messages_of=prompt_messages(recipe.data),
        train_prompts=c.splits["train"].select_columns(["input_ids", "row"])
        if cfg.dynamic_sampling
        else None,
    )
    if runner is not None:
        runner.calls_of = stage.calls
    if isinstance(runner, VerifiersRunner):
        runner.probe(accelerator.unwrap_model(c.model), stage.episode_start(0, "check"))
    ahead = None
    if cfg.async_:
        live = accelerator.unwrap_model(c.model, keep_torch_compile=False)
        ahead = AheadRollouts(stage, cfg.async_, live, c.upcoming, c.total_steps)
        log.info(
            "rl.async=%d: each step trains on rollouts drawn in the background from weights %d update(s) old "
            "(fewer for the first steps), weighted by the truncated importance ratio (cap %g)",
            cfg.async_,
            cfg.async_,
            cfg.importance_sampling_cap,
        )
    return RLObjective(cfg, accelerator, stage, c.mask_rows, c.gather, c.run_dir.samples, ahead=ahead)


def make_engine(
    recipe: Recipe, accelerator, tokenizer, synced: bool, model, whole_for_generation=not_gathered
) -> Engine:
    """What draws the completions of `model` (the policy, unwrapped): transformers' generate (keyed) or its
    continuous batching (rl.batching, where the model takes it), a server, or a colocated vLLM engine.
    `whole_for_generation`: ZeRO-3's or FSDP2's weights gathered for each call (unless rl.gather_for_generation
    is false)."""
    cfg = recipe.rl
    eos = tokenizer.eos_token_id
    eos_ids = [eos] if isinstance(eos, int) else list(eos)
    if tokenizer.pad_token_id is None:
        raise UserError(
            f"model.tokenizer: {recipe.model.tokenizer or recipe.model.name_or_path} has no pad token"
        )
    engine = TransformersEngine(
        recipe.seed,
        cfg.max_new_tokens,
        cfg.temperature,
        cfg.top_p,
        eos_ids,
        tokenizer.pad_token_id,
        synced,
        gathered=whole_for_generation if cfg.gather_for_generation else not_gathered,
        autocast=accelerator.autocast,
    )
    if cfg.generator == "transformers":
        # continuous batching where the model takes it; else batched generate, said why
        return engine_for(model, engine, say=log.info) if cfg.batching == "continuous" else engine
    if cfg.generator == "server":
        adapters = None
        if cfg.server_push == "adapter":  # where the server reads each version of the adapter from
            adapters = AdapterPush(RunDir(recipe.output_dir).served_adapters, accelerator.process_index)
        served = ServerEngine(engine, cfg.server_url, cfg.server_model, os.environ.get(API_KEY_ENV), adapters)
        served.check("rl.server_url")
        return served
    check_vllm_installed()
    return VLLMEngine(
        engine,
        accelerator,
        tokenizer,
        gpu_memory_utilization=cfg.vllm_gpu_memory_utilization,
        max_model_len=recipe.data.max_length + cfg.max_new_tokens,
    )


def described(
    cfg: RLSection,
    rewards: list[Reward],
    recomputed: str | None = None,
    continuous: bool = False,
    merged: bool = False,
) -> str:
    """The start-up line's account of the objective; `recomputed`: why transformers' generate computes every
    context again (prefix_cache.reuse_refusal), None where it reuses them; `continuous`: the engine is
    transformers' continuous batching; `merged`: generate runs a copy of the base with the adapter merged."""
    to = {
        "frozen_copy": "a frozen copy of the initial model",
        "adapter_disabled": "the base under the adapter",
    }
    source = {
        "vllm": "a colocated vLLM engine",
        "server": f"the server at {cfg.server_url}",
        "transformers": "transformers' generate (batched, keyed, "
        + (
            f"contexts computed again at each call: {recomputed})"
            if recomputed
            else "each context computed once"
            + (", on a copy of the base with the adapter merged)" if merged else ")")
        )
        if not continuous
        else "transformers' continuous batching (paged attention, keyed)",
    }[cfg.generator]
    if verifiers_target(cfg.environment) is not None:
        source = f"the environment {cfg.environment}, calling the policy on 127.0.0.1 (keyed)"
    return (
        f"{cfg.loss_type} loss, {cfg.advantage} advantages (scale {cfg.scale_rewards}), {cfg.num_generations} "
        f"completions per prompt from {source}, rewards {', '.join(f'{r.name} x {r.weight:g}' for r in rewards)}"
        + (f", KL beta {cfg.beta:g} to {to[cfg.reference]}" if cfg.beta > 0 else "")
    )


def prompt_messages(data):
    """A prompt record's prompt (as the columns keep it) -> the messages it was rendered from."""
    fmt = prompt_format(data)
    return lambda prompt: fmt.messages({fmt.name("prompt"): prompt})


def episode_runner(recipe: Recipe, tokenizer, engine: Engine, train_columns) -> EpisodeRunner:
    """rl.tools and rl.environment loaded and checked: the chat template renders tools, every tool has a schema,
    the environment resets alike twice under one seed (else a warning naming it)."""
    cfg, data = recipe.rl, recipe.data
    if why := probe_tools(tokenizer, data.chat_template_kwargs):
        raise UserError(
            f"rl.tools / rl.environment: the chat template cannot render tools ({why}); give one that does: "
            "data.chat_template: data/tools/chatml_tools.jinja (Hermes/Qwen tags) or the model family's own"
        )
    (tools, schemas), envs = load_tools(cfg), load_environment(cfg)
    if envs is not None:
        schemas = schemas + envs.schemas
        first = {"prompt": train_columns[0][0], **train_columns[1][0]}
        if warning := check_deterministic(envs, first, env_seed(recipe.seed, 0, 0)):
            log.warning(warning)
    names = [s["function"]["name"] for s in schemas]
    log.info(
        "episodes: up to %d turns and %d tokens after the prompt; tools %s%s",
        cfg.max_turns,
        cfg.max_new_tokens,
        ", ".join(names) or "none",
        f"; environment {envs.name}" + (" (its own reward)" if envs.owns_reward else "") if envs else "",
    )
    return EpisodeRunner(
        engine,
        tokenizer,
        tools,
        envs,
        cfg.max_turns,
        cfg.max_new_tokens,
        cfg.tool_output_chars,
        dict(data.chat_template_kwargs),
        schemas,
        calls_of=lambda n: n,
    )


def verifiers_runner(recipe: Recipe, tokenizer, engine: Engine) -> VerifiersRunner:
    """rl.environment=verifiers:...: its worker started and the environment loaded (said at start-up)."""
    cfg = recipe.rl
    worker = start_worker(cfg)
    log.info(
        "episodes: the verifiers environment %s (%s) runs its own rollouts in %s; its rubric: %s",
        cfg.environment,
        worker.kind,
        interpreter(),
        ", ".join(f"{n} x {w:g}" for n, w in worker.rewards),
    )
    return VerifiersRunner(
        worker, tokenizer, cfg, recipe.seed, engine.eos_token_ids, dict(recipe.data.chat_template_kwargs)
    )


def environment_reward(envs) -> Reward:
    """The environment's get_reward as one more reward (weight 1, named after its class), as TRL adds it."""

    def get_reward(environments, **kw):
        return [e.get_reward() for e in environments]

    return Reward(envs.name, 1.0, get_reward, f"rl.environment ({envs.name}).get_reward")


register(
    ObjectiveKind("rl", applies=lambda recipe: recipe.rl is not None, build=build_rl_objective, priority=30)
)
