"""The product matrix: every ``configs/*.yaml`` through the real CLI on 1 and 2 processes.

Each config runs as shipped with only sizes shrunk (see ``tests/product_matrix.py``): validation
(kNN, online probe, collapse monitor, embedding picture) every epoch, checkpointing, then a
resume from ``last.ckpt`` that must start at the saved step and finish. One driver process per
rank runs all configs (2 processes: a gloo group shared by every config, ``strategy: ddp``);
the 1-process driver and the 2-process pair run side by side. New configs are picked up
automatically; register small overrides in ``product_matrix.EXTRA_ARGS``.

The divergence check rides along: SimCLR at lr 1e6 must stop with ``TrainingDivergedError`` on
both ranks (in the DDP pair) and, through ``python -m ssl_lightning``, exit non-zero with the
step, the learning rate and the advice, leaving a finite ``last.ckpt``.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from product_matrix import COMPOSED, CONFIGS, ROOT, STREAMING_RUN, SUBCOMMANDS, shrink_args

from ssl_lightning.testing.process_pool import free_port

pytestmark = pytest.mark.slow

#: A driver whose log and results file stayed unchanged this long hangs: it is killed, and the
#: config it was running fails with its name. The results file changes at every config's start
#: and end, so this bounds one config (with its resume leg), not the whole matrix: a loaded
#: machine makes the matrix slower, not a config silent for minutes.
STALL_S = 300
DIVERGE = ["--model.init_args.lr", "1e6", "--model.init_args.warmup_epochs", "0",
           "--trainer.max_epochs", "6"]


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", **extra)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests"),
                                         env.get("PYTHONPATH", "")])
    return env


def _diverge_args(data_root: Path) -> list[str]:
    config = ROOT / "configs" / "simclr.yaml"
    return ["fit", "--config", str(config), *shrink_args(config, data_root, 1), *DIVERGE]


def _shards(images: Path, out: Path) -> str | None:
    """litdata shards of the tiny folder's splits (None without litdata: no shard run)."""
    try:
        from ssl_lightning.data.shards import write_shards

        for split in ("train", "test"):
            write_shards(images / split, out / split, shard_size=10, progress=False)
    except ImportError:
        return None
    return str(out)


@pytest.fixture(scope="module")
def matrix(tmp_path_factory: pytest.TempPathFactory, tiny_image_folder: Path) -> dict[str, Any]:
    """Runs everything once: ``{world_size: {rank: results}}``, plus the divergence CLI run."""
    tmp = tmp_path_factory.mktemp("matrix")
    shards = _shards(tiny_image_folder, tmp / "shards")
    procs: list[tuple[int, int, subprocess.Popen, Path]] = []
    logs = []
    port = free_port()
    for world in (1, 2):
        spec = {"configs": [str(c) for c in CONFIGS], "workdir": str(tmp / f"w{world}"),
                "data_root": str(tiny_image_folder), "timeout_s": 300,
                "diverge": DIVERGE if world == 2 else None, "shards": shards,
                "composed": list(COMPOSED) if world == 2 else []}
        spec_path = tmp / f"spec{world}.json"
        spec_path.write_text(json.dumps(spec))
        for rank in range(world):
            out = tmp / f"out{world}"
            out.mkdir(exist_ok=True)
            env = _env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world),
                       RANK=str(rank), LOCAL_RANK=str(rank))
            log = open(tmp / f"log{world}_{rank}.txt", "w")  # noqa: SIM115 (closed below)
            logs.append(log)
            proc = subprocess.Popen(
                [sys.executable, str(ROOT / "tests" / "product_matrix.py"), str(spec_path),
                 str(out)], env=env, stdout=log, stderr=subprocess.STDOUT, cwd=tmp)
            procs.append((world, rank, proc, out))
    diverge_dir = tmp / "diverge"
    diverge_dir.mkdir()
    cli_log = tmp / "diverge_cli.txt"
    with open(cli_log, "w") as log:
        cli = subprocess.Popen([sys.executable, "-m", "ssl_lightning",
                                *_diverge_args(tiny_image_folder)], env=_env(), cwd=diverge_dir,
                               stdout=log, stderr=subprocess.STDOUT)
    watched = [(proc, [tmp / f"log{world}_{rank}.txt", out / f"rank{rank}.json"])
               for world, rank, proc, out in procs]
    _wait_while_progressing([*watched, (cli, [cli_log])], STALL_S)
    cli_output = cli_log.read_text()
    for log in logs:
        log.close()
    results: dict[str, Any] = {1: {}, 2: {}}
    for world, rank, _proc, out in procs:
        path = out / f"rank{rank}.json"
        results[world][rank] = json.loads(path.read_text()) if path.exists() else {}
        results[world][rank]["_log"] = (tmp / f"log{world}_{rank}.txt").read_text()[-3000:]
    results["diverge_cli"] = (cli.returncode, cli_output, diverge_dir)
    return results


def _wait_while_progressing(children: list[tuple[subprocess.Popen, list[Path]]],
                            stall_s: float) -> None:
    """Waits for every child process; kills one whose files (its log, its results) stayed
    unchanged for ``stall_s`` seconds (a hang, reported by the test of what it was running)."""
    stamps: list[tuple[Any, float]] = [((), time.monotonic()) for _ in children]
    while any(proc.poll() is None for proc, _ in children):
        now = time.monotonic()
        for i, (proc, paths) in enumerate(children):
            if proc.poll() is not None:
                continue
            stamp = tuple((p.stat().st_size, p.stat().st_mtime_ns) if p.exists() else None
                          for p in paths)
            if stamp != stamps[i][0]:
                stamps[i] = (stamp, now)
            elif now - stamps[i][1] > stall_s:
                proc.kill()
                proc.wait()
        time.sleep(1.0)


