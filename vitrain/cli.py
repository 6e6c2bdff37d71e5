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

    export = sub.add_parser("export", help="write a checkpoint's weights as one fp32 model.safetensors + config")
    export.add_argument("checkpoint", help="a step directory (runs/NAME/checkpoints/step_00000100) or a run directory")
    export.add_argument("out", help="output directory")
    export.add_argument("--format", choices=["vitrain", "timm"], default="vitrain", help="parameter names to use")
    export.set_defaults(func=_export)

    estimate = sub.add_parser("estimate", help="memory per device for a preset (or all) under a parallel strategy")
    estimate.add_argument("preset", nargs="?", help="a preset name or alias; omit for a table of every preset")
    estimate.add_argument("--devices", type=int, default=1)
    estimate.add_argument("--strategy", choices=["single", "ddp", "zero1", "zero2", "zero3"], default="zero3")
    estimate.add_argument("--wrap", choices=["block", "model"], default="block")
    estimate.add_argument("--offload", action="store_true", help="sharded states in host memory (zero2/zero3)")
    estimate.add_argument("--ac", action="store_true", help="per-block activation checkpointing")
    estimate.add_argument("--batch", type=int, default=1, help="images per device")
    estimate.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default="fp32")
    estimate.add_argument("--memory", type=float, default=80.0, help="GiB per device, for the devices-needed count")
    estimate.set_defaults(func=_estimate)

    models = sub.add_parser("models", help="list model presets with their size and cost")
    models.set_defaults(func=_models)

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
    from vitrain.parallel import shutdown

    cfg = _load(args.args)
    try:
        trainer = Trainer(cfg, resume=args.resume)
        summary = trainer.fit()
    finally:
        shutdown()
    if trainer.is_main:
        print(json.dumps(summary, indent=2))
    return 0


def _eval(args: argparse.Namespace) -> int:
    from pathlib import Path

    from vitrain import checkpoint as ckpt
    from vitrain.config import load_config
    from vitrain.data import BatchAugment, BatchLoader, build_datasets
    from vitrain.engine import evaluate, resolve_device
    from vitrain.models import create_model

    path = ckpt.resolve(Path(args.checkpoint))
    meta = ckpt.read_meta(path)
    cfg = load_config(overrides=args.overrides, base=meta["config"])
    device = resolve_device(cfg.train.device)
    model = create_model(cfg.model)
    ckpt.load_model_weights(path, model)
    model = model.to(device)
    _, val_set = build_datasets(cfg)
    loader = BatchLoader(
        val_set,
        cfg.train.batch_size,
        BatchAugment(cfg.data, cfg.model.in_chans, train=False),
        device,
        shuffle=False,
        drop_last=False,
    )
    result = {"checkpoint": str(path), "step": meta.get("step"), **evaluate(model, loader)}
    print(json.dumps(result, indent=2))
    return 0


def _export(args: argparse.Namespace) -> int:
    from pathlib import Path

    from vitrain import checkpoint as ckpt
    from vitrain.config import config_from_dict
    from vitrain.models import create_model
    from vitrain.weights import export

    path = ckpt.resolve(Path(args.checkpoint))
    cfg = config_from_dict(ckpt.read_meta(path)["config"])
    model = create_model(cfg.model)
    ckpt.load_model_weights(path, model)
    print(export(model, cfg, Path(args.out), args.format))
    return 0


def _estimate(args: argparse.Namespace) -> int:
    from vitrain.bench.memory import breakdown, table
    from vitrain.config import load_config

    setting = {
        "devices": args.devices,
        "strategy": args.strategy,
        "wrap": args.wrap,
        "offload": args.offload,
        "ac": args.ac,
        "batch": args.batch,
        "precision": args.precision,
    }
    header = ", ".join(f"{k}={v}" for k, v in setting.items())
    if args.preset is None:
        print(f"memory per device with AdamW ({header})")
        print(table(args.memory, **setting))
    else:
        model = load_config(base={"model": {"preset": args.preset}}).model
        print(f"{args.preset}: memory per device with AdamW ({header})")
        print(breakdown(model, args.memory, **setting))
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


def _config_show(args: argparse.Namespace) -> int:
    from vitrain.config import to_yaml

    print(to_yaml(_load(args.args)), end="")
    return 0


def _one_line_warning(message, category, filename, lineno, file=None, line=None) -> None:
    print(f"vitrain: warning: {message}", file=sys.stderr)
