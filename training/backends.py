"""Distributed backends and the one list of what cannot run where.

A backend is what one accelerate config file asks for (single process, DDP, FSDP or DeepSpeed ZeRO,
sharding, offload, and the device mesh of its `parallelism_config` block: tensor parallelism, HSDP). The planner reads it from the YAML file (`read_backend`); the training processes
read it from the environment variables `accelerate launch --config_file FILE` turns that file into
(`launched_backend`). Both go through the same parser, so they see the same backend.

`refusal(recipe, backend, cuda)` is the single table of recipe settings a backend or a machine without
CUDA cannot run: the trainer raises its error before anything loads (exit 2), and the planner shows
its message as the reason a configuration does not fit. `check_tensor_parallel(config, backend)` adds
the checks that need the model's config (a tensor-parallel plan, heads divisible by tp_size).

Meshes keep the backend's kind: a MULTI_GPU file with `parallelism_config_tp_size: 2` (tp.yaml) is kind
"ddp" with tp_size 2 (dp_size 1), fsdp_tp.yaml is kind "fsdp" with dp_shard 2 x tp 2, hsdp.yaml kind
"fsdp" with dp_replicate 2 x dp_shard 2. What a backend shards (kind, shard) and what its mesh splits
(tp_size, dp_shard_size, dp_replicate_size) are independent, so every rule reads only the field it is about.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from training.config import Recipe
from training.errors import RecipeError, UserError

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Backend:
    """What matters, for memory and for what can run, in one accelerate config."""

    name: str
    file: str
    kind: str  # single | ddp | fsdp | deepspeed
    cpu: bool = False  # runs on CPU processes (use_cpu: true)
    zero_stage: int = 0
    shard: str = "none"  # none | grads_optim (ZeRO-1 optim only: "optim") | full | hybrid
    offload_optimizer: bool = False
    offload_params: bool = False
    activation_checkpointing: bool = False
    num_machines: int = 1
    num_processes: int = 1  # on all machines together, as accelerate counts them (the launched WORLD_SIZE)
    zero3_init: bool = False
    gathers_16bit: bool = False  # ZeRO-3 gathers 16-bit weights when saving, so final/ can be exported
    deepspeed_file: Path | None = None  # the DeepSpeed JSON, found
    ds: dict = field(default_factory=dict, repr=False)  # its zero_optimization section
    ds_config: dict = field(default_factory=dict, repr=False)  # the whole DeepSpeed JSON
    # the device mesh of the file's parallelism_config block (accelerate's ParallelismConfig); 1 = unused
    dp_replicate_size: int = 1
    dp_shard_size: int = 1
    tp_size: int = 1
    cp_size: int = 1
    # DeepSpeed Ulysses (parallelism_config_sp_size): DeepSpeed's own groups, not in the mesh
    sp_size: int = 1
    # expert parallelism (training/expert_parallel.py): MoE experts sharded over this many DDP ranks
    ep_size: int = 1
    # pipeline parallelism (training/pipeline.py): stages, schedule, micro-batches per optimizer micro-step
    pp_size: int = 1
    pp_schedule: str = "1F1B"
    pp_microbatches: int | None = None  # None: one per row of train.batch_size

    @property
    def shards_parameters(self) -> bool:
        """FSDP and ZeRO-3 split every parameter across ranks as the model loads."""
        return self.kind == "fsdp" or (self.kind == "deepspeed" and self.zero_stage == 3)

    @property
    def mesh_sizes(self) -> dict[str, int]:
        """The mesh dimensions in use (size > 1), in accelerate's order (tp innermost)."""
        sizes = {
            "pp": self.pp_size,
            "dp_replicate": self.dp_replicate_size,
            "dp_shard": self.dp_shard_size,
            "cp": self.cp_size,
            "tp": self.tp_size,
        }
        return {k: v for k, v in sizes.items() if v > 1}

    @property
    def mesh(self) -> str:
        """e.g. "dp_shard=2 x tp=2"; "" without a mesh (no parallelism_config, or all its sizes 1)."""
        return " x ".join(f"{k}={v}" for k, v in self.mesh_sizes.items())

    @property
    def mesh_size(self) -> int:
        """Processes the mesh needs: pp x dp_replicate x dp_shard x cp x tp (1 without a mesh)."""
        return math.prod(self.mesh_sizes.values())

    @property
    def dp_size(self) -> int:
        """Data-parallel degree (ranks that see different batches): dp_replicate x dp_shard of a mesh,
        else all processes (= world / (tp x cp) whenever the mesh matches the processes)."""
        if self.mesh:
            return self.dp_replicate_size * self.dp_shard_size
        return max(1, self.num_processes // self.sp_size)  # a Ulysses group shares its sequences


# ----------------------------------------------------------------------------- reading accelerate configs


def _truthy(v) -> bool:
    return str(v).strip().lower() in ("true", "1", "yes")


def read_backend(path: Path) -> Backend:
    """Parse one accelerate config YAML generically (distributed_type, fsdp_config, deepspeed_config)."""
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise UserError(f"accelerate config {path}: not valid YAML ({getattr(e, 'problem', e)})") from None
    if not isinstance(raw, dict):
        raise UserError(f"accelerate config {path}: expected a mapping of keys")
    return parse_backend(raw, path.stem, str(path), f"accelerate config {path}", near=path.parent)


def read_backends(configs_dir: Path) -> list[Backend]:
    if not configs_dir.is_dir():
        raise UserError(f"no accelerate configs: {configs_dir} is not a directory")
    files = sorted(p for p in configs_dir.iterdir() if p.suffix in (".yaml", ".yml"))
    if not files:
        raise UserError(f"no accelerate configs (*.yaml) in {configs_dir}")
    return [read_backend(p) for p in files]


def parse_backend(raw: dict, name: str, file: str, origin: str, near: Path | None = None) -> Backend:
    """The Backend of an accelerate config mapping; `origin` names it in errors, `near` is the folder
    a relative deepspeed_config_file is also looked up in."""
    dtype = str(raw.get("distributed_type", "NO")).upper()
    b = Backend(
        name=name,
        file=file,
        kind="single",
        cpu=_truthy(raw.get("use_cpu", False)) or dtype == "MULTI_CPU",
        num_machines=int(raw.get("num_machines", 1) or 1),
        num_processes=int(raw.get("num_processes", 1) or 1),
    )
    if dtype in ("MULTI_GPU", "MULTI_CPU", "MULTI_XPU", "MULTI_NPU"):
        b.kind = "ddp"
    elif dtype == "FSDP":
        _read_fsdp(b, raw.get("fsdp_config") or {})
    elif dtype == "DEEPSPEED":
        _read_deepspeed(b, raw.get("deepspeed_config") or {}, origin, near)
    _read_mesh(b, raw.get("parallelism_config") or {}, origin)
    return b


MESH_KEYS = {  # accelerate config key -> Backend field (sp_size: DeepSpeed Ulysses' degree, not a mesh dimension)
    "parallelism_config_dp_replicate_size": "dp_replicate_size",
    "parallelism_config_dp_shard_size": "dp_shard_size",
    "parallelism_config_tp_size": "tp_size",
    "parallelism_config_cp_size": "cp_size",
    "parallelism_config_sp_size": "sp_size",
    "parallelism_config_pp_size": "pp_size",  # ours: accelerate has no pipeline (see PIPELINE_KEYS)
}
# Pipeline keys: accelerate 1.15 copies a parallelism_config block's keys onto its launch arguments but
# exports only its own sizes to the training processes, so these (and EP_KEY) reach them through
# launcher_keys(), which reads the launcher's --config_file.
PIPELINE_KEYS = (
    "parallelism_config_pp_size",
    "parallelism_config_pp_schedule",
    "parallelism_config_pp_microbatches",
)
PIPELINE_SCHEDULES = ("GPipe", "1F1B")


def _read_mesh(b: Backend, pc: dict, origin: str) -> None:
    """The sizes of a `parallelism_config` block. accelerate copies its keys verbatim onto its launch
    arguments, so a key without the `parallelism_config_` prefix would be ignored without a word."""
    if not isinstance(pc, dict):
        raise UserError(f"{origin}: parallelism_config must be a mapping of parallelism_config_* keys")
    for key, value in pc.items():
        if not str(key).startswith("parallelism_config_"):
            raise UserError(
                f"{origin}: parallelism_config key {key} would be ignored by accelerate; "
                f"spell it parallelism_config_{key} (as in accelerate_configs/fsdp_tp.yaml)"
            )
        if key in MESH_KEYS:
            try:
                size = int(value)
            except (TypeError, ValueError):
                size = 0
            if size < 1 or str(value).strip() != str(size):
                raise UserError(f"{origin}: {key} must be a whole number >= 1 (got {value!r})")
            setattr(b, MESH_KEYS[key], size)
        elif key == EP_KEY:
            b.ep_size = _read_ep_size(value, origin)
        elif key == "parallelism_config_pp_schedule":
            names = {n.lower(): n for n in PIPELINE_SCHEDULES}
            if str(value).lower() not in names:
                raise UserError(
                    f"{origin}: {key} must be one of {', '.join(PIPELINE_SCHEDULES)} (got {value!r})"
                )
            b.pp_schedule = names[str(value).lower()]
        elif key == "parallelism_config_pp_microbatches" and value is not None:
            if not str(value).strip().isdigit() or int(value) < 1:
                raise UserError(f"{origin}: {key} must be a whole number >= 1 (got {value!r})")
            b.pp_microbatches = int(value)


# Expert parallelism: ours (accelerate 1.15 has no such key). It is not a mesh dimension of its own: the
# experts are sharded over the data-parallel (DDP) ranks, which keep every other weight whole. Like the
# pipeline keys it reaches the training processes through launcher_keys().
EP_KEY = "parallelism_config_ep_size"


def _read_ep_size(value, origin: str) -> int:
    if not str(value).strip().isdigit() or int(value) < 1:
        raise UserError(f"{origin}: {EP_KEY} must be a whole number >= 1 (got {value!r})")
    return int(value)


def launcher_config_file() -> Path | None:
    """The accelerate config file this process was launched with: $LLM_FORGE_ACCELERATE_CONFIG if set
    (for launchers other than `accelerate launch`), else the `--config_file` of the `accelerate launch`
    process that started this one (its parent: torch's elastic agent runs inside it), else accelerate's
    default config file when that launch named none. None when not launched by accelerate."""
    if path := os.environ.get("LLM_FORGE_ACCELERATE_CONFIG"):
        return Path(path)
    try:
        import psutil

        argv = psutil.Process(os.getppid()).cmdline()
    except Exception:  # no such process, or not allowed to read it
        return None
    if "launch" not in argv or not any(Path(a).name.startswith("accelerate") for a in argv[:3]):
        return None
    from accelerate.commands.config import default_config_file
    from accelerate.commands.launch import launch_command_parser

    args, _ = launch_command_parser().parse_known_args(argv[argv.index("launch") + 1 :])
    path = args.config_file or (default_config_file if os.path.isfile(default_config_file) else None)
    return Path(path) if path else None


def launcher_keys() -> dict:
    """Our own parallelism_config keys (PIPELINE_KEYS, EP_KEY) of the launcher's accelerate config file,
    which accelerate does not pass on to the training processes; {} when there is none."""
    path = launcher_config_file()
    if path is None or not path.is_file():
        return {}
    raw = yaml.safe_load(path.read_text()) or {}
    pc = (raw.get("parallelism_config") or {}) if isinstance(raw, dict) else {}
    return {k: v for k, v in pc.items() if k in (*PIPELINE_KEYS, EP_KEY)} if isinstance(pc, dict) else {}


_FSDP_SHARDING = {
    "1": "full",
    "FULL_SHARD": "full",
    "2": "grads_optim",
    "SHARD_GRAD_OP": "grads_optim",
    "3": "none",
    "NO_SHARD": "none",
    "4": "hybrid",
    "HYBRID_SHARD": "hybrid",
    "5": "hybrid",
    "HYBRID_SHARD_ZERO2": "hybrid",
}


def _read_fsdp(b: Backend, fs: dict) -> None:
    b.kind = "fsdp"
    strategy = str(fs.get("fsdp_sharding_strategy", "FULL_SHARD")).upper()
    if "fsdp_reshard_after_forward" in fs:  # FSDP2 spelling
        reshard = fs["fsdp_reshard_after_forward"]
        if _truthy(reshard):
            strategy = "FULL_SHARD"
        else:
            strategy = "SHARD_GRAD_OP" if str(reshard).lower() == "false" else str(reshard).upper()
    b.shard = _FSDP_SHARDING.get(strategy, "full")
    b.offload_params = b.offload_optimizer = _truthy(fs.get("fsdp_offload_params", False))
    b.activation_checkpointing = _truthy(fs.get("fsdp_activation_checkpointing", False))


def _read_deepspeed(b: Backend, dc: dict, origin: str, near: Path | None) -> None:
    """A DeepSpeed JSON (deepspeed_config_file) decides over the accelerate config's own keys; accelerate
    refuses a config that sets both. ZeRO stage 2 is DeepSpeedPlugin's default."""
    b.kind = "deepspeed"
    if dc.get("deepspeed_config_file"):
        b.deepspeed_file = find_deepspeed_json(str(dc["deepspeed_config_file"]), origin, near)
        b.ds_config = read_deepspeed_json(b.deepspeed_file)
        zo = b.ds_config.get("zero_optimization", {})
    else:
        zo = {}
    b.ds = zo
    b.zero_stage = int(zo.get("stage", dc.get("zero_stage", 2)) or 0)

    def offloads(key: str, alt: str) -> bool:
        return str((zo.get(key) or {}).get("device", dc.get(alt, "none")) or "none").lower() not in (
            "none",
            "",
        )

    b.offload_optimizer = offloads("offload_optimizer", "offload_optimizer_device")
    b.offload_params = offloads("offload_param", "offload_param_device")
    b.zero3_init = _truthy(dc.get("zero3_init_flag", False))
    b.gathers_16bit = zo.get("stage3_gather_16bit_weights_on_model_save") is True or _truthy(
        dc.get("zero3_save_16bit_model", False)
    )
    b.shard = {0: "none", 1: "optim", 2: "grads_optim", 3: "full"}.get(b.zero_stage, "full")


def find_deepspeed_json(raw: str, origin: str, near: Path | None = None) -> Path:
    """The DeepSpeed JSON an accelerate config names: as given (absolute, or relative to the working
    directory), next to the accelerate config, or relative to the repository root (so
    `accelerate_configs/ds_*.json` works from any directory)."""
    path = Path(raw).expanduser()
    folders = [Path.cwd(), *([near] if near is not None else []), ROOT]
    candidates = [path, *([near / path] if near is not None else []), ROOT / path]
    if near is not None:
        candidates.append(near / path.name)
    for candidate in candidates:
        if candidate.is_file():
            return candidate.resolve()
    raise UserError(
        f"{origin}: deepspeed_config_file {raw} does not exist (looked in {', '.join(map(str, folders))}); "
        f"use a path relative to the repository root, e.g. accelerate_configs/ds_zero2.json, or an absolute path"
    )


def read_deepspeed_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"DeepSpeed config {path} line {e.lineno}: not valid JSON ({e.msg})") from None


