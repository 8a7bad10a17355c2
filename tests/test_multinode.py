"""Multi-node launch: two `torchrun --nnodes 2 --nproc-per-node 1` processes (node ranks 0 and 1)
on 127.0.0.1 run the real entry point `python -m megatron_core.pretrain_gpt` data-parallel and match the
single-process run's losses; plus the command builder's flags and its refusals."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from megatron_core.checkpoint_format import CheckpointError

from distributed_utils import free_port
from megatron_core.launch import LaunchError, torchrun_command
from megatron_core.training.logging import read_metrics
from training_fixtures import TINY_OVERRIDES, VOCAB_SIZE, train_losses, write_corpus

ROOT = Path(__file__).resolve().parent.parent
OVERRIDES = [
    *TINY_OVERRIDES,
    "hidden_dropout=0.0",
    "attention_dropout=0.0",
    "train_iters=6",
    "eval_interval=100",
    "eval_iters=1",
    "save_interval=null",
    "global_batch_size=4",
    "micro_batch_size=2",
]


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _run_nodes(commands: list[list[str]], timeout: float = 300, **popen) -> list[str]:
    """Start every node's command at once (they rendezvous), wait, and return each one's output."""
    nodes = [
        subprocess.Popen(
            cmd,
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
            **popen,
        )
        for cmd in commands
    ]
    outputs, deadline = [], time.monotonic() + timeout
    try:
        for node in nodes:
            try:
                outputs.append(node.communicate(timeout=max(deadline - time.monotonic(), 1))[0])
            except subprocess.TimeoutExpired:
                outputs.append(None)
    finally:
        for node in nodes:  # torchrun and its workers: the whole process group, so no rank outlives the test
            if node.poll() is None:
                os.killpg(node.pid, signal.SIGKILL)
    # A node that hangs usually waits on one that failed: show every node's output, not the first one's.
    outputs = [out if out is not None else node.communicate()[0] for node, out in zip(nodes, outputs)]
    report = "\n".join(
        f"--- node {rank} (exit {node.returncode}) ---\n{out[-3000:]}"
        for rank, (node, out) in enumerate(zip(nodes, outputs))
    )
    assert all(node.returncode == 0 for node in nodes), f"a node failed or hung past {timeout} s:\n{report}"
    return outputs


def _extra(prefix: str, run_dir) -> list[str]:
    return ["--data-path", prefix, "--vocab-size", str(VOCAB_SIZE), "--run-dir", str(run_dir)]


@pytest.mark.slow
def test_two_node_data_parallel_matches_single_process(tmp_path):
    prefix = write_corpus(tmp_path / "corpus")
    single_dir, multi_dir = tmp_path / "single", tmp_path / "two-nodes"
    single = subprocess.run(
        [
            sys.executable,
            "-m",
            "megatron_core.pretrain_gpt",
            "--recipe",
            "smoke",
            *[a for item in OVERRIDES for a in ("--set", item)],
            *_extra(prefix, single_dir),
        ],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert single.returncode == 0, single.stderr[-3000:]

    port = free_port()
    outputs = _run_nodes(
        [
            torchrun_command(
                "smoke",
                OVERRIDES,
                1,
                nnodes=2,
                node_rank=rank,
                master_addr="127.0.0.1",
                master_port=port,
                extra_args=_extra(prefix, multi_dir),
            )
            for rank in (0, 1)
        ]
    )
    assert "DP 2" in outputs[0] and "backend gloo, world size 2" in outputs[0]

    expected, got = train_losses(read_metrics(single_dir)), train_losses(read_metrics(multi_dir))
    assert sorted(got) == sorted(expected) == list(range(1, 7))
    for it in expected:
        assert got[it] == pytest.approx(expected[it], rel=1e-5), f"iteration {it}"


def test_command_for_static_and_rendezvous_launch():
    static = torchrun_command(
        "smoke",
        ["lr=1e-3"],
        8,
        nnodes=2,
        node_rank=1,
        master_addr="10.0.0.1",
        master_port=6000,
        extra_args=["--run-dir", "r"],
    )
    assert {"--nproc-per-node=8", "--nnodes=2", "--node-rank=1", "--master-addr=10.0.0.1", "--master-port=6000"} <= set(
        static
    )
    # torchrun may itself be `python -m torch.distributed.run`
    tail = static[static.index("megatron_core.pretrain_gpt") - 1 :]
    assert tail == [
        "-m",
        "megatron_core.pretrain_gpt",
        "--recipe",
        "smoke",
        "--set",
        "lr=1e-3",
        "--set",
        "parallel.world_size=16",
        "--run-dir",
        "r",
    ]
    rdzv = torchrun_command("smoke", [], 8, nnodes=4, rdzv_endpoint="head:29400")
    assert "--rdzv-backend=c10d" in rdzv and "--rdzv-endpoint=head:29400" in rdzv
    assert not any(a.startswith("--node-rank") for a in rdzv)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(nproc=0), "--nproc 0"),
        (dict(nproc=2, nnodes=2, node_rank=2), "--node-rank 2"),
        (dict(nproc=2, master_port=70000), "--master-port 70000"),
        (dict(nproc=2, nnodes=2, rdzv_endpoint="head"), "host:port"),
    ],
)
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
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "SLURM_JOB_NODELIST": "gpu-[a-b]",
        "SLURM_NNODES": "2",
        "SLURM_JOB_ID": "12345",
        "WORKDIR": str(tmp_path / "work"),
    }
    done = subprocess.run(
        ["bash", str(script), "codeparrot-small-8gpu", "--set", "lr=1e-4"],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0, done.stderr
    calls = log.read_text().splitlines()
    assert len(calls) == 3 and calls[0].startswith("invoke preprocess --recipe codeparrot-small-8gpu")
    for node, call in enumerate(calls[1:]):
        assert call.startswith("invoke train --recipe codeparrot-small-8gpu")
        assert (
            f"--nproc 8 --nnodes 2 --node-rank {node} --master-addr gpu-a --master-port 32345 --set lr=1e-4" in call
        ), call


def _invoke_train(workdir, *flags) -> list[str]:
    return [
        sys.executable,
        "-m",
        "invoke",
        "train",
        "--recipe",
        "smoke",
        "--workdir",
        str(workdir),
        "--set",
        "world_size=2",
        "--set",
        "tensor_model_parallel_size=2",
        "--set",
        "train_iters=6",
        "--set",
        "save_interval=6",
        "--set",
        "eval_interval=100",
        *flags,
    ]


@pytest.mark.slow
def test_two_nodes_without_a_shared_filesystem(tmp_path):
    """Two `invoke train --nnodes 2 --node-rank r` on 127.0.0.1, each in its own --workdir: each node
    builds corpus, tokenizer, .bin/.idx and dataset indices itself, writes its own ranks' checkpoint
    files, and the losses equal one node running the same TP 2 layout; gathered into one directory,
    the two nodes' files are the one node's checkpoint."""
    from megatron_core import workflow
    from megatron_core.config import load_recipe
    from megatron_core.convert.shards import read_checkpoint

    recipe = load_recipe(
        "smoke",
        ["world_size=2", "tensor_model_parallel_size=2", "train_iters=6", "save_interval=6", "eval_interval=100"],
    )
    one = subprocess.run(
        _invoke_train(tmp_path / "one-node"), cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300
    )
    assert one.returncode == 0, one.stdout[-3000:] + one.stderr[-3000:]

    port = free_port()
    _run_nodes(
        [
            _invoke_train(
                tmp_path / f"node{rank}",
                "--nproc",
                "1",
                "--nnodes",
                "2",
                "--node-rank",
                str(rank),
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                str(port),
            )
            for rank in (0, 1)
        ],
        cwd=ROOT,
    )

    runs = {name: workflow.run_dir(recipe, tmp_path / name) for name in ("one-node", "node0", "node1")}
    expected, got = train_losses(read_metrics(runs["one-node"])), train_losses(read_metrics(runs["node0"]))
    assert sorted(got) == sorted(expected) and got == pytest.approx(expected, rel=1e-6)

    # Each node holds its own TP rank's file; gathered, they are the one-node checkpoint.
    held = {
        name: sorted(p.name for p in (runs[name] / "checkpoints" / "iter_0000006").iterdir())
        for name in ("node0", "node1")
    }
    assert held == {"node0": ["manifest.json", "mp_rank_00"], "node1": ["manifest-rank1.json", "mp_rank_01"]}
    gathered = tmp_path / "gathered"
    shutil.copytree(runs["node0"] / "checkpoints", gathered)
    shutil.copytree(runs["node1"] / "checkpoints" / "iter_0000006", gathered / "iter_0000006", dirs_exist_ok=True)
    merged, reference = read_checkpoint(gathered), read_checkpoint(runs["one-node"] / "checkpoints")
    assert merged.state.keys() == reference.state.keys()
    for name, tensor in reference.state.items():
        assert torch.allclose(merged.state[name], tensor, rtol=1e-6, atol=1e-7), name
    # gathered, each node's manifest still covers its own files (one manifest.json per node would have
    # overwritten node 0's): a flipped byte in node 0's file is found
    node0_file = gathered / "iter_0000006" / "mp_rank_00" / "model_optim_rng.pt"
    data = bytearray(node0_file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    node0_file.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="mp_rank_00/model_optim_rng.pt fails verification"):
        read_checkpoint(gathered)
