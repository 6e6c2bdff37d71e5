"""Peers side by side: one ViT and batch trained by vitrain, timm and Hugging Face transformers, steps interleaved.

    vitrain bench --peers                          # ViT-S/16, 224 px, batch 64 on this device
    vitrain bench --peers model.preset=vit_base_patch16 train.batch_size=128

Every contender trains the same architecture (class token, 1000 classes) on the same random images with AdamW:
- vitrain: its default recipe (`precision.mode=auto`, `model.attention=auto`, `optim.impl=auto`), i.e. the trainer's
  own step with what its autotune picks;
- timm: `VisionTransformer` (fused attention) with `create_optimizer_v2(..., "adamw")`, its faster of foreach and
  fused kernels, in fp32 or under bf16 autocast, whichever is faster here (as `train.py --amp` would be used);
- transformers: `ViTForImageClassification` with `attn_implementation="sdpa"`, torch's fused AdamW, fp32 or bf16
  autocast, whichever is faster here.
Where bf16 is emulated (a CPU whose bf16 matmul measures over 3x slower than fp32's: vitrain/device.py
bf16_emulated), no bf16 option is timed, for any contender, and the table says so.
Each peer's choice is timed first; then all take `--warmup` steps (default 3: autotune's and the allocator's first
steps settle) and `--steps` rounds (default 7), one step each per round in turns. A row gives the median images/s
and its spread (min-max over the rounds); a ratio to vitrain is taken round by round (pairing cancels drift between
rounds) and its median and spread are given, marked where the spread reaches across 1.0x. MFU too is taken round by
round: the GEMM peak is measured at the start of every round, and a round's MFU is its step's model FLOP/s over
that peak.

The peers are an extra: `pip install 'vitrain[peers]'` (timm is imported as vitrain/models/external.py does, which
lets the registry's CUDA-only torchvision import beside the CPU wheel).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from vitrain.bench import write_results
from vitrain.bench.spread import format_spread, paired_ratio, spread
from vitrain.bench.step import IMAGENET_SHAPED, dtype_key
from vitrain.config import Config
from vitrain.device import bf16_emulated_here, cpu_description, peak_flops, synchronize
from vitrain.errors import ConfigError
from vitrain.models import external
from vitrain.optim import optimizer_kernel
from vitrain.weights import timm_mlp_ratio

PEERS_EXTRA = "pip install 'vitrain[peers]'"
DEFAULT_BASE = [
    "name=peers",
    "model.preset=vit_small_patch16",
    *IMAGENET_SHAPED,
    "train.batch_size=64",
    "log.progress=false",
]


class PeerMissing(Exception):
    """A peer library is not installed (or cannot import here); the message says why and how to get it."""


def import_timm():
    try:
        return external.import_timm()
    except ConfigError:
        raise PeerMissing(f"timm is not installed ({PEERS_EXTRA})") from None


def import_transformers():
    if importlib.util.find_spec("transformers") is None:
        raise PeerMissing(f"transformers is not installed ({PEERS_EXTRA})")
    external.allow_torchvision_import()  # transformers imports torchvision too where it is installed
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers

    return transformers


@dataclasses.dataclass
class Contender:
    name: str
    setting: str  # what it runs as (precision, optimizer kernel, attention)
    step: Callable[[], float]  # one training step; returns its seconds
    dtype: str  # what its matmuls compute in: fp32 | bf16


def _timed(device: torch.device, body: Callable[[], None]) -> Callable[[], float]:
    def step() -> float:
        start = time.perf_counter()
        body()
        synchronize(device)
        return time.perf_counter() - start

    return step


def _plain_loop(model, optimizer, images, labels, device, bf16: bool, logits: Callable) -> Callable[[], float]:
    """A peer's fair training step: forward (bf16 autocast or fp32), cross-entropy, backward, step, zero."""

    def body() -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            out = logits(model, images)
        loss = F.cross_entropy(out.float(), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return _timed(device, body)


def _best_of(options: dict[str, Callable[[], Callable[[], float]]], warmup: int) -> tuple[str, Callable[[], float]]:
    """Build each option, time `warmup` + 1 steps, keep the fastest (by its last step)."""
    best = None
    for label, build in options.items():
        step = build()
        for _ in range(warmup):
            step()
        seconds = step()
        print(f"    {label}: {seconds:.2f} s/step", file=sys.stderr)
        if best is None or seconds < best[0]:
            best = (seconds, label, step)
        del step
    _, label, _ = best
    return label, options[label]()


def timm_contender(cfg: Config, images, labels, device, warmup: int, bf16: tuple[bool, ...]) -> Contender:
    timm = import_timm()
    m = cfg.model
    from timm.optim import create_optimizer_v2

    def build(bf16: bool, kernel: str) -> Callable[[], Callable[[], float]]:
        def make() -> Callable[[], float]:
            with torch.random.fork_rng(devices=[]):
                model = timm.models.VisionTransformer(
                    img_size=m.image_size,
                    patch_size=m.patch_size,
                    in_chans=m.in_chans,
                    num_classes=m.num_classes,
                    embed_dim=m.width,
                    depth=m.depth,
                    num_heads=m.heads,
                    mlp_ratio=timm_mlp_ratio(m.width, m.hidden_dim),  # timm builds int(width * ratio)
                    qkv_bias=m.qkv_bias,
                ).to(device)
            kwargs = {"fused": True} if kernel == "fused" else {"foreach": True}
            optimizer = create_optimizer_v2(
                model, "adamw", lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay, **kwargs
            )
            return _plain_loop(model, optimizer, images, labels, device, bf16, lambda net, x: net(x))

        return make

    options = {
        f"{'bf16 autocast' if low else 'fp32'}, AdamW {kernel}": build(low, kernel)
        for low in bf16
        for kernel in ("foreach", "fused")
    }
    label, step = _best_of(options, warmup)
    return Contender(f"timm {timm.__version__}", f"{label}, fused attention (F.sdpa)", step, dtype_key(label))


def transformers_contender(cfg: Config, images, labels, device, warmup: int, bf16: tuple[bool, ...]) -> Contender:
    transformers = import_transformers()
    m = cfg.model

    def build(bf16: bool) -> Callable[[], Callable[[], float]]:
        def make() -> Callable[[], float]:
            config = transformers.ViTConfig(
                hidden_size=m.width,
                num_hidden_layers=m.depth,
                num_attention_heads=m.heads,
                intermediate_size=m.hidden_dim,
                image_size=m.image_size,
                patch_size=m.patch_size,
                num_channels=m.in_chans,
                num_labels=m.num_classes,
                qkv_bias=m.qkv_bias,
                hidden_dropout_prob=0.0,
                attention_probs_dropout_prob=0.0,
                attn_implementation="sdpa",
            )
            with torch.random.fork_rng(devices=[]):
                model = transformers.ViTForImageClassification(config).to(device)
            model.train()
            optimizer = torch.optim.AdamW(
                model.parameters(), lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay, fused=True
            )
            return _plain_loop(
                model, optimizer, images, labels, device, bf16, lambda net, x: net(pixel_values=x).logits
            )

        return make

    options = {f"{'bf16 autocast' if low else 'fp32'}, AdamW fused": build(low) for low in bf16}
    label, step = _best_of(options, warmup)
    return Contender(f"transformers {transformers.__version__}", f"{label}, sdpa attention", step, dtype_key(label))


def vitrain_contender(cfg: Config, images, labels) -> tuple[Contender, Any]:
    from vitrain.engine.trainer import Trainer

    trainer = Trainer(cfg)
    engine = trainer.engine
    batch = [(images, labels)] * cfg.train.accum_steps  # the same images for each micro-step of the recipe

    def body() -> None:  # the trainer's own step, as `fit` runs it
        trainer.train_step(batch, cfg.optim.lr)

    c = trainer.cfg
    chosen = (
        ("precision.mode", cfg.precision.mode),
        ("model.attention", cfg.model.attention),
        ("optim.impl", cfg.optim.impl),
    )
    fixed = [f"{key}={value}" for key, value in chosen if value != "auto"]
    if cfg.precision.compile_norms != "auto":
        fixed.append(f"precision.compile_norms={str(cfg.precision.compile_norms).lower()}")
    fixed += ["train.fused_linear=false"] if not cfg.train.fused_linear else []
    recipe = f"set: {', '.join(fixed)}" if fixed else "default recipe: auto values by autotune"
    setting = (
        f"{engine.precision_label}, AdamW {optimizer_kernel(c, trainer.device)}, attention {c.model.attention} "
        f"({recipe})"
    )
    return Contender("vitrain", setting, _timed(trainer.device, body), dtype_key(engine.precision_label)), trainer


def main(name: str | None, overrides: list[str], args: argparse.Namespace) -> int:
    from vitrain.config import load_config, resolve_config_path

    cfg = load_config(resolve_config_path(name) if name else None, (DEFAULT_BASE if name is None else []) + overrides)
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    steps = args.steps or 7
    warmup = 3 if args.warmup is None else args.warmup
    out = Path(args.out or Path(cfg.log.out_dir) / "bench-peers")
    out.mkdir(parents=True, exist_ok=True)
    result = compare(cfg, steps, warmup)
    result["command"] = " ".join(["vitrain", *sys.argv[1:]])
    write_results(out, "peers", result, to_markdown(result))
    return 0


def compare(cfg: Config, steps: int, warmup: int) -> dict[str, Any]:
    """Build the contenders (each peer at its measured best), then time them in turns; one dict of figures."""
    from vitrain.device import resolve_device
    from vitrain.models.vit import complexity

    device = resolve_device(cfg.train.device)
    m, batch = cfg.model, cfg.train.batch_size
    # vitrain's trainer builds its loader (unused here: every contender steps on the same tensors); one batch to hold.
    samples = max(cfg.data.synthetic_samples, 2 * batch)
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, synthetic_samples=samples))
    draw = torch.Generator().manual_seed(0)
    images = torch.randn(batch, m.in_chans, m.image_size, m.image_size, generator=draw).to(device)
    labels = torch.randint(0, m.num_classes, (batch,), generator=draw).to(device)
    started = time.perf_counter()
    contenders: list[Contender] = []
    missing: dict[str, str] = {}
    print("peers: vitrain (its autotune decides its auto values)", file=sys.stderr)
    vitrain, trainer = vitrain_contender(cfg, images, labels)
    contenders.append(vitrain)
    # Where bf16 is emulated (a CPU without bf16 instructions) a peer's bf16 steps would take minutes only to lose,
    # as autotune's candidates would (vitrain/device.py bf16_emulated): fp32 only, and the table says why.
    emulated = bf16_emulated_here(device.type)
    if emulated:
        print(f"peers: no bf16 option timed: {emulated}", file=sys.stderr)
    bf16 = (False,) if emulated else (False, True)
    for peer, build in (("timm", timm_contender), ("transformers", transformers_contender)):
        print(f"peers: {peer}: timing its options", file=sys.stderr)
        try:
            contenders.append(build(cfg, images, labels, device, warmup, bf16))
        except PeerMissing as exc:
            missing[peer] = str(exc)
    for contender in contenders:  # warm-up of the final set, in the order they will take turns
        for _ in range(warmup):
            contender.step()
    times: dict[str, list[float]] = {c.name: [] for c in contenders}
    # The GEMM peak is measured in every round beside the steps: a shared machine's speed drifts between rounds, and
    # a round's MFU (its step over its own peak) moves with neither (docs/performance.md).
    dtypes = sorted({c.dtype for c in contenders})
    round_peaks: dict[str, list[float]] = {dtype: [] for dtype in dtypes}
    sources: dict[str, str] = {}
    for round_ in range(steps):
        for dtype in dtypes:
            peak, sources[dtype] = peak_flops(device, dtype)
            round_peaks[dtype].append(peak)
        for contender in contenders:
            times[contender.name].append(contender.step())
        print(
            f"peers: round {round_ + 1}/{steps}: " + ", ".join(f"{name} {t[-1]:.2f} s" for name, t in times.items()),
            file=sys.stderr,
        )
    trainer.close()
    cost = complexity(cfg.model)
    rows = []
    for contender in contenders:
        rounds = times[contender.name]
        per_round = spread([batch / t for t in rounds])
        ratio = paired_ratio(rounds, times["vitrain"])  # its step time over vitrain's: vitrain's speed-up
        flops = cost.train_flops * per_round["median"]
        peaks = round_peaks[contender.dtype]
        mfu = spread([cost.train_flops * batch / t / peak for t, peak in zip(rounds, peaks, strict=True)])
        rows.append(
            {
                "name": contender.name,
                "setting": contender.setting,
                "images_per_s": per_round["median"],
                "images_per_s_spread": per_round,
                "step_s": [round(t, 6) for t in rounds],
                "vitrain_speedup": ratio["median"],
                "vitrain_speedup_spread": ratio,
                "model_gflops_per_s": flops / 1e9,
                "compute_dtype": contender.dtype,
                "mfu": mfu["median"],
                "mfu_spread": mfu,
                "peak_source": sources[contender.dtype],
            }
        )
    where = f"GPU: {torch.cuda.get_device_name(device)}" if device.type == "cuda" else cpu_description()
    return {
        "model": f"{m.preset or 'ViT'}/{m.patch_size} @ {m.image_size}px, {cost.params / 1e6:.1f}M params",
        "batch": batch,
        "device": where,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "steps": steps,
        "warmup": warmup,
        "train_gflops_per_image": cost.train_flops / 1e9,
        "peaks_gflops_per_s": {dtype: statistics.median(v) / 1e9 for dtype, v in round_peaks.items()},
        "peaks_gflops_per_s_spread": {dtype: spread([p / 1e9 for p in v]) for dtype, v in round_peaks.items()},
        "peaks_gflops_per_s_rounds": {dtype: [round(p / 1e9, 3) for p in v] for dtype, v in round_peaks.items()},
        "rows": rows,
        "missing": missing,
        "bf16_skipped": emulated or "",
        "wall_s": time.perf_counter() - started,
    }


