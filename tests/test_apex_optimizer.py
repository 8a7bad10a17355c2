"""`training.optimizer: apex`: our MegatronOptimizer around Apex's FusedAdam, checked on a CPU.

Apex needs CUDA, so `ApexFusedAdam` below stands in for it: it follows apex/optimizers/fused_adam.py and
csrc/multi_tensor_adam.cu (NVIDIA/apex tag 25.09) in what the wrapper depends on: `step` counted once per
parameter group (not per tensor) and kept in the group, per-tensor state of only exp_avg/exp_avg_sq,
adam_w_mode's decoupled decay folded into the update, host-side bias corrections. Driven through the
wrapper, it must give torch's AdamW path's numbers, across resumes in both directions and skipped steps.
"""

from __future__ import annotations

import copy

import pytest
import torch
from test_training_optimizer import TwoLayer

from megatron_core.config import load_recipe
from megatron_core.errors import UserError
from megatron_core.optimizer.grad_scaler import DynamicGradScaler
from megatron_core.optimizer.optimizer import AdamSettings, MegatronOptimizer

SETTINGS = AdamSettings(lr=1e-2, weight_decay=0.1, beta1=0.9, beta2=0.95, eps=1e-8)
STEPS = 5


class ApexFusedAdam(torch.optim.Optimizer):
    """Apex's FusedAdam update rule in plain torch (fp32 math, as its kernel's MATH_T)."""

    def __init__(
        self,
        params,
        lr=1e-3,
        bias_correction=True,
        betas=(0.9, 0.999),
        eps=1e-8,
        adam_w_mode=True,
        weight_decay=0.0,
        amsgrad=False,
        _set_grad_none=True,
        capturable=False,
        master_weights=False,
    ):
        if amsgrad or capturable or master_weights:
            raise RuntimeError("the stand-in implements Apex's default, non-capturable path only")
        super().__init__(
            params, dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps, weight_decay=weight_decay)
        )
        self.adam_w_mode = 1 if adam_w_mode else 0

    @torch.no_grad()
    def step(self, _closure=None):
        for group in self.param_groups:
            if len(group["params"]) == 0:
                continue
            # Apex: "assume same step across group now to simplify things"
            group["step"] = group["step"] + 1 if "step" in group else 1
            beta1, beta2 = group["betas"]
            step, decay, lr, eps = group["step"], group["weight_decay"], group["lr"], group["eps"]
            correction1 = 1 - beta1**step if group["bias_correction"] else 1.0
            correction2 = 1 - beta2**step if group["bias_correction"] else 1.0
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if len(state) == 0:
                    state["exp_avg"] = torch.zeros_like(p).float()
                    state["exp_avg_sq"] = torch.zeros_like(p).float()
                g, m, v = p.grad.float(), state["exp_avg"], state["exp_avg_sq"]
                if self.adam_w_mode == 0:  # L2: the decay joins the gradient
                    g = g + decay * p.float()
                m.mul_(beta1).add_(g, alpha=1 - beta1)
                v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
                update = (m / correction1) / ((v / correction2).sqrt() + eps)
                if self.adam_w_mode == 1:  # AdamW: decoupled decay, in the same update
                    update = update + decay * p.float()
                p.copy_(p.float() - lr * update)


def _optimizer(model, precision: str, apex: bool, scaler=None) -> MegatronOptimizer:
    opt = MegatronOptimizer(
        model,
        SETTINGS,
        precision=precision,
        clip_grad=1.0,
        grad_scaler=scaler,
        device=torch.device("cpu"),
        fused_adam_cls=ApexFusedAdam if apex else None,
    )
    assert isinstance(opt.optimizer, ApexFusedAdam) == apex  # the wrapper steps through the class it was given
    return opt


def _train(model, opt, batches, inf_at=()) -> list[bool]:
    oks = []
    for i, x in enumerate(batches):
        opt.zero_grad()
        opt.scale_loss(model(x)).backward()
        if i in inf_at:  # an fp16 overflow: the step is skipped and must not count
            model.dense.weight.grad[0, 0] = float("inf")
        oks.append(opt.step()[0])
    return oks


def _batches(n: int, dtype=torch.float32) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(8, 6, generator=generator).to(dtype) for _ in range(n)]


def _model(dtype=torch.float32) -> TwoLayer:
    torch.manual_seed(0)
    return TwoLayer(6).to(dtype)


def _assert_same(a: MegatronOptimizer, b: MegatronOptimizer) -> None:
    for ma, mb in zip(a.master_params, b.master_params):
        torch.testing.assert_close(ma, mb, rtol=1e-4, atol=1e-6)
    for name, sa in a.state_dict()["param_state"].items():
        for key, value in sa.items():
            torch.testing.assert_close(value, b.state_dict()["param_state"][name][key], rtol=1e-4, atol=1e-8)


def test_stand_in_counts_steps_per_group_as_apex_does():
    model = _model()
    opt = _optimizer(model, "fp32", apex=True)
    _train(model, opt, _batches(3))
    assert opt.description.startswith("apex.optimizers.FusedAdam (adam_w_mode)")
    assert [g["step"] for g in opt.optimizer.param_groups] == [3, 3]
    assert all("step" not in s for s in opt.optimizer.state.values())  # nothing per tensor
    assert opt.state_dict()["step"] == 3


