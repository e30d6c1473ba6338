"""The stop checkpoint of :class:`PreemptionCheckpoint` holds the state a run that was never
stopped holds at that step: model (with the EMA teacher its callback updates), optimiser and
every callback's ``state_dict`` (the online probe), in one process without a signal (the flag is
set as the signal handler sets it; ``test_preemption.py`` sends real signals)."""

from __future__ import annotations

import logging
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from momentum_utils import cpu_trainer, views_loader
from pytorch_lightning.callbacks import ModelCheckpoint

from ssl_lightning.backbones import SmallConvNet
from ssl_lightning.callbacks import OnlineProbe, PreemptionCheckpoint
from ssl_lightning.methods import BYOL
from ssl_lightning.testing.trainer_runs import assert_states_close

STOP_AT = 2  # the flag is set before this step; the run stops after it (global_step 3)


class _FlagAt(pl.Callback):
    """Sets ``preemption.received`` to SIGTERM at the start of step ``step``."""

    def __init__(self, preemption: PreemptionCheckpoint, step: int) -> None:
        self.preemption, self.step = preemption, step

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            self.preemption.received = signal.SIGTERM


def _byol() -> BYOL:
    torch.manual_seed(0)
    return BYOL(SmallConvNet((4, 8), norm="group"), projection_hidden_dim=8, projection_dim=4,
                momentum_base=0.9, optimizer="sgd", lr=0.3, lr_scaling="none", image_size=16)


def _callback_states(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """Every callback's state but the checkpoint writers' own (file names and scores)."""
    return {k: v for k, v in checkpoint["callbacks"].items()
            if not k.startswith(("ModelCheckpoint", "PreemptionCheckpoint"))}


def test_stop_checkpoint_holds_every_callbacks_update_of_its_step(tmp_path: Path) -> None:
    straight = ModelCheckpoint(tmp_path / "straight", filename="{step}", save_top_k=-1,
                               every_n_train_steps=1)
    cpu_trainer(str(tmp_path), 1, callbacks=[straight, OnlineProbe(num_classes=10)]).fit(
        _byol(), views_loader())
    expected = torch.load(tmp_path / "straight" / f"step={STOP_AT + 1}.ckpt", weights_only=True)

    # The CLI's order: the stop callback before the probe and the method's EMA callback.
    preemption = PreemptionCheckpoint(str(tmp_path / "stopped"))
    callbacks = [preemption, OnlineProbe(num_classes=10), _FlagAt(preemption, STOP_AT)]
    with pytest.raises(SystemExit) as stopped:
        cpu_trainer(str(tmp_path), 1, callbacks=callbacks, enable_checkpointing=False).fit(
            _byol(), views_loader())
    assert stopped.value.code == 143
    saved = torch.load(tmp_path / "stopped" / "last.ckpt", weights_only=True)

    assert saved["global_step"] == expected["global_step"] == STOP_AT + 1
    states = _callback_states(saved)
    assert any(k.startswith("OnlineProbe") and v for k, v in states.items())
    assert_states_close(states, _callback_states(expected), atol=0.0, path="callbacks")
    assert_states_close(saved["state_dict"], expected["state_dict"], atol=0.0, path="model")
    assert_states_close(saved["optimizer_states"], expected["optimizer_states"], atol=0.0,
                        path="optimizer")


def test_the_stop_checkpoint_prints_no_lightning_info_line(tmp_path: Path) -> None:
    """Lightning logs "`weights_only` was not set" when a checkpoint is saved without saying;
    the stop message is the only thing a stopped run prints."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append  # type: ignore[method-assign]
    lightning_log = logging.getLogger(pl.trainer.connectors.checkpoint_connector.__name__)
    lightning_log.addHandler(handler)
    level = lightning_log.level
    lightning_log.setLevel(logging.INFO)
    preemption = PreemptionCheckpoint(str(tmp_path / "stopped"))
    try:
        with pytest.raises(SystemExit):
            cpu_trainer(str(tmp_path), 1, callbacks=[preemption, _FlagAt(preemption, 0)],
                        enable_checkpointing=False).fit(_byol(), views_loader())
    finally:
        lightning_log.removeHandler(handler)
        lightning_log.setLevel(level)
    assert (tmp_path / "stopped" / "last.ckpt").exists()
    assert [r.getMessage() for r in records if "weights_only" in r.getMessage()] == []


class _SignalAtFitEnd(pl.Callback):
    """Sends this process SIGTERM in ``on_fit_end`` (the backbone's export) and ``teardown``
    (the run's summary), after the last training step."""

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        os.kill(os.getpid(), signal.SIGTERM)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        os.kill(os.getpid(), signal.SIGTERM)


@pytest.mark.parametrize("ignore_after_finish", [True, False])
def test_signals_after_the_last_step_do_not_stop_a_finished_run(
        tmp_path: Path, capfd: pytest.CaptureFixture[str], ignore_after_finish: bool) -> None:
    """The fit returns normally (no SystemExit) and, with ``ignore_after_finish`` (the CLI's
    setting), a SIGTERM after ``fit`` returned is noted too, until the process exits; without
    it, the handler in place before ``fit`` gets it back (here: a recorder, not the default
    that would end the process)."""
    previous: list[int] = []
    before = signal.signal(signal.SIGTERM, lambda signum, frame: previous.append(signum))
    try:
        preemption = PreemptionCheckpoint(str(tmp_path), ignore_after_finish=ignore_after_finish)
        trainer = cpu_trainer(str(tmp_path), 1, callbacks=[preemption, _SignalAtFitEnd()],
                              enable_checkpointing=False, max_steps=2)
        trainer.fit(_byol(), views_loader())
        assert preemption.finished and trainer.state.finished
        assert previous == [] and not (tmp_path / "last.ckpt").exists()
        os.kill(os.getpid(), signal.SIGTERM)  # after fit returned: the process is ending
        assert previous == ([] if ignore_after_finish else [signal.SIGTERM])
    finally:
        signal.signal(signal.SIGTERM, before)
    notes = capfd.readouterr().err.count("SIGTERM received after the last training step")
    assert notes == (3 if ignore_after_finish else 2)


def test_a_signal_before_setup_stops_the_run_at_its_first_step(tmp_path: Path) -> None:
    """``listen`` (the CLI calls it before ``fit``): a Ctrl-C while the data is indexed is
    kept, not a ``KeyboardInterrupt``; the run stops after its first step and exits 130."""
    preemption = PreemptionCheckpoint(str(tmp_path))
    trainer = cpu_trainer(str(tmp_path), 1, callbacks=[preemption], enable_checkpointing=False)
    before = signal.getsignal(signal.SIGINT)
    try:
        preemption.listen(trainer)
        os.kill(os.getpid(), signal.SIGINT)
        assert preemption.received == signal.SIGINT
        with pytest.raises(SystemExit) as stopped:
            trainer.fit(_byol(), views_loader())
    finally:  # on_exception left the default handler for a second Ctrl-C
        signal.signal(signal.SIGINT, before)
    assert stopped.value.code == 130 and preemption.received == signal.SIGINT
    assert torch.load(tmp_path / "last.ckpt", weights_only=True)["global_step"] == 1
