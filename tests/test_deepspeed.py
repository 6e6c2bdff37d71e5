"""The DeepSpeed engine on 2 gloo ranks: ZeRO stages 0-3 train the digits recipe like the native engine."""

from __future__ import annotations

import pytest

pytest.importorskip("deepspeed", reason="DeepSpeed is not installed: pip install 'vitrain[deepspeed]'")

import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from torch.multiprocessing.spawn import ProcessRaisedException  # noqa: E402

from tests.conftest import reseal_with_checksums, run_cli  # noqa: E402
from tests.distributed_helpers import free_port, losses, run_two_ranks, torchrun_env  # noqa: E402
from tests.face.helpers import face_config, make_faces  # noqa: E402
from vitrain import checkpoint as ckpt  # noqa: E402
from vitrain.cli import main  # noqa: E402
from vitrain.config import CONFIG_DIR, load_config  # noqa: E402
from vitrain.engine import Trainer  # noqa: E402
from vitrain.engine.deepspeed import UNIVERSAL_DIR, consolidated_state_dict, universal_checkpoint  # noqa: E402
from vitrain.errors import CheckpointError, ConfigError  # noqa: E402
from vitrain.models import create_model  # noqa: E402

# run name -> parallel.strategy, which picks the ZeRO stage. Stage 1 runs DeepSpeed's stage-1-and-2 optimizer like
# stage 2 (partitioned optimizer states, not gradients): the default suite trains 0, 2 and 3, a slow test stage 1.
STAGES = {f"deepspeed_stage{stage}": strategy for stage, strategy in ((0, "ddp"), (2, "zero2"), (3, "zero3"))}


def digits(out_dir, name: str, *overrides: str):
    """The digits recipe for 5 steps in fp32: exactly comparable between engines and machines."""
    return load_config(
        CONFIG_DIR / "digits.yaml",
        [
            f"name={name}",
            f"log.out_dir={out_dir}",
            "log.every_steps=1",
            "log.progress=false",
            "train.max_steps=5",
            "train.threads=1",
            "precision.mode=fp32",
            *overrides,
        ],
    )


# A user's DeepSpeed JSON: vitrain fills the "auto" values; the keys it does not map reach DeepSpeed as written.
USER_JSON = {
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "train_batch_size": "auto",
    "gradient_clipping": "auto",
    "zero_optimization": {"stage": "auto", "overlap_comm": False, "reduce_bucket_size": 1000000},
    "bf16": {"enabled": "auto"},
}


def _train_engines(out_dir):
    Trainer(digits(out_dir, "native_ddp", "parallel.strategy=ddp")).fit()
    for name, strategy in STAGES.items():
        Trainer(digits(out_dir, name, "train.engine=deepspeed", f"parallel.strategy={strategy}")).fit()
    user = f"train.deepspeed_config={out_dir / 'ds.json'}"
    Trainer(digits(out_dir, "deepspeed_user_json", "train.engine=deepspeed", "parallel.strategy=zero2", user)).fit()
    # 64 images a rank as one batch and as 2 micro-batches, without the random crops (drawn per batch)
    for name, batch, accum in (("deepspeed_64x1", 64, 1), ("deepspeed_32x2", 32, 2)):
        grouped = (f"train.batch_size={batch}", f"train.accum_steps={accum}", "data.crop_padding=0")
        Trainer(digits(out_dir, name, "train.engine=deepspeed", "parallel.strategy=zero2", *grouped)).fit()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("deepspeed")
    (out_dir / "ds.json").write_text(json.dumps(USER_JSON))
    run_two_ranks(_train_engines, out_dir)
    return out_dir


@pytest.mark.parametrize("name", list(STAGES))
def test_deepspeed_stage_gives_the_native_engines_losses_on_two_ranks(runs, name):
    reference = losses(runs / "native_ddp")
    got = losses(runs / name)
    assert sorted(got) == sorted(reference) == [1, 2, 3, 4, 5]
    for step, loss in reference.items():
        assert got[step] == pytest.approx(loss, abs=1e-4), f"{name} step {step}"
    assert len({round(v, 6) for v in reference.values()}) > 1  # training moved


def test_an_accumulated_deepspeed_step_logs_the_loss_of_its_whole_batch(runs):
    # DeepSpeed counts the micro-steps itself; the step's loss is still the mean over them, as one batch of 64 logs.
    # Before, the last micro-batch's loss alone.
    reference, got = losses(runs / "deepspeed_64x1"), losses(runs / "deepspeed_32x2")
    assert sorted(got) == sorted(reference) == [1, 2, 3, 4, 5]
    for step, loss in reference.items():
        assert got[step] == pytest.approx(loss, abs=1e-5), f"step {step}"


def _train_stage1(out_dir):
    Trainer(digits(out_dir, "deepspeed_stage1", "train.engine=deepspeed", "parallel.strategy=zero1")).fit()


@pytest.mark.slow
def test_deepspeed_stage1_gives_the_native_engines_losses_on_two_ranks(runs, tmp_path):
    run_two_ranks(_train_stage1, tmp_path)
    reference, got = losses(runs / "native_ddp"), losses(tmp_path / "deepspeed_stage1")
    assert sorted(got) == sorted(reference) == [1, 2, 3, 4, 5]
    for step, loss in reference.items():
        assert got[step] == pytest.approx(loss, abs=1e-4), f"step {step}"


def test_a_run_from_a_user_json_gets_vitrains_values_and_the_files_own_keys_on_two_ranks(runs):
    reference, got = losses(runs / "native_ddp"), losses(runs / "deepspeed_user_json")
    assert sorted(got) == sorted(reference)
    for step, loss in reference.items():
        assert got[step] == pytest.approx(loss, abs=1e-4), f"step {step}"
    meta = ckpt.read_meta(next((runs / "deepspeed_user_json" / "checkpoints").glob("step_*")))
    config = meta["precision"]["deepspeed_config"]
    assert config["zero_optimization"] == {"stage": 2, "overlap_comm": False, "reduce_bucket_size": 1000000}
    assert config["train_micro_batch_size_per_gpu"] * 2 == config["train_batch_size"]