def to_markdown(result: dict[str, Any]) -> str:
    measured = result.get("peaks_gflops_per_s_spread") or {
        dtype: {"median": value, "n": 1} for dtype, value in result["peaks_gflops_per_s"].items()
    }
    peaks = ", ".join(f"{dtype} {format_spread(value, 0)}" for dtype, value in measured.items())
    each_round = ""
    if "peaks_gflops_per_s_spread" in result:
        each_round = " in each round; a row's MFU: each round's step over that round's peak"
    sources = sorted({row["peak_source"] for row in result["rows"] if row.get("peak_source")})
    lines = [
        f"# vitrain vs peers: {result['model']}, batch {result['batch']}",
        "",
        f"- Device: {result['device']}; {result['threads']} thread(s); torch {result['torch']}",
        f"- {result['warmup']} warm-up steps, then {result['steps']} rounds of one step each, taking turns. images/s: "
        "median (min-max) over the rounds; vitrain x: the contender's step time over vitrain's in the same round, "
        "median (min-max); `~` marks a ratio whose spread reaches across 1.0x.",
        f"- Peak GFLOP/s for MFU: {peaks} ({'; '.join(sources) or 'measured here'}{each_round}).",
        f"- Command: `{result.get('command', '')}` ({result['wall_s']:.0f} s)",
        *([f"- bf16: no peer's bf16 option was timed: {why}."] if (why := result.get("bf16_skipped")) else []),
        "",
        "| contender | runs as | images/s | vitrain x | model GFLOP/s | MFU (its dtype) |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for row in result["rows"]:
        ips = row.get("images_per_s_spread") or {"median": row["images_per_s"], "n": 1}
        ratio = row.get("vitrain_speedup_spread") or {"median": row["vitrain_speedup"], "n": 1}
        marker = " ~" if ratio.get("overlaps_1x") and row["name"] != "vitrain" else ""
        mfu = format_spread(row.get("mfu_spread") or {"median": row["mfu"], "n": 1}, 3)
        lines.append(
            f"| {row['name']} | {row['setting']} | {format_spread(ips)} | {format_spread(ratio, unit='x')}{marker} | "
            f"{row['model_gflops_per_s']:.0f} | {mfu} ({row['compute_dtype']}) |"
        )
    for peer, why in result["missing"].items():
        lines.append(f"| {peer} | not run: {why} | | | | |")
    return "\n".join(lines) + "\n"
