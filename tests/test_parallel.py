"""Every strategy trains exactly like one process: DDP, ZeRO-1, FSDP2 zero2/zero3, activation checkpointing, offload."""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
import weakref
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.conftest import TINY_MODEL, TRUNK_FIELDS, model_overrides
from tests.distributed_helpers import losses, run_two_ranks, tiny_config
from vitrain.config import load_config
from vitrain.engine import Trainer
from vitrain.errors import ConfigError
from vitrain.models import create_model
from vitrain.parallel import apply_activation_checkpointing, init_distributed, parallelize, shutdown
from vitrain.parallel.sync_batchnorm import sync_batchnorm

# name -> parallel section; all of them run in one spawned 2-process job.
VARIANTS = {
    "ddp": {"strategy": "ddp"},
    "zero1": {"strategy": "zero1"},
    "zero2_block": {"strategy": "zero2", "wrap": "block"},
    "zero2_model": {"strategy": "zero2", "wrap": "model"},
    "zero3_block": {"strategy": "zero3", "wrap": "block"},
    "zero3_model": {"strategy": "zero3", "wrap": "model"},
    "zero3_sublayer": {"strategy": "zero3", "wrap": "sublayer"},
    "zero3_ac_block": {"strategy": "zero3", "activation_checkpointing": "block"},
    "zero3_ac_every_k": {"strategy": "zero3", "activation_checkpointing": "every_k", "checkpoint_every_k": 2},
    "zero3_offload": {"strategy": "zero3", "offload": "params"},
    "zero3_no_prefetch": {"strategy": "zero3", "backward_prefetch": False},
    # Built on the meta device, each rank's shards drawn afterwards: the very same initial weights.
    "zero3_sharded_init": {"strategy": "zero3", "sharded_init": True},
    "zero2_sharded_init_offload": {"strategy": "zero2", "sharded_init": True, "offload": "params"},
}


# 70 synthetic images hold out 7 for validation: split over 2 ranks, one share is padded.
ODD_VAL = {"synthetic_samples": 70}


def _train_variants(out_dir):
    for name, parallel in VARIANTS.items():
        # Same global batch as the single-process run: 8 per rank x 2 ranks = 16.
        Trainer(tiny_config(out_dir, name, batch_size=8, parallel=parallel)).fit()
    Trainer(tiny_config(out_dir, "zero3_odd_val", batch_size=8, data=ODD_VAL, parallel={"strategy": "zero3"})).fit()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("parallel")
    Trainer(tiny_config(out_dir, "single")).fit()
    Trainer(tiny_config(out_dir, "single_odd_val", data=ODD_VAL)).fit()
    run_two_ranks(_train_variants, out_dir)
    return out_dir


@pytest.mark.parametrize("name", list(VARIANTS))
def test_two_ranks_match_one_process_for_five_steps(runs, name):
    reference = losses(runs / "single")
    got = losses(runs / name)
    assert sorted(got) == [1, 2, 3, 4, 5]
    for step, loss in reference.items():
        assert got[step] == pytest.approx(loss, abs=1e-5), f"{name} step {step}"
    # Training moved: the losses are not all the same number (a frozen model would also "match").
    assert len({round(v, 6) for v in reference.values()}) > 1


def _last_eval(run_dir) -> dict:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if "val_top1" in r][-1]


# two-rank run -> (one-process run, validation images): each rank evaluates its share, the counts are summed.
EVAL_PAIRS = {name: ("single", 6) for name in VARIANTS} | {"zero3_odd_val": ("single_odd_val", 7)}


@pytest.mark.parametrize("name", list(EVAL_PAIRS))
def test_two_ranks_evaluate_each_validation_sample_once_like_one_process(runs, name):
    single, samples = EVAL_PAIRS[name]
    reference, got = _last_eval(runs / single), _last_eval(runs / name)
    assert got["step"] == reference["step"] == 5
    assert got["val_samples"] == reference["val_samples"] == samples
    assert got["val_loss"] == pytest.approx(reference["val_loss"], abs=1e-5)
    assert got["val_top1"] == reference["val_top1"] and got["val_top5"] == reference["val_top5"]


