"""A run stopped at any optimizer step and resumed ends bit-identical to the run that
was never stopped, with the real data modules, random augmentations and any number of workers.

Every registered method's exact resume inside an epoch is the property
``tests/properties/test_exact_resume.py`` (in-process, ready views, no workers). The harness runs
here add what it does not cover, for a few methods whose data paths differ (SimCLR's 2 views with
a BatchNorm head, BYOL's asymmetric views, DINO's multi-crop, iBOT's block masks and stochastic
depth, DINOv3's Gram crops and Gram teacher, the linear evaluation): real image folders with
random augmentations, loader workers, SIGTERM, the batched ``DeviceViews``, a pre-change
checkpoint, and litdata shards on 1 and 2 processes.

One shared set of runs (``tests/resume_harness.py``, three fresh processes forked from its fork
server, ``resume_harness.start``: a resumed run shares no memory with the run that wrote its
checkpoint):

1. straight 2-epoch fits of those methods (``num_workers=0``, a checkpoint after every step),
   plus SimCLR with 2 workers and SimCLR with the batched ``DeviceViews`` (after the batch
   transfer);
2. a SimCLR fit with 2 workers and :class:`PreemptionCheckpoint` that receives SIGTERM from
   this test inside epoch 1;
3. every resume: each method from step 2 (inside epoch 0, with 2 workers) and from step 9
   (inside epoch 1, with 0 workers); SimCLR from the SIGTERM checkpoint; the DeviceViews run
   from step 9 with its views made in 2 workers' collate; a pre-change checkpoint (no
   data-module state).

The same runs on litdata shards of the image folder (``StreamingDataModule``, when litdata is
installed): a straight 1-process run with a checkpoint after every step (its weights equal the
image-folder SimCLR run's: the same batches) resumed from steps 2 and 9, and from step 2 with the
shards read from a ``local:`` URL; a straight 2-process run (``ddp_fork``) resumed inside
epoch 1 on 2 processes with 2 workers, the shards read from the ``local:`` URL into one fresh
cache; its mid-epoch checkpoint and its checkpoint after epoch 0's last batch
refused on 1 process, its end-of-epoch-0 checkpoint resumed there.

Tiny data: 24 train images of 32 px (6 steps of 4 per epoch), 16 px crops, SmallConvNet; and
iBOT with a tiny ViT whose stochastic depth (``drop_path_rate=0.5``) draws from the samples'
seeds.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from ssl_lightning.testing.trainer_runs import assert_states_close

pytestmark = pytest.mark.slow

try:
    import litdata  # noqa: F401

    STREAMING = True
except ImportError:
    STREAMING = False

#: One method per data path (the others' exact resume is the property's, see the docstring):
#: byol: asymmetric views and an EMA teacher; dino: multi-crop and a teacher-temperature warm-up
#: across the epoch; ibot_vit: block masks, stochastic depth; dinov3: Gram anchoring, the Gram
#: teacher refreshed at 1, 5, 9; linear: the linear evaluation (not a registered method).
METHODS = ["simclr", "byol", "dino", "linear", "ibot_vit", "dinov3"]
RESUME_POINTS = {2: 2, 9: 0}  # step -> num_workers of the resumed run
SIGTERM_AT = 8  # the SIGTERM run holds from this step until the signal arrived


def _run_jobs(jobs: list[dict[str, Any]], stderr: Path) -> str:
    """Runs ``jobs`` in a fresh harness process; returns its standard error."""
    import resume_harness  # here: it builds its tables at import, which collection need not

    process = resume_harness.start(jobs, stderr)
    process.join()
    assert process.exitcode == 0, stderr.read_text()[-3000:]
    return stderr.read_text()


def straight_and_resumed(root: Path, make_image_folder: Any, straight: list[str],
                         resumed: dict[str, str]) -> Any:
    """2-epoch harness runs of the ``straight`` methods on a tiny image folder (a checkpoint
    after every step), then every method of ``resumed`` (name -> the straight method whose
    checkpoints it resumes) from each of :data:`RESUME_POINTS`. Returns ``load(name)``, the
    saved state of run ``name`` (``<method>`` or ``<method>_from<step>``)."""
    data = root / "data"
    make_image_folder(data / "train", classes=2, per_class=12, seed=0)
    make_image_folder(data / "test", classes=2, per_class=6, seed=1)

    def job(name: str, method: str, workers: int, **extra: Any) -> dict[str, Any]:
        return {"method": method, "data_root": str(data), "workers": workers, "epochs": 2,
                "out": str(root / f"{name}.pt"), **extra}

    _run_jobs([job(m, m, 0, ckpt_dir=str(root / f"ckpt_{m}")) for m in straight],
              root / "straight.stderr")
    _run_jobs([job(f"{m}_from{step}", m, workers, resume=str(root / f"ckpt_{source}" /
                                                               f"step={step}.ckpt"))
               for m, source in resumed.items() for step, workers in RESUME_POINTS.items()],
              root / "resumes.stderr")
    return lambda name: torch.load(root / f"{name}.pt", weights_only=True)


def _sigterm_run(job: dict[str, Any], stderr: Path) -> dict[str, Any]:
    import resume_harness

    child = resume_harness.start([job], stderr)
    waiting = Path(job["out"] + ".waiting")
    while not waiting.exists():
        assert child.is_alive(), stderr.read_text()[-3000:]
        time.sleep(0.02)
    sent = time.time()
    os.kill(child.pid, signal.SIGTERM)
    child.join(timeout=300)
    ckpt = Path(job["preempt_dir"]) / "last.ckpt"
    return {"returncode": child.exitcode, "exit_s": time.time() - sent,
            "stderr": stderr.read_text(), "checkpoint": ckpt,
            "saved_s": ckpt.stat().st_mtime - sent if ckpt.exists() else None}


def make_runs(tmp_path_factory: pytest.TempPathFactory, make_image_folder) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("resume_exact")
    data = root / "data"
    make_image_folder(data / "train", classes=2, per_class=12, seed=0)
    make_image_folder(data / "test", classes=2, per_class=6, seed=1)

    def job(name: str, method: str, workers: int, **extra: Any) -> dict[str, Any]:
        return {"method": method, "data_root": str(data), "workers": workers, "epochs": 2,
                "out": str(root / f"{name}.pt"), **extra}

    straight = [job(m, m, 0, ckpt_dir=str(root / f"ckpt_{m}")) for m in METHODS]
    straight += [job("simclr_w2", "simclr", 2),
                 job("device", "simclr", 0, device_views=True, views_on="device",
                     ckpt_dir=str(root / "ckpt_dv"))]
    stream = _streaming_jobs(data, root, job) if STREAMING else {"straight": [], "resumes": []}
    _run_jobs(straight + stream["straight"], root / "straight.stderr")

    sigterm = _sigterm_run(job("sigterm", "simclr", 2, preempt_dir=str(root / "preempt"),
                               wait_step=SIGTERM_AT), root / "sigterm.stderr")

    old = torch.load(root / "ckpt_simclr" / "step=3.ckpt", weights_only=True)
    del old["ImageFolderDataModule"]  # as written before the data module had a state
    old["loops"]["fit_loop"]["state_dict"].pop("combined_loader")
    torch.save(old, root / "old.ckpt")

    resumes = [job(f"{m}_from{step}", m, workers, resume=str(root / f"ckpt_{m}/step={step}.ckpt"))
               for m in METHODS for step, workers in RESUME_POINTS.items()]
    resumes += [job("sigterm_resumed", "simclr", 2, resume=str(sigterm["checkpoint"])),
                job("device_from9", "simclr", 2, device_views=True, views_on="workers",
                    resume=str(root / "ckpt_dv/step=9.ckpt")),
                job("old_resumed", "simclr", 0, resume=str(root / "old.ckpt"))]
    stderr = _run_jobs(resumes + stream["resumes"], root / "resumes.stderr")
    load = lambda name: torch.load(root / f"{name}.pt", weights_only=True)  # noqa: E731
    return {"load": load, "sigterm": sigterm, "resume_stderr": stderr, "root": root}


def _streaming_jobs(data: Path, root: Path, job: Any) -> dict[str, list[dict[str, Any]]]:
    """Shards of ``data`` and the streaming jobs of both harness runs (see the docstring)."""
    from ssl_lightning.data.shards import write_shards

    for split in ("train", "test"):
        write_shards(data / split, root / "shards" / split, shard_size=5, progress=False)
    shards, ddp = str(root / "shards"), root / "ckpt_stream_ddp"
    return {
        "straight": [job("stream", "simclr", 0, shards=shards, ckpt_dir=str(root / "ckpt_stream")),
                     job("stream_ddp", "simclr", 0, shards=shards, devices=2, ckpt_dir=str(ddp),
                         epoch_ckpt_dir=str(ddp / "epochs"))],
        "resumes": [
            *[job(f"stream_from{step}", "simclr", workers, shards=shards,
                  resume=str(root / f"ckpt_stream/step={step}.ckpt"))
              for step, workers in RESUME_POINTS.items()],
            job("stream_url_from2", "simclr", 2, shards=f"local:{shards}",
                cache_dir=str(root / "shard_cache"), resume=str(root / "ckpt_stream/step=2.ckpt")),
            job("stream_ddp_url_from4", "simclr", 2, shards=f"local:{shards}", devices=2,
                cache_dir=str(root / "shard_cache_ddp"), resume=str(ddp / "step=4.ckpt")),
            job("stream_ddp_to1_mid", "simclr", 0, shards=shards, expect_error=True,
                resume=str(ddp / "step=4.ckpt")),
            job("stream_ddp_to1_last", "simclr", 0, shards=shards, expect_error=True,
                resume=str(ddp / "step=3.ckpt")),
            job("stream_ddp_to1_end", "simclr", 0, shards=shards,
                resume=str(ddp / "epochs" / "epoch=0.ckpt"))]}


def _assert_identical(resumed: dict[str, Any], straight: dict[str, Any]) -> None:
    assert resumed["global_step"] == straight["global_step"] == 12
    for part in ("model", "optimizer", "scheduler", "callbacks"):
        assert_states_close(resumed[part], straight[part], atol=0.0, path=part)
    # Epoch means of training metrics average only the batches after a mid-epoch resume
    # (Lightning does not checkpoint its metric accumulators): compare validation and
    # per-step metrics.
    metrics = {k: v for k, v in straight["metrics"].items()
               if k.startswith("val/") or k.endswith("_step")}
    assert any(k.startswith("val/") for k in metrics)
    assert {k: resumed["metrics"][k] for k in metrics} == metrics


@pytest.mark.parametrize("method", METHODS)
def test_resume_inside_epoch_0_and_1_is_bit_identical(runs: dict[str, Any], method: str) -> None:
    straight = runs["load"](method)
    for step in RESUME_POINTS:
        _assert_identical(runs["load"](f"{method}_from{step}"), straight)
    if method != "linear":
        assert "OnlineProbe" in straight["callbacks"] and "val/knn_top1" in straight["metrics"]


def test_gram_teacher_is_the_ema_teacher_of_its_last_snapshot_step(runs: dict[str, Any]) -> None:
    """The straight run's final Gram teacher equals the EMA teacher of the step-9 checkpoint
    bit for bit, and neither step 8's nor step 10's (a refresh off by one step)."""
    final = runs["load"]("dinov3")["model"]
    assert int(final["gram_teacher.snapshot_step"]) == 9
    gram = {k.removeprefix("gram_teacher.backbone."): v for k, v in final.items()
            if k.startswith("gram_teacher.backbone.")}
    for step in (8, 9, 10):
        state = torch.load(runs["root"] / f"ckpt_dinov3/step={step}.ckpt",
                           weights_only=False)["state_dict"]
        teacher = {k.removeprefix("teacher_backbone."): v for k, v in state.items()
                   if k.startswith("teacher_backbone.")}
        same = all(torch.equal(gram[k], teacher[k]) for k in teacher)
        assert teacher.keys() == gram.keys() and same == (step == 9), step


def test_same_weights_with_0_and_2_workers(runs: dict[str, Any]) -> None:
    _assert_identical(runs["load"]("simclr_w2"), runs["load"]("simclr"))


def test_batched_views_resume_in_the_workers_is_bit_identical(runs: dict[str, Any]) -> None:
    """Straight: DeviceViews after the transfer; resumed: in 2 workers' collate."""
    straight = runs["load"]("device")
    _assert_identical(runs["load"]("device_from9"), straight)
    # The batched path is a different pipeline: the equality above is not the SimCLRViews run.
    assert not torch.equal(straight["model"]["backbone.net.0.weight"],
                           runs["load"]("simclr")["model"]["backbone.net.0.weight"])


