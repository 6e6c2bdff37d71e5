"""Thin command line: parse, load the config, call the library; bad input exits 2 with one line."""

from __future__ import annotations

import argparse
import json
import math
import sys
import warnings
from collections.abc import Callable
from typing import NoReturn

from vitrain.config import DEFAULT_RECIPE
from vitrain.engine.cluster import EXIT_STOPPED, Stopped
from vitrain.errors import CheckpointError, ConfigError, VitrainError


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    # `vitrain bench CONFIG ...` (and `vitrain bench --ladder`) is `vitrain bench run ...`.
    if argv[:1] == ["bench"] and (len(argv) == 1 or argv[1] not in BENCH_COMMANDS + ("-h", "--help")):
        argv.insert(1, "run")
    warnings.showwarning = _one_line_warning
    try:
        args = parser.parse_args(argv)
        return args.func(args)
    except Stopped as stopped:  # a stop signal: the checkpoint is written; the same command continues the run
        print(f"vitrain: {stopped}", file=sys.stderr)
        stopped.said = True
        return EXIT_STOPPED
    except VitrainError as exc:
        print(f"vitrain: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `vitrain models | head`: the reader left; not an error
        sys.stderr.close()
        return 0
    except KeyboardInterrupt:
        print("vitrain: interrupted; continue the run with --resume", file=sys.stderr)
        return 130


BENCH_COMMANDS = ("run", "loader", "optim")


class _Parser(argparse.ArgumentParser):
    """argparse whose mistakes are one line like every other error (its subcommands' parsers are of this class)."""

    def error(self, message: str) -> NoReturn:
        raise ConfigError(f"{self.prog}: {message} (see {self.prog} --help)")


def _number(kind: type, low: float, inclusive: bool = True) -> Callable[[str], int | float]:
    """An argparse type: a finite `kind` (int or float) >= `low` (> `low` without `inclusive`)."""
    wanted = f"{'an integer' if kind is int else 'a finite number'} {'>=' if inclusive else '>'} {low:g}"

    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {wanted}") from None
        if not math.isfinite(value) or value < low or (value == low and not inclusive):
            raise argparse.ArgumentTypeError(f"{text} must be {wanted}")
        return value

    return parse


positive_int = _number(int, 1)
non_negative_int = _number(int, 0)
positive_float = _number(float, 0, inclusive=False)
non_negative_float = _number(float, 0)


def non_empty(text: str) -> str:
    """An argparse type for a path: '' would mean the current folder without anyone having said so."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path; give a folder (write . for the current one)")
    return text


def counts(text: str) -> list[int]:
    """An argparse type: comma-separated integers >= 0, e.g. worker counts 0,1,2."""
    return [non_negative_int(part.strip()) for part in text.split(",")]


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="vitrain", description="Train Vision Transformers fast.")
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser(
        "train",
        help="train a model: vitrain train [CONFIG] [section.key=value ...]",
        epilog="every section.key, its type, default and meaning: vitrain config keys [SECTION]",
    )
    train.add_argument("args", nargs="*", metavar="CONFIG|OVERRIDE", help="a recipe name or YAML path, then overrides")
    train.add_argument(
        "--resume",
        nargs="?",
        const=True,
        default=False,
        metavar="CHECKPOINT",
        help="continue the run's newest complete checkpoint, or the given run folder or step folder (in its own run); "
        "auto: continue the run when it exists, else start it (the default in a requeued SLURM job; a run stopped by a "
        "signal is continued by the same command anyway)",
    )
    train.set_defaults(func=_train)

    evaluate = sub.add_parser(
        "eval", help="evaluate a checkpoint: its validation split, or face verification on any face folder"
    )
    evaluate.add_argument("checkpoint", help="a run folder or a step folder")
    evaluate.add_argument("overrides", nargs="*", metavar="OVERRIDE", help="e.g. data.root=PATH")
    evaluate.add_argument(
        "--pairs",
        action="append",
        default=None,
        help="face models: an LFW-format pairs file, cfp-ff, cfp-fp or generated (repeatable; default: the run's "
        "task.pairs on its held-out identities)",
    )
    evaluate.add_argument("--root", default=None, help="face models: identity folders (or a .zip) the pairs name")
    evaluate.add_argument(
        "--out",
        default=None,
        metavar="DIR",
        help="face models: where verification.json and the ROC plot go; detection, with --show: where the PNGs go "
        "(default: RUN/eval)",
    )
    evaluate.add_argument(
        "--show",
        type=non_negative_int,
        default=0,
        metavar="N",
        help="detection: draw N validation images' detections as PNGs",
    )
    evaluate.add_argument(
        "--min-score",
        type=non_negative_float,
        default=0.5,
        metavar="S",
        help="detection, with --show: draw detections >= S",
    )
    evaluate.set_defaults(func=_eval)

    export = sub.add_parser(
        "export", help="write a checkpoint's weights as one fp32 model.safetensors + config, or an ONNX graph"
    )
    export.add_argument("checkpoint", help="a step directory (runs/NAME/checkpoints/step_00000100) or a run directory")
    export.add_argument("out", type=non_empty, help="output directory")
    export.add_argument(
        "overrides",
        nargs="*",
        metavar="OVERRIDE",
        help="config values the checkpoint's own must match to be used, e.g. model.name=mypkg.models:my_vit (an "
        "import path a checkpoint names is imported only when given here)",
    )
    export.add_argument(
        "--format",
        choices=["vitrain", "timm", "onnx"],
        default="vitrain",
        help="vitrain / timm: model.safetensors under those parameter names; onnx: model.onnx (fp32, any batch "
        "size), checked by onnxruntime against PyTorch where it is installed (pip install 'vitrain[onnx]')",
    )
    export.add_argument(
        "--tolerance",
        type=non_negative_float,
        default=1e-4,
        help="onnx: the largest |output difference| allowed, x max(1, largest |output|) (default 1e-4)",
    )
    export.add_argument("--overwrite", action="store_true", help="replace an export already in the output folder")
    export.set_defaults(func=_export)

    estimate = sub.add_parser("estimate", help="memory per device for a preset (or all) under a parallel strategy")
    estimate.add_argument("preset", nargs="?", help="a preset name or alias; omit for a table of every preset")
    estimate.add_argument(
        "--config",
        help="take strategy, wrap, checkpointing, offload, precision, batch, stages and EMA from a recipe",
    )
    estimate.add_argument(
        "--devices", type=positive_int, nargs="+", help="processes (several: a grid of presets x devices)"
    )
    estimate.add_argument("--strategy", choices=["single", "ddp", "zero1", "zero2", "zero3"])
    estimate.add_argument("--wrap", choices=["block", "sublayer", "model"])
    estimate.add_argument("--offload", action="store_true", default=None, help="sharded states in host memory")
    estimate.add_argument("--ac", action="store_true", default=None, help="per-block activation checkpointing")
    estimate.add_argument(
        "--checkpoint-every-k",
        type=positive_int,
        metavar="K",
        help="checkpoint only blocks 0, K, 2K, ... (parallel.activation_checkpointing=every_k; implies --ac)",
    )
    estimate.add_argument(
        "--ema", action="store_true", default=None, help="an fp32 moving average of the weights (train.ema)"
    )
    estimate.add_argument(
        "--batch", type=positive_int, help="images (clips for a video preset) per device and step (default 1)"
    )
    estimate.add_argument("--precision", choices=["fp32", "bf16", "fp16"], help="fp32, or amp_o2 in this dtype")
    estimate.add_argument(
        "--pipeline-stages", type=positive_int, help="blocks split into this many stages, one per process"
    )
    estimate.add_argument(
        "--build",
        choices=["whole", "sharded"],
        help="whole: every process builds the full fp32 model first (the default); sharded: only its shards "
        "(parallel.sharded_init=true under zero2/zero3)",
    )
    estimate.add_argument(
        "--baseline-gib", type=non_negative_float, default=0.0, help="per-process memory besides the model (CPU: ~0.33)"
    )
    estimate.add_argument("--image-size", type=positive_int, help="instead of the presets' own")
    estimate.add_argument("--patch-size", type=positive_int, help="instead of the presets' own")
    estimate.add_argument(
        "--from",
        dest="first",
        metavar="PRESET",
        help="the table starts at this preset and keeps to its kind (image or video)",
    )
    estimate.add_argument(
        "--memory", type=positive_float, nargs="+", default=[80.0], help="GiB per device (several: marks in a grid)"
    )
    estimate.add_argument(
        "--largest", action="store_true", help="the largest ViT on the presets' proportions that fits in --memory"
    )
    estimate.set_defaults(func=_estimate)

    models = sub.add_parser("models", help="list model presets with their size and cost")
    models.set_defaults(func=_models)

    data_help = (
        "data set files: memory-mapped shards for the fast loader (prepare), tar shards or RecordIO (pack), the "
        "sample count of tar shards (index)"
    )
    data = sub.add_parser("data", help=data_help, description=data_help)
    data_sub = data.add_subparsers(dest="data_command", required=True)
    prepare = data_sub.add_parser(
        "prepare", help="decode an ImageFolder tree or .zip once into memory-mapped uint8 shards (resumable)"
    )
    prepare.add_argument(
        "src", metavar="SRC", help="ImageFolder tree (<split>/<class>/<image>), identity folders, or a .zip of one"
    )
    prepare.add_argument("dst", metavar="DST", help="output folder; rerun the same command to resume")
    prepare.add_argument(
        "--size", type=positive_int, default=None, help="resize to S x S (default: the images' own size)"
    )
    prepare.add_argument("--workers", type=positive_int, default=2, help="decoding processes (default 2)")
    prepare.add_argument("--shard-size", type=positive_int, default=2048, help="images per shard file (default 2048)")
    prepare.add_argument("--channels", type=int, choices=(1, 3), default=None, help="default: 1 if all grey")
    prepare.add_argument(
        "--identities",
        action="store_true",
        help="SRC is a face set (one folder per identity, as task.name=face reads it): one split 'all', names kept",
    )
    prepare.set_defaults(func=_data_prepare)
    pack = data_sub.add_parser(
        "pack", help="copy an ImageFolder tree, face identity folders or a .zip into tar shards or RecordIO files"
    )
    pack.add_argument("src", metavar="SRC", help="ImageFolder tree (<split>/<class>/<image>), identity folders, a .zip")
    pack.add_argument("out", metavar="OUT", help="output folder; rerun the same command to resume (shards)")
    pack.add_argument("--format", choices=("shards", "recordio"), required=True, help="WebDataset tars or RecordIO")
    pack.add_argument(
        "--shard-samples", type=positive_int, default=10_000, help="samples per tar shard (default 10000)"
    )
    pack.add_argument(
        "--workers", type=positive_int, default=2, help="processes writing shards in parallel (default 2)"
    )
    pack.add_argument("--identities", action="store_true", help="SRC is a face set: one folder per identity")
    pack.add_argument(
        "--video", action="store_true", help="SRC is a video tree (<class>/<clip>.mp4): one shard sample per clip"
    )
    pack.add_argument(
        "--val-match",
        default="",
        metavar="REGEX",
        help="--video: clips whose path matches go to split 'test' (as data.val_match splits), the rest to 'train'",
    )
    pack.set_defaults(func=_data_pack)
    index = data_sub.add_parser("index", help="count the samples of tar shards into an index.json (once per set)")
    index.add_argument("shards", metavar="SHARDS", help="a folder, list file, brace pattern or pipe:COMMAND")
    index.add_argument("--out", default=None, help="index file (default: index.json beside local shards)")
    index.set_defaults(func=_data_index)

    bench = sub.add_parser(
        "bench", help="benchmarks a reader can rerun: vitrain bench [CONFIG] [overrides] [--ladder | --peers]"
    )
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    run = bench_sub.add_parser(
        "run", help="time a recipe's real training step (the default: `vitrain bench CONFIG` means this)"
    )
    run.add_argument("args", nargs="*", metavar="CONFIG|OVERRIDE", help="a recipe name or YAML path, then overrides")
    run.add_argument(
        "--steps",
        type=positive_int,
        default=None,
        help="timed optimizer steps (default 5; ladder rows 3, 20 on a GPU; peers: rounds, 7)",
    )
    run.add_argument(
        "--warmup",
        type=non_negative_int,
        default=None,
        help="untimed steps first (default 2; ladder and scaling rows 2, 5 on a GPU; peers 3)",
    )
    run.add_argument(
        "--synthetic",
        action="store_true",
        help="random images (clips of model.num_frames frames for a video model) of the model's shape instead of the "
        "recipe's data",
    )
    run.add_argument("--profile", metavar="DIR", help="write a torch.profiler trace and op table of one timed step")
    run.add_argument("--json", metavar="FILE", help="also write the result (or the ladder/peers results) as JSON")
    mode = run.add_mutually_exclusive_group()  # one benchmark per command
    mode.add_argument("--ladder", action="store_true", help="the ablation ladder, each row in its own processes")
    mode.add_argument("--peers", action="store_true", help="vitrain vs timm and transformers on the same model/batch")
    mode.add_argument(
        "--scaling",
        action="store_true",
        help="one process on every core vs N processes (DDP, zero2, zero3), same model and global batch",
    )
    run.add_argument("--out", metavar="DIR", help="--ladder/--peers: where the table, JSON and PNG go")
    run.add_argument(
        "--rows",
        metavar="TEXT,...",
        help="--ladder: only these rows (a row's whole name picks it alone, other text every row containing it)",
    )
    run.add_argument(
        "--nproc",
        type=positive_int,
        default=None,
        help="--ladder/--scaling: processes per row (default: 2 on a CPU, the GPUs on CUDA; scaling: the cores)",
    )
    run.add_argument(
        "--repeats",
        type=positive_int,
        default=None,
        help="--ladder/--scaling: run every row this many times, rows taking turns; median and spread (default 1; 3)",
    )
    # The ladder measures the GEMM peaks once and hands them to its rows: fp32=TFLOPS,bf16=TFLOPS.
    run.add_argument("--peaks", default=None, help=argparse.SUPPRESS)
    run.set_defaults(func=_bench_run)
    loader = bench_sub.add_parser("loader", help="images/s of the data sources' loaders (prepared, folder, streams)")
    loader.add_argument("--prepared", required=True, help="a folder made by `vitrain data prepare`")
    loader.add_argument("--folder", required=True, help="the same images as an ImageFolder tree (or .zip)")
    loader.add_argument("--shards", default=None, help="the same images packed as shards: rows per source instead")
    loader.add_argument("--recordio", default=None, help="the same images packed as RecordIO (with --shards)")
    loader.add_argument(
        "--workers", type=counts, default=[0, 1, 2], help="with --shards: worker counts to time (default 0,1,2)"
    )
    loader.add_argument("--batches", type=positive_int, default=60, help="timed batches per loader (default 60)")
    loader.add_argument("--warmup", type=non_negative_int, default=5, help="untimed batches first (default 5)")
    loader.add_argument(
        "--rounds", type=positive_int, default=3, help="alternating rounds; medians reported (default 3)"
    )
    loader.add_argument("--out", default=None, help="also write the result as JSON to this file")
    loader.add_argument("overrides", nargs="*", metavar="OVERRIDE", help="e.g. train.batch_size=256 data.hflip=0.5")
    loader.set_defaults(func=_bench_loader)
    lr_find = sub.add_parser("lr-find", help="lr range test: writes lr_find.csv, a plot and a suggested lr")
    lr_find.add_argument("args", nargs="*", metavar="CONFIG|OVERRIDE", help="a recipe name or YAML path, overrides")
    lr_find.add_argument("--start", type=positive_float, default=1e-7, help="first learning rate (default 1e-7)")
    lr_find.add_argument("--end", type=positive_float, default=10.0, help="last learning rate (default 10)")
    lr_find.add_argument("--steps", type=_number(int, 3), default=100, help="number of steps, >= 3 (default 100)")
    lr_find.add_argument("--out", default=None, help="output folder (default: <log.out_dir>/<name>-lr-find)")
    lr_find.add_argument("--overwrite", action="store_true", help="replace lr_find.csv and .png already in --out")
    lr_find.set_defaults(func=_lr_find)

    bench_optim = bench_sub.add_parser("optim", help="time one optimizer step per kernel (loop/foreach/fused/flat)")
    bench_optim.add_argument("--model", default="vit_small_patch16", help="a preset (default ViT-S/16)")
    bench_optim.add_argument("--optimizer", default="adamw", choices=["adamw", "sgd", "lamb", "lars", "muon"])
    bench_optim.add_argument(
        "--impls", default=None, help="comma-separated kernels (default: every kernel the optimizer has, then auto)"
    )
    bench_optim.add_argument(
        "--ns-dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="muon only: the dtype of its Newton-Schulz matmuls (a bf16 run uses bfloat16; default float32)",
    )
    bench_optim.add_argument("--steps", type=positive_int, default=20, help="timed steps per kernel (median reported)")
    bench_optim.add_argument("--threads", type=non_negative_int, default=0, help="torch threads (0: torch's default)")
    bench_optim.set_defaults(func=_bench_optim)

    plot = sub.add_parser("plot", help="loss, lr and top-1 vs steps and wall-clock of one or more runs, one PNG")
    plot.add_argument("runs", nargs="+", metavar="RUN", help="run folders (each holds metrics.jsonl)")
    plot.add_argument("--out", default=None, help="the PNG (default: RUN/curves.png for one run, curves.png for more)")
    plot.add_argument("--names", default=None, metavar="A,B,...", help="legend names, one per run (default: folders)")
    plot.add_argument("--metric", default="val_top1", help="the evaluation field to draw (default val_top1)")
    plot.set_defaults(func=_plot)

    checkpoint = sub.add_parser("checkpoint", help="inspect checkpoints without loading them")
    checkpoint_sub = checkpoint.add_subparsers(dest="checkpoint_command", required=True)
    verify = checkpoint_sub.add_parser("verify", help="each step folder: intact (checksums), incomplete or damaged")
    verify.add_argument("path", metavar="RUN|STEP", help="a run folder or a step folder")
    verify.set_defaults(func=_checkpoint_verify)

    config = sub.add_parser("config", help="inspect configs")
    config_sub = config.add_subparsers(dest="config_command", required=True)
    show = config_sub.add_parser("show", help="print the resolved config")
    show.add_argument("args", nargs="*", metavar="CONFIG|OVERRIDE")
    show.set_defaults(func=_config_show)
    listing = config_sub.add_parser("list", help="the recipes shipped with vitrain: name, path, what each trains")
    listing.set_defaults(func=_config_list)
    keys = config_sub.add_parser("keys", help="every config key: type, default and what it does")
    keys.add_argument("section", nargs="?", help="only this section (model, data, train, ...)")
    keys.set_defaults(func=_config_keys)
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
    from vitrain.api import train

    name, overrides = _split_args(args.args)
    # --resume PATH names the run itself, whose config.yaml it continues: a recipe beside it would be ignored.
    # (Plain --resume and --resume auto find the run by the recipe's name, so there it stays.)
    if args.resume not in (True, False, "auto") and args.args and name == args.args[0]:
        raise ConfigError(
            f"--resume {args.resume} continues that run with its own config.yaml, not {name}'s: drop {name} from the "
            f"command line (overrides such as train.epochs=N still apply), or train {name} without --resume"
        )
    summary = train(name, overrides, resume=args.resume)
    if summary is not None:  # rank 0
        print(json.dumps(summary, indent=2))
    return 0


def _eval(args: argparse.Namespace) -> int:
    from pathlib import Path

    from vitrain import checkpoint as ckpt
    from vitrain.config import load_config, override_keys, trusted_values
    from vitrain.data import build_loaders
    from vitrain.device import resolve_device
    from vitrain.engine.protocol import load_model_weights
    from vitrain.engine.runs import from_training_folder
    from vitrain.files import check_output_path
    from vitrain.tasks import build_task
    from vitrain.tasks.evaluate import evaluate

    if args.out:  # face verification and detection reports: a folder, checked before the checkpoint loads
        check_output_path(Path(args.out), "--out", folder=True)
    path = ckpt.resolve(Path(args.checkpoint))
    meta = ckpt.read_meta(path)
    # The checkpoint's config names no code or command the command line does not (vitrain/trust.py).
    cfg = load_config(overrides=args.overrides, base=meta["config"], untrusted=path / ckpt.META_FILE)
    given = override_keys(args.overrides)
    cfg, moved = from_training_folder(cfg, meta, given, path / ckpt.META_FILE)  # relative data read where it trained
    for line in moved:
        print(f"vitrain: {line}", file=sys.stderr)
    device = resolve_device(cfg.train.device)
    model = build_task(cfg).build_model()
    # whichever engine wrote it: DCP shards or DeepSpeed's partitions (one the config did not pass is refused)
    load_model_weights(path, model, trusted_values(cfg))
    model = model.to(device)
    if args.show and cfg.task.name != "detection":
        raise ConfigError(
            f"--show draws a detection model's boxes; {path} was trained with task.name={cfg.task.name}: leave it out"
        )
    if cfg.task.name == "face":
        from vitrain.tasks.face import verify

        out = Path(args.out) if args.out else ckpt.run_dir_of(path) / "eval"
        root = Path(args.root).expanduser() if args.root else None
        report = verify(model, cfg, device, root, args.pairs, out)
        result = {"checkpoint": str(path), "step": meta.get("step"), **report}
    elif cfg.task.name == "detection":
        from vitrain.tasks.detection import evaluate_checkpoint

        out = Path(args.out) if args.out else ckpt.run_dir_of(path) / "eval"
        result = {
            "checkpoint": str(path),
            "step": meta.get("step"),
            **evaluate_checkpoint(model, cfg, device, out, args.show, args.min_score),
        }
    elif args.pairs or args.root or args.out:
        raise ConfigError(
            f"--pairs and --root verify face models, --out is for face and detection models; {path} was trained "
            f"with task.name={cfg.task.name}"
        )
    elif cfg.task.name == "video":  # clip and multi-clip video accuracy (vitrain/tasks/video.py)
        task = build_task(cfg)
        task.build_data(device, 0, 1)
        metrics = task.evaluate(model, True, ckpt.run_dir_of(path))
        result = {"checkpoint": str(path), "step": meta.get("step"), **metrics}
    else:
        _, loader = build_loaders(cfg, device)
        metrics = evaluate(model, loader, flip=cfg.train.eval_flip)
        result = {"checkpoint": str(path), "step": meta.get("step"), **metrics}
    print(json.dumps(result, indent=2))
    return 0


def _export(args: argparse.Namespace) -> int:
    import dataclasses
    from pathlib import Path

    from vitrain import checkpoint as ckpt
    from vitrain.config import load_config, trusted_values
    from vitrain.engine.protocol import load_model_weights
    from vitrain.engine.runs import class_names
    from vitrain.files import check_output_folder
    from vitrain.tasks import build_task
    from vitrain.weights import EXPORT_FILES, export

    # Before a checkpoint is read (the library checks again for its own callers).
    check_output_folder(Path(args.out), args.overwrite, EXPORT_FILES[args.format], "export", CheckpointError)
    path = ckpt.resolve(Path(args.checkpoint))
    # The checkpoint's config names no code the command line does not (vitrain/trust.py); its data is not read.
    meta = ckpt.read_meta(path)
    cfg = load_config(overrides=args.overrides, base=meta["config"], untrusted=path / ckpt.META_FILE, data=False)
    task = build_task(cfg)
    saved = class_names(meta)
    if getattr(task, "classes", ...) is None and saved is not None:
        task.classes = saved  # detection: the classes it trained on size the head; the annotations are not read
    model = task.build_model()  # a face model exports its embedding backbone (the neck included)
    load_model_weights(path, model, trusted_values(cfg))  # native (DCP) or DeepSpeed checkpoints
    built = class_names(task)
    if built is not None and cfg.model.num_classes != len(built):
        if cfg.task.name == "detection":  # the data's classes sized the head
            cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, num_classes=len(built)))
        else:  # names that do not fit the head (a hand-edited meta.json): none are written
            built = None
    said: list[str] = []  # onnx: the parity line, printed after the file's path
    path = export(model, cfg, Path(args.out), args.format, args.overwrite, args.tolerance, built, said.append)
    print("\n".join([str(path), *said]))
    return 0


def _estimate(args: argparse.Namespace) -> int:
    from vitrain.config import load_config
    from vitrain.models import find_preset
    from vitrain.models.memory import breakdown, grid, largest, preset_models, table
    from vitrain.models.plan import auto_wrap

    fields = {"image_size": args.image_size, "patch_size": args.patch_size}
    if args.first is not None and (args.preset is not None or args.largest):
        alone = f"the preset {args.preset} alone" if args.preset is not None else "--largest's own climb"
        raise ConfigError(f"--from starts the table of presets; {alone} has no start: drop --from or the other")
    model = None
    if args.preset is not None and not args.largest:  # --largest climbs the ViT presets' proportions instead
        model = load_config(base={"model": {"preset": args.preset, **{k: v for k, v in fields.items() if v}}}).model
    # An MViT's memory is modelled with whole weights (vitrain/models/memory.py): ddp unless a strategy is given.
    strategy = "ddp" if model is not None and model.name == "mvit" else "zero3"
    setting = {"strategy": strategy, "wrap": "auto", "offload": False, "ac": False, "batch": 1, "precision": "fp32"}
    setting.update(pipeline_stages=1, build="whole")
    if args.config:
        setting.update(_recipe_setting(_load([args.config])))
    flags = {
        "strategy": args.strategy,
        "wrap": args.wrap,
        "offload": args.offload,
        "ac": True if args.checkpoint_every_k else args.ac,
        "checkpoint_every_k": args.checkpoint_every_k,
        "batch": args.batch,
        "precision": args.precision,
        "pipeline_stages": args.pipeline_stages,
        "build": args.build,
        "ema": args.ema,
    }
    setting.update({k: v for k, v in flags.items() if v is not None})
    if args.ac and not args.checkpoint_every_k:  # --ac is every block: a config's every_k gives way to it
        setting.pop("checkpoint_every_k", None)
    setting.update(baseline_bytes=int(args.baseline_gib * 2**30))
    shown = dict(setting)
    # auto (the default, or a config's) is resolved after the flags: --strategy may change what it resolves to.
    if setting["wrap"] == "auto":
        setting["wrap"] = auto_wrap(setting["strategy"])
        shown["wrap"] = f"{setting['wrap']} (parallel.wrap=auto without autotune)"
    devices = args.devices or [1]
    header = ", ".join(f"{k}={v}" for k, v in {"devices": " ".join(map(str, devices)), **shown}.items())
    # The whole answer is made before any of it is printed: a refused setting prints only its error line.
    if args.largest:
        base = {k: v for k, v in fields.items() if v}
        title = f"memory per device with AdamW ({header})"
        body = largest(args.memory[0], base, devices=devices[0], **setting)
    elif len(devices) > 1:
        title = f"peak memory per device with AdamW ({header})"
        models = {find_preset(args.preset).alias: model} if model is not None else preset_models(args.first, **fields)
        body = grid(devices, args.memory, models, **setting)
    elif model is None:
        title = f"memory per device with AdamW ({header})"
        body = table(args.memory[0], preset_models(args.first, **fields), devices=devices[0], **setting)
    else:
        title = f"{args.preset}: memory per device with AdamW ({header})"
        body = breakdown(model, args.memory[0], devices=devices[0], **setting)
    print(title)
    print(body)
    return 0


def _recipe_setting(cfg) -> dict:
    """What `vitrain estimate` needs from a config: how it is parallelized, its precision and batch per device."""
    p = cfg.parallel
    if cfg.train.engine != "native":
        # DeepSpeed's ZeRO stages partition other states than FSDP2 and ZeroRedundancyOptimizer (stage 1 the fp32
        # master too, stage 2 not the weights) and offload the optimizer on their own: the native figures would
        # be wrong for it, silently.
        raise ConfigError(
            f"vitrain estimate models the native engine; train.engine={cfg.train.engine} is not modelled: give the "
            "strategy, precision and batch as flags for the native engine's figures"
        )
    if cfg.precision.mode == "pure":
        raise ConfigError("vitrain estimate models fp32, amp_o1 and amp_o2; precision.mode=pure is not modelled")
    return {
        "strategy": p.strategy,
        "wrap": p.wrap,  # auto is resolved by the caller, for the strategy a flag may set instead
        "offload": p.offload == "params",
        "ac": p.activation_checkpointing != "none",
        # every_k recomputes blocks 0, k, 2k, ... only: the others keep their activations.
        **({"checkpoint_every_k": p.checkpoint_every_k} if p.activation_checkpointing == "every_k" else {}),
        "batch": cfg.train.batch_size,
        # amp_o1 keeps fp32 weights: its states are fp32's (its low-dtype activations are counted as fp32).
        "precision": cfg.precision.dtype if cfg.precision.mode == "amp_o2" else "fp32",
        "pipeline_stages": p.pipeline_stages,
        "microbatches": p.microbatches,
        "build": "sharded" if p.sharded_init else "whole",
        **({"ema": True} if cfg.train.ema else {}),  # an fp32 copy of the weights (vitrain/engine/ema.py)
    }


def _models(args: argparse.Namespace) -> int:
    from vitrain.config import load_config
    from vitrain.models import PRESETS, config_complexity

    bytes_per_param = 16  # fp32 AdamW: weights 4 + gradients 4 + two moments 8
    print(f"{'preset':<24}{'alias':<14}{'params':>16}{'image':>7}{'GFLOPs':>11}{'train GiB':>12}")
    for p in PRESETS.values():
        cost = config_complexity(load_config(overrides=[f"model.preset={p.name}"]).model)
        gib = cost.params * bytes_per_param / 2**30
        size = f"{p.num_frames}x{p.image_size}" if p.is_video else str(p.image_size)
        print(f"{p.name:<24}{p.alias:<14}{cost.params:>16,}{size:>7}{cost.flops / 1e9:>11.1f}{gib:>12.1f}")
    print("GFLOPs: one forward pass of one image (video: one clip of the preset's frames), multiply-add = 2 FLOPs")
    print("(timm's tables count MACs: half).")
    print("train GiB: fp32 AdamW model state (weights, gradients, two moments) without activations.")
    return 0


def _data_prepare(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from vitrain.data.prepare import FAILED, prepare
    from vitrain.engine.runlog import bars_render

    bars: list[tqdm] = []  # made once the number of images is known, so a bad SRC prints only its error

    def start_bar(total: int) -> None:
        bars.append(
            tqdm(
                total=total, desc="prepare", unit="img", file=sys.stderr, dynamic_ncols=True, disable=not bars_render()
            )
        )

    try:
        result = prepare(
            args.src,
            args.dst,
            size=args.size,
            workers=args.workers,
            shard_size=args.shard_size,
            channels=args.channels,
            progress=lambda n: bars[0].update(n),
            on_plan=start_bar,
            identities=args.identities,
        )
    except BrokenPipeError:  # `vitrain models | head`: the reader left; not an error
        sys.stderr.close()
        return 0
    except KeyboardInterrupt:
        print(
            "\nvitrain: interrupted; run the same command again to finish (finished shards are kept)", file=sys.stderr
        )
        return 130
    finally:
        for bar in bars:
            bar.close()
    for where, reason in result.failed[:20]:
        print(f"vitrain: skipped {where}: {reason}", file=sys.stderr)
    if result.failed:
        print(f"vitrain: {len(result.failed)} files did not decode; all listed in {args.dst}/{FAILED}", file=sys.stderr)
    print(
        f"prepared {result.images} images into {args.dst} ({result.shards_converted} shards converted, "
        f"{result.shards_done_before} already done from an earlier run, {len(result.failed)} failed)"
    )
    return 0


def _data_pack(args: argparse.Namespace) -> int:
    from pathlib import Path

    from vitrain.data.pack import check_pack_folder, list_source, list_videos, pack_recordio, pack_shards

    if args.shard_samples < 1 or args.workers < 1:
        raise ConfigError("--shard-samples and --workers must be >= 1")
    if args.video and (args.format != "shards" or args.identities):
        raise ConfigError("--video packs clips into shards only; use --format shards without --identities")
    if args.val_match and not args.video:
        raise ConfigError("--val-match splits video trees; add --video (image trees keep their split folders)")
    src, out = Path(args.src), Path(args.out)
    settings = {"shard_samples": args.shard_samples} if args.format == "shards" else {}
    check_pack_folder(out, src, args.format, "identities" if args.identities else "classes", **settings)
    listing = list_videos(src, args.val_match) if args.video else list_source(src, args.identities)
    if args.format == "shards":
        totals = pack_shards(listing, out, args.shard_samples, args.workers)
    else:
        totals = pack_recordio(listing, out)
    counts = ", ".join(f"{split} {n}" for split, n in totals.items())
    print(
        f"packed {counts} samples of {len(listing.classes)} {listing.layout} into {out} ({args.format}, counted back)"
    )
    return 0


def _data_index(args: argparse.Namespace) -> int:
    from pathlib import Path

    from vitrain.data.shards import index_path, scan_index, shard_urls, write_index
    from vitrain.files import check_output_path

    urls = shard_urls(args.shards, "SHARDS")
    out = Path(args.out) if args.out else index_path(urls)
    if out is None:
        raise ConfigError("pipe: shards have no folder to hold their index; give --out index.json")
    check_output_path(out, "--out" if args.out else "the index", folder=False)
    index = scan_index(urls)
    write_index(out, index)
    print(f"indexed {index.total} samples in {len(urls)} shards ({len(index.classes)} classes) -> {out}")
    return 0


def _bench_run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from vitrain.files import check_output_path

    # Checked before the bench runs: its result is written after it.
    if args.rows is not None and not [r for r in args.rows.split(",") if r.strip()]:
        raise ConfigError("--rows names no row (it is empty); give row names or text, e.g. --rows zero2,zero3")
    if args.json:
        check_output_path(Path(args.json), "--json", folder=False)
    if args.profile:
        check_output_path(Path(args.profile), "--profile", folder=True)
    if args.ladder or args.peers or args.scaling:
        import importlib

        which = "ladder" if args.ladder else "peers" if args.peers else "scaling"
        module = importlib.import_module(f"vitrain.bench.{which}")
        # Without a recipe these benchmarks use their own model (ViT-Ti/16, ViT-S/16 at 224 px), not digits.
        has_recipe = bool(args.args) and "=" not in args.args[0]
        name, overrides = (args.args[0], args.args[1:]) if has_recipe else (None, list(args.args))
        return module.main(name, overrides, args)

    from vitrain.bench.step import bench_step, format_result, parse_peaks, write_json
    from vitrain.parallel import shutdown
    from vitrain.parallel.distributed import rank

    cfg = _load(args.args)
    if args.synthetic:
        cfg = _synthetic_data(cfg)
    try:
        result = bench_step(
            cfg,
            steps=args.steps or 5,
            warmup=2 if args.warmup is None else args.warmup,
            profile=Path(args.profile) if args.profile else None,
            peaks=parse_peaks(args.peaks),
        )
        is_main = rank() == 0
    finally:
        shutdown()
    if is_main:
        print(format_result(result))
        if args.json:
            write_json(result, Path(args.json))
    return 0


def _synthetic_data(cfg):
    import dataclasses

    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, source="synthetic", root=""))


def _bench_loader(args: argparse.Namespace) -> int:
    from vitrain.bench.loader import bench_loader, bench_sources, format_result, format_rows

    if args.out:  # checked before the bench runs: its result is written after it
        from pathlib import Path

        from vitrain.files import check_output_path

        check_output_path(Path(args.out), "--out", folder=False)
    if args.shards:
        sources = {"folder": args.folder, "prepared": args.prepared, "shards": args.shards}
        sources |= {"recordio": args.recordio} if args.recordio else {}
        result = bench_sources(sources, args.workers, args.overrides, args.batches, args.warmup, args.rounds)
        print(format_rows(result))
    else:
        result = bench_loader(args.prepared, args.folder, args.overrides, args.batches, args.warmup, args.rounds)
        print(format_result(result))
    if args.out:
        from pathlib import Path

        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


def _plot(args: argparse.Namespace) -> int:
    from pathlib import Path

    from vitrain.plot import plot_runs, read_curves

    names = args.names.split(",") if args.names else [None] * len(args.runs)
    if len(names) != len(args.runs):
        raise ConfigError(f"--names has {len(names)} names for {len(args.runs)} runs; give one per run")
    curves = [read_curves(run, name) for run, name in zip(args.runs, names, strict=True)]
    out = Path(args.out) if args.out else (Path(args.runs[0]) / "curves.png" if len(args.runs) == 1 else None)
    out = plot_runs(curves, out or Path("curves.png"), metric=args.metric)
    print(out)
    return 0


def _lr_find(args: argparse.Namespace) -> int:
    from pathlib import Path

    from vitrain.engine.lr_find import lr_range_test

    if not args.start < args.end:  # each is > 0 (its parser)
        raise ConfigError(f"lr-find needs --start < --end; got --start={args.start} --end={args.end}")
    from vitrain.parallel import shutdown
    from vitrain.parallel.distributed import rank

    cfg = _load(args.args)
    out = Path(args.out) if args.out else cfg.run_dir.with_name(f"{cfg.name}-lr-find")
    try:
        result = lr_range_test(cfg, args.start, args.end, args.steps, out, overwrite=args.overwrite)
        is_main = rank() == 0
    finally:
        shutdown()
    if not is_main:
        return 0
    print(f"lr range test: {len(result.lrs)} steps from {result.lrs[0]:.2e} to {result.lrs[-1]:.2e}")
    print(f"suggested lr: {result.suggested_lr:.3e} (steepest loss descent); losses in {result.csv_path}")
    if result.plot_path is not None:
        print(f"plot: {result.plot_path}")
    else:
        print("no plot: matplotlib is not installed; pip install 'vitrain[plot]', then rerun with --overwrite for it")
    return 0


def _bench_optim(args: argparse.Namespace) -> int:
    import torch

    from vitrain.bench.optim import bench_optimizer_step, default_impls, preset_model_config
    from vitrain.config import OptimConfig

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.impls is None:
        impls = default_impls(args.optimizer)
    else:
        impls = tuple(i.strip() for i in args.impls.split(",") if i.strip())
    if args.ns_dtype != "float32" and args.optimizer != "muon":
        raise ConfigError(f"--ns-dtype is muon's Newton-Schulz dtype; --optimizer {args.optimizer} has none")
    model_cfg = preset_model_config(args.model)
    ns_dtype = getattr(torch, args.ns_dtype)
    params, timings = bench_optimizer_step(
        model_cfg, OptimConfig(name=args.optimizer), impls, args.steps, ns_dtype=ns_dtype
    )
    newton_schulz = f", Newton-Schulz in {args.ns_dtype}" if args.optimizer == "muon" else ""
    print(
        f"{args.optimizer} step over {args.model} ({params / 1e6:.1f}M params, fp32{newton_schulz}, cpu, "
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


def _config_list(args: argparse.Namespace) -> int:
    from vitrain.config import CONFIG_DIR, recipe_description, recipe_names

    names = recipe_names()
    width = max(map(len, names), default=0) + 2
    print(f"recipes shipped in {CONFIG_DIR}:")
    for name in names:
        path = CONFIG_DIR / f"{name}.yaml"
        print(f"{name:<{width}}{path}")
        print(f"{'':<{width}}{recipe_description(path)}")
    print("train one: vitrain train NAME; to edit one, copy it out: vitrain config show NAME > my.yaml")
    return 0


def _checkpoint_verify(args: argparse.Namespace) -> int:
    from pathlib import Path

    from vitrain.checkpoint import verify_report

    report = verify_report(Path(args.path))
    for step, _, what in report:
        print(f"{step}: {what}")
    bad = [step for step, intact, _ in report if not intact]
    if not report:
        raise CheckpointError(f"checkpoint verify: {args.path} holds no step folder")
    if bad:
        raise CheckpointError(
            f"{len(bad)} of {len(report)} step folder(s) in {args.path} are not intact (listed above)"
        )
    return 0


def _config_keys(args: argparse.Namespace) -> int:
    from vitrain.config import config_keys

    rows = config_keys(args.section)
    width = max(len(row.key) for row in rows) + 2
    kinds = max(len(row.type) for row in rows) + 2
    for row in rows:
        print(f"{row.key:<{width}}{row.type:<{kinds}}{row.default:<22} {row.help}")
    return 0


def _one_line_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """A warning as one line on stderr: vitrain's own as `vitrain: warning: ...`; another library's (torch's,
    DeepSpeed's) names that library and the warning's class too, so that it is not read as vitrain's."""
    source = _package_of(filename)
    said = "" if source == "vitrain" else f" from {source} ({category.__name__})"
    print(f"vitrain: warning{said}: {message}", file=sys.stderr)


def _package_of(filename: str) -> str:
    """The top-level package a source file belongs to (vitrain, or an installed one), else its file name."""
    from pathlib import Path

    path = Path(filename).resolve()
    if path.is_relative_to(Path(__file__).resolve().parent):
        return "vitrain"
    for installed in ("site-packages", "dist-packages"):
        if installed in path.parts[:-1]:
            return Path(path.parts[path.parts.index(installed) + 1]).stem
    return path.name
