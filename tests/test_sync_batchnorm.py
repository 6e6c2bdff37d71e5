"""BatchNorm over all ranks on CPU: 2 gloo ranks with half a batch each behave like one BatchNorm over the batch."""

from __future__ import annotations

import json

import torch
import torch.distributed as dist
from torch import nn

from tests.distributed_helpers import run_two_ranks
from vitrain.parallel.sync_batchnorm import CpuSyncBatchNorm, sync_batchnorm


def _batch() -> torch.Tensor:
    return torch.randn(8, 5, generator=torch.Generator().manual_seed(0)) * 3 + 1


def _job(out: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = sync_batchnorm(nn.Sequential(nn.BatchNorm1d(5)), torch.device("cpu"))
    x = _batch()[rank * 4 : (rank + 1) * 4].requires_grad_()
    y = model(x)
    (y * torch.arange(5.0)).pow(2).sum().backward()
    norm = model[0]
    result = {
        "type": type(norm).__name__,
        "y": y.tolist(),
        "x_grad": x.grad.tolist(),
        "weight_grad": norm.weight.grad.tolist(),
        "running_var": norm.running_var.tolist(),
        "running_mean": norm.running_mean.tolist(),
    }
    with open(f"{out}.rank{rank}.json", "w") as f:
        json.dump(result, f)


def test_two_ranks_normalize_with_the_whole_batch_like_one_batchnorm(tmp_path):
    norm = nn.BatchNorm1d(5)
    x = _batch().requires_grad_()
    y = norm(x)
    (y * torch.arange(5.0)).pow(2).sum().backward()
    run_two_ranks(_job, str(tmp_path / "out"))
    weight_grad = torch.zeros(5)
    for rank in (0, 1):
        got = json.loads((tmp_path / f"out.rank{rank}.json").read_text())
        mine = slice(rank * 4, (rank + 1) * 4)
        assert got["type"] == CpuSyncBatchNorm.__name__
        assert torch.allclose(torch.tensor(got["y"]), y[mine], atol=1e-5)
        assert torch.allclose(torch.tensor(got["x_grad"]), x.grad[mine], atol=1e-4)
        assert torch.allclose(torch.tensor(got["running_var"]), norm.running_var, atol=1e-5)
        assert torch.allclose(torch.tensor(got["running_mean"]), norm.running_mean, atol=1e-6)
        weight_grad += torch.tensor(got["weight_grad"])
    # Each rank's weight gradient covers its own samples; data parallelism sums (averages) them.
    assert torch.allclose(weight_grad, norm.weight.grad, atol=1e-4)


def test_one_process_keeps_plain_batchnorm_arithmetic():
    plain, synced = nn.BatchNorm1d(5), CpuSyncBatchNorm(5)
    x = _batch()
    assert torch.allclose(plain(x), synced(x)) and torch.allclose(plain.running_var, synced.running_var)


def _autocast_job(out: str) -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = sync_batchnorm(nn.Sequential(nn.Linear(5, 6), nn.BatchNorm1d(6)), torch.device("cpu"))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = model(_batch())
    y.float().sum().backward()
    norm = model[1]
    with open(f"{out}.rank{dist.get_rank()}.json", "w") as f:
        json.dump({"dtype": str(y.dtype), "stats": str(norm.running_var.dtype), "finite": bool(y.isfinite().all())}, f)


def test_bf16_autocast_keeps_the_statistics_in_fp32(tmp_path):
    run_two_ranks(_autocast_job, str(tmp_path / "out"))
    got = json.loads((tmp_path / "out.rank0.json").read_text())
    assert got == {"dtype": "torch.bfloat16", "stats": "torch.float32", "finite": True}