def _train_command(out_dir):
    """`vitrain train` under ZeRO-3 as torchrun would run it, each rank's stdout and stderr (its file descriptors,
    where DeepSpeed's and torch's own writes land too) in files of its own, and the number of numactl probes of
    DeepSpeed's CPU accelerator after deepspeed.initialize in a third."""
    import deepspeed
    import deepspeed.utils.numa as numa

    rank = os.environ["RANK"]
    probes, probe, initialize = [], numa.get_numa_cores, deepspeed.initialize
    numa.get_numa_cores = lambda: probes.append(1) or probe()

    def initialize_then_count(*args, **kwargs):
        engine = initialize(*args, **kwargs)
        probes.clear()
        return engine

    deepspeed.initialize = initialize_then_count  # this spawned process only
    with open(out_dir / f"rank{rank}.out", "w") as out, open(out_dir / f"rank{rank}.err", "w") as err:
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        args = ["train", "digits", f"log.out_dir={out_dir}", "name=command", "train.engine=deepspeed"]
        args += ["parallel.strategy=zero3", "train.max_steps=3", "train.threads=1", "precision.mode=fp32"]
        args += ["model.width=64", "model.depth=2", "log.progress=false"]
        try:
            assert main(args) == 0
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
    (out_dir / f"rank{rank}.numactl").write_text(str(len(probes)))
    (out_dir / f"rank{rank}.shm_op").write_text(repr(deepspeed.comm.comm.cdb.shm_comm_op))


SHM = Path("/dev/shm")