@pytest.mark.parametrize("precision, dtype", [("fp32", torch.float32), ("bf16", torch.bfloat16)])
def test_apex_path_equals_torch_adamw_step_for_step(precision, dtype):
    torch_model, apex_model = _model(dtype), _model(dtype)
    torch_opt, apex_opt = _optimizer(torch_model, precision, False), _optimizer(apex_model, precision, True)
    for x in _batches(STEPS, dtype):
        _train(torch_model, torch_opt, [x])
        _train(apex_model, apex_opt, [x])
        _assert_same(torch_opt, apex_opt)
    assert torch_opt.state_dict()["step"] == apex_opt.state_dict()["step"] == STEPS


@pytest.mark.parametrize(
    "first, then", [(False, True), (True, False), (True, True)], ids=["torch-apex", "apex-torch", "apex-apex"]
)
def test_resume_between_optimizers_keeps_the_step_count(first, then):
    """3 steps, a checkpoint (state_dict), a fresh optimizer of the other kind loading it, 2 more steps:
    the same as 5 uninterrupted torch steps. Bias correction reads the restored count: a group
    restarting at step 1 would show here."""
    batches = _batches(STEPS)
    reference_model = _model()
    reference = _optimizer(reference_model, "bf16", False)
    _train(reference_model, reference, batches)

    model = _model()
    opt = _optimizer(model, "bf16", first)
    _train(model, opt, batches[:3])
    saved = copy.deepcopy(opt.state_dict())
    assert saved["step"] == 3

    resumed_model = copy.deepcopy(model)
    resumed = _optimizer(resumed_model, "bf16", then)
    resumed.load_state_dict(saved)
    assert resumed.state_dict()["step"] == 3
    _train(resumed_model, resumed, batches[3:])
    _assert_same(reference, resumed)
    assert resumed.state_dict()["step"] == STEPS


def test_skipped_fp16_steps_are_not_counted_by_either():
    """An overflow skips the inner step, so Apex's group count and torch's per-tensor counts stay together
    (the fp16 master-weight machinery runs on a CPU here; fp16 training itself needs a GPU)."""
    results = {}
    for apex in (False, True):
        model = _model(torch.float16)
        opt = _optimizer(model, "fp16", apex, DynamicGradScaler(initial_scale=1024.0, hysteresis=1))
        oks = _train(model, opt, _batches(STEPS, torch.float16), inf_at=(1,))
        assert oks == [True, False, True, True, True]
        assert opt.state_dict()["step"] == STEPS - 1
        results[apex] = opt
    _assert_same(results[False], results[True])


# -- the recipe key ----------------------------------------------------------------------------------


def test_optimizer_key_defaults_to_torch_adamw_and_names_the_run():
    recipe = load_recipe("smoke")
    assert recipe.training.optimizer == "adam" and recipe.to_dict()["training"]["optimizer"] == "adam"
    apex = load_recipe("smoke", ["optimizer=apex", "device=auto"])
    assert apex.to_dict()["training"]["optimizer"] == "apex" and apex.hash != recipe.hash


def test_apex_on_a_cpu_recipe_is_refused_at_load():
    with pytest.raises(
        UserError,
        match=r"^training.optimizer 'apex' \(Apex's FusedAdam\) runs on CUDA only but "
        r"training.device is cpu: use --set optimizer=adam",
    ):
        load_recipe("smoke", ["optimizer=apex", "device=cpu"])


def test_apex_refused_before_any_work_where_it_cannot_run(monkeypatch):
    from megatron_core import pretrain_gpt
    from megatron_core.fusions import apex as apex_module

    recipe = load_recipe("smoke", ["optimizer=apex", "device=auto"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(pretrain_gpt.TrainingConfigError, match="runs on CUDA only but training runs on cpu"):
        pretrain_gpt.check_training_values(recipe)
    # a GPU host without Apex's CUDA extensions
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(
        apex_module,
        "apex_status",
        lambda: {
            "apex": False,
            "amp_C": False,
            "fused_layer_norm_cuda": False,
            "apex.optimizers.FusedAdam": False,
            "errors": {"apex.optimizers.FusedAdam": "ModuleNotFoundError: No module named 'apex'"},
        },
    )
    with pytest.raises(pretrain_gpt.TrainingConfigError) as info:
        pretrain_gpt.check_training_values(recipe)
    message = str(info.value)
    assert "\n" not in message
    assert (
        "needs Apex's FusedAdam with its CUDA extensions, but apex.optimizers.FusedAdam and amp_C do not "
        "import here (ModuleNotFoundError: No module named 'apex')"
    ) in message
    assert message.endswith("or use --set optimizer=adam")


def test_build_model_and_optimizer_picks_the_recipes_optimizer(monkeypatch):
    from megatron_core import pretrain_gpt
    from megatron_core.fusions import apex as apex_module

    tiny = [
        "num_layers=1",
        "hidden_size=16",
        "num_attention_heads=2",
        "seq_length=8",
        "max_position_embeddings=8",
        "fusions=torch",
    ]
    # Apex importable and working (the stand-in): still torch's AdamW unless the recipe asks
    monkeypatch.setattr(apex_module, "fused_adam_problem", lambda _device_type: None)
    monkeypatch.setattr(apex_module, "fused_adam_class", lambda: ApexFusedAdam)
    *_, optimizer = pretrain_gpt.build_model_and_optimizer(load_recipe("smoke", tiny), 64, torch.device("cpu"))
    assert optimizer.description == "torch.optim.AdamW(fused=True)"
    recipe = load_recipe("smoke", [*tiny, "optimizer=apex", "device=auto"])
    *_, optimizer = pretrain_gpt.build_model_and_optimizer(recipe, 64, torch.device("cpu"))
    assert isinstance(optimizer.optimizer, ApexFusedAdam)
