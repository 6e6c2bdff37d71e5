"""optim.name=muon: Newton-Schulz orthogonalization, the update rule per group, parameter grouping, resume, refusals."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.distributed_helpers import losses, run_two_ranks, tiny_config, whole_and_resumed
from tests.test_checkpoint import TEN_STEPS
from vitrain.config import load_config, resolve_config_path
from vitrain.engine import Trainer
from vitrain.errors import ConfigError
from vitrain.models import create_model
from vitrain.optim import build_optimizer, param_groups
from vitrain.optim.muon import RMS_MATCH, Muon, orthogonalize


@pytest.mark.parametrize("shape", [(32, 96), (96, 32), (48, 48)])
def test_orthogonalize_pushes_every_singular_value_towards_one(shape):
    torch.manual_seed(0)
    # A badly conditioned matrix: singular values spread over four orders of magnitude.
    u, _ = torch.linalg.qr(torch.randn(shape[0], shape[0]))
    v, _ = torch.linalg.qr(torch.randn(shape[1], shape[1]))
    k = min(shape)
    spread = torch.logspace(-3, 1, k)
    matrix = u[:, :k] @ torch.diag(spread) @ v[:, :k].T
    out = orthogonalize(matrix)
    assert out.shape == matrix.shape and out.dtype == matrix.dtype
    singular = torch.linalg.svdvals(out)
    assert singular.max() < 1.25
    assert singular[: k // 2].min() > 0.6  # the larger half lands near 1 (the tiniest ones grow more slowly)
    # The same singular vectors: the output is U f(S) V^T, so U^T out V is diagonal.
    inner = u[:, :k].T @ out @ v[:, :k]
    assert torch.allclose(inner, torch.diag(torch.diagonal(inner)), atol=1e-3)


def _two_groups(seed: int = 0) -> tuple[nn.Parameter, nn.Parameter]:
    torch.manual_seed(seed)
    return nn.Parameter(torch.randn(16, 24)), nn.Parameter(torch.randn(24))


def test_adamw_groups_follow_torch_adamw():
    lr, wd, betas = 1e-2, 0.1, (0.9, 0.99)
    ours, theirs = _two_groups(), _two_groups()
    ours_opt = Muon([{"params": list(ours), "muon": False}], lr=lr, betas=betas, weight_decay=wd)
    theirs_opt = torch.optim.AdamW(list(theirs), lr=lr, betas=betas, weight_decay=wd, foreach=False)
    for step in range(5):
        torch.manual_seed(100 + step)
        grads = [torch.randn_like(p) for p in ours]
        for p, q, g in zip(ours, theirs, grads, strict=True):
            p.grad, q.grad = g.clone(), g.clone()
        ours_opt.step()
        theirs_opt.step()
    for p, q in zip(ours, theirs, strict=True):
        assert torch.allclose(p, q, atol=1e-6)


def test_a_muon_step_is_the_orthogonalized_nesterov_momentum_at_adamw_rms():
    lr, wd, mu = 1e-2, 0.1, 0.95
    weight, _ = _two_groups()
    start = weight.detach().clone()
    optimizer = Muon([{"params": [weight], "muon": True}], lr=lr, weight_decay=wd, momentum=mu)
    grad = torch.randn_like(weight)
    weight.grad = grad.clone()
    optimizer.step()
    buf = (1 - mu) * grad  # the momentum buffer after one step from zero
    direction = grad + mu * (buf - grad)  # Nesterov: grad.lerp(buf, mu)
    expected = start * (1 - lr * wd) - lr * RMS_MATCH * 24**0.5 * orthogonalize(direction)
    assert torch.allclose(weight, expected, atol=1e-6)
    assert torch.equal(optimizer.state[weight]["momentum_buffer"], buf)
    # The update's RMS is that of a typical AdamW step, lr x 0.2, whatever the gradient's scale.
    update = (start * (1 - lr * wd) - weight.detach()) / lr
    assert update.pow(2).mean().sqrt().item() == pytest.approx(RMS_MATCH, rel=0.2)


def test_only_the_blocks_weight_matrices_follow_muon():
    cfg = load_config(
        resolve_config_path("digits"), ["optim.name=muon", "model.patch_embed=conv", "model.stem_channels=[8,16]"]
    )
    model = create_model(cfg.model)
    names = {p: n for n, p in model.named_parameters()}
    muon = {names[p] for g in param_groups(model, cfg.optim) if g["muon"] for p in g["params"]}
    blocks_matrices = {n for n, p in model.named_parameters() if n.startswith("blocks.") and p.ndim == 2}
    assert muon == blocks_matrices and muon
    assert not any(n.startswith(("head.", "patch_embed.")) for n in muon)
    optimizer = build_optimizer(model, cfg.optim, torch.device("cpu"))
    assert isinstance(optimizer, Muon)
    # Weight decay stays off norms and biases under either rule.
    for group in optimizer.param_groups:
        if any(p.ndim <= 1 for p in group["params"]):
            assert group["weight_decay"] == 0.0
    # Other optimizers' groups carry no muon key.
    plain = param_groups(model, load_config(resolve_config_path("digits")).optim)
    assert all("muon" not in g for g in plain)


def test_muon_trains_and_resumes_exactly(tmp_path):
    muon = {"name": "muon", "lr": 3e-3}
    whole, part, _ = whole_and_resumed(tmp_path, TEN_STEPS, stop_at=5, optim=muon)
    expected, got = losses(whole.run_dir), losses(part.run_dir)
    assert [got[s] for s in range(6, 11)] == [expected[s] for s in range(6, 11)]
    assert expected[10] < expected[1]


@pytest.mark.parametrize(
    "overrides, field",
    [
        (["parallel.strategy=zero3"], "parallel.strategy=single or ddp"),
        (["parallel.strategy=zero1"], "parallel.strategy=single or ddp"),
        (["optim.impl=flat"], "optim.impl=flat"),
        (["optim.muon_momentum=1.0"], "optim.muon_momentum"),
    ],
)
def test_muon_is_refused_where_it_cannot_run(overrides, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_config(resolve_config_path("digits"), ["optim.name=muon", *overrides])


def test_bf16_newton_schulz_gives_the_fp32_direction():
    torch.manual_seed(0)
    stack = torch.randn(3, 64, 32)
    fp32, bf16 = orthogonalize(stack), orthogonalize(stack, dtype=torch.bfloat16)
    assert bf16.dtype == torch.float32 and bf16.shape == stack.shape
    cosine = torch.nn.functional.cosine_similarity(fp32.flatten(1), bf16.flatten(1))
    assert cosine.min() > 0.99
    # A stack is orthogonalized matrix by matrix.
    assert torch.allclose(orthogonalize(stack[1]), fp32[1], atol=1e-5)


@pytest.mark.parametrize("mode, expected", [("fp32", torch.float32), ("amp_o2", torch.bfloat16)])
def test_newton_schulz_runs_in_the_runs_compute_dtype(tmp_path, mode, expected):
    cfg = tiny_config(tmp_path, mode, optim={"name": "muon"}, precision={"mode": mode})
    trainer = Trainer(cfg)
    assert isinstance(trainer.engine.optimizer, Muon)
    assert trainer.engine.optimizer.ns_dtype == expected


def _muon_ddp(out_dir):
    # 8 per rank x 2 ranks: the same global batch of 16 as the one-process run.
    Trainer(tiny_config(out_dir, "ddp", batch_size=8, optim={"name": "muon"}, parallel={"strategy": "ddp"})).fit()


def test_muon_under_ddp_matches_one_process(tmp_path):
    Trainer(tiny_config(tmp_path, "single", optim={"name": "muon"})).fit()
    run_two_ranks(_muon_ddp, tmp_path)
    reference, got = losses(tmp_path / "single"), losses(tmp_path / "ddp")
    assert sorted(got) == [1, 2, 3, 4, 5]
    for step, loss in reference.items():
        assert got[step] == pytest.approx(loss, abs=1e-5), f"step {step}"
    assert len({round(v, 6) for v in reference.values()}) > 1
