"""Thin command line: parse, load the config, call the library; bad input exits 2 with one line."""

from __future__ import annotations

import argparse
import json
import sys
import warnings

from vitrain.errors import VitrainError

DEFAULT_RECIPE = "digits"


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    warnings.showwarning = _one_line_warning
    try:
        return args.func(args)
    except VitrainError as exc:
        print(f"vitrain: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("vitrain: interrupted; continue the run with --resume", file=sys.stderr)
        return 130


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vitrain", description="Train Vision Transformers fast.")
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="train a model: vitrain train [CONFIG] [section.key=value ...]")
    train.add_argument("args", nargs="*", metavar="CONFIG|OVERRIDE", help="a recipe name or YAML path, then overrides")
    train.add_argument(
        "--resume",
        nargs="?",
        const=True,
        default=False,
        metavar="CHECKPOINT",
        help="continue from the run's last.pt (or the given checkpoint)",
    )
    train.set_defaults(func=_train)

    evaluate = sub.add_parser("eval", help="evaluate a checkpoint on its validation split")
    evaluate.add_argument("checkpoint")
    evaluate.add_argument("overrides", nargs="*", metavar="OVERRIDE", help="e.g. data.root=PATH")
    evaluate.set_defaults(func=_eval)

    models = sub.add_parser("models", help="list model presets with their size and cost")
    models.set_defaults(func=_models)

    lr_find = sub.add_parser("lr-find", help="lr range test: writes lr_find.csv, a plot and a suggested lr")
    lr_find.add_argument("args", nargs="*", metavar="CONFIG|OVERRIDE", help="a recipe name or YAML path, overrides")
    lr_find.add_argument("--start", type=float, default=1e-7, help="first learning rate (default 1e-7)")
    lr_find.add_argument("--end", type=float, default=10.0, help="last learning rate (default 10)")
    lr_find.add_argument("--steps", type=int, default=100, help="number of steps (default 100)")
    lr_find.add_argument("--out", default=None, help="output folder (default: <log.out_dir>/<name>-lr-find)")
    lr_find.set_defaults(func=_lr_find)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    bench_optim = bench_sub.add_parser("optim", help="time one optimizer step per kernel (loop/foreach/fused/flat)")
    bench_optim.add_argument("--model", default="vit_small_patch16", help="a preset (default ViT-S/16)")
    bench_optim.add_argument("--optimizer", default="adamw", choices=["adamw", "sgd", "lamb", "lars"])
    bench_optim.add_argument("--impls", default="loop,foreach,fused,flat,auto", help="comma-separated kernels")
    bench_optim.add_argument("--steps", type=int, default=20, help="timed steps per kernel (median reported)")
    bench_optim.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    bench_optim.set_defaults(func=_bench_optim)

    config = sub.add_parser("config", help="inspect configs")
    config_sub = config.add_subparsers(dest="config_command", required=True)
    show = config_sub.add_parser("show", help="print the resolved config")
    show.add_argument("args", nargs="*", metavar="CONFIG|OVERRIDE")
    show.set_defaults(func=_config_show)
    return parser


def _split_args(args: list[str]) -> tuple[str, list[str]]:
    """The first argument without '=' is the config; everything else is an override."""
    if args and "=" not in args[0]:
        return args[0], args[1:]
    return DEFAULT_RECIPE, args


def _load(args: list[str]):
    from vitrain.config import load_config, resolve_config_path

    name, overrides = _split_args(args)
    return load_config(resolve_config_path(name), overrides)


def _train(args: argparse.Namespace) -> int:
    from vitrain.engine import Trainer

    cfg = _load(args.args)
    summary = Trainer(cfg, resume=args.resume).fit()
    print(json.dumps(summary, indent=2))
    return 0