def _check(result: dict[str, Any], name: str, world: int, rank: int, log: str) -> None:
    where = f"{name} on {world} process(es), rank {rank}"
    if not result:
        pytest.fail(f"{where}: never started (an earlier config hung or the driver died):\n{log}")
    if result["status"] == "running":
        pytest.fail(f"{where}: did not finish (hang or crash inside it):\n{log}")
    if result["status"] != "ok":
        pytest.fail(f"{where} failed:\n{result['error']}")
    assert result["finished"], where
    assert result["world_size"] == world, where
    if SUBCOMMANDS.get(name, "fit") != "fit":
        return
    assert result["saved_step"] == result["first_step"] > 0, where
    assert result["resume_start"] == result["saved_step"], f"{where}: resumed from step 0"
    assert result["final_step"] == 2 * result["saved_step"], f"{where}: resume did not finish"
    assert all(math.isfinite(v) for k, v in result["metrics"].items() if "loss" in k), where


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("config", CONFIGS, ids=lambda path: path.name)
def test_config_runs_and_resumes(matrix: dict[str, Any], config: Path, world: int) -> None:
    for rank, results in matrix[world].items():
        _check(results.get(config.name, {}), config.name, world, rank, results["_log"])
    if world == 2 and SUBCOMMANDS.get(config.name, "fit") == "fit":
        rank0, rank1 = (matrix[2][r][config.name]["metrics"] for r in (0, 1))
        for key in ("val/knn_top1", "val/top1", "train/loss"):  # reduced: equal on both ranks
            if key in rank0:
                assert rank0[key] == pytest.approx(rank1[key], abs=1e-6), (config.name, key)


@pytest.mark.parametrize("world", [1, 2])
def test_a_config_runs_and_resumes_on_shards(matrix: dict[str, Any], world: int) -> None:
    """simclr.yaml + configs/shared/streaming.yaml on shards of the tiny folder."""
    pytest.importorskip("litdata")
    for rank, results in matrix[world].items():
        _check(results.get(STREAMING_RUN, {}), STREAMING_RUN, world, rank, results["_log"])
        assert "val/knn_top1" in results[STREAMING_RUN]["metrics"]


@pytest.mark.parametrize("leg", list(COMPOSED))
def test_composed_leg_runs_and_resumes_on_two_processes(matrix: dict[str, Any], leg: str) -> None:
    """E.g. dinov3.yaml with shared/fsdp.yaml: sharded, distributed checkpoints, resumed."""
    for rank, results in matrix[2].items():
        result = results.get(leg, {})
        _check(result, leg, 2, rank, results["_log"])
        if "fsdp" in leg:
            assert result["strategy"] == "ShardedStrategy", result["strategy"]
            assert result["sharded_checkpoint"], f"{leg}: last.ckpt is not a sharded directory"


def test_divergence_stops_every_rank_at_the_same_step(matrix: dict[str, Any]) -> None:
    for rank in (0, 1):
        result = matrix[2][rank].get("__diverge__", {})
        assert result.get("type") == "TrainingDivergedError", result.get("error", result)
        assert "Training diverged: the loss is" in result["error"]
    steps = {matrix[2][r]["__diverge__"]["step"] for r in (0, 1)}
    assert len(steps) == 1 and None not in steps


def test_divergence_exits_non_zero_naming_step_lr_and_advice(matrix: dict[str, Any]) -> None:
    returncode, output, workdir = matrix["diverge_cli"]
    assert returncode != 0, output[-2000:]
    message = output[output.rfind("TrainingDivergedError:"):]
    assert "Training diverged: the loss is nan" in message, output[-3000:]
    for part in ("at global step", "learning rate", "--model.lr", "warm-up", "bf16-mixed",
                 "gradient_clip_val"):
        assert part in message, (part, message)
    step = int(message.split("at global step ")[1].split()[0])
    (last,) = Path(workdir).glob("**/last.ckpt")
    checkpoint = torch.load(last, map_location="cpu", weights_only=True)
    assert 0 < checkpoint["global_step"] <= step
    assert all(torch.isfinite(v).all() for v in checkpoint["state_dict"].values()
               if v.is_floating_point())


def test_a_silent_driver_is_killed_and_a_slow_one_that_writes_is_not(tmp_path: Path) -> None:
    """The matrix's hang detection: the silent child is killed after ``stall_s``; the child that
    writes a line every 0.3 s for longer than that finishes on its own."""
    silent_log, busy_log = tmp_path / "silent.txt", tmp_path / "busy.txt"
    busy_code = ("import sys, time\nfor i in range(8):\n    print(i, flush=True)\n"
                 "    time.sleep(0.3)")
    with open(silent_log, "w") as silent_out, open(busy_log, "w") as busy_out:
        silent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                                  stdout=silent_out)
        busy = subprocess.Popen([sys.executable, "-c", busy_code], stdout=busy_out)
    _wait_while_progressing([(silent, [silent_log]), (busy, [busy_log])], stall_s=1.5)
    assert silent.returncode == -9
    assert busy.returncode == 0 and busy_log.read_text().split() == [str(i) for i in range(8)]
