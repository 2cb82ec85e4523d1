"""The SLURM launch template (accelerate_configs/slurm/): its per-node script, run twice on this machine
in a simulated two-node allocation (SLURM_NODEID 0/1, SLURM_NNODES=2, a node list whose names resolve to
loopback, one CPU process per "node"), trains like 2-process DDP; the commands it builds from SLURM's
variables (compact node lists, GPUs per node, the elastic torchrun variant); bad input exits 2."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, train_inprocess
from launching import STEPS, TWO_RANKS, assert_same_run, free_port, rows, write_recipe

SCRIPT = ROOT / "accelerate_configs" / "slurm" / "launch.sh"
CONFIG = "accelerate_configs/multi_node.yaml"
BIN = str(Path(sys.executable).parent)


def slurm_env(node: int, nodes: int = 2, nodelist: str = "localhost,localhost", **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    path = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep) if p != BIN)
    return {
        **env,
        "PATH": f"{BIN}{os.pathsep}{path}",  # this venv's accelerate / torchrun / python
        "PYTHON": sys.executable,
        "SLURM_NODEID": str(node),
        "SLURM_NNODES": str(nodes),
        "SLURM_JOB_NODELIST": nodelist,
        "SLURM_JOB_ID": "4242",
        **extra,
    }


def dry_run(node: int, *args: str, **env) -> list[str]:
    proc = subprocess.run(
        ["bash", str(SCRIPT), CONFIG, "recipe.yaml", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=slurm_env(node, **{"DRY_RUN": "1", **env}),
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.split("\n")[:-1]


def option(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


@pytest.mark.slow
def test_two_simulated_slurm_nodes_train_together_like_ddp(tmp_path):
    recipe = write_recipe(tmp_path / "recipe.yaml", tmp_path / "unused")
    single = tmp_path / "single"
    assert train_inprocess(recipe, f"output_dir={single}", "train.batch_size=4", "train.grad_accum=1") == 0
    assert len(rows(single, "loss")) == STEPS

    out, port = tmp_path / "slurm", str(free_port())
    procs = [
        subprocess.Popen(
            ["bash", str(SCRIPT), CONFIG, str(recipe), f"output_dir={out}", *TWO_RANKS],
            cwd=ROOT,
            env=slurm_env(node, MAIN_PROCESS_PORT=port),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for node in (0, 1)
    ]
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=600))
    except subprocess.TimeoutExpired:  # say what each node printed (a node that hangs waits on the other)
        for p in procs:
            p.kill()
        said = [p.communicate() for p in procs]
        pytest.fail(
            "a node did not finish in 600 s:\n"
            + "\n".join(f"node {i}: {e[-3000:]}" for i, (_, e) in enumerate(said))
        )
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, (stdout, stderr) in zip(procs, outputs):
        assert p.returncode == 0, f"node failed ({p.returncode}):\n{stdout[-2000:]}\n{stderr[-5000:]}"
    for node, (_, stderr) in enumerate(outputs):
        assert f"node {node}/2 on " in stderr
        assert f"--machine_rank {node} --num_processes 2 --main_process_ip localhost" in stderr
    assert "2 process(es), MULTI_CPU" in outputs[0][1]
    assert_same_run(out, single)


def test_commands_from_a_compact_node_list_and_gpus_per_node():
    cmd = dry_run(2, "train.lr=1e-4", nodes=3, nodelist="gpu[07-08,10],login1", SLURM_GPUS_ON_NODE="8")
    assert cmd[:4] == ["accelerate", "launch", "--config_file", CONFIG]
    assert option(cmd, "--machine_rank") == "2"
    assert option(cmd, "--num_machines") == "3"
    assert option(cmd, "--num_processes") == "24"  # 8 GPUs x 3 nodes
    assert option(cmd, "--main_process_ip") == "gpu07"  # first host, zero padding kept
    assert option(cmd, "--main_process_port") == "29500"
    assert cmd[-4:] == ["-m", "training.train", "recipe.yaml", "train.lr=1e-4"]
    assert "--rdzv_backend" not in cmd
    # GPUS_PER_NODE wins; an explicit host list wins over the node list
    cmd = dry_run(0, GPUS_PER_NODE="2", SLURM_HOSTS="10.1.0.5 10.1.0.6")
    assert option(cmd, "--num_processes") == "4" and option(cmd, "--main_process_ip") == "10.1.0.5"


def test_elastic_variants_use_c10d_rendezvous_with_restarts():
    cmd = dry_run(1, MAX_RESTARTS="3", MAIN_PROCESS_PORT="31000")
    assert option(cmd, "--rdzv_backend") == "c10d" and option(cmd, "--max_restarts") == "3"
    cmd = dry_run(1, LAUNCHER="torchrun", MAX_RESTARTS="2", GPUS_PER_NODE="4", nodelist="n[1-2]")
    assert cmd[0] == "torchrun"
    assert option(cmd, "--nnodes") == "2:2" and option(cmd, "--nproc_per_node") == "4"
    assert option(cmd, "--rdzv_backend") == "c10d" and option(cmd, "--rdzv_endpoint") == "n1:29500"
    assert option(cmd, "--rdzv_id") == "4242" and option(cmd, "--max-restarts") == "2"


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (["missing.yaml", "r.yaml"], {}, "accelerate config missing.yaml: no such file"),
        ([CONFIG], {}, "usage:"),
        ([CONFIG, "r.yaml"], {"SLURM_NODEID": ""}, "SLURM_NODEID is not set"),
    ],
)
def test_bad_input_exits_2_naming_it(args, env, message):
    proc = subprocess.run(
        ["bash", str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True, env={**slurm_env(0), **env}
    )
    assert proc.returncode == 2 and message in proc.stderr
