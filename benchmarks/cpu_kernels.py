"""What vitrain's CPU kernels (vitrain/models/kernels.py) change, on ViT-S/16's shapes at batch 64 (224 px).

    python benchmarks/cpu_kernels.py --out results/cpu-kernels

Five measurements, each with its contenders taking turns round by round (median and min-max, ratios paired by
round), on this process's threads (2 by default) with freed host memory kept in the heap as training runs it:
1. each linear layer's forward + backward in bf16: aten's addmm (bias written into the whole output first, then the
   GEMM accumulates onto it) against oneDNN's linear with the bias in the GEMM's epilogue (train.fused_linear);
2. the patch embedding's forward + backward in bf16: oneDNN's convolution against one GEMM over the patches
   (train.fused_linear);
3. manual attention's forward + backward: autograd over the plain ops against the one autograd function;
4. amp_o2's fp32 LayerNorm on bf16 activations: the cast hooks against precision.compile_norms's compiled kernel;
5. the whole training step (`vitrain bench run`, amp_o2 bf16 + manual attention) with a switch (--step-switch,
   train.fused_linear by default) true against false, one process per run.
"""

from __future__ import annotations

import argparse
import functools
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from vitrain.bench.spread import format_spread, paired_ratio, spread
from vitrain.device import cpu_description, reuse_freed_host_memory
from vitrain.models import kernels

STEPS = 6  # timed steps per whole-step run
BATCH, TOKENS, WIDTH, HEADS, HIDDEN = 64, 197, 384, 6, 1536
LAYERS = {"qkv": (WIDTH, 3 * WIDTH), "proj": (WIDTH, WIDTH), "fc1": (WIDTH, HIDDEN), "fc2": (HIDDEN, WIDTH)}
STEP = (
    "model.preset=vit_small_patch16 model.image_size=224 model.in_chans=3 model.num_classes=1000 "
    "data.source=synthetic data.mean=[0.5,0.5,0.5] data.std=[0.5,0.5,0.5] train.batch_size=64 log.progress=false "
    "precision.mode=amp_o2 model.attention=manual"
).split()