def test_activation_checkpointing_keeps_gradients_and_names():
    four_blocks = dataclasses.replace(TINY_MODEL, depth=4)  # on 16x16 images in the default 16x16 patches
    cfg = load_config(overrides=model_overrides(four_blocks, (*TRUNK_FIELDS, "image_size")))
    torch.manual_seed(0)
    plain = create_model(cfg.model)
    checkpointed = create_model(cfg.model)
    checkpointed.load_state_dict(plain.state_dict())
    assert apply_activation_checkpointing(checkpointed.blocks, "every_k", every_k=3) == 2
    images = torch.randn(2, 3, 16, 16)
    plain(images).square().sum().backward()
    checkpointed(images).square().sum().backward()
    assert list(checkpointed.state_dict()) == list(plain.state_dict())
    for (name, a), (_, b) in zip(plain.named_parameters(), checkpointed.named_parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_offload_params_needs_an_fsdp_strategy():
    with pytest.raises(ConfigError, match="parallel.offload=params needs parallel.strategy=zero2 or zero3"):
        load_config(overrides=["parallel.strategy=ddp", "parallel.offload=params"])


def test_unknown_strategy_suggests_the_closest():
    with pytest.raises(ConfigError, match="did you mean zero3"):
        load_config(overrides=["parallel.strategy=zer03"])


def test_optimizer_only_offload_is_refused_with_the_alternative():
    with pytest.raises(ConfigError, match="use parallel.offload=params with parallel.strategy=zero2 or zero3"):
        load_config(overrides=["parallel.strategy=zero3", "parallel.offload=optimizer"])


def test_several_processes_with_strategy_single_are_refused(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="2 processes were launched but parallel.strategy=single"):
        init_distributed(torch.device("cpu"), "single")


def test_more_processes_on_a_node_than_gpus_are_refused_naming_the_rank(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ConfigError, match=r"LOCAL_RANK=1 needs GPU 1 but this node has 1: launch at most one process"):
        init_distributed(torch.device("cuda"), "ddp")


def test_sharded_init_needs_an_fsdp_strategy():
    with pytest.raises(ConfigError, match="parallel.sharded_init=true draws FSDP2 shards, but parallel.strategy=ddp"):
        load_config(overrides=["parallel.strategy=ddp", "parallel.sharded_init=true"])
    with pytest.raises(ConfigError, match="parallel.sharded_init=true under train.engine=deepspeed"):
        load_config(overrides=["parallel.strategy=zero3", "parallel.sharded_init=true", "train.engine=deepspeed"])


@pytest.mark.parametrize("overrides", [[], ["model.pool=gap", "model.pos_embed=sincos"]])
@pytest.mark.parametrize("embed_dim", [0, 16])
def test_a_model_built_on_meta_says_how_every_tensor_starts(overrides, embed_dim):
    cfg = load_config(overrides=[*model_overrides(fields=TRUNK_FIELDS), *overrides])
    with torch.device("meta"):
        model = create_model(cfg.model, embed_dim)
    assert hasattr(model, "init_rng_state")  # drawn later, from the state this build started from
    sync_batchnorm(model, torch.device("cpu"))  # as the strategies do before sharding (the face neck's BatchNorm)
    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    assert {name for name, _ in model.init_plan()} == set(tensors)


def _my_part(tensor, whole):
    """This rank's shard of a DTensor and the same part of `whole`, laid out by DTensor itself with no collective."""
    if not hasattr(tensor, "to_local"):
        return tensor, whole
    from torch.distributed.tensor import distribute_tensor

    expected = distribute_tensor(whole, tensor.device_mesh, tensor.placements, src_data_rank=None)
    return tensor.to_local(), expected.to_local()


def _sharded_face_model_equals_a_whole_build(out_dir):
    """Each rank: a face model (bias-free neck Linear, BatchNorm) built on meta and sharded vs a whole build."""
    cfg = load_config(overrides=[*model_overrides(fields=TRUNK_FIELDS), "parallel.strategy=zero3"])
    init_distributed(torch.device("cpu"), "zero3")
    torch.manual_seed(3)
    whole = create_model(cfg.model, embed_dim=16)
    torch.manual_seed(3)
    with torch.device("meta"):
        sharded = create_model(cfg.model, embed_dim=16)
    parallelize(sharded, cfg.parallel, torch.device("cpu"))
    state = sharded.state_dict()
    # Each rank checks its own shard, with no collective: gloo's allgather, one per tensor, corrupted the heap in
    # about 1 run in 250 of this test (torch 2.13, two cores).
    mismatched = [
        name for name, tensor in whole.state_dict().items() if not torch.equal(*_my_part(state[name], tensor))
    ]
    (out_dir / f"mismatched{torch.distributed.get_rank()}.json").write_text(json.dumps(mismatched))


# slow: 8 s on a Zen 4; sharded init of the classifier runs in the default suite
@pytest.mark.slow
def test_sharded_init_draws_the_whole_builds_weights_for_a_face_model(tmp_path):
    run_two_ranks(_sharded_face_model_equals_a_whole_build, tmp_path)
    for rank in (0, 1):
        assert json.loads((tmp_path / f"mismatched{rank}.json").read_text()) == []


def _threads_left_after_shutdown(out_dir):
    """Each rank: a zero3 model's weights gathered through DTensor, then shutdown(): the names of the threads left."""
    cfg = load_config(overrides=[*model_overrides(fields=TRUNK_FIELDS), "parallel.strategy=zero3"])
    init_distributed(torch.device("cpu"), "zero3")
    model = create_model(cfg.model)
    parallelize(model, cfg.parallel, torch.device("cpu"))
    next(iter(model.state_dict().values())).full_tensor()  # DTensor's redistribute caches the mesh
    del model  # what Trainer.close lets go of before the group ends
    gone = nn.Module()
    dead = [weakref.proxy(gone)]  # torch.compile's caches leave such proxies about: shutdown's object walk skips them
    del gone
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        shutdown()
    assert len(dead) == 1
    names = [(task / "comm").read_text().strip() for task in Path("/proc/self/task").iterdir()]
    said = [str(w.message) for w in caught]  # the object walk once read torch.distributed.reduce_op: a FutureWarning
    (out_dir / f"threads{os.getpid()}.json").write_text(json.dumps({"threads": names, "warnings": said}))


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="thread names are read from Linux's /proc")
def test_shutdown_joins_gloos_threads_after_dtensor_collectives(tmp_path):
    # A gloo worker thread alive at interpreter exit can abort a process that finished its work (see shutdown).
    run_two_ranks(_threads_left_after_shutdown, tmp_path)
    reports = sorted(tmp_path.glob("threads*.json"))
    assert len(reports) == 2
    for report in reports:
        left = json.loads(report.read_text())
        assert [name for name in left["threads"] if "gloo" in name] == [] and left["warnings"] == []


