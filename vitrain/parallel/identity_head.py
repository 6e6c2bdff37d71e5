"""The identity head of face recognition: centres sharded over the ranks, sampled each step (Partial FC), margin loss.

With N ranks each holds about 1/N of the identity centres (rows `start:end`, `torch.chunk`'s split). A step:

1. every rank's embeddings and labels are all-gathered: each rank scores the whole global batch against its rows;
2. with `sample_rate` r < 1 each rank keeps every centre whose identity is in the global batch plus a random r
   fraction of the rest of its rows (at least r x rows in all), and scores only those;
3. the softmax over all identities is computed across ranks: the row maxima and the sums of exponentials are
   all-reduced, and the true identity's logit comes from the rank that owns it;
4. backward: each rank's centres get their gradient from every sample of the global batch (no reduction needed);
   the embedding gradients are summed over ranks and each rank keeps its own samples'.

The loss is the mean over the global batch, identical on every rank. Data parallelism then averages the backbone's
gradients over the ranks, so the gather's backward returns N x each sample's gradient: the backbone ends with the
gradient of the global-batch loss, as one process with the whole batch would compute it.

Rows that were not sampled get a zero gradient for that step. The optimizer still steps them: weight decay
shrinks them and momentum (AdamW's moments, SGD's buffer) keeps moving them along their recent direction, with the
moments decaying; this is what insightface's Partial FC does too.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from vitrain.errors import CheckpointError
from vitrain.models.heads import Margin

INIT_STD = 0.01
INIT_BLOCK_ROWS = 4096  # rows are initialized block by block from (seed, block): the same centres on any world size


def init_rows(start: int, end: int, dim: int, seed: int) -> torch.Tensor:
    """Rows start:end of the seeded (num_classes, dim) initial centre matrix, without building the whole matrix."""
    out = torch.empty(end - start, dim)
    first, last = start // INIT_BLOCK_ROWS, (end - 1) // INIT_BLOCK_ROWS
    for block in range(first, last + 1) if end > start else ():
        lo = block * INIT_BLOCK_ROWS
        gen = torch.Generator().manual_seed(seed * 1_000_003 + block)
        rows = torch.randn(INIT_BLOCK_ROWS, dim, generator=gen) * INIT_STD
        a, b = max(start, lo), min(end, lo + INIT_BLOCK_ROWS)
        out[a - start : b - start] = rows[a - lo : b - lo]
    return out


def shard_range(num_classes: int, rank: int, world_size: int) -> tuple[int, int]:
    """Rows of `rank`, split as torch.chunk (and DTensor's Shard(0)) would: ceil(C / N) each, the last ones shorter."""
    per_rank = -(-num_classes // world_size)
    start = min(num_classes, rank * per_rank)
    return start, min(num_classes, start + per_rank)


def _distributed() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class _GatherBatch(torch.autograd.Function):
    """All-gather equal-sized per-rank batches; backward sums the gradients over ranks and returns this rank's rows
    times the world size (data parallelism averages the backbone gradients afterwards)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        rank, world = _distributed()
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x.contiguous())
        ctx.rank, ctx.world, ctx.rows = rank, world, x.shape[0]
        return torch.cat(parts)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad)
        mine = grad[ctx.rank * ctx.rows : (ctx.rank + 1) * ctx.rows]
        return mine * ctx.world


class _ShardedCrossEntropy(torch.autograd.Function):
    """Per-sample cross-entropy over logits whose columns (classes) are split over the ranks.

    `target_col` is the true class's column in this rank's logits, or -1 when another rank owns it.
    """

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target_col: torch.Tensor, sharded: bool) -> torch.Tensor:
        rows = logits.shape[0]
        if logits.shape[1]:
            row_max = logits.max(dim=1).values
        else:  # a rank that owns no rows still joins the collectives
            row_max = logits.new_full((rows,), -math.inf)
        if sharded:
            dist.all_reduce(row_max, op=dist.ReduceOp.MAX)
        exp = (logits - row_max[:, None]).exp()
        total = exp.sum(dim=1)
        owned = target_col >= 0
        target_logit = torch.zeros(rows, dtype=logits.dtype, device=logits.device)
        target_logit[owned] = logits[owned.nonzero().squeeze(1), target_col[owned]]
        if sharded:
            both = torch.stack([total, target_logit])
            dist.all_reduce(both)
            total, target_logit = both[0], both[1]
        ctx.save_for_backward(exp.div_(total[:, None]), target_col)
        return total.log() + row_max - target_logit

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        probs, target_col = ctx.saved_tensors
        grad = probs.clone()
        owned = (target_col >= 0).nonzero().squeeze(1)
        grad[owned, target_col[owned]] -= 1.0
        return grad * grad_loss[:, None], None, None


class IdentityHead(nn.Module):
    """This rank's identity centres and the margin-softmax loss of a (global) batch of embeddings against all of them.

    `sharded=False` (or one process) keeps every centre on every rank and scores only the local batch; its
    gradient must then be averaged over ranks like any replicated parameter (the trainer's head optimizer does).
    """

    def __init__(
        self,
        num_classes: int,
        embed_dim: int,
        margin: Margin,
        sample_rate: float = 1.0,
        sharded: bool = True,
        seed: int = 0,
    ):
        super().__init__()
        rank, world = _distributed()
        self.sharded = sharded and world > 1
        self.rank, self.world_size = (rank, world) if self.sharded else (0, 1)
        self.replicas = world if not self.sharded else 1  # ranks that hold the same rows
        self.num_classes, self.embed_dim = num_classes, embed_dim
        self.margin, self.sample_rate = margin, sample_rate
        self.start, self.end = shard_range(num_classes, self.rank, self.world_size)
        self.weight = nn.Parameter(init_rows(self.start, self.end, embed_dim, seed))
        self._mesh = None

    @property
    def rows(self) -> int:
        return self.end - self.start

    def extra_repr(self) -> str:
        return (
            f"identities={self.num_classes}, rows={self.start}:{self.end}, embed_dim={self.embed_dim}, "
            f"margin={self.margin}, sample_rate={self.sample_rate}, sharded={self.sharded}"
        )

    def forward(self, embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The mean loss over the global batch (fp32, outside autocast, under every precision policy)."""
        with torch.autocast(embeddings.device.type, enabled=False):
            x = embeddings.float()
            if self.sharded:
                x = _GatherBatch.apply(x)
                labels = _gather_labels(labels)
            index, target_col = self.sample(labels)
            weight = self.weight if index is None else self.weight[index]
            cos = F.normalize(x, dim=1) @ F.normalize(weight, dim=1).t()
            logits = self.margin.logits(cos, target_col)
            return _ShardedCrossEntropy.apply(logits, target_col, self.sharded).mean()

    def sample(self, labels: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(rows to score, sorted; None = all) and each sample's true column among them (-1: not on this rank).

        Every centre of an identity in the batch is kept; the others are drawn from torch's RNG (seed + rank,
        saved in checkpoints), so a resumed run draws the same centres.
        """
        local = labels - self.start
        mine = (local >= 0) & (local < self.rows)
        if self.sample_rate >= 1.0:
            return None, torch.where(mine, local, -1)
        positives = local[mine].unique()
        keep = min(self.rows, max(int(self.sample_rate * self.rows), positives.numel()))
        priority = torch.rand(self.rows, device=self.weight.device)
        priority[positives] = 2.0  # above any random draw: positives always make the cut
        index = priority.topk(keep).indices.sort().values
        position = torch.searchsorted(index, local.clamp(0, max(self.rows - 1, 0)))
        return index, torch.where(mine, position, -1)

    # ------------------------------------------------------------------------------------------ checkpoints

    def checkpoint_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """Weights and optimizer state keyed by identity row: row tensors are (num_classes, D) DTensors sharded over
        the ranks, so DCP writes each rank's rows and reads them back under any world size."""
        state = optimizer.state.get(self.weight, {})
        return {
            "weight": self._global(self.weight.detach()),
            "state": {key: self._global(value) if self._is_rows(value) else value for key, value in state.items()},
        }

    def load_checkpoint(self, path: Any, optimizer: torch.optim.Optimizer) -> None:
        """Collective: fill this rank's rows and their optimizer state from a checkpoint of any world size."""
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        from vitrain import checkpoint as ckpt  # checkpoint imports the parallel package: import late

        index = ckpt.read_index(path)
        saved = index.get("head.weight")
        shape = (self.num_classes, self.embed_dim)
        if saved is None or tuple(saved.size) != shape:
            found = "no identity head" if saved is None else f"a head of shape {tuple(saved.size)}"
            raise CheckpointError(
                f"checkpoint {path} holds {found}, this run's is {shape} (identities x task.embed_dim); "
                "resume with the same data.root, task.verify_identities and task.embed_dim"
            )
        device = self.weight.device
        group = optimizer.param_groups[0]
        scalars_on_device = bool(group.get("fused") or group.get("capturable"))
        fields: dict[str, Any] = {}
        for key, md in index.items():
            if not key.startswith("head.state."):
                continue
            field = key[len("head.state.") :]
            if not isinstance(md, TensorStorageMetadata):
                fields[field] = None  # a plain value: DCP fills it in
                continue
            ckpt.check_state_size(path, key, md, shape)  # the same on every rank: all refuse it together
            if tuple(md.size) == shape:
                rows = torch.empty(self.rows, self.embed_dim, dtype=md.properties.dtype, device=device)
                fields[field] = self._global(rows)
            else:  # a scalar such as AdamW's step: on the device only for fused / capturable optimizers
                scalar_device = device if scalars_on_device else torch.device("cpu")
                fields[field] = torch.empty(md.size, dtype=md.properties.dtype, device=scalar_device)
        wanted = {"head": {"weight": self._global(self.weight.data), "state": fields}}
        ckpt.load_extra(path, wanted)
        loaded = wanted["head"]["state"]
        if loaded:
            optimizer.state[self.weight] = {k: v.to_local() if hasattr(v, "to_local") else v for k, v in loaded.items()}

    def _is_rows(self, value: Any) -> bool:
        return torch.is_tensor(value) and tuple(value.shape) == (self.rows, self.embed_dim)

    def _global(self, local: torch.Tensor) -> torch.Tensor:
        if not self.sharded:
            return local
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Shard

        if self._mesh is None:
            self._mesh = init_device_mesh(self.weight.device.type, (self.world_size,))
        return DTensor.from_local(
            local,
            self._mesh,
            [Shard(0)],
            run_check=False,
            shape=torch.Size((self.num_classes, self.embed_dim)),
            stride=(self.embed_dim, 1),
        )


def _gather_labels(labels: torch.Tensor) -> torch.Tensor:
    parts = [torch.empty_like(labels) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, labels.contiguous())
    return torch.cat(parts)


def average_replicated_gradients(head: IdentityHead) -> None:
    """A replicated head (sharded=False on several ranks) averages its gradient like DDP would."""
    if head.replicas > 1 and head.weight.grad is not None:
        dist.all_reduce(head.weight.grad)
        head.weight.grad /= head.replicas
