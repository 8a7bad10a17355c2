"""The roofline's GEMMs are exactly the FLOPs the model formula counts, and they are measured."""

import torch

from bench import roofline
from megatron_core.training import flops


def test_model_gemms_are_the_formulas_flops():
    shape = dict(seq_length=64, num_layers=3, hidden_size=48, ffn_hidden_size=192)
    gemms = roofline.model_gemms(micro_batch_size=2, num_attention_heads=4, padded_vocab_size=320, **shape)
    per_micro_batch = sum(g.flops for g in gemms)
    assert per_micro_batch == flops.model_flops_per_iteration(global_batch_size=2, padded_vocab_size=320, **shape)


def test_measure_times_every_gemm_of_an_iteration_of_micro_batches():
    shape = dict(seq_length=16, num_layers=2, hidden_size=32, ffn_hidden_size=64)
    gemms = roofline.model_gemms(micro_batch_size=1, num_attention_heads=2, padded_vocab_size=64, **shape)
    result = roofline.measure(gemms, micro_batches=2, dtype=torch.float32, device=torch.device("cpu"), repeats=1)
    assert [row["gemm"] for row in result["gemms"]] == [g.name for g in gemms]
    # two micro-batches of one sample: the formula's FLOPs of a global batch of two
    assert result["gemm_flops_per_iteration"] == flops.model_flops_per_iteration(
        global_batch_size=2, padded_vocab_size=64, **shape
    )
    assert all(row["ms"] > 0 and row["tflops"] > 0 for row in result["gemms"])
