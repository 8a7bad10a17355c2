"""The roofline's GEMMs are exactly the FLOPs the model formula counts, and they are measured."""

import torch

from bench import roofline
from megatron_core.training import flops


def test_model_gemms_are_the_formulas_flops():
    shape = dict(seq_length=64, num_layers=3, hidden_size=48, ffn_hidden_size=192)
    gemms = roofline.model_gemms(micro_batch_size=2, num_attention_heads=4, padded_vocab_size=320, **shape)
    per_micro_batch = sum(g.flops for g in gemms)
    assert per_micro_batch == flops.model_flops_per_iteration(global_batch_size=2, padded_vocab_size=320, **shape)


def test_measure_reports_time_and_throughput_per_gemm():
    gemms = roofline.model_gemms(micro_batch_size=1, seq_length=16, num_layers=2, hidden_size=32, ffn_hidden_size=64,
                                 num_attention_heads=2, padded_vocab_size=64)
    result = roofline.measure(gemms, micro_batches=2, dtype=torch.float32, device=torch.device("cpu"), repeats=1)
    assert [row["gemm"] for row in result["gemms"]] == [g.name for g in gemms]
    assert result["gemm_flops_per_iteration"] == 2 * sum(g.flops for g in gemms)
    assert result["gemm_ms_per_iteration"] == sum(row["ms"] for row in result["gemms"]) > 0
    assert result["gemm_tflops"] > 0
