"""Multi-node launch: two `torchrun --nnodes 2 --nproc-per-node 1` processes (node ranks 0 and 1)
on 127.0.0.1 run the real entry point `python -m megatron_core.pretrain_gpt` data-parallel and match the
single-process run's losses; plus the command builder's flags and its refusals."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from distributed_utils import free_port
from megatron_core.launch import LaunchError, torchrun_command
from megatron_core.training.logging import read_metrics
from training_fixtures import TINY_OVERRIDES, VOCAB_SIZE, train_losses, write_corpus

OVERRIDES = [*TINY_OVERRIDES, "hidden_dropout=0.0", "attention_dropout=0.0", "train_iters=6", "eval_interval=100",
             "eval_iters=1", "save_interval=null", "global_batch_size=4", "micro_batch_size=2"]


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _extra(prefix: str, run_dir) -> list[str]:
    return ["--data-path", prefix, "--vocab-size", str(VOCAB_SIZE), "--run-dir", str(run_dir)]


def test_two_node_data_parallel_matches_single_process(tmp_path):
    prefix = write_corpus(tmp_path / "corpus")
    single_dir, multi_dir = tmp_path / "single", tmp_path / "two-nodes"
    single = subprocess.run([sys.executable, "-m", "megatron_core.pretrain_gpt", "--recipe", "smoke",
                             *[a for item in OVERRIDES for a in ("--set", item)], *_extra(prefix, single_dir)],
                            env=_env(), capture_output=True, text=True, timeout=180)
    assert single.returncode == 0, single.stderr[-3000:]

    port = free_port()
    nodes = [subprocess.Popen(torchrun_command("smoke", OVERRIDES, 1, nnodes=2, node_rank=rank,
                                               master_addr="127.0.0.1", master_port=port,
                                               extra_args=_extra(prefix, multi_dir)),
                              env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank in (0, 1)]
    outputs = []
    try:
        for node in nodes:
            outputs.append(node.communicate(timeout=180)[0])
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
    for rank, (node, out) in enumerate(zip(nodes, outputs)):
        assert node.returncode == 0, f"node {rank} failed:\n{out[-3000:]}"
    assert "DP 2" in outputs[0] and "backend gloo, world size 2" in outputs[0]

    expected, got = train_losses(read_metrics(single_dir)), train_losses(read_metrics(multi_dir))
    assert sorted(got) == sorted(expected) == list(range(1, 7))
    for it in expected:
        assert got[it] == pytest.approx(expected[it], rel=1e-5), f"iteration {it}"


def test_command_for_static_and_rendezvous_launch():
    static = torchrun_command("smoke", ["lr=1e-3"], 8, nnodes=2, node_rank=1, master_addr="10.0.0.1",
                              master_port=6000, extra_args=["--run-dir", "r"])
    assert {"--nproc-per-node=8", "--nnodes=2", "--node-rank=1", "--master-addr=10.0.0.1",
            "--master-port=6000"} <= set(static)
    tail = static[static.index("megatron_core.pretrain_gpt") - 1:]  # torchrun may itself be `python -m torch.distributed.run`
    assert tail == ["-m", "megatron_core.pretrain_gpt", "--recipe", "smoke", "--set", "lr=1e-3",
                    "--set", "parallel.world_size=16", "--run-dir", "r"]
    rdzv = torchrun_command("smoke", [], 8, nnodes=4, rdzv_endpoint="head:29400")
    assert "--rdzv-backend=c10d" in rdzv and "--rdzv-endpoint=head:29400" in rdzv
    assert not any(a.startswith("--node-rank") for a in rdzv)


@pytest.mark.parametrize("kwargs, message", [
    (dict(nproc=0), "--nproc 0"),
    (dict(nproc=2, nnodes=2, node_rank=2), "--node-rank 2"),
    (dict(nproc=2, master_port=70000), "--master-port 70000"),
    (dict(nproc=2, nnodes=2, rdzv_endpoint="head"), "host:port"),
])
def test_impossible_launch_flags_are_refused(kwargs, message):
    nproc = kwargs.pop("nproc")
    with pytest.raises(LaunchError, match=message):
        torchrun_command("smoke", [], nproc, **kwargs)


def test_slurm_template_starts_one_invoke_train_per_node(tmp_path):
    """ci/slurm/train.sbatch under stand-in srun/scontrol/invoke: data steps once, then one
    `invoke train` per node with its node rank and the first node as master."""
    from pathlib import Path

    bin_dir, log = tmp_path / "bin", tmp_path / "calls.log"
    bin_dir.mkdir()
    fakes = {
        "scontrol": 'printf "gpu-a\\ngpu-b\\n"',
        "invoke": f'echo "invoke $* | node=${{SLURM_NODEID:-?}}" >> {log}',
        # srun: the preprocess step once; the train step once per node with SLURM_NODEID set.
        "srun": 'if [ "$1" = "--nodes=1" ]; then shift 2; "$@"; else shift;'
                ' for n in $(seq 0 $((SLURM_NNODES - 1))); do SLURM_NODEID=$n "$@"; done; fi',
    }
    for name, body in fakes.items():
        path = bin_dir / name
        path.write_text(f"#!/bin/bash\n{body}\n")
        path.chmod(0o755)
    script = Path(__file__).resolve().parent.parent / "ci" / "slurm" / "train.sbatch"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "gpu-[a-b]",
           "SLURM_NNODES": "2", "SLURM_JOB_ID": "12345", "WORKDIR": str(tmp_path / "work")}
    done = subprocess.run(["bash", str(script), "codeparrot-small-8gpu", "--set", "lr=1e-4"], env=env,
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    calls = log.read_text().splitlines()
    assert len(calls) == 3 and calls[0].startswith("invoke preprocess --recipe codeparrot-small-8gpu")
    for node, call in enumerate(calls[1:]):
        assert call.startswith("invoke train --recipe codeparrot-small-8gpu")
        assert (f"--nproc 8 --nnodes 2 --node-rank {node} --master-addr gpu-a --master-port 32345 --set lr=1e-4"
                in call), call
