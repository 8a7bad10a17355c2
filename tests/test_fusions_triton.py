"""Every Triton kernel (softmax, cross entropy) against its torch reference, forward and backward, in one of
two modes picked at start:

* compiled: a CUDA GPU is visible, so the tensors are CUDA tensors and Triton compiles each kernel for that GPU;
* interpreter: no GPU, so TRITON_INTERPRET=1 is set (before anything imports triton) and the kernels run on CPU
  tensors in Triton's interpreter.

The mode is printed once per session ("fusion kernel tests: ... mode") and each comparison asserts its tensors
live on the mode's device. MEGATRON_FUSIONS_TEST_MODE=compiled (or interpreter) makes the run fail unless that mode
ran: ci/gpu.sh and bench/gpu_speed.sh and bench/gpu_check.py set it, so a GPU job cannot quietly test the
interpreter instead.

How the interpreter gets switched on (checked on triton 3.9): TRITON_INTERPRET=1 must be in the environment
before the process first imports triton, because triton decorates its own library functions (tl.rand,
...) at import; setting it later makes every kernel that calls them fail. Our kernel modules load only on
first use, so setting os.environ at the top of this module, before anything imports triton, works when this
module is imported first. In a full pytest run some earlier module may already have imported triton
(torch._dynamo and transformers' model code do); then these cases cannot run in this process, and
`test_triton_cases_in_a_fresh_process` runs this very file in a fresh python with the variable set (and fails if
any case fails there). Exactly one of the two paths runs the cases; the other is skipped with its reason.
In compiled mode TRITON_INTERPRET must not be set at all (fusions/backends.py refuses Triton on CUDA then).

Outputs are poisoned: every tensor a launcher allocates is filled with NaN, so an element a kernel forgets to
write fails the comparison. Tolerances are norm-wise relative: ||a - b|| / ||b||,
against an fp32 reference computed from the same (possibly low-precision) inputs.
"""

import os

import torch  # imports no triton

COMPILED = torch.cuda.is_available()
MODE = "compiled" if COMPILED else "interpreter"
DEVICE = torch.device("cuda" if COMPILED else "cpu")
if not COMPILED:
    os.environ["TRITON_INTERPRET"] = "1"  # before anything below can import triton; see the docstring

import subprocess  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from megatron_core.errors import UserError  # noqa: E402
from megatron_core.fusions import cross_entropy, scaled_causal_softmax  # noqa: E402
from megatron_core.fusions.backends import triton_problem  # noqa: E402
from megatron_core.fusions.cross_entropy import cross_entropy_reference  # noqa: E402
from megatron_core.fusions.softmax import scaled_causal_softmax_reference  # noqa: E402

MODE_LINE = (
    f"fusion kernel tests: compiled mode (CUDA tensors, Triton kernels compiled for {torch.cuda.get_device_name()})"
    if COMPILED
    else "fusion kernel tests: interpreter mode (CPU tensors, TRITON_INTERPRET=1)"
)
TRITON_PROBLEM = triton_problem(DEVICE)
needs_triton_here = pytest.mark.skipif(
    TRITON_PROBLEM is not None,
    reason=(
        f"not in this process ({TRITON_PROBLEM}); test_triton_cases_in_a_fresh_process runs them"
        if not COMPILED
        else f"Triton cannot run on the GPU: {TRITON_PROBLEM}"
    ),
)


@pytest.fixture(scope="module", autouse=True)
def report_mode(request):
    """Say which mode runs, once, past pytest's output capture."""
    capture = request.config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled():
        print(f"\n{MODE_LINE}" + (f" -- cases skipped here: {TRITON_PROBLEM}" if TRITON_PROBLEM else ""), flush=True)
    yield


@pytest.fixture(autouse=True)
def on_mode_device():
    """Every tensor a test makes without naming a device lands on the mode's device."""
    with torch.device(DEVICE):
        yield


