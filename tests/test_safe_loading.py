"""Loading a checkpoint never runs code: crafted meta and DCP files are refused in one line, their payload unrun."""

from __future__ import annotations

import json
import os
import pickle
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tests.conftest import run_cli
from tests.distributed_helpers import tiny_config
from vitrain import checkpoint as ckpt
from vitrain.engine import Trainer
from vitrain.errors import CheckpointError
from vitrain.weights import read_weights


class Payload:
    """Unpickling this runs a shell command that creates a file: proof that loading ran code."""

    def __init__(self, proof):
        self.proof = str(proof)

    def __reduce__(self):
        return (os.system, (f"touch {self.proof}",))


def reseal(step_dir):
    """Rewrite COMPLETE for the folder's current files, as an attacker who hands out a whole folder would."""
    files = {p.name: p.stat().st_size for p in step_dir.iterdir() if p.name != ckpt.COMPLETE_FILE}
    (step_dir / ckpt.COMPLETE_FILE).write_text(json.dumps({"step": 1, "files": files}))


@pytest.fixture
def step_dir(tmp_path):
    cfg = tiny_config(tmp_path / "runs", "victim", train={"max_steps": 1})
    Trainer(cfg).fit()
    return ckpt.latest(cfg.run_dir)


def test_pickled_payload_really_runs_when_unpickled(tmp_path):
    # The fixture's payload is live: plain pickle runs it (so the tests below prove something).
    proof = tmp_path / "ran"
    pickle.loads(pickle.dumps(Payload(proof)))
    assert proof.exists()


def _as_legacy_with(step_dir, meta_obj):
    """Turn a step folder into the earlier format (pickled meta.pt, no JSON meta, no marker) holding meta_obj."""
    (step_dir / ckpt.META_FILE).unlink()
    (step_dir / ckpt.COMPLETE_FILE).unlink()
    torch.save(meta_obj, step_dir / ckpt.LEGACY_META_FILE)  # how format 2 wrote it


def refused_line(command: str, step_dir, tmp_path) -> str:
    """Run a command that loads `step_dir` as a user would; it must exit 2 with one line on stderr: that line."""
    args = {
        "eval": ["eval", str(step_dir)],
        "export": ["export", str(step_dir), str(tmp_path / "out")],
        "resume": ["train", "log.progress=false", "--resume", str(step_dir)],
    }[command]
    result = run_cli(*args, warnings="")
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


@pytest.mark.parametrize("command", ["eval", "export", "resume"])
def test_a_crafted_meta_file_is_refused_and_its_command_never_runs(tmp_path, step_dir, command):
    proof = tmp_path / "ran"
    _as_legacy_with(step_dir, {"config": {}, "step": Payload(proof)})
    line = refused_line(command, step_dir, tmp_path)
    assert f"checkpoint file {step_dir / ckpt.LEGACY_META_FILE}" in line and "refusing to load it" in line
    assert not proof.exists()


@pytest.mark.parametrize("command", ["eval", "export", "resume"])
def test_a_crafted_dcp_metadata_file_is_refused_and_its_command_never_runs(tmp_path, step_dir, command):
    proof = tmp_path / "ran"
    with open(step_dir / ckpt.DCP_INDEX, "wb") as handle:
        pickle.dump(Payload(proof), handle)
    reseal(step_dir)
    assert f"checkpoint file {step_dir / ckpt.DCP_INDEX} refers to posix.system" in refused_line(
        command, step_dir, tmp_path
    )
    assert not proof.exists()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_crafted_value_inside_the_dcp_shards_is_refused_and_never_runs(tmp_path):
    # DCP stores non-tensor values (hyperparameters, step counts) as pickles in the .distcp files.
    proof = tmp_path / "ran"
    folder = tmp_path / "crafted"
    dcp.save({"model": {"w": torch.ones(2)}, "trap": Payload(proof)}, checkpoint_id=folder, no_dist=True)
    assert not proof.exists()  # saving pickled the object without running it
    wanted = {"model": {"w": torch.zeros(2)}, "trap": None}
    with pytest.raises(CheckpointError, match="an object that is not plain data"):
        ckpt.load_extra(folder, wanted)
    assert not proof.exists()


def test_a_checkpoint_of_the_earlier_format_is_read_without_unpickling_code(tmp_path, step_dir):
    meta = json.loads((step_dir / ckpt.META_FILE).read_text())
    _as_legacy_with(step_dir, {**meta, "format": 2, "rng": {"torch": torch.get_rng_state()}})
    assert ckpt.is_complete(step_dir)
    loaded = ckpt.read_meta(step_dir)
    assert loaded["step"] == meta["step"] and loaded["config"] == meta["config"]
    result = run_cli("eval", str(step_dir))
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["step"] == meta["step"]


def test_metadata_is_json_and_holds_no_pickle(step_dir):
    assert not (step_dir / ckpt.LEGACY_META_FILE).exists()
    meta = json.loads((step_dir / ckpt.META_FILE).read_text())
    assert meta["format"] == ckpt.FORMAT_VERSION and meta["step"] == 1


def test_a_tampered_shard_makes_the_checkpoint_incomplete(tmp_path, step_dir):
    shard = next(step_dir.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-10])
    with pytest.raises(CheckpointError, match="is incomplete"):
        ckpt.read_meta(step_dir)


# ---------------------------------------------------------------------------------------------- the audit's minor two


def test_a_shard_of_random_bytes_is_named_without_torchs_advice_to_load_it_unsafely(tmp_path, step_dir):
    shard = next(step_dir.glob("*.distcp"))
    shard.write_bytes(os.urandom(shard.stat().st_size))
    reseal(step_dir)
    line = refused_line("eval", step_dir, tmp_path)
    assert f"checkpoint file {shard} is not a checkpoint vitrain can load safely" in line
    assert "weights_only" not in line and len(line) < 300


def test_an_old_protocol_pickle_as_init_from_gives_its_error_and_no_torch_warning(tmp_path):
    proof, weights = tmp_path / "ran", tmp_path / "evil.pt"
    with open(weights, "wb") as handle:
        pickle.dump(Payload(proof), handle, protocol=4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(CheckpointError, match="model.init_from=.*evil.pt cannot be read"):
            read_weights(weights)
    assert not caught and not proof.exists()