def _eval(args: argparse.Namespace) -> int:
    from pathlib import Path

    from vitrain import checkpoint as ckpt
    from vitrain.config import load_config
    from vitrain.data import BatchAugment, BatchLoader, build_datasets
    from vitrain.engine import evaluate, resolve_device
    from vitrain.models import create_model

    path = Path(args.checkpoint)
    state = ckpt.load(path)
    cfg = load_config(overrides=args.overrides, base=state["config"])
    device = resolve_device(cfg.train.device)
    model = create_model(cfg.model).to(device)
    ckpt.load_model_state(model, state["model"], path)
    _, val_set = build_datasets(cfg)
    loader = BatchLoader(
        val_set,
        cfg.train.batch_size,
        BatchAugment(cfg.data, cfg.model.in_chans, train=False),
        device,
        shuffle=False,
        drop_last=False,
    )
    result = {"checkpoint": str(path), "step": state.get("step"), **evaluate(model, loader)}
    print(json.dumps(result, indent=2))
    return 0


def _models(args: argparse.Namespace) -> int:
    from vitrain.config import ModelConfig
    from vitrain.models import PRESETS, complexity

    bytes_per_param = 16  # fp32 AdamW: weights 4 + gradients 4 + two moments 8
    print(f"{'preset':<22}{'alias':<13}{'params':>16}{'image':>7}{'GFLOPs':>11}{'train GiB':>12}")
    for p in PRESETS.values():
        cfg = ModelConfig(
            width=p.width,
            depth=p.depth,
            heads=p.heads,
            mlp_dim=p.mlp_dim,
            patch_size=p.patch_size,
            image_size=p.image_size,
        )
        cost = complexity(cfg)
        gib = cost.params * bytes_per_param / 2**30
        print(f"{p.name:<22}{p.alias:<13}{cost.params:>16,}{p.image_size:>7}{cost.flops / 1e9:>11.1f}{gib:>12.1f}")
    print("GFLOPs: one forward pass of one image, multiply-add = 2 FLOPs (timm's tables count MACs: half).")
    print("train GiB: fp32 AdamW model state (weights, gradients, two moments) without activations.")
    return 0


def _lr_find(args: argparse.Namespace) -> int:
    from pathlib import Path

    from vitrain.errors import ConfigError
    from vitrain.optim.lr_find import lr_range_test

    if not 0 < args.start < args.end or args.steps < 3:
        raise ConfigError(
            f"lr-find needs 0 < --start < --end and --steps >= 3; got --start={args.start} --end={args.end} "
            f"--steps={args.steps}"
        )
    cfg = _load(args.args)
    out = Path(args.out) if args.out else cfg.run_dir.with_name(f"{cfg.name}-lr-find")
    result = lr_range_test(cfg, args.start, args.end, args.steps, out)
    print(f"lr range test: {len(result.lrs)} steps from {result.lrs[0]:.2e} to {result.lrs[-1]:.2e}")
    print(f"suggested lr: {result.suggested_lr:.3e} (steepest loss descent); losses in {result.csv_path}")
    if result.plot_path is not None:
        print(f"plot: {result.plot_path}")
    else:
        print("no plot: matplotlib is not installed; pip install 'vitrain[plot]' and rerun to get lr_find.png")
    return 0


def _bench_optim(args: argparse.Namespace) -> int:
    import torch

    from vitrain.bench.optim import bench_optimizer_step, preset_model_config
    from vitrain.config import OptimConfig

    if args.threads:
        torch.set_num_threads(args.threads)
    impls = tuple(i.strip() for i in args.impls.split(",") if i.strip())
    model_cfg = preset_model_config(args.model)
    params, timings = bench_optimizer_step(model_cfg, OptimConfig(name=args.optimizer), impls, args.steps)
    print(
        f"{args.optimizer} step over {args.model} ({params / 1e6:.1f}M params, fp32, cpu, "
        f"{torch.get_num_threads()} threads), median of {args.steps} steps"
    )
    print(f"{'impl':<9}{'runs as':<10}{'ms/step':>10}{'vs loop':>10}")
    for t in timings:
        speedup = f"{t.speedup_vs_loop:.1f}x" if t.speedup_vs_loop else "-"
        print(f"{t.impl:<9}{t.resolved:<10}{t.ms_per_step:>10.1f}{speedup:>10}")
    return 0


def _config_show(args: argparse.Namespace) -> int:
    from vitrain.config import to_yaml

    print(to_yaml(_load(args.args)), end="")
    return 0


def _one_line_warning(message, category, filename, lineno, file=None, line=None) -> None:
    print(f"vitrain: warning: {message}", file=sys.stderr)
