"""The identity head: margins, the sharded softmax over 2 gloo ranks against one process, Partial FC sampling."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tests.distributed_helpers import run_two_ranks
from vitrain.models.heads import Margin
from vitrain.parallel.identity_head import IdentityHead, init_rows, shard_range

IDENTITIES, DIM, PER_RANK = 11, 8, 6  # 11 identities: the two shards are uneven (6 and 5 rows)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    inputs = torch.randn(2 * PER_RANK, 5, generator=gen)
    labels = torch.tensor([0, 3, 5, 6, 10, 2, 7, 7, 1, 9, 4, 8])
    return inputs, labels


def _backbone() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(5, DIM)


def _margin(kind: str) -> Margin:
    return Margin(kind, 16.0, m2=0.5) if kind == "arcface" else Margin(kind, 16.0, m3=0.35)


def _one_process(kind: str) -> tuple[float, torch.Tensor, torch.Tensor]:
    backbone, (inputs, labels) = _backbone(), _batch()
    head = IdentityHead(IDENTITIES, DIM, _margin(kind), seed=1)
    loss = head(backbone(inputs), labels)
    loss.backward()
    return float(loss.detach()), backbone.weight.grad.clone(), head.weight.grad.clone()


def _two_rank_job(kind: str, out: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    backbone = nn.parallel.DistributedDataParallel(_backbone())
    inputs, labels = _batch()
    mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    head = IdentityHead(IDENTITIES, DIM, _margin(kind), seed=1)
    loss = head(backbone(inputs[mine]), labels[mine])
    loss.backward()
    result = {
        "loss": float(loss.detach()),
        "backbone_grad": backbone.module.weight.grad.tolist(),
        "head_rows": [head.start, head.end],
        "head_grad": head.weight.grad.tolist(),
    }
    with open(f"{out}.rank{rank}.json", "w") as f:
        json.dump(result, f)


# cosface is slow (11 s on a Zen 4): the margin heads share the sharded code; arcface runs in the default suite
@pytest.mark.parametrize("kind", ["arcface", pytest.param("cosface", marks=pytest.mark.slow)])
def test_sharded_head_on_two_ranks_equals_one_process(tmp_path, kind):
    loss, backbone_grad, head_grad = _one_process(kind)
    run_two_ranks(_two_rank_job, kind, str(tmp_path / "out"))
    for rank in (0, 1):
        got = json.loads((tmp_path / f"out.rank{rank}.json").read_text())
        assert got["loss"] == pytest.approx(loss, abs=1e-5)
        assert torch.allclose(torch.tensor(got["backbone_grad"]), backbone_grad, atol=1e-5)
        start, end = got["head_rows"]
        assert (start, end) == shard_range(IDENTITIES, rank, 2)
        assert torch.allclose(torch.tensor(got["head_grad"]), head_grad[start:end], atol=1e-5)


def test_centres_are_initialized_the_same_on_any_world_size():
    whole = init_rows(0, 10_000, 4, seed=5)
    assert torch.equal(init_rows(4000, 8500, 4, seed=5), whole[4000:8500])
    assert not torch.equal(init_rows(0, 10, 4, seed=6), whole[:10])


def test_cosface_subtracts_the_margin_from_the_true_cosine_only():
    cos = torch.tensor([[0.5, 0.2], [0.1, 0.9]])
    logits = Margin("cosface", 10.0, m3=0.35).logits(cos, torch.tensor([0, -1]))
    assert torch.allclose(logits, torch.tensor([[1.5, 2.0], [1.0, 9.0]]))


def test_arcface_adds_the_angle_and_keeps_decreasing_past_pi():
    margin = Margin("arcface", 1.0, m2=0.5)
    cos = torch.tensor([[0.6], [-0.95]])
    logits = margin.logits(cos, torch.tensor([0, 0]))
    assert logits[0, 0] == pytest.approx(math.cos(math.acos(0.6) + 0.5), abs=1e-6)
    # theta + m > pi: the straight continuation, below the margined value of a slightly better angle
    assert logits[1, 0] == pytest.approx(-0.95 - math.sin(math.pi - 0.5) * 0.5, abs=1e-6)
    assert logits[1, 0] < margin.logits(torch.tensor([[-0.85]]), torch.tensor([0]))[0, 0]


def test_combined_margin_with_m1_1_and_m3_0_is_arcface_for_acute_angles():
    cos = torch.tensor([[0.3, 0.8]])
    combined = Margin("combined", 2.0, m1=1.0, m2=0.5, m3=0.0).logits(cos, torch.tensor([1]))
    arcface = Margin("arcface", 2.0, m2=0.5).logits(cos, torch.tensor([1]))
    assert torch.allclose(combined, arcface, atol=1e-6)


@pytest.mark.parametrize("m", [(1.0, 0.3, 0.2), (1.2, 0.3, 0.0), (0.9, 0.4, 0.1)])
def test_the_combined_margin_keeps_decreasing_in_the_angle_all_the_way_to_pi(m):
    theta = torch.linspace(0.0, math.pi, 2001, dtype=torch.float64)
    target = Margin("combined", 1.0, *m).target(torch.cos(theta))
    assert (target.diff() < 0).all()  # cos(m1 theta + m2) alone turned back up past m1 theta + m2 = pi
    inside = theta < (math.pi - m[1]) / m[0]
    expected = torch.cos(m[0] * theta[inside] + m[1]) - m[2]  # insightface's formula where it is monotone
    assert torch.allclose(target[inside], expected, atol=1e-12)


def test_softmax_head_is_scaled_cosine_cross_entropy():
    torch.manual_seed(0)
    x, labels = torch.randn(4, DIM), torch.tensor([0, 1, 2, 1])
    head = IdentityHead(3, DIM, Margin("softmax", 8.0), seed=0)
    cos = F.normalize(x, dim=1) @ F.normalize(head.weight, dim=1).t()
    with torch.no_grad():
        assert float(head(x, labels)) == pytest.approx(float(F.cross_entropy(8.0 * cos, labels)), abs=1e-6)


def test_head_computes_in_fp32_under_autocast():
    head = IdentityHead(5, DIM, Margin("cosface", 8.0, m3=0.2))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = head(torch.randn(4, DIM, dtype=torch.bfloat16), torch.tensor([0, 1, 2, 3]))
    assert loss.dtype == torch.float32


def test_sampling_keeps_every_positive_centre_and_the_rate_of_the_rest():
    torch.manual_seed(0)
    head = IdentityHead(1000, DIM, Margin("cosface", 8.0, m3=0.2), sample_rate=0.1)
    labels = torch.tensor([3, 999, 500, 500, 42, 7])
    index, target_col = head.sample(labels)
    assert index.numel() == 100 and torch.equal(index, index.sort().values)
    assert torch.equal(index[target_col], labels)  # every sample's true centre is among the sampled, at its column


def test_sampling_keeps_all_positives_when_they_outnumber_the_rate():
    head = IdentityHead(20, DIM, Margin("cosface", 8.0, m3=0.2), sample_rate=0.1)
    labels = torch.tensor([1, 4, 9, 16, 19])
    index, target_col = head.sample(labels)
    assert index.tolist() == [1, 4, 9, 16, 19] and torch.equal(index[target_col], labels)


def test_sampled_head_trains_and_leaves_unsampled_rows_without_gradient():
    torch.manual_seed(0)
    head = IdentityHead(200, DIM, Margin("cosface", 8.0, m3=0.2), sample_rate=0.1)
    x, labels = torch.randn(8, DIM, requires_grad=True), torch.randint(0, 200, (8,))
    optimizer = torch.optim.SGD([head.weight, x], lr=0.5)
    first = None
    for _ in range(20):
        optimizer.zero_grad()
        loss = head(x, labels)
        loss.backward()
        first = first if first is not None else float(loss.detach())
        touched = head.weight.grad.abs().sum(dim=1) > 0
        assert int(touched.sum()) <= 20 and bool(touched[labels].all())
        optimizer.step()
    assert float(loss.detach()) < 0.5 * first