def _warnings_shown(out_dir):
    """Each rank: a library's warning after the process group's set-up, as the user's stderr would get it."""
    init_distributed(torch.device("cpu"), "ddp")
    rank = torch.distributed.get_rank()
    with warnings.catch_warnings(record=True) as shown:  # records what the filters let through; sets none of its own
        warnings.warn(f"a third-party library's warning, from rank {rank}", UserWarning, stacklevel=1)
    (out_dir / f"warnings{rank}.json").write_text(json.dumps([str(w.message) for w in shown]))


def test_python_warnings_are_shown_on_rank_0_only_as_vitrains_own_lines(tmp_path):
    # Every rank runs the same code: each warning came once per rank, rank 1's a copy of rank 0's.
    run_two_ranks(_warnings_shown, tmp_path)
    assert json.loads((tmp_path / "warnings0.json").read_text()) == ["a third-party library's warning, from rank 0"]
    assert json.loads((tmp_path / "warnings1.json").read_text()) == []


def _zero2_warnings(out_dir):
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        parallel = {"strategy": "zero2", "wrap": "model"}
        trainer = Trainer(
            tiny_config(out_dir, "z2", parallel=parallel, train={"max_steps": 1}, precision={"mode": "amp_o1"})
        )
        trainer.fit()
        trainer.close()
    rank = torch.distributed.get_rank()
    (out_dir / f"zero2_warnings{rank}.json").write_text(json.dumps([str(w.message) for w in shown]))