def _ms(fn, repeats: int = 5) -> float:
    """Median of `repeats` calls after one untimed call, in ms."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1e3


def _race(contenders: dict, rounds: int) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(rounds):
        for name, fn in contenders.items():
            out[name].append(_ms(fn))
    return out


def _pair(times: dict[str, list[float]], slow: str, fast: str) -> dict:
    return {name: spread(v) for name, v in times.items()} | {"speedup": paired_ratio(times[slow], times[fast])}


def _layer_step(linear, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, grad: torch.Tensor) -> None:
    x.grad = w.grad = b.grad = None
    linear(x, w, b).backward(grad)


def linear_layers(rounds: int) -> dict:
    """Each of a block's linear layers, forward + backward in bf16 (amp_o2's working copy): F.linear (aten's addmm)
    against the linear with its bias in oneDNN's GEMM."""
    results: dict = {}
    if not kernels._onednn_linear(torch.bfloat16):
        return results
    for name, (k, n) in LAYERS.items():
        x = torch.randn(BATCH, TOKENS, k, dtype=torch.bfloat16, requires_grad=True)
        w = torch.randn(n, k, dtype=torch.bfloat16, requires_grad=True)
        b = torch.randn(n, dtype=torch.bfloat16, requires_grad=True)
        grad = torch.randn(BATCH, TOKENS, n, dtype=torch.bfloat16)
        contenders = {
            "addmm": functools.partial(_layer_step, F.linear, x, w, b, grad),
            "onednn": functools.partial(_layer_step, kernels._BiasInGemm.apply, x, w, b, grad),
        }
        results[f"{name} ({k} -> {n})"] = _pair(_race(contenders, rounds), "addmm", "onednn")
    return results


def attention(rounds: int) -> dict:
    qkv = torch.randn(BATCH, TOKENS, 3 * WIDTH, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(BATCH, TOKENS, WIDTH, dtype=torch.bfloat16)
    plain_graph = kernels.plain_graph

    def run(function: bool) -> None:
        kernels.plain_graph = plain_graph if function else (lambda: True)
        try:
            qkv.grad = None
            kernels.manual_attention(qkv, HEADS, False).backward(grad)
        finally:
            kernels.plain_graph = plain_graph

    times = _race({"plain ops": lambda: run(False), "function": lambda: run(True)}, rounds)
    return {"attention bf16": _pair(times, "plain ops", "function")}


def patch_embedding(rounds: int) -> dict:
    """The 16 x 16 patch embedding (3 -> WIDTH channels) forward + backward in bf16 as ViT's PatchEmbed uses it (the
    output flattened to tokens), the image taking no gradient: oneDNN's convolution against the conv as one GEMM over
    the patches (PatchGemmConv2d, train.fused_linear)."""
    from torch import nn

    if not kernels._onednn_linear(torch.bfloat16):
        return {}
    image = torch.randn(BATCH, 3, 224, 224, dtype=torch.bfloat16)
    conv = nn.Conv2d(3, WIDTH, 16, stride=16).to(torch.bfloat16)
    patches = kernels.PatchGemmConv2d(3, WIDTH, 16, stride=16).to(torch.bfloat16)
    patches.load_state_dict(conv.state_dict())
    grad = torch.randn(BATCH, (224 // 16) ** 2, WIDTH, dtype=torch.bfloat16)

    def run(layer: nn.Module) -> None:
        layer.weight.grad = layer.bias.grad = None
        layer(image).flatten(2).transpose(1, 2).backward(grad)

    times = _race({"conv": lambda: run(conv), "gemm": lambda: run(patches)}, rounds)
    return {f"patch embedding (3 -> {WIDTH}, 16 x 16)": _pair(times, "conv", "gemm")}


def norms(rounds: int) -> dict:
    """amp_o2's fp32 LayerNorm on bf16 activations, forward + backward: the hooks' upcast, norm and downcast against
    precision.compile_norms's one compiled kernel (its compile happens in the first, untimed, call)."""
    from torch import nn

    from vitrain.precision import _working_copy, compile_norms_problem

    if compile_norms_problem(torch.device("cpu")) is not None:
        return {}
    x = torch.randn(BATCH, TOKENS, WIDTH, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(BATCH, TOKENS, WIDTH, dtype=torch.bfloat16)
    norm = nn.LayerNorm(WIDTH)

    def run(module: nn.Module) -> None:
        x.grad = norm.weight.grad = norm.bias.grad = None
        module(x).backward(grad)

    hooks, compiled = (_working_copy(norm, torch.bfloat16, compile_norms=c)[0] for c in (False, True))
    times = _race({"hooks": lambda: run(hooks), "compiled": lambda: run(compiled)}, rounds)
    return {f"LayerNorm ({WIDTH}) in fp32 on bf16": _pair(times, "hooks", "compiled")}


def whole_step(rounds: int, steps: int, switch: str) -> dict:
    off, on = f"{switch}=false", f"{switch}=true"
    images: dict[str, list[float]] = {off: [], on: []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(rounds):
            for variant in images:
                out = Path(tmp) / f"{r}-{variant}.json"
                cmd = [sys.executable, "-m", "vitrain", "bench", "run", *STEP, variant]
                cmd += ["--steps", str(steps), "--warmup", "2", "--json", str(out)]
                subprocess.run(cmd, check=True, capture_output=True, text=True)
                images[variant].append(json.loads(out.read_text())["images_per_s"])
                print(f"[{r}] {variant}: {images[variant][-1]:.2f} images/s", flush=True)
    return {name: spread(v) for name, v in images.items()} | {
        "switch": switch,
        "speedup": paired_ratio(images[on], images[off]),
        "images_per_s_rounds": images,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=5, help="rounds of the layer and attention races")
    parser.add_argument("--step-rounds", type=int, default=5, help="rounds of the whole-step runs (0: skip)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--step-switch", default="train.fused_linear", help="the boolean the whole-step runs toggle")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    reuse_freed_host_memory()
    torch.manual_seed(0)
    result = {"cpu": cpu_description(), "threads": args.threads, "torch": torch.__version__}
    layers = linear_layers(args.rounds) | patch_embedding(args.rounds) | attention(args.rounds) | norms(args.rounds)
    result["layers"] = layers
    if args.step_rounds:
        result["step"] = whole_step(args.step_rounds, STEPS, args.step_switch)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "kernels.json").write_text(json.dumps(result, indent=1) + "\n")
    lines = [
        "# vitrain's CPU kernels on ViT-S/16 shapes (batch 64, 224 px)",
        "",
        f"- {result['cpu']}; {args.threads} thread(s); torch {torch.__version__}",
        f"- Command: `python benchmarks/cpu_kernels.py {' '.join(sys.argv[1:])}`; contenders take turns, "
        f"{args.rounds} rounds "
        "(each the median of 5 calls); speedup paired round by round, median (min-max); `~`: spread reaches 1.0x.",
        "",
        "| what | before, ms | after, ms | speedup |",
        "|---|---:|---:|---:|",
    ]
    for name, row in result["layers"].items():
        slow, fast = [v for k, v in row.items() if k != "speedup"]
        mark = " ~" if row["speedup"]["overlaps_1x"] else ""
        if "attention" in name:
            change = "plain ops -> one function"
        elif "LayerNorm" in name:
            change = "hooks (upcast, norm, downcast) -> one compiled kernel"
        elif "patch" in name:
            change = "oneDNN's convolution -> one GEMM over the patches"
        else:
            change = "addmm -> bias in oneDNN's GEMM"
        what = f"{name} forward + backward, {change}"
        speedup = format_spread(row["speedup"], 3)
        lines.append(f"| {what} | {format_spread(slow, 1)} | {format_spread(fast, 1)} | {speedup}x{mark} |")
    if "step" in result:
        s = result["step"]
        mark = " ~" if s["speedup"]["overlaps_1x"] else ""
        lines += [
            "",
            f"Whole step (`vitrain bench run {' '.join(STEP)} {s['switch']}=... --steps {STEPS} --warmup 2`, "
            "one process per run), images/s:",
            f"{s['switch']}=false {format_spread(s[s['switch'] + '=false'])}, true "
            f"{format_spread(s[s['switch'] + '=true'])}: **{format_spread(s['speedup'], 3)}x{mark}** paired by round.",
        ]
    (args.out / "README.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
