"""The experiment of chunked-attention.patch as a module of its own: vitrain's manual attention a few samples at a
time, for race.py."""

import functools

import torch
from torch.autograd.function import once_differentiable

from vitrain.models.kernels import split_heads

# The scores of this many bytes per thread are computed, normalized and used while they are in the CPU's caches.
CHUNK_BYTES_PER_THREAD = 2 << 20


def samples_per_chunk(batch: int, heads: int, tokens: int, itemsize: int) -> int:
    """How many samples _ManualAttention takes at a time: their heads' scores (heads x tokens^2 each) about
    CHUNK_BYTES_PER_THREAD per thread, and at least two heads per thread for the batched GEMMs to share out."""
    threads = torch.get_num_threads()
    by_cache = threads * CHUNK_BYTES_PER_THREAD // (heads * tokens * tokens * itemsize)
    by_threads = -(-2 * threads // heads)
    return max(1, min(batch, max(by_cache, by_threads)))


class _ManualAttention(torch.autograd.Function):
    """The experiment: manual attention a few samples at a time (split, scores, softmax in place, output, merge)."""

    @staticmethod
    def forward(ctx, qkv: torch.Tensor, heads: int, seq_first: bool) -> torch.Tensor:
        src = split_heads(qkv, heads, seq_first)  # (3, B, H, N, d), a view
        _, b, _, n, d = src.shape
        scale = d**-0.5
        per = samples_per_chunk(b, heads, n, qkv.element_size())
        empty = functools.partial(torch.empty, dtype=qkv.dtype, device=qkv.device)
        split, probs = empty((3, b, heads, n, d)), empty((b, heads, n, n))  # kept for backward
        out = empty((n, b, heads, d) if seq_first else (b, n, heads, d))
        head_out = empty((per * heads, n, d))
        for s in range(0, b, per):
            e = min(s + per, b)
            c = (e - s) * heads
            split[:, s:e].copy_(src[:, s:e])
            q, k, v = (t.view(c, n, d) for t in split[:, s:e].unbind(0))
            p = probs[s:e].view(c, n, n)
            torch.baddbmm(p, q, k.transpose(1, 2), beta=0, alpha=scale, out=p)
            torch._softmax(p, -1, False, out=p)
            o = torch.bmm(p, v, out=head_out[:c]).view(e - s, heads, n, d)
            if seq_first:
                out[:, s:e].copy_(o.permute(2, 0, 1, 3))
            else:
                out[s:e].copy_(o.transpose(1, 2))
        ctx.save_for_backward(split, probs)
        ctx.dims = (per, scale, seq_first)
        return out.view(*out.shape[:2], heads * d)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        split, probs = ctx.saved_tensors
        per, scale, seq_first = ctx.dims
        _, b, heads, n, d = split.shape
        if seq_first:
            g_src = grad.view(n, b, heads, d).permute(1, 2, 0, 3)
            dqkv = torch.empty((n, b, 3, heads, d), dtype=grad.dtype, device=grad.device)
            dst = dqkv.permute(2, 1, 3, 0, 4)
        else:
            g_src = grad.view(b, n, heads, d).transpose(1, 2)
            dqkv = torch.empty((b, n, 3, heads, d), dtype=grad.dtype, device=grad.device)
            dst = dqkv.permute(2, 0, 3, 1, 4)
        empty = functools.partial(torch.empty, dtype=grad.dtype, device=grad.device)
        g_buf, dsplit, dscores = empty((per, heads, n, d)), empty((3, per * heads, n, d)), empty((per * heads, n, n))
        for s in range(0, b, per):
            e = min(s + per, b)
            c = (e - s) * heads
            g = g_buf[: e - s].copy_(g_src[s:e]).view(c, n, d)
            q, k, v = (t.view(c, n, d) for t in split[:, s:e].unbind(0))
            p, ds = probs[s:e].view(c, n, n), dscores[:c]
            torch.bmm(p.transpose(1, 2), g, out=dsplit[2, :c])
            torch.bmm(g, v.transpose(1, 2), out=ds)
            torch.ops.aten._softmax_backward_data.out(ds, p, -1, p.dtype, grad_input=ds)
            torch.baddbmm(dsplit[0, :c], ds, k, beta=0, alpha=scale, out=dsplit[0, :c])
            torch.baddbmm(dsplit[1, :c], ds.transpose(1, 2), q, beta=0, alpha=scale, out=dsplit[1, :c])
            dst[:, s:e].copy_(dsplit[:, :c].view(3, e - s, heads, n, d))
        return dqkv.view(*dqkv.shape[:2], 3 * heads * d), None, None