# slow: 8 s on a Zen 4
@pytest.mark.slow
def test_a_zero2_run_of_vitrains_vit_warns_of_no_view_it_never_modifies(tmp_path):
    # FSDP2 warned that the root returned a view in every low-precision zero2 run; nothing modifies it in place.
    run_two_ranks(_zero2_warnings, tmp_path)
    said = json.loads((tmp_path / "zero2_warnings0.json").read_text())
    assert not [message for message in said if "returned a view tensor" in message]


@pytest.mark.parametrize(("rank", "env", "shown"), [(0, "", True), (1, "", False), (1, "1", True)])
def test_vitrain_all_rank_warnings_shows_the_other_ranks_warnings(monkeypatch, rank, env, shown):
    from vitrain.parallel.distributed import ALL_RANK_WARNINGS_ENV, warnings_on_rank_0_only

    monkeypatch.setenv(ALL_RANK_WARNINGS_ENV, env)
    with warnings.catch_warnings():  # this process's filters as they were afterwards
        warnings_on_rank_0_only(rank)
        with warnings.catch_warnings(record=True) as seen:
            warnings.warn(f"a warning on rank {rank} with {ALL_RANK_WARNINGS_ENV}={env!r}", UserWarning, stacklevel=1)
    assert len(seen) == int(shown)


def _overlapped_and_blocking_gradients(out_dir):
    """Each rank: zero2 models per unit kind whose reductions run beside backward (parallel.overlap_comm) or block,
    by FSDP2's reduce-scatter or by an all-reduce (parallel.grad_reduce), the same weights and images: what was
    still running after backward, how many all-reduces backward issued, whether the gradients equal FSDP2's own
    blocking reduce-scatter's once waited for, and whether a run accumulating micro-batches defers."""
    import torch.distributed as dist

    from vitrain.parallel.strategies import finish_reductions

    init_distributed(torch.device("cpu"), "zero2")
    all_reduce, calls = dist.all_reduce, []

    def counted(*args, **kwargs):
        calls.append(1)
        return all_reduce(*args, **kwargs)

    dist.all_reduce = counted
    report = {"auto": load_config(overrides=[]).parallel.grad_reduce}
    for wrap in ("block", "model"):
        grads = {}
        for reduce in ("reduce_scatter", "all_reduce"):
            cfg = load_config(
                overrides=[
                    *model_overrides(fields=TRUNK_FIELDS),
                    "parallel.strategy=zero2",
                    f"parallel.wrap={wrap}",
                    f"parallel.grad_reduce={reduce}",
                ]
            )
            for overlap in (True, False):
                torch.manual_seed(5)
                model = create_model(cfg.model)
                parallelize(model, cfg.parallel, torch.device("cpu"), overlap=overlap)
                torch.manual_seed(6 + torch.distributed.get_rank())  # each rank its own images
                images = torch.randn(4, cfg.model.in_chans, cfg.model.image_size, cfg.model.image_size)
                calls.clear()
                model(images).square().mean().backward()
                reductions = getattr(model, "_vitrain_reductions", None)
                name = f"{wrap} {reduce} {overlap}"
                report[f"{name} pending"] = len(reductions.pending) if reductions is not None else None
                report[f"{name} all-reduces"] = len(calls)
                finish_reductions(model)
                grads[(reduce, overlap)] = {n: p.grad.to_local().clone() for n, p in model.named_parameters()}
        reference = grads[("reduce_scatter", False)]  # FSDP2's own blocking reduce-scatter
        report[f"{wrap} unequal"] = [
            f"{key} {n}" for key, g in grads.items() for n in reference if not torch.equal(g[n], reference[n])
        ]
    dist.all_reduce = all_reduce
    accumulating = tiny_config(
        out_dir, "accumulating", batch_size=4, train={"accum_steps": 2}, parallel={"strategy": "zero2"}
    )
    report["accumulating overlaps"] = hasattr(Trainer(accumulating).engine.model, "_vitrain_reductions")
    (out_dir / f"overlap{torch.distributed.get_rank()}.json").write_text(json.dumps(report))


