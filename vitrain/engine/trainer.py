"""The training loop: data in; metrics, checkpoints and a summary out. Reads top to bottom."""

from __future__ import annotations

import itertools
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tqdm import tqdm

from vitrain import checkpoint as ckpt
from vitrain.config import Config, config_from_dict, to_dict, to_yaml
from vitrain.data import BatchAugment, BatchLoader, build_datasets
from vitrain.engine.evaluate import evaluate
from vitrain.errors import CheckpointError, ConfigError
from vitrain.models import complexity, count_parameters, create_model
from vitrain.optim import Schedule, build_optimizer, resolve_impl, scaled_lr, set_lr
from vitrain.precision import PrecisionPolicy, fp32_state_dict


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"train.device={name} is not a device; use auto, cpu or cuda") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device=cuda but no CUDA device is available; use train.device=auto or cpu")
    return device


class RunLog:
    """Human lines to stderr and log.txt; machine records to metrics.jsonl."""

    def __init__(self, run_dir: Path):
        self.text = open(run_dir / "log.txt", "a")
        self.jsonl = open(run_dir / "metrics.jsonl", "a")

    def info(self, message: str) -> None:
        tqdm.write(message, file=sys.stderr)
        self.text.write(message + "\n")
        self.text.flush()

    def record(self, **fields: Any) -> None:
        self.jsonl.write(json.dumps(fields) + "\n")
        self.jsonl.flush()

    def close(self) -> None:
        self.text.close()
        self.jsonl.close()


