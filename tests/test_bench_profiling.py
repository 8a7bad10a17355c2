"""bench.profiling: each op or kernel counted once in the time tables the benchmarks write."""

from types import SimpleNamespace

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from bench.profiling import matmul_split, time_table


def test_cpu_table_is_self_time_of_the_ops_that_ran():
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(4):
            (a @ b).relu_()
    total, table = time_table(prof, 4, "cpu")
    ops = {row["op"]: row for row in table}
    assert ops["aten::mm"]["calls"] == 4 // 4 and ops["aten::relu_"]["calls"] == 1
    assert abs(sum(row["share"] for row in table) - 1.0) < 1e-9
    assert abs(sum(row["ms_per_call"] for row in table) - total) < 1e-9
    assert table == sorted(table, key=lambda row: -row["ms_per_call"])


class _Profile:
    """What time_table reads of a CUDA profile: key_averages() rows (key, count, self times, device type)."""

    def __init__(self, rows):
        self.rows = [
            SimpleNamespace(
                key=key, count=count, self_device_time_total=device_us, self_cpu_time_total=cpu_us, device_type=kind
            )
            for key, count, device_us, cpu_us, kind in rows
        ]

    def key_averages(self):
        return self.rows


def test_cuda_table_counts_each_kernel_once_not_again_through_the_op_that_launched_it():
    # As torch.profiler reports a CUDA step: the CPU op that launched a kernel carries that kernel's time as
    # its own "self device time", and the kernel's event carries it too (stop 20's profiles summed both).
    prof = _Profile(
        [
            ("aten::mm", 6, 3000.0, 90.0, DeviceType.CPU),
            ("nvjet_sm90_gemm", 6, 3000.0, 0.0, DeviceType.CUDA),
            ("megatron_fusions::layer_norm_bwd", 3, 1000.0, 60.0, DeviceType.CPU),
            ("_layer_norm_bwd_kernel", 3, 1000.0, 0.0, DeviceType.CUDA),
            ("aten::view", 9, 0.0, 5.0, DeviceType.CPU),
        ]
    )
    total, table = time_table(prof, 3, "cuda", unit="step")
    assert [row["op"] for row in table] == ["nvjet_sm90_gemm", "_layer_norm_bwd_kernel"]
    assert abs(total - 4000.0 / 1e3 / 3) < 1e-12
    assert [row["calls"] for row in table] == [2, 1]
    assert [round(row["share"], 6) for row in table] == [0.75, 0.25]
    assert abs(table[1]["ms_per_step"] - 1000.0 / 1e3 / 3) < 1e-12


def test_matmul_split_adds_the_gemm_ops_of_a_cpu_profile_and_leaves_the_rest_to_other():
    a, b, x = torch.randn(128, 96), torch.randn(96, 64), torch.randn(4, 32, 32)
    bias = torch.randn(64)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(2):
            torch.nn.functional.linear(a, b.t(), bias).relu_()  # aten::addmm under aten::linear
            (a @ b).sum()  # aten::mm under aten::matmul
            torch.bmm(x, x).softmax(-1)
    total, table = time_table(prof, 2, "cpu", unit="step")
    split = matmul_split(table, "cpu")
    ops = {row["op"]: row["ms_per_step"] for row in table}
    assert {"aten::addmm", "aten::mm", "aten::bmm", "aten::relu_", "aten::_softmax"} <= set(ops)
    expected = sum(ops.get(op, 0.0) for op in ("aten::addmm", "aten::mm", "aten::bmm"))
    assert abs(split["matmul_ms_per_step"] - expected) < 1e-9
    assert split["other_ms_per_step"] >= ops["aten::relu_"] + ops["aten::_softmax"]
    assert abs(split["matmul_ms_per_step"] + split["other_ms_per_step"] - total) < 1e-9


def test_matmul_split_of_a_cuda_table_goes_by_kernel_name():
    table = [
        {"op": "nvjet_sm90_tst_192x192_64x3_2x1_v_bz_coopB_NNN", "ms_per_step": 7.0},
        {"op": "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_kernel0_0", "ms_per_step": 4.0},
        {"op": "sm80_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize96x128x32", "ms_per_step": 2.0},
        {"op": "_layer_norm_bwd_kernel", "ms_per_step": 3.0},
        {"op": "void at::native::elementwise_kernel<128, 4, CUDAFunctor_add<float>>", "ms_per_step": 1.5},
    ]
    assert matmul_split(table, "cuda") == {"matmul_ms_per_step": 13.0, "other_ms_per_step": 4.5}