@pytest.fixture(scope="module")
def command(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("deepspeed_command")
    shm_before = set(SHM.glob("deepspeed_*")) if SHM.is_dir() else set()
    run_two_ranks(_train_command, out_dir)
    files = {path.name: path.read_text() for path in out_dir.glob("rank*")}
    files["new shm"] = set(SHM.glob("deepspeed_*")) - shm_before if SHM.is_dir() else set()
    for path in files["new shm"]:  # a failure's 66 MB per rank of memory, freed
        path.unlink()
    return files


# slow: 18 s on a Zen 4 (a whole zero3 command for its stderr)
@pytest.mark.slow
def test_a_zero3_run_prints_no_deprecation_of_the_torch_collectives_deepspeed_calls(command):
    assert "is deprecated" not in command["rank0.err"] + command["rank1.err"]
    assert "precision fp32" in command["rank0.err"]  # rank 0's log is in the file


def test_the_stdout_of_a_deepspeed_train_command_is_rank_0s_json_summary_alone(command):
    assert json.loads(command["rank0.out"])["engine"] == "deepspeed"
    assert command["rank1.out"] == ""


def test_deepspeeds_inference_comm_op_is_neither_compiled_nor_loaded_for_training(command):
    # Compiling it took 35-50 s of a first DeepSpeed run on 2 cores, for an all-reduce only inference calls.
    assert command["rank0.shm_op"] == command["rank1.shm_op"] == "None"


def test_zero3_steps_start_no_numactl_subprocess_and_leave_no_shared_memory(command):
    assert command["rank0.numactl"] == command["rank1.numactl"] == "0"
    assert command["new shm"] == set()  # DeepSpeed's shm op, had it started with LOCAL_SIZE set, never unlinks it


PROBE_SEED = 7  # the fixed images whose logits the exported weights must reproduce


def _probe_images():
    return torch.randn(4, 1, 16, 16, generator=torch.Generator().manual_seed(PROBE_SEED))


def _train_and_probe(out_dir, name: str, *overrides: str) -> None:
    """Train on 2 ranks; rank 0 keeps the engine's full fp32 weights and its logits on the probe images."""
    trainer = Trainer(digits(out_dir, name, "train.engine=deepspeed", *overrides))
    trainer.fit()
    state = trainer.engine.full_state_dict()  # collective
    trainer.forward.eval()
    with torch.no_grad():
        logits = trainer.forward(_probe_images())  # collective under ZeRO-3
    if torch.distributed.get_rank() == 0:
        torch.save({"state": state, "logits": logits}, out_dir / f"{name}.probe.pt")


def _train_checkpointed(out_dir):
    for strategy in ("ddp", "zero3"):
        _train_and_probe(out_dir, f"export_{strategy}", f"parallel.strategy={strategy}")
    # The same run straight through 6 steps, and stopped at 3 then resumed to 6.
    Trainer(digits(out_dir, "straight", "train.engine=deepspeed", "parallel.strategy=zero2", "train.max_steps=6")).fit()
    first = digits(out_dir, "resumed", "train.engine=deepspeed", "parallel.strategy=zero2", "train.max_steps=3")
    Trainer(first).fit()
    later = digits(out_dir, "resumed", "train.engine=deepspeed", "parallel.strategy=zero2", "train.max_steps=6")
    Trainer(later, resume=True).fit()


@pytest.fixture(scope="module")
def checkpointed(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("deepspeed_checkpoints")
    run_two_ranks(_train_checkpointed, out_dir)
    return out_dir


@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
def test_export_turns_a_deepspeed_checkpoint_into_fp32_weights_with_the_same_logits(checkpointed, tmp_path, strategy):
    run = checkpointed / f"export_{strategy}"
    probe = torch.load(checkpointed / f"export_{strategy}.probe.pt", weights_only=True)
    assert main(["export", str(run), str(tmp_path)]) == 0
    exported = load_file(str(tmp_path / "model.safetensors"))
    assert exported.keys() == probe["state"].keys()
    for name, tensor in probe["state"].items():
        assert exported[name].dtype == torch.float32
        torch.testing.assert_close(exported[name], tensor, rtol=0, atol=0, msg=name)
    cfg = digits(checkpointed, "export_check")
    model = create_model(cfg.model)
    model.load_state_dict(exported)
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(_probe_images()), probe["logits"], rtol=0, atol=1e-6)


def test_export_of_a_zero_checkpoint_shows_deepspeeds_progress_only_when_the_conversion_fails(
    checkpointed, tmp_path, capsys
):
    run = checkpointed / "export_zero3"
    assert main(["export", str(run), str(tmp_path / "export")]) == 0
    assert capsys.readouterr().err == ""
    step_dir = next((run / "checkpoints").glob("step_*"))
    shutil.copytree(step_dir, tmp_path / step_dir.name)
    (tmp_path / step_dir.name / ckpt.DEEPSPEED_DIR / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    with pytest.raises(ValueError, match=r"Expected 2 of '\*_optim_states.pt'"):
        consolidated_state_dict(tmp_path / step_dir.name, ckpt.read_meta(step_dir))
    assert "Processing zero checkpoint" in capsys.readouterr().err


def test_a_resumed_deepspeed_run_continues_the_losses_of_an_uninterrupted_one(checkpointed):
    straight, resumed = losses(checkpointed / "straight"), losses(checkpointed / "resumed")
    assert sorted(resumed) == sorted(straight) == [1, 2, 3, 4, 5, 6]
    for step in (4, 5, 6):
        assert resumed[step] == pytest.approx(straight[step], abs=1e-6), f"step {step}"


def _one_process(job, *args) -> None:
    """Run `job(*args)` in one spawned process with torchrun's variables (world size 1): its process group and
    DeepSpeed's state end with it instead of staying in the test process."""
    mp.spawn(_one_process_worker, args=(free_port(), job, args), nprocs=1, join=True)


def _one_process_worker(rank: int, port: int, job, args: tuple) -> None:
    os.environ.update(torchrun_env(rank, port, world_size=1))
    from vitrain.parallel import shutdown

    try:
        job(*args)
    finally:
        shutdown()


def _resume_on_one_rank(out_dir, name: str, strategy: str, max_steps: int) -> None:
    """Resume run `name` (saved on 2 ranks) in one process for 2 more steps; keep the weights DeepSpeed loaded,
    before any step changes them."""
    from vitrain.engine.deepspeed import DeepSpeedEngine

    loaded: dict[str, torch.Tensor] = {}
    load = DeepSpeedEngine.load

    def load_and_keep(self, path, meta):
        restored = load(self, path, meta)
        loaded.update(self.full_state_dict())
        return restored

    DeepSpeedEngine.load = load_and_keep  # this spawned process only
    cfg = digits(
        out_dir, name, "train.engine=deepspeed", f"parallel.strategy={strategy}", f"train.max_steps={max_steps}"
    )
    Trainer(cfg, resume=True).fit()
    torch.save(loaded, out_dir / f"{name}.loaded.pt")


UNIVERSAL = [pytest.param("resumed", "zero2", 6, marks=pytest.mark.slow), ("export_zero3", "zero3", 5)]


@pytest.mark.parametrize(("name", "strategy", "saved_step"), UNIVERSAL)
def test_a_zero_checkpoint_of_two_ranks_resumes_on_one_through_deepspeeds_universal_checkpoint(
    checkpointed, tmp_path, name, strategy, saved_step
):
    shutil.copytree(checkpointed / name, tmp_path / name)
    step_dir = tmp_path / name / "checkpoints" / f"step_{saved_step:08d}"
    saved = consolidated_state_dict(step_dir, ckpt.read_meta(step_dir))  # the 2 ranks' fp32 masters, merged
    before = losses(tmp_path / name)
    _one_process(_resume_on_one_rank, tmp_path, name, strategy, saved_step + 2)
    loaded = torch.load(tmp_path / f"{name}.loaded.pt", weights_only=True)
    assert loaded.keys() == saved.keys()
    for key, tensor in saved.items():
        torch.testing.assert_close(loaded[key], tensor, rtol=0, atol=1e-6, msg=key)
    assert (step_dir / UNIVERSAL_DIR / ckpt.DEEPSPEED_DIR / "zero").is_dir()
    after = losses(tmp_path / name)
    # One rank sees half the global batch of two, so the new losses are not the 2-rank run's: they are finite and
    # continue from the saved step.
    assert sorted(after) == [*range(1, saved_step + 3)]
    assert all(after[step] == before[step] for step in before)
    assert all(math.isfinite(after[step]) for step in (saved_step + 1, saved_step + 2))
    meta = ckpt.read_meta(tmp_path / name / "checkpoints" / f"step_{saved_step + 2:08d}")
    assert meta["world_size"] == 1 and meta["step"] == saved_step + 2


def test_a_folder_deepspeeds_converter_cannot_convert_is_refused_naming_it_and_leaves_nothing(checkpointed, tmp_path):
    step_dir = next((checkpointed / "export_ddp" / "checkpoints").glob("step_*"))
    shutil.copytree(step_dir, tmp_path / step_dir.name)  # stage 0: no ZeRO optimizer partitions to convert
    with pytest.raises(CheckpointError, match=r"universal checkpoint conversion .* failed \(FileNotFoundError"):
        universal_checkpoint(tmp_path / step_dir.name)
    assert sorted(p.name for p in (tmp_path / step_dir.name).iterdir()) == sorted(p.name for p in step_dir.iterdir())


def _native_then_deepspeed(out_dir):
    Trainer(digits(out_dir, "native", "parallel.strategy=ddp", "train.max_steps=1")).fit()
    cfg = digits(out_dir, "native", "train.engine=deepspeed", "parallel.strategy=ddp")
    Trainer(cfg, resume=str(out_dir / "native")).fit()


@pytest.mark.slow  # the library test below runs one process without torchrun twice in the default suite
def test_a_deepspeed_run_of_one_process_without_torchrun_trains(tmp_path, monkeypatch):
    # `python -m vitrain train ... train.engine=deepspeed` without a launcher: DeepSpeed asserts that LOCAL_RANK is
    # set; vitrain sets it as torchrun would for one process, in the one-process group it opens.
    for name in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    args = [
        "train",
        "digits",
        f"log.out_dir={tmp_path}",
        "name=plain",
        "train.engine=deepspeed",
        "parallel.strategy=zero2",
    ]
    done = run_cli(*args, "train.max_steps=2", "train.threads=1", "precision.mode=fp32", "model.depth=1")
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-2000:]
    summary = json.loads(done.stdout)
    assert (summary["engine"], summary["world_size"], summary["steps"]) == ("deepspeed", 1, 2)


# Library calls without torchrun, two in one process: vitrain sets LOCAL_RANK (and LOCAL_SIZE on CPU) for DeepSpeed,
# which reads them all run; once the trainer is closed they are gone again, else a later run in the process looked
# launched by torchrun. The second run failed at its start (DeepSpeed kept the first run's process group, which
# vitrain had ended). The second trains the conv stem's BatchNorms in bf16: DeepSpeed 0.19 casts their weights and
# not their running statistics, which torch's batch_norm refused at the first step; they now normalize in fp32.
LIBRARY_RUN = """
import json, os, sys
import vitrain
for strategy, more in (("zero3", []), ("zero2", ["precision.mode=amp_o2", "model.patch_embed=conv"])):
    summary = vitrain.train("digits", [*sys.argv[1:], f"name={strategy}", f"parallel.strategy={strategy}", *more])
    print(json.dumps({"steps": summary["steps"], "val_loss": summary["val_loss"] < 3,
                      **{k: os.environ.get(k) for k in ("LOCAL_RANK", "LOCAL_SIZE")}}))
"""


def test_library_runs_without_torchrun_train_one_after_another_and_leave_no_launcher_variables(tmp_path, monkeypatch):
    for name in ("LOCAL_RANK", "LOCAL_SIZE", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    args = [f"log.out_dir={tmp_path}", "train.engine=deepspeed", "train.max_steps=2", "train.threads=1",
            "precision.mode=fp32", "model.depth=1", "log.progress=false"]  # fmt: skip
    done = subprocess.run([sys.executable, "-c", LIBRARY_RUN, *args], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    printed = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert printed == [{"steps": 2, "val_loss": True, "LOCAL_RANK": None, "LOCAL_SIZE": None}] * 2


def test_deepspeed_on_several_processes_without_local_rank_is_refused_in_one_line(monkeypatch):
    from vitrain.engine.deepspeed import _local_rank_for_deepspeed
    from vitrain.parallel.distributed import DistInfo

    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("OMPI_COMM_WORLD_LOCAL_RANK", raising=False)
    two = DistInfo(1, 2, 0, torch.device("cpu"), data_rank=1, data_size=2)
    with pytest.raises(ConfigError, match=r"^train.engine=deepspeed on 2 processes needs LOCAL_RANK .*: launch with "):
        _local_rank_for_deepspeed(two)
    assert "LOCAL_RANK" not in os.environ


# slow: 13 s on a Zen 4
@pytest.mark.slow
def test_a_native_checkpoint_is_refused_by_the_deepspeed_engine(tmp_path):
    with pytest.raises(ProcessRaisedException, match=r"written by train.engine=native; resume it with train.engine="):
        _one_process(_native_then_deepspeed, tmp_path)


class _RunsCode:
    """Unpickling this calls a function: what a crafted checkpoint file would do."""

    def __reduce__(self):
        return (os.makedirs, (str(Path(os.environ["VITRAIN_TEST_MARKER"])),))


def test_a_deepspeed_file_whose_pickle_would_run_code_is_refused_before_it_is_read(checkpointed, tmp_path, monkeypatch):
    run = tmp_path / "crafted"
    shutil.copytree(checkpointed / "export_ddp", run)
    marker = tmp_path / "code-ran"
    monkeypatch.setenv("VITRAIN_TEST_MARKER", str(marker))
    states = next(run.glob(f"checkpoints/*/{ckpt.DEEPSPEED_DIR}/mp_rank_00_model_states.pt"))
    torch.save({"module": {}, "payload": _RunsCode()}, states)
    reseal_with_checksums(states.parent.parent)  # else refused as damaged, before its pickle is looked at
    result = run_cli("export", str(run), str(tmp_path / "out"), warnings="")
    assert result.returncode == 2 and f"checkpoint file {states} holds more than tensors" in result.stderr
    assert not marker.exists() and not (tmp_path / "out" / "model.safetensors").exists()


def test_a_damaged_deepspeed_file_is_one_line_without_torchs_note_on_its_pickle_protocol(checkpointed, tmp_path):
    run = tmp_path / "damaged"
    shutil.copytree(checkpointed / "export_ddp", run)
    states = next(run.glob(f"checkpoints/*/{ckpt.DEEPSPEED_DIR}/mp_rank_00_model_states.pt"))
    states.write_bytes(b"\x80" * 4096)  # read as a pickle of protocol 128, which torch warns of beside its error
    reseal_with_checksums(states.parent.parent)
    result = run_cli("export", str(run), str(tmp_path / "out"), warnings="")
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert f"checkpoint file {states} cannot be read" in result.stderr


# ---------------------------------------------------------------------------------------------- face task

ORL = Path("/work/shared/data/orl-faces.zip")
FACE_STAGES = ("ddp", "zero1", "zero2", "zero3")  # ZeRO stages 0-3


def _face_runs(out_dir, root):
    """The face task's sharded identity head on 2 ranks: native ddp, DeepSpeed stages 0-3, and ZeRO-2 stopped at
    step 3 then resumed from its checkpoint (head rows included)."""
    two = {"batch_size": 8}
    Trainer(face_config(out_dir, root, "face_native", parallel={"strategy": "ddp"}, train=two)).fit()
    for strategy in FACE_STAGES:
        ds = {"strategy": strategy}
        Trainer(
            face_config(out_dir, root, f"face_ds_{strategy}", parallel=ds, train={**two, "engine": "deepspeed"})
        ).fit()
    first = face_config(
        out_dir,
        root,
        "face_ds_resumed",
        parallel={"strategy": "zero2"},
        train={**two, "engine": "deepspeed", "max_steps": 3},
    )
    Trainer(first).fit()
    later = face_config(
        out_dir, root, "face_ds_resumed", parallel={"strategy": "zero2"}, train={**two, "engine": "deepspeed"}
    )
    Trainer(later, resume=True).fit()


@pytest.fixture(scope="module")
def face_runs(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("deepspeed_face")
    root = make_faces(out_dir / "faces")
    run_two_ranks(_face_runs, out_dir, root)
    return out_dir


@pytest.mark.slow  # the default suite trains the face-orl recipe under DeepSpeed (below)
@pytest.mark.parametrize("strategy", FACE_STAGES)
def test_the_face_task_with_a_deepspeed_backbone_and_the_sharded_head_gives_the_native_losses(face_runs, strategy):
    reference, got = losses(face_runs / "face_native"), losses(face_runs / f"face_ds_{strategy}")
    assert sorted(got) == sorted(reference) == [1, 2, 3, 4, 5, 6]
    for step, loss in reference.items():
        assert got[step] == pytest.approx(loss, abs=1e-4), f"step {step}"
    assert len({round(v, 6) for v in reference.values()}) > 1  # training moved


@pytest.mark.slow
def test_a_deepspeed_face_checkpoint_holds_the_head_by_identity_row_and_resumes(face_runs):
    step3 = face_runs / "face_ds_resumed" / "checkpoints" / "step_00000003"
    index = ckpt.read_index(step3)
    assert tuple(index["head.weight"].size) == (5, 16) and tuple(index["head.state.exp_avg"].size) == (5, 16)
    assert (step3 / ckpt.DEEPSPEED_DIR).is_dir()
    straight, resumed = losses(face_runs / "face_ds_zero2"), losses(face_runs / "face_ds_resumed")
    for step in (4, 5, 6):
        assert resumed[step] == pytest.approx(straight[step], abs=1e-6), f"step {step}"


def _orl_steps(out_dir):
    overrides = ["train.engine=deepspeed", "parallel.strategy=zero2", "train.max_steps=3", "train.epochs=1"]
    overrides += [f"data.root={ORL}", f"log.out_dir={out_dir}", "log.every_steps=1", "log.progress=false"]
    Trainer(load_config(CONFIG_DIR / "face-orl.yaml", overrides)).fit()


# slow: 33 s on a Zen 4; the face task under DeepSpeed runs in the default suite with synthetic faces (face_runs)
@pytest.mark.slow
@pytest.mark.skipif(not ORL.is_file(), reason=f"the ORL faces are not at {ORL}")
def test_the_face_orl_recipe_trains_under_deepspeed_with_the_sharded_head_on_two_ranks(tmp_path):
    run_two_ranks(_orl_steps, tmp_path)
    got = losses(tmp_path / "face-orl")
    assert sorted(got) == [1, 2, 3] and all(math.isfinite(v) for v in got.values())
    summary = json.loads((tmp_path / "face-orl" / "summary.json").read_text())
    assert summary["engine"] == "deepspeed" and summary["task"] == "face"


@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
def test_eval_reads_a_deepspeed_run_and_prints_its_metrics(checkpointed, capsys, strategy):
    run = checkpointed / f"export_{strategy}"
    assert main(["eval", str(run)]) == 0
    printed = json.loads(capsys.readouterr().out)
    summary = json.loads((run / "summary.json").read_text())  # the run's own evaluation, on 2 ranks
    assert printed["step"] == summary["steps"] == 5
    assert printed["val_top1"] == pytest.approx(summary["val_top1"], abs=1e-9)
    assert printed["val_loss"] == pytest.approx(summary["val_loss"], abs=1e-5)


def _lr_find_under_deepspeed(out_dir):
    overrides = [f"log.out_dir={out_dir}", "train.engine=deepspeed", "parallel.strategy=zero2", "precision.mode=fp32"]
    overrides += ["train.threads=1", "log.progress=false"]
    assert main(["lr-find", "digits", *overrides, "--steps", "8", "--start", "1e-5", "--end", "1", "--out",
                 str(out_dir / "lr-find")]) == 0  # fmt: skip


@pytest.mark.slow
def test_lr_find_runs_under_deepspeed_on_two_ranks(tmp_path):
    run_two_ranks(_lr_find_under_deepspeed, tmp_path)
    rows = (tmp_path / "lr-find" / "lr_find.csv").read_text().splitlines()
    assert rows[0] == "lr,loss,smoothed_loss" and 3 <= len(rows) - 1 <= 8
    lrs = [float(row.split(",")[0]) for row in rows[1:]]
    assert lrs[0] == pytest.approx(1e-5) and lrs == sorted(lrs)


def _resume_with_another_weight_decay(out_dir) -> None:
    """Train 2 steps under optim.weight_decay=0.05, resume for a third with 0.1; keep the groups' weight decay as
    DeepSpeed's load leaves them."""
    from vitrain.engine.deepspeed import DeepSpeedEngine

    seen: list[float] = []
    load = DeepSpeedEngine.load

    def load_and_look(self, path, meta):
        restored = load(self, path, meta)
        seen.extend(group["weight_decay"] for group in self.optimizer.param_groups)
        return restored

    DeepSpeedEngine.load = load_and_look  # this spawned process only
    run = ("train.engine=deepspeed", "parallel.strategy=zero2", "model.depth=1")
    Trainer(digits(out_dir, "decay", *run, "train.max_steps=2", "optim.weight_decay=0.05")).fit()
    Trainer(digits(out_dir, "decay", *run, "train.max_steps=3", "optim.weight_decay=0.1"), resume=True).fit()
    (out_dir / "seen.json").write_text(json.dumps(seen))


def test_optim_values_given_on_resume_hold_under_deepspeed_as_under_the_native_engine(tmp_path):
    # DeepSpeed's load put the saved groups' values back: optim.weight_decay=0.1 given on resume ran at 0.05.
    _one_process(_resume_with_another_weight_decay, tmp_path)
    seen = json.loads((tmp_path / "seen.json").read_text())
    assert sorted(set(seen)) == [0.0, 0.1]  # the parameters without decay (norms, biases) and the rest
    assert losses(tmp_path / "decay").keys() == {1, 2, 3}


FROZEN = "blocks.0.attn.qkv.weight"  # frozen on resume by a model handed in


def _resume_through_the_universal_checkpoint(out_dir) -> None:
    """ZeRO-3 with the conv stem (BatchNorm) straight through 5 steps, and stopped at 3 then resumed through
    DeepSpeed's universal checkpoint (the route another world size, grouping or weights dtype takes; forced here with
    nothing else changed). Then ZeRO-2 stopped at 3 and resumed with FROZEN no longer trained (its own route there).
    Keeps the whole state (parameters and buffers) each resume loaded, before any step changes it."""
    from vitrain.engine.deepspeed import DeepSpeedEngine

    load, loaded = DeepSpeedEngine.load, {}

    def load_and_keep(self, path, meta):
        restored = load(self, path, meta)
        loaded[self.cfg.name] = self.full_state_dict()
        return restored

    def frozen_on_resume(model_cfg):
        model = create_model(model_cfg)
        model.get_parameter(FROZEN).requires_grad_(False)
        return model

    DeepSpeedEngine.load = load_and_keep  # this spawned process only
    run = ("train.engine=deepspeed", "parallel.strategy=zero3", "model.depth=1", "model.patch_embed=conv")
    Trainer(digits(out_dir, "straight", *run)).fit()
    Trainer(digits(out_dir, "resumed", *run, "train.max_steps=3")).fit()
    regrouped = DeepSpeedEngine._regrouped
    DeepSpeedEngine._regrouped = lambda self, path, meta: True
    Trainer(digits(out_dir, "resumed", *run), resume=True).fit()
    DeepSpeedEngine._regrouped = regrouped
    run = ("train.engine=deepspeed", "parallel.strategy=zero2", "model.depth=1")
    Trainer(digits(out_dir, "frozen", *run, "train.max_steps=3")).fit()
    Trainer(digits(out_dir, "frozen", *run, "train.max_steps=4"), resume=True, model=frozen_on_resume).fit()
    torch.save(loaded, out_dir / "loaded.pt")


def test_a_run_resumed_through_the_universal_checkpoint_continues_the_uninterrupted_one(tmp_path):
    # DeepSpeed 0.19.8's ZeRO-3 universal load gave every sub-group's state one `step` tensor, which AdamW advanced
    # once per group: with two groups the resumed run counted 2 steps for each it took (step 5's loss 1e-3 off the
    # run straight through, its bias correction ahead). Each state now gets its own. And the universal load reads
    # only the trained parameters: BatchNorm's statistics and a parameter frozen on resume stayed as the new run
    # built them (0.15 and 2.7e-4 off); vitrain now loads them from the step folder.
    _one_process(_resume_through_the_universal_checkpoint, tmp_path)
    straight, resumed = losses(tmp_path / "straight"), losses(tmp_path / "resumed")
    assert sorted(resumed) == sorted(straight) == [1, 2, 3, 4, 5]
    for step in (4, 5):
        assert resumed[step] == pytest.approx(straight[step], abs=1e-6), f"step {step}"
    loaded = torch.load(tmp_path / "loaded.pt", weights_only=True)
    for name in ("resumed", "frozen"):
        step_dir = tmp_path / name / "checkpoints" / "step_00000003"
        assert (step_dir / UNIVERSAL_DIR).is_dir()
        saved = consolidated_state_dict(step_dir, ckpt.read_meta(step_dir))
        assert loaded[name].keys() == saved.keys()
        for key, tensor in saved.items():
            assert torch.equal(loaded[name][key], tensor), f"{name}: {key}"
    assert any("running_mean" in key for key in loaded["resumed"])
    assert losses(tmp_path / "frozen").keys() == {1, 2, 3, 4}


def _resume_changed(out_dir, strategies: tuple[str, ...], change: str, first: str = "precision.mode=fp32") -> None:
    """Per strategy: train 2 steps under `first`, then resume for a third with `change` (one that regroups the
    parameters or changes the weights' dtype). Keeps each parameter's fp32 master weight and optimizer state (AdamW's
    moments, SGD's momentum) as saved and as loaded, or the line refusing the resume."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    from vitrain.engine.deepspeed import DeepSpeedEngine

    def per_parameter(engine) -> dict[str, torch.Tensor]:
        optimizer = engine.optimizer
        if hasattr(optimizer, "_hp_optimizer_states_linked"):
            # DeepSpeed 0.19.8's ZeRO 1-2 links each parameter to its moments once, after the first group's first
            # step (when the later groups have none yet), and not after a load: linked here, or they read as missing.
            optimizer._hp_optimizer_states_linked = False
            optimizer._lazy_init_hp_params_optimizer_state()
        found = {}
        for name, param in engine.ds.module.named_parameters():
            found[f"{name}.fp32"] = safe_get_full_fp32_param(param).clone()
            for field in ("momentum_buffer",) if engine.cfg.optim.name == "sgd" else ("exp_avg", "exp_avg_sq"):
                found[f"{name}.{field}"] = safe_get_full_optimizer_state(param, field).clone()
        return found

    save, load = DeepSpeedEngine.save, DeepSpeedEngine.load
    kept: dict[str, dict[str, torch.Tensor]] = {}

    def save_and_keep(self, run_dir, step, meta, keep):
        if self.stage > 0 and "saved" not in kept:  # the step-2 checkpoint (stage 0: torch's optimizer)
            kept["saved"] = per_parameter(self)
        return save(self, run_dir, step, meta, keep)

    def load_and_keep(self, path, meta):
        restored = load(self, path, meta)
        kept["loaded"] = per_parameter(self)
        if self.stage < 3:  # the weights the forward computes with (stage 3's are partitioned)
            kept["module"] = {name: param.detach().clone() for name, param in self.ds.module.named_parameters()}
        return restored

    DeepSpeedEngine.save, DeepSpeedEngine.load = save_and_keep, load_and_keep  # this spawned process only
    for strategy in strategies:
        kept.clear()
        run = ("train.engine=deepspeed", f"parallel.strategy={strategy}", "model.depth=1", "log.every_steps=1")
        Trainer(digits(out_dir, strategy, *run, "train.max_steps=2", *first.split())).fit()
        config = (out_dir / strategy / "config.yaml").read_text()
        try:
            Trainer(digits(out_dir, strategy, *run, "train.max_steps=3", *change.split()), resume=True).fit()
        except CheckpointError as error:
            assert (out_dir / strategy / "config.yaml").read_text() == config  # refused before anything changed
            (out_dir / f"{strategy}.refused").write_text(str(error))
            continue
        torch.save(kept, out_dir / f"{strategy}.pt")


def _check_changed_resume(out_dir, strategy: str) -> None:
    kept = torch.load(out_dir / f"{strategy}.pt", weights_only=True)
    assert kept["loaded"].keys() == kept["saved"].keys()
    for key, saved in kept["saved"].items():
        assert torch.equal(kept["loaded"][key], saved), key
    for name, weight in kept.get("module", {}).items():  # the model's weights are the masters, in its dtype
        assert torch.equal(weight, kept["loaded"][f"{name}.fp32"].to(weight.dtype)), name
    assert losses(out_dir / strategy).keys() == {1, 2, 3}
    assert (out_dir / strategy / "checkpoints" / "step_00000002" / UNIVERSAL_DIR).is_dir()


def test_a_deepspeed_resume_with_other_parameter_groups_loads_each_parameters_state_or_says_why_not(tmp_path):
    # optim.weight_decay=0 puts every parameter in one group where the run saved two. DeepSpeed keeps its state by
    # group: its load failed on an unrelated setting ("parameter-alignment layout", stages 1-2) or a count of groups
    # (stages 0 and 3). Now stages 1-3 load through the universal checkpoint, parameter by parameter; stage 0, whose
    # state is indexed by position, is refused in one line naming the value changed (not optim.lr, changed as well,
    # which does not decide the groups).
    _one_process(_resume_changed, tmp_path, ("zero2", "ddp"), "optim.weight_decay=0 optim.lr=0.001")
    _check_changed_resume(tmp_path, "zero2")
    refused = (tmp_path / "ddp.refused").read_text()
    assert "state for optim.weight_decay=0.0 (saved with 0.05): resume with the values it was saved" in refused
    assert losses(tmp_path / "ddp").keys() == {1, 2}


@pytest.mark.slow
def test_more_parameter_groups_on_resume_load_under_deepspeed_stage_3_and_are_refused_under_stage_1(tmp_path):
    # optim.layer_decay=0.75: 6 groups where the run saved 2. Stage 3's universal load fills every group; stages 1-2's
    # pairs the saved groups with the first ones by index and left the other 4 without moments (a silent restart).
    _one_process(_resume_changed, tmp_path, ("zero3", "zero1"), "optim.layer_decay=0.75")
    _check_changed_resume(tmp_path, "zero3")
    refused = (tmp_path / "zero1.refused").read_text()
    assert "optim.layer_decay=0.75 (saved with 1.0)" in refused
    assert losses(tmp_path / "zero1").keys() == {1, 2}


def test_a_deepspeed_resume_between_bf16_and_fp32_weights_loads_the_fp32_masters_or_says_why_not(tmp_path):
    # precision.mode=auto resolves by the machine: a run started where bf16 wins and resumed where it does not trains
    # fp32 weights. DeepSpeed names its optimizer files by the weights' dtype and failed to find them
    # (FileNotFoundError, stages 1-3) or a key of another optimizer's state (KeyError, stage 0). Stages 1-3 now load
    # the fp32 masters and moments through the universal checkpoint; stage 0 is refused, naming the precision to
    # resume with.
    _one_process(_resume_changed, tmp_path, ("zero2", "ddp"), "precision.mode=fp32", "precision.mode=amp_o2")
    _check_changed_resume(tmp_path, "zero2")
    refused = (tmp_path / "ddp.refused").read_text()
    assert "holds DeepSpeed's state of bf16 weights and this run trains fp32 ones" in refused
    assert "resume with precision.mode=amp_o2 precision.dtype=bf16" in refused
    assert losses(tmp_path / "ddp").keys() == {1, 2}


@pytest.mark.slow
def test_deepspeed_stage_1_and_3_runs_of_fp32_weights_resume_in_bf16(tmp_path):
    _one_process(_resume_changed, tmp_path, ("zero1", "zero3"), "precision.mode=amp_o2")
    for strategy in ("zero1", "zero3"):
        _check_changed_resume(tmp_path, strategy)


@pytest.mark.slow
def test_a_deepspeed_sgd_run_regrouped_on_resume_is_refused_naming_what_to_resume_with(tmp_path):
    # DeepSpeed's universal converter reads AdamW's moments only: SGD's momentum stops it (KeyError: 'exp_avg'), and
    # the line said to resume "on the world size it was saved with", which had not changed.
    sgd = "precision.mode=fp32 optim.name=sgd"
    _one_process(_resume_changed, tmp_path, ("zero2",), f"{sgd} optim.weight_decay=0", sgd)
    refused = (tmp_path / "zero2.refused").read_text()
    assert "universal checkpoint conversion" in refused
    assert "resume with the optim.* values it was saved with" in refused
    assert not (tmp_path / "zero2" / "checkpoints" / "step_00000002" / UNIVERSAL_DIR).exists()


def _stub_engine(stage: int, groups: list[list[str]], dtype: str = "fp32"):
    """What DeepSpeedEngine's resume checks read of an engine: its stage, groups, DeepSpeed config and precision."""
    from types import SimpleNamespace

    strategy = {0: "ddp", 1: "zero1", 2: "zero2", 3: "zero3"}[stage]
    config = {section: {"enabled": dtype == section} for section in ("bf16", "fp16")}
    cfg = SimpleNamespace(parallel=SimpleNamespace(strategy=strategy), precision=SimpleNamespace(mode="auto"))
    return SimpleNamespace(stage=stage, groups=groups, config=config, cfg=cfg, resolved=SimpleNamespace(mode="fp32"))


TWO = [["a.weight", "b.weight"], ["a.bias", "b.bias"]]


@pytest.mark.parametrize(
    ("stage", "groups", "expected"),
    [
        (2, TWO, False),  # the same groups
        (2, [["a.weight", "b.weight", "a.bias", "b.bias"]], True),  # fewer: the universal checkpoint by name
        (1, [["a.weight"], ["b.weight", "a.bias", "b.bias"]], True),  # as many, other members
        (3, [["a.weight"], ["b.weight"], ["a.bias"], ["b.bias"]], True),  # more: stage 3 fills every group
        (2, [["a.weight"], ["b.weight"], ["a.bias", "b.bias"]], "into at most as many groups as it saved"),
        (0, [["a.weight", "b.weight", "a.bias", "b.bias"]], "by position in its groups"),
        (3, [["a.weight", "b.weight"], ["a.bias"]], True),  # b.bias frozen on resume: its state is left behind
        (1, [["a.weight", "b.weight"], ["a.bias"]], True),
        (0, [["a.weight", "b.weight"], ["a.bias"]], "it holds b.bias, which this run's model does not train (1 such)"),
        (2, [["a.weight", "b.weight", "c.weight"], TWO[1]], "this run's model trains c.weight, which it holds no"),
        (3, [["c.weight", "a.weight", "b.weight"], TWO[1]], "this run's model trains c.weight, which it holds no"),
    ],
)
def test_which_parameter_groups_deepspeed_resumes_into_and_the_line_refusing_the_rest(stage, groups, expected):
    from vitrain.engine.deepspeed import DeepSpeedEngine
    from vitrain.optim import GROUPED_BY

    meta = {"precision": {"param_groups": TWO}}
    if isinstance(expected, bool):
        assert DeepSpeedEngine._regrouped(_stub_engine(stage, groups), Path("ckpt"), meta) is expected
        return
    with pytest.raises(CheckpointError) as raised:
        DeepSpeedEngine._regrouped(_stub_engine(stage, groups), Path("ckpt"), meta)
    line = str(raised.value)
    assert expected in line and "\n" not in line
    if "position" in expected or "as many groups" in expected:  # runs.restore names the grouping optim.* changed
        assert isinstance(raised.value, ckpt.StateMismatch) and raised.value.shaped_by == GROUPED_BY
        assert line.endswith("or start a new run from its weights (`vitrain export`, then model.init_from=)")
    else:  # another model: no optim.* value gives its state back
        assert not isinstance(raised.value, ckpt.StateMismatch) and line.endswith("the model it was saved with")
    # checkpoints written before vitrain kept the groups are taken as the same
    assert DeepSpeedEngine._regrouped(_stub_engine(stage, groups), Path("ckpt"), {"precision": {}}) is False


@pytest.mark.parametrize(
    ("stage", "saved", "now", "expected"),
    [
        (2, "bf16", "bf16", None),
        (2, "bf16", "fp32", "bf16"),  # the universal checkpoint's fp32 tensors load into either
        (3, "fp32", "bf16", "fp32"),
        (0, "bf16", "fp32", "resume with precision.mode=amp_o2 precision.dtype=bf16"),  # another optimizer per dtype
        (2, "fp16", "bf16", "resume with precision.mode=amp_o2 precision.dtype=fp16"),  # the loss scale is not carried
        (1, "fp32", "fp16", "resume with precision.mode=fp32"),
    ],
)
def test_which_weight_dtypes_deepspeed_resumes_between_and_the_line_refusing_the_rest(stage, saved, now, expected):
    from vitrain.engine.deepspeed import DeepSpeedEngine

    meta = {"precision": {"deepspeed_config": _stub_engine(stage, TWO, saved).config}}
    engine = _stub_engine(stage, TWO, now)
    if expected is None or expected in ("bf16", "fp32"):
        assert DeepSpeedEngine._retyped(engine, Path("ckpt"), meta) == expected
    else:
        with pytest.raises(CheckpointError, match=f"holds DeepSpeed's state of {saved} weights.*{expected}$"):
            DeepSpeedEngine._retyped(engine, Path("ckpt"), meta)
    assert DeepSpeedEngine._retyped(engine, Path("ckpt"), {"precision": {}}) is None  # before vitrain kept the config


def test_deepspeed_fp16_on_an_accelerator_without_it_is_refused_in_one_line(tmp_path, capsys, monkeypatch):
    # DeepSpeed's CPU accelerator trains no fp16: its refusal was a ValueError traceback from inside initialize.
    from deepspeed.accelerator import get_accelerator

    monkeypatch.setattr(type(get_accelerator()), "is_fp16_supported", lambda self: False)
    args = ["train", "digits", f"log.out_dir={tmp_path}", "train.engine=deepspeed", "parallel.strategy=zero2",
            "precision.mode=amp_o2", "precision.dtype=fp16", "train.max_steps=1", "model.depth=1"]  # fmt: skip
    assert main(args) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("vitrain: error: precision.dtype=fp16 under train.engine=deepspeed: DeepSpeed's ")
    assert line.endswith("use precision.dtype=bf16, precision.mode=fp32, or train.engine=native")