class Trainer:
    """Builds everything from one config, then `fit()` trains, evaluates, checkpoints and summarizes."""

    def __init__(self, cfg: Config, resume: bool | str = False):
        self.cfg = cfg
        self.run_dir = cfg.run_dir
        self.resume_path = self._resume_path(resume)
        torch.manual_seed(cfg.train.seed)
        if cfg.train.threads:
            torch.set_num_threads(cfg.train.threads)
        self.device = resolve_device(cfg.train.device)

        train_set, val_set = build_datasets(cfg)
        t = cfg.train
        self.train_loader = BatchLoader(
            train_set,
            t.batch_size,
            BatchAugment(cfg.data, cfg.model.in_chans, train=True),
            self.device,
            shuffle=True,
            seed=t.seed,
        )
        self.val_loader = BatchLoader(
            val_set,
            t.batch_size,
            BatchAugment(cfg.data, cfg.model.in_chans, train=False),
            self.device,
            shuffle=False,
            drop_last=False,
        )
        self.steps_per_epoch = len(self.train_loader) // t.accum_steps
        if self.steps_per_epoch == 0:
            raise ConfigError(
                f"train.batch_size={t.batch_size} x train.accum_steps={t.accum_steps} is larger than the "
                f"{len(train_set)} training samples; lower the batch size"
            )
        self.total_steps = self.steps_per_epoch * t.epochs
        peak_lr = scaled_lr(cfg.optim.lr, cfg.schedule, t.batch_size * t.accum_steps)
        self.schedule = Schedule(cfg.schedule, peak_lr, self.total_steps, self.steps_per_epoch)

        self.model = create_model(cfg.model).to(self.device)  # fp32: the weights checkpoints hold
        # The policy may hand back a low-precision working copy; the optimizer always updates self.model.
        self.precision = PrecisionPolicy(cfg.precision, self.device)
        train_model = self.precision.prepare(self.model)
        self.optimizer = build_optimizer(self.model, cfg.optim, self.device)
        self.forward = torch.compile(train_model) if t.compile else train_model

        self.step = 0
        self.epoch = 0
        self.batch_in_epoch = 0  # micro-batches of the current epoch already consumed
        self.best_top1 = -1.0
        self.last_eval: dict[str, float] = {}

    # ------------------------------------------------------------------------------------------ state

    def _resume_path(self, resume: bool | str) -> Path | None:
        last = self.run_dir / "last.pt"
        if resume:
            path = Path(resume) if isinstance(resume, str) else last
            if not path.exists():
                raise CheckpointError(f"--resume: checkpoint {path} does not exist; start without --resume")
            return path
        if last.exists():
            raise CheckpointError(
                f"{self.run_dir} already holds a run (last.pt); pass --resume to continue it "
                f"or name=NEW_NAME to start another"
            )
        return None

    def state_dict(self) -> dict[str, Any]:
        return {
            "format": ckpt.FORMAT_VERSION,
            "config": to_dict(self.cfg),
            "model": fp32_state_dict(self.model),
            "optimizer": self.optimizer.state_dict(),
            "precision": self.precision.state_dict(),
            "step": self.step,
            "epoch": self.epoch,
            "batch_in_epoch": self.batch_in_epoch,
            "best_top1": self.best_top1,
            "last_eval": self.last_eval,
            "rng": ckpt.rng_state(),
        }

    def load_state_dict(self, state: dict[str, Any], path: Path) -> None:
        saved = config_from_dict(state["config"])
        if saved.model != self.cfg.model:
            raise CheckpointError(
                f"checkpoint {path} was trained with a different model config; resume with the same model.* keys"
            )
        ckpt.load_model_state(self.model, state["model"], path)
        self.optimizer.load_state_dict(state["optimizer"])
        self.precision.load_state_dict(state.get("precision"))
        self.step, self.epoch = state["step"], state["epoch"]
        self.batch_in_epoch = state["batch_in_epoch"]
        self.best_top1, self.last_eval = state["best_top1"], state["last_eval"]
        ckpt.set_rng_state(state["rng"])

    def save(self, is_best: bool = False) -> Path:
        state = self.state_dict()
        path = self.run_dir / "last.pt"
        ckpt.atomic_save(state, path)
        if is_best:
            ckpt.atomic_save(state, self.run_dir / "best.pt")
        return path

    # ------------------------------------------------------------------------------------------ loop

    def fit(self) -> dict[str, Any]:
        cfg, t = self.cfg, self.cfg.train
        self.run_dir.mkdir(parents=True, exist_ok=True)
        log = RunLog(self.run_dir)
        if self.resume_path is not None:
            self.load_state_dict(ckpt.load(self.resume_path), self.resume_path)
            log.info(f"resumed from {self.resume_path} at step {self.step} (epoch {self.epoch})")
        (self.run_dir / "config.yaml").write_text(to_yaml(cfg))
        self._log_header(log)

        wall_start = time.perf_counter()
        train_seconds, train_images, compile_s = 0.0, 0, None
        stop = False
        while self.epoch < t.epochs and not stop:
            bar = tqdm(
                total=self.steps_per_epoch,
                initial=self.batch_in_epoch // t.accum_steps,
                desc=f"epoch {self.epoch + 1}/{t.epochs}",
                disable=not cfg.log.progress,
                file=sys.stderr,
                dynamic_ncols=True,
                leave=False,
            )
            micro = 0
            step_start = time.perf_counter()
            window_images, window_start = 0, step_start
            # Only whole optimizer steps: leftover micro-batches would leak gradients into the next epoch.
            remaining = self.steps_per_epoch * t.accum_steps - self.batch_in_epoch
            batches = itertools.islice(self.train_loader.epoch(self.epoch, self.batch_in_epoch), remaining)
            for images, labels in batches:
                if micro == 0:
                    lr = self.schedule(self.step)
                    set_lr(self.optimizer, lr)
                with self.precision.autocast():
                    loss = F.cross_entropy(self.forward(images).float(), labels, label_smoothing=t.label_smoothing)
                self.precision.backward(loss / t.accum_steps)
                micro += 1
                self.batch_in_epoch += 1
                if micro < t.accum_steps:
                    continue
                grad_norm, skipped = self.precision.step(self.optimizer, cfg.optim.clip_grad_norm)
                micro = 0
                self.step += 1
                if skipped:
                    log.record(step=self.step, epoch=self.epoch, skipped=True, **self._scaler_fields())

                now = time.perf_counter()
                step_images = images.shape[0] * t.accum_steps
                if compile_s is None and t.compile:
                    compile_s = now - step_start
                    log.info(f"first step with torch.compile took {compile_s:.1f} s")
                elif self.step > 1 or self.resume_path is not None:
                    train_seconds += now - step_start
                    train_images += step_images
                window_images += step_images
                bar.update(1)
                if self.step % cfg.log.every_steps == 0 or self.step == 1:
                    loss_value = float(loss)
                    images_per_s = window_images / max(now - window_start, 1e-9)
                    bar.set_postfix(loss=f"{loss_value:.4f}", lr=f"{lr:.2e}", img_s=f"{images_per_s:.0f}")
                    log.record(
                        step=self.step,
                        epoch=self.epoch,
                        loss=loss_value,
                        lr=lr,
                        grad_norm=grad_norm,
                        images_per_s=images_per_s,
                        **self._scaler_fields(),
                    )
                    window_images, window_start = 0, time.perf_counter()
                if t.checkpoint_every_steps and self.step % t.checkpoint_every_steps == 0:
                    self.save()
                if t.max_steps and self.step >= t.max_steps:
                    stop = True
                    break
                step_start = time.perf_counter()
            bar.close()
            if not stop:
                self.epoch += 1
                self.batch_in_epoch = 0
            if stop or self.epoch % t.eval_every_epochs == 0 or self.epoch == t.epochs:
                self._evaluate_and_save(log)

        wall_s = time.perf_counter() - wall_start
        summary = self._summary(wall_s, train_images / train_seconds if train_seconds else 0.0, compile_s)
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        log.info(
            f"done: val_top1={summary['val_top1']:.4f} images/s={summary['images_per_s']:.0f} "
            f"wall={wall_s:.1f}s -> {self.run_dir / 'summary.json'}"
        )
        log.close()
        return summary

    def _scaler_fields(self) -> dict[str, Any]:
        scaler = self.precision.scaler
        return {} if scaler is None else {"loss_scale": scaler.scale, "skipped_steps": scaler.skipped_steps}

    def _evaluate_and_save(self, log: RunLog) -> None:
        with self.precision.autocast():
            self.last_eval = evaluate(self.forward, self.val_loader)
        is_best = self.last_eval["val_top1"] > self.best_top1
        self.best_top1 = max(self.best_top1, self.last_eval["val_top1"])
        log.record(step=self.step, epoch=self.epoch, **self.last_eval)
        log.info(
            f"epoch {self.epoch} step {self.step}: val_top1={self.last_eval['val_top1']:.4f} "
            f"val_top5={self.last_eval['val_top5']:.4f} val_loss={self.last_eval['val_loss']:.4f}"
        )
        self.save(is_best)

    def _log_header(self, log: RunLog) -> None:
        cfg = self.cfg
        cost = complexity(cfg.model)
        global_batch = cfg.train.batch_size * cfg.train.accum_steps
        impl = resolve_impl(cfg.optim.impl, self.device, cfg.optim.name)
        log.info(
            f"vitrain: {count_parameters(self.model) / 1e6:.2f}M params, {cost.flops / 1e9:.3f} GFLOPs/image, "
            f"device={self.device}, optimizer={cfg.optim.name}[{impl}], "
            f"global batch={global_batch}, {self.steps_per_epoch} steps/epoch x {cfg.train.epochs} epochs, "
            f"{len(self.train_loader.data)} train / {len(self.val_loader.data)} val images, run dir {self.run_dir}"
        )
        log.info(self.precision.describe())

    def _summary(self, wall_s: float, images_per_s: float, compile_s: float | None) -> dict[str, Any]:
        summary = {
            "name": self.cfg.name,
            "val_top1": self.last_eval.get("val_top1", 0.0),
            "val_top5": self.last_eval.get("val_top5", 0.0),
            "best_val_top1": self.best_top1,
            "images_per_s": images_per_s,
            "wall_s": wall_s,
            "epochs": self.epoch,
            "steps": self.step,
            "params": count_parameters(self.model),
            "checkpoint": str(self.run_dir / "last.pt"),
            "best_checkpoint": str(self.run_dir / "best.pt"),
            "device": str(self.device),
            "precision": self.precision.resolved.label,
            **self._scaler_fields(),
        }
        if compile_s is not None:
            summary["compile_s"] = compile_s
        return summary