# ----------------------------------------------------------------------------- the backend this process was launched with

# accelerate config key -> the variable `accelerate launch` sets from it for the training processes
_DEEPSPEED_ENV = {
    "deepspeed_config_file": "ACCELERATE_DEEPSPEED_CONFIG_FILE",
    "zero_stage": "ACCELERATE_DEEPSPEED_ZERO_STAGE",
    "offload_optimizer_device": "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE",
    "offload_param_device": "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE",
    "zero3_init_flag": "ACCELERATE_DEEPSPEED_ZERO3_INIT",
    "zero3_save_16bit_model": "ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL",
}
_FSDP_ENV = {
    "fsdp_sharding_strategy": "FSDP_SHARDING_STRATEGY",
    "fsdp_reshard_after_forward": "FSDP_RESHARD_AFTER_FORWARD",
    "fsdp_offload_params": "FSDP_OFFLOAD_PARAMS",
    "fsdp_activation_checkpointing": "FSDP_ACTIVATION_CHECKPOINTING",
}


def _flag(name: str) -> bool:
    return _truthy(os.environ.get(name, "false"))


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def launched_backend() -> Backend:
    """The backend `accelerate launch` asked for, rebuilt from the environment it gives each process:
    ACCELERATE_USE_DEEPSPEED / ACCELERATE_USE_FSDP and their settings, ACCELERATE_USE_CPU, the mesh
    (ACCELERATE_USE_PARALLELISM_CONFIG and PARALLELISM_CONFIG_*_SIZE), and the WORLD_SIZE /
    LOCAL_WORLD_SIZE of torchrun (several processes without either flag: DDP)."""
    env = os.environ
    local = int(env.get("LOCAL_WORLD_SIZE", world_size()))
    raw: dict = {
        "use_cpu": _flag("ACCELERATE_USE_CPU"),
        "num_processes": world_size(),
        "num_machines": max(1, world_size() // local),
    }
    if _flag("ACCELERATE_USE_PARALLELISM_CONFIG"):
        raw["parallelism_config"] = {
            key: env[var]
            for key in MESH_KEYS
            if (var := key.upper()) in env  # PARALLELISM_CONFIG_TP_SIZE, ...
        }
        raw["parallelism_config"].update(launcher_keys())  # ours: pipeline stages, expert parallelism
    if _flag("ACCELERATE_USE_DEEPSPEED"):
        raw["distributed_type"] = "DEEPSPEED"
        raw["deepspeed_config"] = {
            k: env[v] for k, v in _DEEPSPEED_ENV.items() if env.get(v, "none") not in ("", "none")
        }
    elif _flag("ACCELERATE_USE_FSDP"):
        raw["distributed_type"] = "FSDP"
        raw["fsdp_config"] = {k: env[v] for k, v in _FSDP_ENV.items() if v in env}
    else:
        raw["distributed_type"] = "MULTI_GPU" if world_size() > 1 else "NO"
    return parse_backend(raw, "launched", "", "accelerate config")


# ----------------------------------------------------------------------------- what cannot run where

Rule = Callable[[Recipe, Backend, bool], UserError | None]


# The trainer rebuilds the backend from the launcher's environment, which does not name the file:
# messages say "the accelerate config" so that the trainer and the planner (whose row names the file)
# give the same one.
WHERE = "the accelerate config"


PIPELINE_WORKS = (
    "pipeline stages run full training (method.type=full) under distributed_type MULTI_GPU with "
    "parallelism_config_pp_size and optionally parallelism_config_dp_replicate_size "
    "(accelerate_configs/pp.yaml, pp_dp.yaml)"
)


def _pipeline_combinations(recipe: Recipe, b: Backend, cuda: bool) -> UserError | None:
    """What training/pipeline.py does not combine with pipeline stages, and the processes it needs."""
    if b.pp_size <= 1:
        return None
    if b.kind in ("fsdp", "deepspeed"):
        what = "FSDP" if b.kind == "fsdp" else "DeepSpeed"
        return UserError(
            f"{WHERE}: parallelism_config_pp_size={b.pp_size} with {what} is not supported; {PIPELINE_WORKS}"
        )
    others = {k: v for k, v in (("dp_shard", b.dp_shard_size), ("tp", b.tp_size), ("cp", b.cp_size)) if v > 1}
    if others:
        keys = ", ".join(f"parallelism_config_{k}_size={v}" for k, v in others.items())
        return UserError(
            f"{WHERE}: parallelism_config_pp_size={b.pp_size} with {keys} is not supported; {PIPELINE_WORKS}"
        )
    if recipe.method.type != "full":
        return RecipeError(
            f"method.type={recipe.method.type} cannot be used with pipeline stages (parallelism_config_pp_size="
            f"{b.pp_size} in {WHERE}) yet; {PIPELINE_WORKS}. For adapters use ddp.yaml or fsdp.yaml"
        )
    if b.num_processes % b.pp_size:
        return UserError(
            f"{WHERE}: {b.num_processes} processes cannot be split into parallelism_config_pp_size={b.pp_size} "
            f"pipeline stages (not divisible); launch with --num_processes a multiple of {b.pp_size}"
        )
    if b.pp_size * b.dp_replicate_size != b.num_processes:
        return UserError(
            f"{WHERE}: parallelism_config_pp_size={b.pp_size} x parallelism_config_dp_replicate_size="
            f"{b.dp_replicate_size} needs {b.pp_size * b.dp_replicate_size} processes but the launch has "
            f"{b.num_processes}; launch with --num_processes {b.pp_size * b.dp_replicate_size} or set "
            f"parallelism_config_dp_replicate_size to {b.num_processes // b.pp_size}"
        )
    rows, m = recipe.train.batch_size, b.pp_microbatches or recipe.train.batch_size
    if m < b.pp_size:
        return RecipeError(
            f"the {b.pp_schedule} schedule needs at least as many micro-batches as stages: {m} micro-batches "
            f"(parallelism_config_pp_microbatches, default train.batch_size={rows}) < parallelism_config_pp_size="
            f"{b.pp_size}; raise train.batch_size (or parallelism_config_pp_microbatches) to {b.pp_size} or more"
        )
    if rows % m:
        return RecipeError(
            f"train.batch_size={rows} rows cannot be cut into parallelism_config_pp_microbatches={m} equal "
            f"micro-batches; use a batch size that is a multiple of {m}"
        )
    return None


def _mesh_must_match_processes(recipe: Recipe, b: Backend, cuda: bool) -> UserError | None:
    if b.mesh and b.mesh_size != b.num_processes:
        return UserError(
            f"{WHERE}: its mesh {b.mesh} (parallelism_config_dp_replicate_size x _dp_shard_size x _cp_size x "
            f"_tp_size) needs {b.mesh_size} processes but the launch has {b.num_processes} (num_processes "
            f"{b.num_processes} on {b.num_machines} machine(s)); launch with --num_processes {b.mesh_size}, or "
            f"change the parallelism_config_* sizes so that they multiply to num_processes"
        )
    return None


def _fsdp_mesh_needs_a_shard_dimension(recipe: Recipe, b: Backend, cuda: bool) -> UserError | None:
    if b.kind == "fsdp" and b.mesh and b.dp_shard_size == 1 and b.cp_size == 1:
        return UserError(
            f"{WHERE}: distributed_type FSDP with the mesh {b.mesh} leaves FSDP nothing to shard over "
            f"(parallelism_config_dp_shard_size is 1); set parallelism_config_dp_shard_size > 1 (as in "
            f"accelerate_configs/fsdp_tp.yaml), or for tensor parallelism alone use distributed_type MULTI_GPU "
            f"(accelerate_configs/tp.yaml)"
        )
    return None


def _tp_needs_a_shard_dimension_beside_replicas(recipe: Recipe, b: Backend, cuda: bool) -> UserError | None:
    if (b.tp_size > 1 or b.cp_size > 1) and b.dp_replicate_size > 1 and b.dp_shard_size == 1:
        return UserError(
            f"{WHERE}: accelerate cannot combine tensor/context parallelism with pure replication "
            f"(parallelism_config_dp_replicate_size={b.dp_replicate_size}, parallelism_config_dp_shard_size=1); "
            f"use parallelism_config_dp_shard_size instead of _dp_replicate_size (FSDP x TP, "
            f"accelerate_configs/fsdp_tp.yaml)"
        )
    return None


def _no_tensor_parallel_under_deepspeed(recipe: Recipe, b: Backend, cuda: bool) -> UserError | None:
    if b.kind == "deepspeed" and b.tp_size > 1:
        return UserError(
            f"{WHERE}: parallelism_config_tp_size={b.tp_size} under DeepSpeed is not supported; for tensor "
            f"parallelism use accelerate_configs/tp.yaml (TP alone) or fsdp_tp.yaml (FSDP x TP), or remove "
            f"the parallelism_config block"
        )
    return None


def _deepspeed_json_must_leave_optimizer_to_recipe(
    recipe: Recipe, b: Backend, cuda: bool
) -> UserError | None:
    keys = [k for k in ("optimizer", "scheduler") if k in b.ds_config]
    if b.kind == "deepspeed" and keys:
        return UserError(
            f"DeepSpeed config {b.deepspeed_file}: remove its {' and '.join(repr(k) for k in keys)} "
            f"block{'s' if len(keys) > 1 else ''}; the recipe decides the optimizer and the schedule "
            f"(train.optimizer, train.lr, train.weight_decay, train.scheduler, train.warmup_ratio), and "
            f"accelerate refuses an optimizer given both in the DeepSpeed config and in the code. "
            f"accelerate_configs/ds_zero2.json is an example without them"
        )
    return None


def _deepspeed_json_precision_must_agree(recipe: Recipe, b: Backend, cuda: bool) -> UserError | None:
    if b.kind != "deepspeed":
        return None
    for section in ("fp16", "bf16"):
        enabled = (b.ds_config.get(section) or {}).get("enabled", "auto")
        if str(enabled).lower() == "true" and recipe.precision != section:
            return RecipeError(
                f"DeepSpeed config {b.deepspeed_file}: {section}.enabled is true but the recipe's "
                f"precision={recipe.precision} (DeepSpeed would train in {section} regardless, or stop with an "
                f'error); set {section}.enabled to "auto" in the JSON so that the recipe\'s precision decides, '
                f"or set precision: {section} in the recipe"
            )
    return None


def _adapters_have_no_tensor_parallel_plan(recipe: Recipe, b: Backend, cuda: bool) -> UserError | None:
    if recipe.method.type == "qlora" and b.tp_size > 1:
        return RecipeError(
            f"method.type=qlora cannot be used with tensor parallelism (parallelism_config_tp_size={b.tp_size} "
            f"in {WHERE}): bitsandbytes 4/8-bit layers have no tensor-parallel plan. Use a config without "
            f"tp (ddp.yaml, fsdp.yaml with quant_storage set, zero2.yaml)"
        )
    if recipe.method.type == "lora" and b.tp_size > 1:
        return RecipeError(
            f"method.type=lora cannot be used with tensor parallelism yet (parallelism_config_tp_size={b.tp_size} "
            f"in {WHERE}): the model's tensor-parallel plan names the base layers that peft wraps. Use "
            f"fsdp.yaml (LoRA under FSDP2 is tested) or ddp.yaml"
        )
    return None


def _expert_parallel_runs_over_ddp(recipe: Recipe, b: Backend, cuda: bool) -> UserError | None:
    if b.ep_size == 1:
        return None
    if b.kind != "ddp" or b.mesh:
        return UserError(
            f"{EP_KEY}={b.ep_size} ({WHERE}): expert parallelism shards the experts over DDP ranks "
            f"(distributed_type MULTI_GPU, no other parallelism_config size); it is not combined with "
            f"{b.kind if b.kind != 'ddp' else b.mesh} here. Use accelerate_configs/ep.yaml"
        )
    if b.ep_size != b.num_processes:
        return UserError(
            f"{EP_KEY}={b.ep_size} ({WHERE}) must equal the number of processes ({b.num_processes}): every "
            f"rank holds num_experts / ep_size experts; launch with --num_processes {b.ep_size} or change it"
        )
    if recipe.method.type != "full":
        return RecipeError(
            f"method.type={recipe.method.type} cannot be used with expert parallelism ({EP_KEY}={b.ep_size} in "
            f"{WHERE}) yet: adapters would wrap sharded expert weights. Use ddp.yaml or fsdp.yaml for LoRA"
        )
    arch = recipe.model.from_scratch
    if arch is not None:
        if arch.num_experts is None and not any(
            k in arch.extra for k in ("num_experts", "num_local_experts")
        ):
            return RecipeError(
                f"{EP_KEY}={b.ep_size} ({WHERE}): model.from_scratch is a dense model (no num_experts); "
                f"set model.from_scratch.num_experts with a Mixture-of-Experts type, or use ddp.yaml"
            )
        if arch.num_experts is not None and arch.num_experts % b.ep_size:
            return RecipeError(
                f"model.from_scratch.num_experts={arch.num_experts} is not divisible by {EP_KEY}={b.ep_size} "
                f"({WHERE}): each rank holds whole experts; use a multiple of {b.ep_size} experts"
            )
    return None


def _deepspeed_cannot_skip_steps(recipe: Recipe, b: Backend, cuda: bool) -> UserError | None:
    if b.kind == "deepspeed" and recipe.train.on_nonfinite == "skip":
        return RecipeError(
            "train.on_nonfinite=skip is not available under DeepSpeed (the engine steps inside backward); use stop"
        )
    return None


def _optimizer_offload_needs_adamw(recipe: Recipe, b: Backend, cuda: bool) -> UserError | None:
    optimizer = recipe.train.optimizer
    if b.kind == "deepspeed" and b.offload_optimizer and optimizer != "adamw":
        return RecipeError(
            f"train.optimizer={optimizer} cannot be used with DeepSpeed optimizer offload: DeepSpeed "
            f"replaces it with its CPU Adam (in plain Adam mode, not AdamW). Use train.optimizer=adamw (the "
            f"offloaded optimizer state lives in CPU RAM anyway), or a config without offload (zero2.yaml, zero3.yaml)"
        )
    return None


def _zero3_must_gather_16bit(recipe: Recipe, b: Backend, cuda: bool) -> UserError | None:
    if b.kind == "deepspeed" and b.zero_stage == 3 and not b.gathers_16bit:
        return RecipeError(
            "the DeepSpeed config uses ZeRO-3 without stage3_gather_16bit_weights_on_model_save: true, so final/ "
            "could not be exported at the end of training; set it in the DeepSpeed JSON (as in "
            "accelerate_configs/ds_zero3.json) or zero3_save_16bit_model: true in the accelerate config"
        )
    return None


def _fp16_needs_cuda(recipe: Recipe, b: Backend, cuda: bool) -> UserError | None:
    if recipe.precision == "fp16" and not cuda:
        return RecipeError(
            "precision=fp16 needs a GPU (CPU has no fp16 loss scaling); use precision=bf16 or no on CPU"
        )
    return None


def _liger_needs_cuda(recipe: Recipe, b: Backend, cuda: bool) -> UserError | None:
    if recipe.model.liger_kernels and not cuda:
        return RecipeError(
            "model.liger_kernels=true needs a CUDA GPU (Liger kernels are Triton GPU kernels); set it to false on CPU"
        )
    return None


def _flash_attention_needs_cuda(recipe: Recipe, b: Backend, cuda: bool) -> UserError | None:
    if recipe.model.attn_implementation == "flash_attention_2" and not cuda:
        return RecipeError(
            "model.attn_implementation=flash_attention_2 needs CUDA and the flash-attn package; use sdpa (or auto)"
        )
    return None


def _sharded_qlora_needs_floating_storage(recipe: Recipe, b: Backend, cuda: bool) -> UserError | None:
    q = recipe.method.quantization
    if recipe.method.type == "qlora" and b.shards_parameters and (q.bits != 4 or q.quant_storage == "uint8"):
        return RecipeError(
            "method.type=qlora under FSDP/DeepSpeed ZeRO-3 needs bits=4 and method.quantization.quant_storage set to "
            f"model.dtype (e.g. quant_storage: bfloat16 with model.dtype: bfloat16), so that the packed 4-bit weights "
            f"can be sharded like the other parameters (got bits={q.bits}, quant_storage={q.quant_storage})"
        )
    return None


def _qlora_float16_compute_needs_cuda(recipe: Recipe, b: Backend, cuda: bool) -> UserError | None:
    if recipe.method.type == "qlora" and recipe.method.quantization.compute_dtype == "float16" and not cuda:
        return RecipeError(
            "method.quantization.compute_dtype=float16 is for GPUs; on CPU use bfloat16 or float32"
        )
    return None


# --- sequence / context parallelism (training.sequence_parallel): each sequence split over a group of ranks

ULYSSES_FILE = "accelerate_configs/sp_ulysses.yaml"
CP_FILE = "accelerate_configs/cp.yaml"


def sequence_split(b: Backend) -> tuple[str, int, int]:
    """(the accelerate config key, its degree, what the sequence length must be a multiple of): DeepSpeed
    Ulysses splits every sequence in sp_size pieces; torch context parallelism in 2 x cp_size chunks (its
    causal load balancing gives each rank one chunk from the start and one from the end). ("", 1, 1) when
    sequences are not split."""
    if b.sp_size > 1:
        return "parallelism_config_sp_size", b.sp_size, b.sp_size
    if b.cp_size > 1:
        return "parallelism_config_cp_size", b.cp_size, 2 * b.cp_size
    return "", 1, 1


def _sequence_parallel_backend(recipe: Recipe, b: Backend, cuda: bool) -> UserError | None:
    if b.sp_size > 1 and b.cp_size > 1:
        return UserError(
            f"{WHERE}: parallelism_config_sp_size={b.sp_size} (DeepSpeed Ulysses) and parallelism_config_cp_size="
            f"{b.cp_size} (torch context parallelism) both split the sequence; keep one of them ({ULYSSES_FILE} or "
            f"{CP_FILE})"
        )
    if b.sp_size > 1 and b.kind != "deepspeed":
        return UserError(
            f"{WHERE}: parallelism_config_sp_size={b.sp_size} is DeepSpeed Ulysses sequence parallelism and needs "
            f"distributed_type: DEEPSPEED (as in {ULYSSES_FILE}); for torch ring-attention context parallelism "
            f"under FSDP use parallelism_config_cp_size ({CP_FILE})"
        )
    if b.sp_size > 1 and b.num_processes % b.sp_size:
        return UserError(
            f"{WHERE}: parallelism_config_sp_size={b.sp_size} does not divide the {b.num_processes} processes of the "
            f"launch: each group of sp_size processes shares its sequences, the groups are data-parallel; launch "
            f"with --num_processes a multiple of {b.sp_size}"
        )
    if b.cp_size > 1 and b.kind != "fsdp":
        return UserError(
            f"{WHERE}: parallelism_config_cp_size={b.cp_size} (torch context parallelism) needs distributed_type: "
            f"FSDP with fsdp_version: 2 (as in {CP_FILE}); for DeepSpeed use parallelism_config_sp_size "
            f"({ULYSSES_FILE})"
        )
    if b.cp_size > 1 and b.tp_size > 1:
        return UserError(
            f"{WHERE}: parallelism_config_cp_size={b.cp_size} with parallelism_config_tp_size={b.tp_size} is not "
            f"supported here yet; use context parallelism over FSDP alone ({CP_FILE})"
        )
    if b.cp_size > 1 and not cuda:
        return UserError(
            f"{WHERE}: parallelism_config_cp_size={b.cp_size} (torch context parallelism) needs CUDA GPUs: torch's "
            f"ring attention only implements the GPU attention kernels (flash, memory-efficient, cuDNN), not CPU "
            f"SDPA. On CPU use DeepSpeed Ulysses sequence parallelism ({ULYSSES_FILE}), which runs over gloo"
        )
    return None


def _sequence_split_needs_a_fitting_recipe(recipe: Recipe, b: Backend, cuda: bool) -> UserError | None:
    key, degree, multiple = sequence_split(b)
    if degree == 1:
        return None
    what = f"{key}={degree} in {WHERE}"
    if recipe.data.max_length % multiple:
        fits = recipe.data.max_length // multiple * multiple
        return RecipeError(
            f"data.max_length={recipe.data.max_length} is not a multiple of {multiple} ({what}): every sequence "
            f"(a text block, or a padded row) is split into {multiple} equal pieces; use data.max_length="
            f"{fits or multiple} or {fits + multiple}"
        )
    if recipe.data.packing:
        return RecipeError(
            f"data.packing=true cannot be used with sequence parallelism ({what}): the split attention runs "
            f"causally over the whole row without its mask, so packed examples would attend to each other; set "
            f"data.packing=false (rows are padded to a multiple of {multiple}) or use format: text"
        )
    if recipe.model.attn_implementation == "eager":
        return RecipeError(
            f"model.attn_implementation=eager cannot be used with sequence parallelism ({what}): it needs a "
            f"full attention mask; use sdpa or auto (flash_attention_2 on GPUs)"
        )
    if recipe.data.streaming or recipe.data.is_mixture:
        return RecipeError(
            f"data.{'streaming' if recipe.data.streaming else 'train'} (a streamed corpus or a mixture) cannot be "
            f"used with sequence parallelism ({what}) yet: the split collator is not wired into the stream; "
            f"pre-tokenize one source (data.streaming=false) or use ddp/zero configs"
        )
    if recipe.method.type == "qlora":
        return RecipeError(
            f"method.type=qlora cannot be used with sequence parallelism ({what}) yet: 4-bit layers are not "
            f"supported by DeepSpeed or FSDP context parallelism here; use method.type=lora or full"
        )
    return None


def _preference_without_model_parallelism(recipe: Recipe, b: Backend, cuda: bool) -> UserError | None:
    """Preference losses pair sequences row by row over whole rows: tested under DDP and ZeRO only."""
    if recipe.preference is None:
        return None
    split = {
        "parallelism_config_tp_size": b.tp_size,
        "parallelism_config_pp_size": b.pp_size,
        "parallelism_config_sp_size": b.sp_size,
        "parallelism_config_cp_size": b.cp_size,
        EP_KEY: b.ep_size,
    }
    if used := [f"{k}={v}" for k, v in split.items() if v > 1]:
        return RecipeError(
            f"preference.objective={recipe.preference.objective} is not proven with {', '.join(used)} ({WHERE}); "
            f"use ddp, fsdp or a DeepSpeed ZeRO config"
        )
    return None


RULES: tuple[Rule, ...] = (
    _pipeline_combinations,
    _mesh_must_match_processes,
    _fsdp_mesh_needs_a_shard_dimension,
    _tp_needs_a_shard_dimension_beside_replicas,
    _no_tensor_parallel_under_deepspeed,
    _deepspeed_json_must_leave_optimizer_to_recipe,
    _deepspeed_json_precision_must_agree,
    _adapters_have_no_tensor_parallel_plan,
    _expert_parallel_runs_over_ddp,
    _deepspeed_cannot_skip_steps,
    _optimizer_offload_needs_adamw,
    _zero3_must_gather_16bit,
    _fp16_needs_cuda,
    _liger_needs_cuda,
    _flash_attention_needs_cuda,
    _sharded_qlora_needs_floating_storage,
    _qlora_float16_compute_needs_cuda,
    _sequence_parallel_backend,
    _sequence_split_needs_a_fitting_recipe,
    _preference_without_model_parallelism,
)


def refusal(recipe: Recipe, backend: Backend, cuda: bool) -> UserError | None:
    """Why `recipe` cannot run under `backend` on processes with (`cuda`) or without CUDA GPUs: the
    error the trainer raises (its message names the recipe or config key and what to use instead),
    or None. The first rule that applies wins.

    Checks that depend on what is installed here (the flash-attn and liger-kernel packages) stay with
    the code that uses them: the planner may be planning for another machine.
    """
    for rule in RULES:
        if (error := rule(recipe, backend, cuda)) is not None:
            return error
    return None


# ----------------------------------------------------------------------------- checks that need the model's config


def check_tensor_parallel(config, backend: Backend) -> None:
    """Refuse tensor parallelism the model cannot have, before any weight loads (RecipeError, exit 2):
    a model type without a tensor-parallel plan in transformers (`config.base_model_tp_plan` empty, as
    for GPT-2), or a tp_size that does not divide the attention heads or the key/value heads (each rank
    holds whole heads). Nothing to check without tensor parallelism."""
    tp = backend.tp_size
    if tp <= 1:
        return

    model_type = getattr(config, "model_type", type(config).__name__)
    if not getattr(config, "base_model_tp_plan", None):
        raise RecipeError(
            f"parallelism_config_tp_size={tp} ({WHERE}): the model type {model_type!r} has no tensor-parallel "
            f"plan in transformers, so it cannot be split across processes. Choose a model (model.name_or_path) "
            f"or a model.from_scratch type whose transformers config has a plan (llama, qwen2, qwen3, mistral, "
            f"mixtral, gemma, phi3, ...), or a config without tensor parallelism (fsdp.yaml, ddp.yaml)"
        )
    heads = getattr(config, "num_attention_heads", None)
    kv = getattr(config, "num_key_value_heads", None) or heads
    for key, count, what in (
        ("num_attention_heads", heads, "attention heads"),
        ("num_key_value_heads", kv, "key/value heads"),
    ):
        if count and count % tp:
            both = math.gcd(heads, kv)
            divisors = [d for d in range(2, both + 1) if both % d == 0]
            raise RecipeError(
                f"parallelism_config_tp_size={tp} ({WHERE}) does not divide the model's {count} {what} "
                f"({key}; each process holds whole heads): use a tp_size among {divisors or [1]}, or, for a model "
                f"built from scratch, change model.from_scratch.{key}"
            )


def check_sequence_parallel(config, backend: Backend) -> None:
    """DeepSpeed Ulysses trades the sequence split for a head split inside attention (all-to-all): each of
    the sp_size processes then holds num_attention_heads / sp_size heads of the whole sequence, so sp_size
    must divide the attention heads, and divide or be a multiple of the key/value heads (DeepSpeed repeats
    grouped key/value heads when there are fewer than processes). RecipeError (exit 2) before any weight
    loads; nothing to check otherwise (context parallelism splits no heads)."""
    sp = backend.sp_size
    if sp <= 1:
        return
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(text, "num_attention_heads", None)
    kv = getattr(text, "num_key_value_heads", None) or heads
    if not heads:
        return
    divisors = [d for d in range(2, heads + 1) if heads % d == 0 and (kv % d == 0 or d % kv == 0)]
    fix = (
        f"use a parallelism_config_sp_size among {divisors or [1]} (with --num_processes a multiple of it), or, "
        f"for a model built from scratch, change model.from_scratch.num_attention_heads / num_key_value_heads"
    )
    if heads % sp:
        raise RecipeError(
            f"parallelism_config_sp_size={sp} ({WHERE}) does not divide the model's {heads} attention heads "
            f"(num_attention_heads; DeepSpeed Ulysses gives each process whole heads of the full sequence): {fix}"
        )
    if kv % sp and sp % kv:
        raise RecipeError(
            f"parallelism_config_sp_size={sp} ({WHERE}) neither divides nor is a multiple of the model's {kv} "
            f"key/value heads (num_key_value_heads): {fix}"
        )


def check_expert_parallel(config, backend: Backend) -> None:
    """Refuse expert parallelism the model cannot have, before any weight loads (RecipeError, exit 2): a
    dense model, an MoE type without an expert-parallel plan in transformers, experts not divisible."""
    ep = backend.ep_size
    if ep <= 1:
        return
    from training.moe import router_shape

    model_type = getattr(config, "model_type", type(config).__name__)
    shape = router_shape(config)
    if shape is None:
        raise RecipeError(
            f"{EP_KEY}={ep} ({WHERE}): the model ({model_type!r}) is dense, it has no experts to shard; "
            f"use a Mixture-of-Experts model (mixtral, qwen3_moe, olmoe, ...) or ddp.yaml"
        )
    if not getattr(config, "base_model_ep_plan", None):
        raise RecipeError(
            f"{EP_KEY}={ep} ({WHERE}): the MoE type {model_type!r} has no expert-parallel plan in transformers; "
            f"use mixtral, qwen3_moe, olmoe, ... or ddp.yaml"
        )
    if shape[0] % ep:
        raise RecipeError(
            f"{EP_KEY}={ep} ({WHERE}) does not divide the model's {shape[0]} experts (each rank holds whole "
            f"experts): use an ep_size among {[d for d in range(2, shape[0] + 1) if shape[0] % d == 0]}"
        )


def check_pipeline(config, backend: Backend) -> None:
    """Refuse pipeline stages the model cannot be split into, before any weight loads (RecipeError, exit 2):
    more stages than decoder layers."""
    pp = backend.pp_size
    if pp <= 1:
        return
    layers = getattr(config, "num_hidden_layers", None)
    if layers is not None and pp > layers:
        raise RecipeError(
            f"parallelism_config_pp_size={pp} ({WHERE}) asks for more pipeline stages than the model's {layers} "
            f"decoder layers (num_hidden_layers); use at most {layers} stages, or for a model built from scratch "
            f"raise model.from_scratch.num_hidden_layers"
        )


def precision_note(recipe: Recipe, env: Mapping[str, str] | None = None) -> str | None:
    """One line for the start-up log when the launcher asked for another mixed precision than the
    recipe's (an accelerate config `mixed_precision:` or `accelerate launch --mixed_precision`, which
    arrive as ACCELERATE_MIXED_PRECISION): the recipe's `precision` is what training uses. None when they
    agree or the launcher said nothing ("no" is also what accelerate exports when nothing is set)."""
    env = os.environ if env is None else env
    launcher = str(env.get("ACCELERATE_MIXED_PRECISION", "no")).strip().lower()
    if launcher in ("", "no") or launcher == recipe.precision:
        return None
    return (
        f"the launcher's mixed_precision={launcher} (accelerate config file or --mixed_precision) is overridden "
        f"by the recipe's precision={recipe.precision}; set precision: {launcher} in the recipe to train in "
        f"{launcher}"
    )