def test_mode_is_the_one_required():
    """MEGATRON_FUSIONS_TEST_MODE names the mode a job expects (the GPU jobs: compiled); anything else fails."""
    required = os.environ.get("MEGATRON_FUSIONS_TEST_MODE")
    if required is not None:
        assert required in ("compiled", "interpreter"), f"MEGATRON_FUSIONS_TEST_MODE={required!r}"
        assert MODE == required, f"{MODE_LINE}, but MEGATRON_FUSIONS_TEST_MODE={required} was required"
        if COMPILED:
            assert TRITON_PROBLEM is None, f"compiled mode required, but Triton cannot run on the GPU: {TRITON_PROBLEM}"
    if COMPILED and TRITON_PROBLEM is None:  # triton imported earlier with the interpreter on would interpret
        from megatron_core.fusions.triton_kernels.softmax import _causal_softmax_fwd_kernel

        assert type(_causal_softmax_fwd_kernel).__name__ == "JITFunction", type(_causal_softmax_fwd_kernel)
    assert torch.empty(1).device.type == DEVICE.type


TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    expected = expected.detach().double()
    return ((actual.detach().double() - expected).norm() / expected.norm().clamp_min(1e-30)).item()


def assert_close(name: str, actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert actual.device.type == DEVICE.type, f"{name}: on {actual.device}, but the {MODE} mode runs on {DEVICE}"
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert torch.isfinite(actual).all(), f"{name}: non-finite values (an unwritten, poisoned element?)"
    error = relative_error(actual, expected)
    assert error <= TOLERANCE[dtype], f"{name}: relative error {error:.3e} > {TOLERANCE[dtype]:.1e} ({dtype})"


@pytest.fixture
def poisoned_outputs(monkeypatch):
    """Make every launcher allocation NaN-filled; yields the list of allocated shapes."""
    from megatron_core.fusions.triton_kernels import _common

    allocated = []

    def poisoned(shape, dtype, device):
        allocated.append(tuple(shape))
        return torch.full(shape, float("nan"), dtype=dtype, device=device)

    monkeypatch.setattr(_common, "new_output", poisoned)
    yield allocated
    assert allocated, "the kernels never allocated through _common.new_output: the poisoning did not apply"


def leaf(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return tensor.to(dtype).requires_grad_()


def fp32_leaf(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().float().requires_grad_()


def compare_fwd_bwd(name, fused, reference, inputs, dtype):
    """Run fused(*inputs) and reference(*fp32 copies) forward and backward with the same random dy."""
    inputs_ref = [fp32_leaf(t) for t in inputs]
    out = fused(*inputs)
    out_ref = reference(*inputs_ref)
    assert_close(f"{name} forward", out, out_ref, dtype)
    dy = torch.randn_like(out_ref).to(out.dtype)
    grads = torch.autograd.grad(out, inputs, dy)
    grads_ref = torch.autograd.grad(out_ref, inputs_ref, dy.float())
    for index, (grad, grad_ref) in enumerate(zip(grads, grads_ref)):
        assert grad.dtype == inputs[index].dtype, f"{name} grad {index} has dtype {grad.dtype}"
        assert_close(f"{name} grad of input {index}", grad, grad_ref, dtype)


SOFTMAX_GRID = [
    ((1, 1, 1, 1), torch.float32),
    ((2, 3, 7, 7), torch.float32),
    ((1, 2, 33, 33), torch.float32),
    ((1, 1, 64, 64), torch.float32),
    ((1, 1, 1000, 1000), torch.float32),
    ((2, 2, 33, 33), torch.float16),
    ((1, 2, 64, 64), torch.bfloat16),
]


@needs_triton_here
@pytest.mark.parametrize("shape,dtype", SOFTMAX_GRID)
@pytest.mark.usefixtures("poisoned_outputs")
def test_scaled_causal_softmax_matches_reference(shape, dtype):
    scale = 0.125
    scores = leaf(torch.randn(shape) * 4, dtype)
    compare_fwd_bwd(
        "softmax",
        lambda s: scaled_causal_softmax(s, scale, backend="triton"),
        lambda s: scaled_causal_softmax_reference(s, scale),
        [scores],
        dtype,
    )


CROSS_ENTROPY_GRID = [(rows, vocab, torch.float32) for vocab in (64, 1000, 1536, 9000) for rows in (1, 7, 33)] + [
    (7, 1000, torch.float16),
    (33, 9000, torch.float16),
    (7, 1536, torch.bfloat16),
]


@needs_triton_here
@pytest.mark.parametrize("rows,vocab,dtype", CROSS_ENTROPY_GRID)
@pytest.mark.usefixtures("poisoned_outputs")
def test_cross_entropy_matches_reference(rows, vocab, dtype):
    logits = leaf(torch.randn(rows, vocab) * 3, dtype)
    labels = torch.randint(0, vocab, (rows,))
    labels[0] = vocab - 1  # the last vocab entry, past the final full block

    def plain(lg):
        return F.cross_entropy(lg, labels, reduction="none")

    compare_fwd_bwd("cross_entropy", lambda lg: cross_entropy(lg, labels, backend="triton"), plain, [logits], dtype)
    compare_fwd_bwd(
        "cross_entropy vs torch backend",
        lambda lg: cross_entropy(lg, labels, backend="triton"),
        lambda lg: cross_entropy_reference(lg, labels),
        [leaf(logits.detach(), dtype)],
        dtype,
    )


@needs_triton_here
@pytest.mark.usefixtures("poisoned_outputs")
def test_cross_entropy_with_a_shard_offset_matches_the_torch_backend():
    """One shard alone (no group): the gradient of every row, and the loss of rows whose label lies in
    [start, start + V_local), agree with the torch backend. (Rows with foreign labels hold only a partial
    statistic until the group's all-reduce; tests/test_fusions_reference.py runs two real gloo ranks.)"""
    logits = torch.randn(33, 500, requires_grad=True)
    labels = torch.randint(0, 1500, (33,))
    labels[:3] = torch.tensor([500, 999, 1000])
    in_shard = (labels >= 500) & (labels < 1000)
    ours = cross_entropy(logits, labels, vocab_start_index=500, backend="triton")
    theirs = cross_entropy(logits, labels, vocab_start_index=500, backend="torch")
    assert_close("in-shard loss", ours[in_shard], theirs[in_shard], torch.float32)
    assert_close(
        "sharded grad",
        torch.autograd.grad(ours.sum(), logits)[0],
        torch.autograd.grad(theirs.sum(), logits)[0],
        torch.float32,
    )


@needs_triton_here
@pytest.mark.usefixtures("poisoned_outputs")
def test_non_contiguous_inputs_are_copied_contiguous():
    scores = torch.randn(2, 7, 3, 7).transpose(1, 2)  # [2, 3, 7, 7], not contiguous
    assert_close(
        "softmax",
        scaled_causal_softmax(scores, 0.5, backend="triton"),
        scaled_causal_softmax_reference(scores, 0.5),
        torch.float32,
    )
    logits, labels = torch.randn(1000, 7).t(), torch.randint(0, 1000, (7,))
    assert_close(
        "cross_entropy",
        cross_entropy(logits, labels, backend="triton"),
        F.cross_entropy(logits, labels, reduction="none"),
        torch.float32,
    )


@needs_triton_here
def test_oversized_rows_are_refused_with_a_user_error():
    """A softmax row over 65536 keys would not fit one program (the scores themselves would take 16 GiB)."""
    from megatron_core.fusions.triton_kernels import _common

    with pytest.raises(UserError, match="65536"):
        _common.row_block(65537, "softmax key length")


@needs_triton_here
def test_compiled_graph_keeps_the_triton_ops_opaque():
    """torch.compile traces through our autograd.Functions and sees the launchers as custom ops
    (megatron_fusions::*), so the fake kernels must describe the outputs; aot_eager needs no C++ compiler."""
    import torch._dynamo

    torch._dynamo.reset()

    labels = torch.randint(0, 7, (2, 3, 7))

    def block(x):
        probs = scaled_causal_softmax(x, 0.5, backend="triton")
        return cross_entropy(probs * 4, labels, backend="triton")

    x = torch.randn(2, 3, 7, 7, requires_grad=True)
    explanation = torch._dynamo.explain(block)(x)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    traced = "".join(
        module.code
        for graph in explanation.graphs
        for module in graph.modules()  # with fwd bodies
        if isinstance(module, torch.fx.GraphModule)
    )
    for op in ("causal_softmax_fwd", "cross_entropy_fwd"):
        assert f"megatron_fusions.{op}" in traced, f"{op} was not traced as the custom op:\n{traced}"
    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    eager_out = block(x)
    compiled_out = compiled(x)
    assert_close("compiled", compiled_out, eager_out, torch.float32)
    assert_close(
        "compiled grad",
        torch.autograd.grad(compiled_out.sum(), x)[0],
        torch.autograd.grad(eager_out.sum(), x)[0],
        torch.float32,
    )


@needs_triton_here
def test_eager_calls_launch_directly_without_the_dispatcher(monkeypatch):
    """Outside a compile trace the launchers run as plain functions: the custom op's dispatch (66 us a call on
    a 2-core CPU) is only for torch.compile. With every op's dispatcher path broken, eager forward and backward
    still run and match the reference."""
    from megatron_core.fusions.triton_kernels import _common

    def broken(*_args):
        raise AssertionError("an eager call went through the torch custom op")

    ops = [
        value for module in _kernel_modules() for value in vars(module).values() if isinstance(value, _common.KernelOp)
    ]
    assert len(ops) == 4, [op.__name__ for op in ops]
    for op in ops:
        monkeypatch.setattr(op, "op", broken)
    x = torch.randn(2, 3, 6, 6, device=DEVICE, requires_grad=True)
    labels = torch.randint(0, 6, (2, 3, 6), device=DEVICE)

    def loss(scores, backend):
        return cross_entropy(scaled_causal_softmax(scores, 0.5, backend=backend) * 4, labels, backend=backend)

    out = loss(x, "triton")
    out.sum().backward()
    expected_x = x.detach().clone().requires_grad_()
    expected = loss(expected_x, "torch")
    expected.sum().backward()
    assert_close("eager direct", out, expected, torch.float32)
    assert_close("eager direct grad", x.grad, expected_x.grad, torch.float32)


def _kernel_modules():
    from megatron_core.fusions.triton_kernels import cross_entropy, softmax

    return [cross_entropy, softmax]


def launch_key(launch):
    """What a compile depends on: kernel, constexprs, num_warps, and each argument's dtype/shape or value."""
    args = tuple(
        ("tensor", a.dtype, tuple(a.shape)) if isinstance(a, torch.Tensor) else (type(a).__name__, a)
        for a in launch.args
    )
    return launch.name, tuple(launch.grid), tuple(sorted(launch.constexprs.items())), launch.num_warps, args


AOT_SHAPES = {"batch": 2, "seq": 37, "heads": 3, "vocab": 1000}


@needs_triton_here
@pytest.mark.parametrize("fusion", ["softmax", "cross_entropy"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_aot_compiles_the_launches_the_ops_make(fusion, dtype, monkeypatch):
    """megatron_core.fusions.aot records the launches from the launchers on meta tensors; the ops, called
    forward and backward through the public API, must launch exactly those kernels with those arguments."""
    from megatron_core.fusions import aot
    from megatron_core.fusions.triton_kernels import _common

    shapes = aot.Shapes("test", **AOT_SHAPES)
    made = []

    real_run = _common.run
    monkeypatch.setattr(_common, "run", lambda launch: (made.append(launch_key(launch)), real_run(launch)))
    if fusion == "softmax":
        out = scaled_causal_softmax(
            leaf(torch.randn(shapes.batch, shapes.heads, shapes.seq, shapes.seq), dtype), 0.125, backend="triton"
        )
    else:
        out = cross_entropy(
            leaf(torch.randn(shapes.tokens, shapes.vocab), dtype),
            torch.randint(0, shapes.vocab, (shapes.tokens,)),
            backend="triton",
        )
    out.float().sum().backward()
    recorded = {launch_key(launch) for _, launch in aot.recorded_launches(fusion, shapes, dtype)}
    assert made and set(made) == recorded, (
        f"launched but not compiled ahead of time: {set(made) - recorded}; "
        f"compiled ahead of time but never launched: {recorded - set(made)}"
    )


def test_triton_cases_in_a_fresh_process():
    if COMPILED:
        pytest.skip("compiled mode: this process runs the cases on the GPU itself")
    if TRITON_PROBLEM is None:
        pytest.skip("this process runs the interpreter cases itself")
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert "fusion kernel tests: interpreter mode" in result.stdout, result.stdout[-3000:]
    print(result.stdout.strip().splitlines()[-1])


@needs_triton_here
def test_fake_tensor_tracing_meets_the_custom_ops_not_the_kernels():
    """Under a dispatch mode (here FakeTensorMode, as make_fx and export use) the launchers must stay the custom
    ops, whose fakes give the shapes: the kernels themselves cannot run on fake tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        scores = torch.randn(2, 3, 5, 5, device=DEVICE)
        probs = scaled_causal_softmax(scores, 0.5, backend="triton")
        loss = cross_entropy(probs, torch.zeros(2, 3, 5, dtype=torch.long, device=DEVICE), backend="triton")
    assert probs.shape == (2, 3, 5, 5) and loss.shape == (2, 3, 5)
