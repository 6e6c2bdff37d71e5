"""Precision policies: dtypes under each mode, fp16 loss scaling, fp32 checkpoints, auto's choice on each CPU."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.conftest import TINY_MODEL, TRUNK_FIELDS, graph_names, model_overrides
from vitrain.config import CONFIG_DIR, OptimConfig, PrecisionConfig, load_config
from vitrain.device import bf16_emulated, cpu_description
from vitrain.engine import Trainer, runs
from vitrain.errors import ConfigError
from vitrain.models import create_model
from vitrain.optim import build_optimizer
from vitrain.parallel.sync_batchnorm import CpuSyncBatchNorm
from vitrain.precision import PrecisionPolicy, TrainingDiverged, check_finite, resolve

CPU = torch.device("cpu")
REPO = Path(__file__).resolve().parent.parent


def tiny_run(tmp_path: Path, *overrides: str):
    """The digits recipe shrunk to a few seconds: a 2-block ViT for a handful of steps."""
    return load_config(
        CONFIG_DIR / "digits.yaml",
        [
            f"log.out_dir={tmp_path}",
            "log.progress=false",
            "log.every_steps=1",
            *model_overrides(fields=TRUNK_FIELDS),
            "train.epochs=1",
            "train.batch_size=32",
            *overrides,
        ],
    )


class NormZoo(nn.Module):
    """Linear layers around each kind of norm, so O2 must keep every norm (and BatchNorm's statistics) in fp32."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.bn = nn.BatchNorm1d(16)
        self.ln = nn.LayerNorm(16)
        self.gn = nn.GroupNorm(4, 16)
        self.fc2 = nn.Linear(16, 3)

    def forward(self, x):
        return self.fc2(self.gn(self.ln(self.bn(self.fc1(x)))))


def policy(mode: str, dtype: str = "bf16", **kwargs) -> PrecisionPolicy:
    return PrecisionPolicy(PrecisionConfig(mode=mode, dtype=dtype, **kwargs), CPU)


def train_step(pol: PrecisionPolicy, forward: nn.Module, optimizer, seed: int = 0, poison=None):
    gen = torch.Generator().manual_seed(seed)
    x, y = torch.randn(16, 8, generator=gen), torch.randint(0, 3, (16,), generator=gen)
    with pol.autocast():
        loss = F.cross_entropy(forward(x).float(), y)
    pol.backward(loss)
    if poison is not None:
        poison()
    return pol.step(optimizer, clip_grad_norm=1.0)


def weights(module: nn.Module) -> dict[str, torch.Tensor]:
    """The parameters only: BatchNorm's running statistics move with every forward, skipped step or not."""
    return {k: v.detach().clone() for k, v in module.named_parameters()}


def test_o2_keeps_norms_their_statistics_and_master_weights_fp32_and_the_rest_low():
    model = NormZoo()
    pol = policy("amp_o2")
    working = pol.prepare(model)
    for name, tensor in working.module.state_dict().items():
        is_norm = name.split(".")[0] in ("bn", "ln", "gn")
        if tensor.is_floating_point():
            assert tensor.dtype == (torch.float32 if is_norm else torch.bfloat16), name
    assert all(t.dtype == torch.float32 for t in model.state_dict().values() if t.is_floating_point())
    assert working.module.bn.running_mean.dtype == torch.float32


def test_o2_runs_batchnorm_statistics_in_fp32_on_the_master():
    model = NormZoo()
    pol = policy("amp_o2")
    working = pol.prepare(model)
    before = model.bn.running_mean.clone()
    logits = working(torch.randn(16, 8))
    assert logits.dtype == torch.float32  # the loss is computed in fp32
    assert model.bn.running_mean.dtype == torch.float32
    assert not torch.equal(model.bn.running_mean, before)  # the working copy updated the master's statistics


def test_o2_optimizer_updates_fp32_master_and_refreshes_low_copy():
    model = NormZoo()
    pol = policy("amp_o2")
    working = pol.prepare(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = model.fc1.weight.detach().clone()
    _, skipped = train_step(pol, working, optimizer)
    assert not skipped
    assert model.fc1.weight.dtype == torch.float32 and not torch.equal(model.fc1.weight, before)
    assert torch.equal(working.module.fc1.weight, model.fc1.weight.detach().to(torch.bfloat16))
    assert working.module.fc1.weight.grad is None  # gradients moved to the master, not kept twice


def test_o2_vit_layernorms_fp32_other_weights_bf16(tiny_model):
    working = policy("amp_o2").prepare(tiny_model).module
    for name, param in working.named_parameters():
        expected = torch.float32 if "norm" in name else torch.bfloat16
        assert param.dtype == expected, name


def test_o2_compile_norms_runs_each_layernorm_and_its_casts_as_one_compiled_kernel():
    """precision.compile_norms: the same values and fp32 norm gradients as the cast hooks, through torch.compile."""
    from vitrain.precision import CompiledFp32LayerNorm, compile_norms_problem

    if compile_norms_problem(CPU) is not None:
        pytest.skip(f"torch.compile needs {compile_norms_problem(CPU)}")
    torch.manual_seed(0)
    x = torch.randn(8, 12, 16)
    results = []
    for compile_norms in (False, True):
        model = NormZoo()
        working = policy("amp_o2", compile_norms=compile_norms).prepare(model)
        assert (type(working.module.ln) is CompiledFp32LayerNorm) == compile_norms
        assert type(working.module.gn) is nn.GroupNorm  # the other norms keep the hooks
        torch.manual_seed(1)
        ln_out = working.module.ln(x.to(torch.bfloat16).requires_grad_())
        assert ln_out.dtype == torch.bfloat16
        assert ("CompiledFunctionBackward" in graph_names(ln_out)) == compile_norms
        ln_out.float().square().sum().backward()
        with torch.no_grad():  # evaluation: eager, the same values; an fp32 input still hands bf16 on
            eval_out = working.module.ln(x.to(torch.bfloat16))
            assert working.module.ln(x).dtype == torch.bfloat16
        results.append((ln_out, eval_out, model.ln.weight.grad, model.ln.bias.grad))
        assert model.ln.weight.grad.dtype == torch.float32
    for plain, compiled in zip(*results, strict=True):
        torch.testing.assert_close(compiled.float(), plain.float(), rtol=1e-2, atol=1e-2)


COMPILED_NORM_AGAINST_EAGER = """
import json, torch
from torch import nn
from vitrain.precision import CompiledFp32LayerNorm, _layer_norm_in_fp32
norm = nn.LayerNorm(64)
norm.__class__, norm.out_dtype = CompiledFp32LayerNorm, torch.bfloat16
x = torch.randn(8, 17, 64, generator=torch.Generator().manual_seed(0)).bfloat16().requires_grad_()
compiled = norm(x)
compiled.float().square().sum().backward()
grad, x.grad = x.grad, None
eager = _layer_norm_in_fp32(x, norm.weight, norm.bias, (64,), norm.eps, torch.bfloat16)
eager.float().square().sum().backward()
gaps = [(compiled.float() - eager.float()).abs().max(), (grad.float() - x.grad.float()).abs().max()]
print(json.dumps([gap.item() for gap in gaps]))
"""


@pytest.mark.slow  # two processes that each import and run inductor: ~25 s
def test_compiled_norms_from_a_cache_built_for_another_instruction_set_stay_right(tmp_path):
    """Inductor's cache does not key its C++ by the vector instruction set (torch 2.13): a norm compiled natively and
    loaded under ATEN_CPU_CAPABILITY=default (scalar code, as on another host sharing the folder) failed to build
    (an AVX2 cap: NaNs, the reverse: a glibc abort); vitrain pins cpp.simdlen so that the two are told apart
    (device.key_compiled_cpu_kernels)."""
    from vitrain.precision import compile_norms_problem

    if compile_norms_problem(CPU) is not None:
        pytest.skip(f"torch.compile needs {compile_norms_problem(CPU)}")
    base = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
    base["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path / "inductor")  # one folder, fresh, shared by the two
    for capability in (None, "default"):
        env = base if capability is None else {**base, "ATEN_CPU_CAPABILITY": capability}
        done = subprocess.run(
            [sys.executable, "-c", COMPILED_NORM_AGAINST_EAGER], env=env, capture_output=True, text=True, timeout=600
        )
        assert done.returncode == 0, (capability, done.stderr[-2000:])
        out, grad = json.loads(done.stdout.splitlines()[-1])
        assert out < 0.05 and grad < 0.05, (capability, out, grad)


def test_compiled_cpu_kernels_carry_the_vector_width_in_inductors_cache_key():
    """The width goes into inductor's config (which its FX graph cache hashes); one a user set stays."""
    from torch._inductor import config, cpu_vec_isa
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    from vitrain.device import key_compiled_cpu_kernels

    with config.patch({"cpp.simdlen": None}):  # inductor's own patch: its value comes back on exit
        picked = pick_vec_isa()
        key_compiled_cpu_kernels("cuda")
        assert config.cpp.simdlen is None
        key_compiled_cpu_kernels("cpu")
        assert config.cpp.simdlen == picked.bit_width()
        assert pick_vec_isa() == picked  # pinned to its width, inductor picks the same instruction set
    with config.patch({"cpp.simdlen": 256}):
        key_compiled_cpu_kernels("cpu")
        assert config.cpp.simdlen == 256
    # A torch whose list put another instruction set of the picked width first: the config stays as it was.
    by_width = {None: "the set picked", 512: "the first set of 512 bits"}
    with config.patch({"cpp.simdlen": None}), pytest.MonkeyPatch.context() as patch:
        patch.setattr(cpu_vec_isa, "pick_vec_isa", lambda: _Isa(by_width[config.cpp.simdlen]))
        key_compiled_cpu_kernels("cpu")
        assert config.cpp.simdlen is None


class _Isa(str):
    def bit_width(self) -> int:
        return 512


def test_compile_norms_without_a_compiler_is_one_line_naming_the_field(monkeypatch):
    from vitrain import precision

    monkeypatch.setattr(precision.shutil, "which", lambda name: None)
    cfg = load_config(CONFIG_DIR / "digits.yaml", ["precision.compile_norms=true", "train.device=cpu"], check=False)
    with pytest.raises(ConfigError, match=r"precision.compile_norms=true needs the C\+\+ compiler .* set it to false"):
        precision.check(cfg)
    zero2 = load_config(
        CONFIG_DIR / "digits.yaml", ["precision.compile_norms=true", "parallel.strategy=zero2"], check=False
    )
    with pytest.raises(ConfigError, match=r"precision.compile_norms=true needs"):  # FSDP2's fp32 norm unit compiles too
        precision.check(zero2)
    for ignored in ("precision.mode=amp_o1", "train.engine=deepspeed"):  # where it is off
        precision.check(load_config(CONFIG_DIR / "digits.yaml", ["precision.compile_norms=true", ignored], check=False))


def test_compile_norms_auto_compiles_on_a_cpu_that_can_build_and_keeps_the_hooks_elsewhere(monkeypatch):
    from vitrain import precision

    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    monkeypatch.setattr(precision, "compile_norms_problem", lambda device: None)
    assert precision.compiles_norms("auto", cpu) and not precision.compiles_norms("auto", gpu)  # a GPU: unmeasured
    assert precision.compiles_norms(True, gpu) and not precision.compiles_norms(False, cpu)
    monkeypatch.setattr(precision, "compile_norms_problem", lambda device: "the C++ compiler g++")
    assert not precision.compiles_norms("auto", cpu)  # no compiler: the hooks, and no error
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8))
    working = policy("amp_o2", compile_norms="auto").prepare(model)
    assert type(working.module[1]) is nn.LayerNorm
    cfg = load_config(CONFIG_DIR / "digits.yaml", ["precision.mode=amp_o2", "train.device=cpu"], check=False)
    assert cfg.precision.compile_norms == "auto"
    precision.check(cfg)  # auto never asks for a compiler


def test_asking_whether_norms_compile_reads_inductors_compiler_without_importing_inductor(monkeypatch):
    code = (
        "import sys, torch; from vitrain.precision import compile_norms_problem as p; "
        "print(p(torch.device('cpu'))); print('torch._inductor.config' in sys.modules)"
    )
    env = {**os.environ, "CXX": "no-such-compiler-vitrain"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    problem, imported = out.strip().splitlines()
    assert "no-such-compiler-vitrain" in problem and imported == "False"  # $CXX, as inductor reads it; no import
    from types import SimpleNamespace

    from vitrain import precision

    loaded = SimpleNamespace(cpp=SimpleNamespace(cxx=(None, "set-by-the-user-c++")))  # a config a user changed
    monkeypatch.setitem(sys.modules, "torch._inductor.config", loaded)
    assert "set-by-the-user-c++" in precision.compile_norms_problem(torch.device("cpu"))


def test_o1_keeps_every_weight_fp32_and_autocasts_matmuls(tiny_model):
    model = tiny_model
    pol = policy("amp_o1")
    forward = pol.prepare(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with pol.autocast():
        logits = forward(torch.randn(4, 1, 16, 16))
        assert logits.dtype == torch.bfloat16
        loss = F.cross_entropy(logits.float(), torch.randint(0, 10, (4,)))
    pol.backward(loss)
    pol.step(optimizer, 1.0)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(s.dtype == torch.float32 for st in optimizer.state.values() for s in st.values() if s.ndim)


def test_pure_casts_every_weight_low_norms_included(tiny_model):
    model = tiny_model
    forward = policy("pure").prepare(model)
    assert all(t.dtype == torch.bfloat16 for t in model.state_dict().values() if t.is_floating_point())
    assert forward(torch.randn(2, 1, 16, 16)).dtype == torch.float32  # the loss is computed in fp32


def test_pure_computes_norms_in_fp32_with_low_weights_and_fp32_statistics():
    model = NormZoo()
    forward = policy("pure").prepare(model)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert model.bn.running_mean.dtype == model.bn.running_var.dtype == torch.float32
    before = model.bn.running_mean.clone()
    forward(torch.randn(16, 8)).sum().backward()
    assert not torch.equal(model.bn.running_mean, before)  # the statistics are updated in place, in fp32
    assert all(p.grad.dtype == torch.bfloat16 for p in model.parameters())
    assert list(model.state_dict()) == list(NormZoo().state_dict())  # checkpoint names unchanged


def test_pure_norm_gradients_match_fp32():
    """A bf16 LayerNorm backward sums its weight/bias gradients over all tokens in bf16 (~15% off); pure must not."""
    torch.manual_seed(0)
    reference = create_model(TINY_MODEL)
    images, labels = torch.randn(64, 1, 16, 16), torch.randint(0, 10, (64,))
    grads = {}
    for mode in ("fp32", "pure"):
        model = copy.deepcopy(reference)
        forward = policy(mode).prepare(model)
        F.cross_entropy(forward(images).float(), labels).backward()
        grads[mode] = {n: p.grad.float() for n, p in model.named_parameters()}
    errors = {n: float((grads["pure"][n] - g).norm() / g.norm()) for n, g in grads["fp32"].items()}
    assert max(errors[n] for n in errors if "norm" in n) < 0.04, errors


@pytest.mark.parametrize("impl", ["fused", "foreach", "flat"])
def test_pure_compensated_keeps_updates_below_bf16_resolution(impl):
    """100 SGD steps of 1e-3 on a weight of 1.0: each is below bf16's half-ulp there (2^-8), so plain bf16 loses all."""
    results = {}
    for compensated in (False, True):
        model = nn.Linear(1, 1, bias=False)
        with torch.no_grad():
            model.weight.fill_(1.0)
        pol = policy("pure", compensated=compensated)
        pol.prepare(model)
        sgd = OptimConfig(name="sgd", lr=1e-3, momentum=0.0, weight_decay=0.0, impl=impl)
        optimizer = build_optimizer(model, sgd, CPU)
        for _ in range(100):
            if model.weight.grad is None:
                model.weight.grad = torch.ones_like(model.weight)
            else:  # the flat optimizer's gradient is a view into its buffer: fill it in place
                model.weight.grad.fill_(1.0)
            pol.step(optimizer, clip_grad_norm=0.0)
        assert model.weight.dtype == torch.bfloat16
        results[compensated] = model.weight.item()
        if compensated:
            results[compensated] += pol.compensation_state(model, optimizer)["weight"].item()
    assert results[False] == 1.0
    assert results[True] == pytest.approx(0.9, abs=1e-4)


def test_pure_compensated_adamw_tracks_fp32_and_keeps_fp32_state():
    """A few hundred AdamW steps with weight decay on a small regression: pure+compensation stays close to fp32."""
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(256, 8, generator=gen), torch.randn(256, 1, generator=gen)
    finals = {}
    for mode, compensated in (("fp32", True), ("pure", True), ("pure", False)):
        model = nn.Linear(8, 1)
        with torch.no_grad():
            model.weight.fill_(0.5), model.bias.fill_(0.0)
        pol = policy(mode, compensated=compensated)
        forward = pol.prepare(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, fused=True)
        for _ in range(300):
            pol.backward(F.mse_loss(forward(x).float(), y))
            pol.step(optimizer, clip_grad_norm=1.0)
        finals[(mode, compensated)] = model.weight.detach().float()
        if mode == "pure" and compensated:
            finals[(mode, compensated)] += pol.compensation_state(model, optimizer)["weight"]
        expected_state = torch.bfloat16 if (mode, compensated) == ("pure", False) else torch.float32
        assert all(t.dtype == expected_state for st in optimizer.state.values() for t in st.values() if t.ndim)
    reference = finals[("fp32", True)]
    compensated_error = (finals[("pure", True)] - reference).abs().max()
    plain_error = (finals[("pure", False)] - reference).abs().max()
    assert compensated_error < 2e-3 and plain_error > 5 * compensated_error, (compensated_error, plain_error)


@pytest.mark.parametrize("impl", ["fused", "flat"])
def test_pure_run_checkpoints_fp32_and_resumes_exactly(tmp_path, impl):
    common = ["precision.mode=pure", "precision.dtype=bf16", f"optim.impl={impl}", "log.every_steps=1"]
    whole = tiny_run(tmp_path, "name=whole", "train.max_steps=8", *common)
    Trainer(whole).fit()
    part = tiny_run(tmp_path, "name=part", "train.max_steps=4", *common)
    Trainer(part).fit()
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from vitrain import checkpoint as ckpt

    dcp_to_torch_save(ckpt.latest(part.run_dir), tmp_path / "whole.pt")
    state = torch.load(tmp_path / "whole.pt", weights_only=False)
    tensors = list(state["model"].values()) + [t for s in state["optim"]["state"].values() for t in s.values()]
    assert all(t.dtype == torch.float32 for t in tensors if t.ndim)
    # The weights the run evaluated with, upcast exactly; what bf16 rounded away is in the compensation beside them.
    assert all(torch.equal(t, t.to(torch.bfloat16).float()) for t in state["model"].values())
    assert state["compensation"].keys() == state["model"].keys()
    assert any(bool(c.any()) for c in state["compensation"].values())
    assert "precision pure bfloat16, Kahan-compensated updates" in (part.run_dir / "log.txt").read_text()
    part.train.max_steps = 8
    Trainer(part, resume=True).fit()
    expected, got = step_losses(whole.run_dir), step_losses(part.run_dir)
    assert sorted(got) == sorted(expected) == list(range(1, 9))
    assert all(got[step] == pytest.approx(expected[step], abs=1e-6) for step in range(5, 9))


def step_losses(run_dir: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def test_injected_inf_gradient_skips_exactly_that_step_and_halves_the_scale():
    model = NormZoo()
    pol = policy("amp_o2", dtype="fp16", init_scale=1024.0)
    working = pol.prepare(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    assert train_step(pol, working, optimizer, seed=0)[1] is False
    master, low = weights(model), weights(working)
    moments = {p: {n: t.clone() for n, t in st.items()} for p, st in optimizer.state.items()}

    def poison():
        working.module.fc2.weight.grad[0, 0] = float("inf")

    grad_norm, skipped = train_step(pol, working, optimizer, seed=1, poison=poison)
    assert skipped and grad_norm is None
    assert all(torch.equal(master[k], v) for k, v in model.named_parameters())  # bitwise unchanged
    assert all(torch.equal(low[k], v) for k, v in working.named_parameters())
    assert all(torch.equal(moments[p][n], t) for p, st in optimizer.state.items() for n, t in st.items())
    assert pol.scaler.scale == 512.0 and pol.scaler.skipped_steps == 1
    assert all(p.grad is None for p in model.parameters())  # nothing leaks into the next step

    assert train_step(pol, working, optimizer, seed=2)[1] is False  # training continues
    assert not torch.equal(master["fc1.weight"], model.fc1.weight)
    assert pol.scaler.scale == 512.0


def test_loss_scale_grows_after_growth_interval_clean_steps():
    model = NormZoo()
    pol = policy("amp_o1", dtype="fp16", init_scale=8.0, growth_interval=2)
    forward = pol.prepare(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    for seed in range(4):
        train_step(pol, forward, optimizer, seed=seed)
    assert pol.scaler.scale == 32.0


def test_consecutive_overflows_at_min_scale_stop_with_a_clear_message():
    model = NormZoo()
    pol = policy("amp_o1", dtype="fp16", init_scale=2.0, min_scale=1.0, max_overflows_at_min=3)
    forward = pol.prepare(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)

    def poison():
        model.fc1.weight.grad.fill_(float("nan"))

    train_step(pol, forward, optimizer, poison=poison)  # 2 -> 1
    train_step(pol, forward, optimizer, poison=poison)  # first overflow at the minimum
    train_step(pol, forward, optimizer, poison=poison)
    with pytest.raises(TrainingDiverged, match=r"3 steps in a row at the minimum loss scale precision.min_scale"):
        train_step(pol, forward, optimizer, poison=poison)


def test_bf16_and_fp32_use_no_loss_scaler():
    assert policy("amp_o2", "bf16").scaler is None
    assert policy("fp32").scaler is None
    assert policy("pure", "fp16").scaler is not None


def test_check_finite_refuses_a_non_finite_weight():
    model = NormZoo()
    with torch.no_grad():
        model.fc1.weight[0, 0] = float("inf")
    with pytest.raises(TrainingDiverged, match="fc1.weight holds inf/NaN"):
        check_finite(model)


def test_auto_selects_fp32_on_a_cpu_without_bf16_units_and_says_why(monkeypatch):
    monkeypatch.setenv("VITRAIN_CPU_BF16_UNITS", "0")
    chosen = resolve(PrecisionConfig(mode="auto"), CPU)
    assert chosen.mode == "fp32" and chosen.dtype == torch.float32
    assert "CPU without AMX bf16 matmul units" in chosen.reason
    # Why, on this CPU: its bf16 emulated, or (avx512_bf16) no race decided it; it said bf16 was slower on both.
    assert "emulated" in chosen.reason or "no race decided it" in chosen.reason


def test_auto_selects_bf16_o1_on_a_cpu_with_bf16_units_and_says_why(monkeypatch):
    monkeypatch.setenv("VITRAIN_CPU_BF16_UNITS", "1")
    chosen = resolve(PrecisionConfig(mode="auto"), CPU)
    assert chosen.mode == "amp_o1" and chosen.dtype == torch.bfloat16
    assert chosen.reason == "auto: CPU with AMX bf16 matmul units, forced by VITRAIN_CPU_BF16_UNITS -> bf16 O1"


@pytest.mark.parametrize(
    "units, label, logged",
    [
        ("0", "fp32", "precision fp32 (auto: CPU without AMX bf16 matmul units, forced by VITRAIN_CPU_BF16_UNITS"),
        (
            "1",
            "amp_o1 bfloat16",
            "precision amp_o1 bfloat16 (auto: CPU with AMX bf16 matmul units, forced by VITRAIN_CPU_BF16_UNITS -> bf16",
        ),
    ],
)
def test_trainer_logs_why_auto_chose_its_precision(tmp_path, monkeypatch, units, label, logged):
    monkeypatch.setenv("VITRAIN_CPU_BF16_UNITS", units)
    cfg = tiny_run(tmp_path, "precision.mode=auto", "train.max_steps=1", "train.device=cpu")  # the CPU's rules
    summary = Trainer(cfg).fit()
    assert summary["precision"] == label
    assert logged in (cfg.run_dir / "log.txt").read_text()


def test_a_bad_bf16_units_override_is_one_line_naming_the_variable_and_its_values(monkeypatch):
    monkeypatch.setenv("VITRAIN_CPU_BF16_UNITS", "yes")
    with pytest.raises(ConfigError) as refused:
        resolve(PrecisionConfig(mode="auto"), CPU)
    message = str(refused.value)
    assert message.startswith("VITRAIN_CPU_BF16_UNITS='yes' must be 1") and "or 0" in message
    assert "\n" not in message


def test_cpu_description_names_the_cpu_and_says_when_the_probe_is_forced(monkeypatch):
    monkeypatch.delenv("VITRAIN_CPU_BF16_UNITS", raising=False)
    probed = "yes" if torch.cpu._is_amx_tile_supported() else "no"
    line = cpu_description()
    assert line.startswith("CPU: ") and f"bf16 matrix units (AMX): {probed};" in line and "\n" not in line
    monkeypatch.setenv("VITRAIN_CPU_BF16_UNITS", "1")
    assert f"(AMX): yes (forced by VITRAIN_CPU_BF16_UNITS=1; the probe says {probed})" in cpu_description()


def test_a_bf16_mode_set_on_a_cpu_that_emulates_bf16_says_auto_runs_faster(monkeypatch):
    import vitrain.device as device
    import vitrain.precision as precision

    probed = []
    why = "a 512^3 bf16 matmul ran at 2.8 GFLOP/s against fp32's 225.5 here, 82x slower (bf16 emulated)"
    monkeypatch.setattr(device, "bf16_emulated", lambda on: probed.append(on.type) or why)
    device.bf16_emulated_here.cache_clear()
    try:
        for mode in ("amp_o1", "amp_o2", "bf16"):
            resolved = precision.resolve(PrecisionConfig(mode=mode, dtype="bf16"), CPU)
            assert resolved.mode == mode and resolved.dtype == torch.bfloat16  # what was asked for still runs
            assert resolved.reason == (
                f"precision.mode={mode} set in the config; {why}: precision.mode=auto or fp32 runs faster here"
            )
        assert probed == ["cpu"]  # measured once per process
        fp32 = precision.resolve(PrecisionConfig(mode="fp32"), CPU)
        assert fp32.reason == "precision.mode=fp32 set in the config"
    finally:
        device.bf16_emulated_here.cache_clear()


def test_cpu_description_says_when_the_instruction_set_is_capped(monkeypatch):
    # An AVX2 CPU emulated on a newer one: its figures (and autotune's cached decisions) are another machine's.
    for name in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS"):
        monkeypatch.delenv(name, raising=False)
    assert "capped" not in cpu_description()
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert cpu_description().endswith("; instruction set capped: ATEN_CPU_CAPABILITY=avx2, ONEDNN_MAX_CPU_ISA=AVX2")


def test_fp16_o2_run_checkpoint_is_all_fp32_and_finite(tmp_path):
    cfg = tiny_run(tmp_path, "precision.mode=amp_o2", "precision.dtype=fp16", "train.max_steps=6")
    Trainer(cfg).fit()
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from vitrain import checkpoint as ckpt
    from vitrain.cli import main

    step_dir = ckpt.latest(cfg.run_dir)
    dcp_to_torch_save(step_dir, tmp_path / "whole.pt")
    state = torch.load(tmp_path / "whole.pt", weights_only=False)
    assert main(["export", str(step_dir), str(tmp_path / "export")]) == 0
    exported = load_file(tmp_path / "export" / "model.safetensors")
    tensors = list(state["model"].values()) + list(exported.values())
    tensors += [t for s in state["optim"]["state"].values() for t in s.values() if torch.is_tensor(t) and t.ndim]
    assert tensors and all(t.dtype == torch.float32 for t in tensors)
    assert all(bool(torch.isfinite(t).all()) for t in tensors)
    assert ckpt.read_meta(step_dir)["precision"]["scaler"]["scale"] > 0


def test_trainer_skips_and_logs_an_injected_overflow_then_continues(tmp_path):
    cfg = tiny_run(tmp_path, "precision.mode=amp_o1", "precision.dtype=fp16", "train.max_steps=6")
    trainer = Trainer(cfg)
    calls = []

    def overflow_on_third_backward(grad):
        calls.append(1)
        return grad * float("inf") if len(calls) == 3 else grad

    trainer.model.head.weight.register_hook(overflow_on_third_backward)
    summary = trainer.fit()
    records = [json.loads(line) for line in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    skipped = [r for r in records if r.get("skipped")]
    assert [r["step"] for r in skipped] == [3]
    steps = {r["step"]: r for r in records if "loss" in r}
    assert steps[3]["loss_scale"] == steps[2]["loss_scale"] / 2
    assert summary["steps"] == 6 and summary["skipped_steps"] == 1


def test_resume_restores_the_loss_scale_and_the_working_copy(tmp_path):
    cfg = tiny_run(tmp_path, "precision.mode=amp_o2", "precision.dtype=fp16", "train.max_steps=2")
    first = Trainer(cfg)
    first.precision.scaler.scale = 1234.0  # as if overflows had lowered it
    first.fit()
    resumed = Trainer(cfg, resume=True)
    runs.restore(resumed, resumed.resume_path)
    assert resumed.precision.scaler.scale == 1234.0
    assert torch.equal(resumed.forward.module.head.weight, first.model.head.weight.detach().to(torch.float16))


@pytest.mark.slow
def test_digits_recipe_in_bf16_ends_within_one_point_of_fp32(tmp_path):
    """The full digits recipe in fp32 and bf16 O1, O2, pure for seeds 0-2, two runs at a time (~13 min here).

    The acceptance is the recipe as it ships (its seed, 0): every bf16 mode within 1 point of fp32. Other seeds
    are compared by their mean, not one by one: fp32 alone spreads with a standard deviation of 0.68 points over
    seeds, and any change in rounding (even fp32 on another thread count) moves a run as far as a new seed does
    (docs/precision-and-optimizers.md).
    """
    if emulated := bf16_emulated(torch.device("cpu")):  # an AVX2 CPU: nine bf16 runs would take hours, not minutes
        pytest.skip(f"bf16 runs in software on this CPU ({emulated}); run it on a CPU with bf16 instructions")
    results = tmp_path / "results.json"
    command = [sys.executable, str(REPO / "benchmarks" / "precision_digits.py"), "--seeds", "0", "1", "2"]
    done = subprocess.run([*command, "--out-dir", str(tmp_path / "runs"), "--results", str(results)], cwd=REPO)
    assert done.returncode == 0
    top1 = {(r["mode"], r["seed"]): r["val_top1"] for r in json.loads(results.read_text())["rows"]}
    mean = {mode: sum(top1[(mode, seed)] for seed in (0, 1, 2)) / 3 for mode in ("fp32", "amp_o1", "amp_o2", "pure")}
    for mode in ("amp_o1", "amp_o2", "pure"):
        assert abs(top1[(mode, 0)] - top1[("fp32", 0)]) <= 0.01, (mode, "seed 0", top1)
        assert abs(mean[mode] - mean["fp32"]) <= 0.01, (mode, "mean", mean)


def test_a_class_in_fp32_modules_that_no_layer_of_the_model_is_is_refused_naming_the_classes():
    """A misspelt class in precision.fp32_modules left the layer it meant in bf16 without a word."""
    with pytest.raises(
        ConfigError, match=r"^precision.fp32_modules names Nope, which no layer of the model is; .*Linear"
    ):
        policy("amp_o2", fp32_modules=("Linear", "Nope")).prepare(NormZoo())
    policy("amp_o2", fp32_modules=("Linear",)).prepare(NormZoo())  # a class the model has


@pytest.mark.parametrize("norm_class", [nn.BatchNorm2d, CpuSyncBatchNorm])
def test_a_batchnorm_with_low_precision_weights_beside_fp32_statistics_normalizes_in_fp32(norm_class):
    # DeepSpeed's bf16 casts parameters, not buffers: bf16 weights beside fp32 running statistics, which torch's CPU
    # batch_norm refused. Swapped, the norm computes what an fp32 one with the same (rounded) weights computes.
    from vitrain.precision import batch_norms_in_fp32, plain_batch_norms

    torch.manual_seed(0)
    reference = nn.Sequential(nn.BatchNorm2d(4))
    with torch.no_grad():
        reference[0].weight.uniform_(0.5, 1.5)
        reference[0].bias.uniform_(-0.5, 0.5)
    model = copy.deepcopy(reference)
    model[0].__class__ = norm_class
    for param in model.parameters():
        param.data = param.data.bfloat16()
    reference[0].weight.data, reference[0].bias.data = model[0].weight.data.float(), model[0].bias.data.float()
    assert batch_norms_in_fp32(model) == 1 and batch_norms_in_fp32(model) == 0
    x = torch.randn(8, 4, 5, 5).bfloat16()
    for train in (True, False):
        model.train(train), reference.train(train)
        out, expected = model(x), reference(x.float())
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out, expected.bfloat16(), rtol=0, atol=0)
        torch.testing.assert_close(model[0].running_var, reference[0].running_var, rtol=0, atol=0)
    model.train()
    model(x).float().square().sum().backward()
    assert model[0].weight.grad.dtype == torch.bfloat16 and bool(model[0].weight.grad.abs().sum() > 0)
    assert model[0].weight.dtype == torch.bfloat16 and isinstance(model[0].weight, nn.Parameter)
    plain_batch_norms(model)
    assert type(model[0]) is norm_class
