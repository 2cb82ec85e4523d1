"""Layer 6, rl: online RL as an objective kind: the GRPO family's objective (objective.py) split along its
concerns (rollouts.py, advantages.py, loss.py, metrics.py), built and registered by build.py; agent
episodes (episode.py, drawn.py), tools and the sandbox (tools.py, sandbox.py), environments (OpenEnv:
openenv.py), rewards (rewards.py) and the code references a recipe names (code_refs.py).

Rule: generates only through training.generation's engines; collectives come in as values (the accelerator's
`reduce`, the context's `gather`); imports core, config, data, model, generation and objectives, never
torch.distributed, accelerate's collectives, parallel/ or loop/.

Importing the package registers the objective kind "rl".
"""

from training.rl import build  # noqa: F401 (registers the objective kind)