needs_litdata = pytest.mark.skipif(not STREAMING, reason="litdata is not installed")


@needs_litdata
def test_streaming_resume_is_bit_identical_and_equals_the_image_folder_run(
        runs: dict[str, Any]) -> None:
    straight = runs["load"]("stream")
    assert_states_close(straight["model"], runs["load"]("simclr")["model"], atol=0.0)
    for step in RESUME_POINTS:  # from step 2 with 2 workers, from step 9 with none
        _assert_identical(runs["load"](f"stream_from{step}"), straight)
    # the same shards read from a URL (litdata's local: scheme, through the cache)
    _assert_identical(runs["load"]("stream_url_from2"), straight)


@needs_litdata
def test_streaming_resume_on_2_processes_and_a_changed_world_size(runs: dict[str, Any]) -> None:
    """2 processes: 12 images per rank, 3 steps per epoch; resumed at step 4 (inside epoch 1)
    with 2 workers per rank, rank 0's weights equal the straight run's."""
    straight = runs["load"]("stream_ddp")["model"]
    # both ranks and their workers reading one fresh cache of the shards' local: URL (the
    # plain folder's resume is the 1-process runs': the same loader state either way)
    assert_states_close(runs["load"]("stream_ddp_url_from4")["model"], straight, atol=0.0)
    error = runs["load"]("stream_ddp_to1_mid")["error"]
    assert "'num_replicas': 2" in error and "'num_replicas': 1" in error
    assert "end of an epoch" in error
    # After epoch 0's last batch but before the epoch ended: Lightning would count 3 more
    # batches of 6 in epoch 0 of the new layout.
    error = runs["load"]("stream_ddp_to1_last")["error"]
    assert "num_replicas: 2 -> 1" in error and "save_on_train_epoch_end" in error
    assert runs["load"]("stream_ddp_to1_end")["global_step"] == 3 + 6  # epoch 1 on 1 process


def test_sigterm_saves_at_the_next_step_and_exits_preempted(runs: dict[str, Any]) -> None:
    sigterm = runs["sigterm"]
    assert sigterm["returncode"] == 143, sigterm["stderr"][-3000:]
    assert f"at step {SIGTERM_AT + 1}" in sigterm["stderr"]  # within one optimizer step
    saved = torch.load(sigterm["checkpoint"], weights_only=True)
    assert saved["global_step"] == SIGTERM_AT + 1
    assert sigterm["saved_s"] is not None and sigterm["exit_s"] < 120
    _assert_identical(runs["load"]("sigterm_resumed"), runs["load"]("simclr"))


def test_checkpoint_without_loader_state_resumes_with_a_warning(runs: dict[str, Any]) -> None:
    assert "holds no data-loader position" in runs["resume_stderr"]
    assert runs["load"]("old_resumed")["global_step"] == 12