def _evaluate_first_then_train(out_dir):
    """Each rank: zero2 and zero3 models whose first forward is an evaluation under torch.inference_mode (a run
    resumed after its epoch's last step), then a training step; what each raised, if anything."""
    init_distributed(torch.device("cpu"), "zero3")
    said = {}
    for strategy in ("zero2", "zero3"):
        cfg = load_config(overrides=[*model_overrides(fields=TRUNK_FIELDS), f"parallel.strategy={strategy}"])
        model = parallelize(create_model(cfg.model), cfg.parallel, torch.device("cpu"))
        images = torch.randn(2, cfg.model.in_chans, cfg.model.image_size, cfg.model.image_size)
        try:
            with torch.inference_mode():
                model.eval()
                model(images)
            model.train()
            model(images).square().mean().backward()
            said[strategy] = "trained"
        except RuntimeError as exc:
            said[strategy] = str(exc)[:120]
    (out_dir / f"first{torch.distributed.get_rank()}.json").write_text(json.dumps(said))


def test_a_sharded_model_whose_first_forward_is_an_evaluation_trains_after_it(tmp_path):
    run_two_ranks(_evaluate_first_then_train, tmp_path)
    for rank in (0, 1):
        said = json.loads((tmp_path / f"first{rank}.json").read_text())
        assert said == {"zero2": "trained", "zero3": "trained"}


def test_deferred_reductions_leave_at_most_in_flight_pending():
    """Issuing a deferred reduction beyond `in_flight` pending ones finishes the oldest (its unit's gradient buffer is
    then freed), in the order issued; `wait` finishes the rest."""
    from vitrain.parallel.overlap import GradientReduction

    class Work:
        waited = False

        def wait(self) -> None:
            self.waited = True

    reduction = GradientReduction(all_reduce=True, defer=True, in_flight=2)
    works, outputs = [Work() for _ in range(4)], [torch.zeros(2) for _ in range(4)]
    for i, (work, output) in enumerate(zip(works, outputs, strict=True)):
        reduction._issued(work, output, torch.full((2,), float(i + 1)))
    assert [w.waited for w in works] == [True, True, False, False]
    assert [o[0].item() for o in outputs] == [1.0, 2.0, 0.0, 0.0]  # the finished ones' chunks copied out
    reduction.wait()
    assert all(w.waited for w in works) and [o[0].item() for o in outputs] == [1.0, 2.0, 3.0, 4.0]
    assert reduction.pending == []


def test_zero2_reductions_beside_backward_or_by_all_reduce_give_fsdp2s_own_gradients(tmp_path):
    run_two_ranks(_overlapped_and_blocking_gradients, tmp_path)
    for rank in (0, 1):
        report = json.loads((tmp_path / f"overlap{rank}.json").read_text())
        assert report["auto"] == "auto"
        for reduce in ("reduce_scatter", "all_reduce"):
            # Still running when backward returned: the last IN_FLIGHT (2) of the 3 units' (fp32: the suite's 2
            # blocks and the root); issuing the third finished the first. The whole model as one unit reduces as
            # backward ends, nothing left to overlap: blocking.
            assert report[f"block {reduce} True pending"] == 2, report
            assert report[f"model {reduce} True pending"] is None and report[f"block {reduce} False pending"] is None
        # An all-reduce per unit where asked for (3 units, or the whole model as one), none otherwise.
        assert report["block all_reduce True all-reduces"] == report["block all_reduce False all-reduces"] == 3
        assert report["model all_reduce True all-reduces"] == report["model all_reduce False all-reduces"] == 1
        assert report["block reduce_scatter True all-reduces"] == report["model reduce_scatter False all-reduces"] == 0
        # Bit-equal: gloo's reduce-scatter is an all-reduce of a clone of the same input.
        assert report["block unequal"] == [] and report["model unequal"] == []
        # A deferred shard would meet FSDP2's in-place accumulation: the engine keeps the reductions blocking.
        assert report["accumulating overlaps"] is False
