"""The report of a replayed step (:func:`ssl_lightning.cli.replay.replay`): what it found and
how it compares with the capture, as the ``replay`` command prints it."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ssl_lightning.training.divergence import ADVICE


@dataclass
class ReplayReport:
    """What the replay of a captured step found (:meth:`text`: as the command prints it)."""

    capture: str
    step: dict[str, int]
    world_size: int
    precision: str
    captured_precision: str
    accelerator: str
    captured_accelerator: str
    reason: str
    same_samples: bool
    captured_loss: Tensor | None
    loss: Tensor | None
    loss_equal: bool | None
    gradient_difference: float | None
    gradients_equal: bool | None
    exact_state: bool
    batch_norm: str
    terms: dict[str, float]
    first_nonfinite_output: str | None
    first_nonfinite_gradient: str | None
    nonfinite_outputs: int
    nonfinite_gradients: int
    largest_outputs: list[tuple[str, float]]
    largest_gradients: list[tuple[str, float]]
    largest_parameter_gradients: list[tuple[str, float]]
    schedules: dict[str, Any]
    image_paths: list[str]
    views_written: list[str] = field(default_factory=list)

    @property
    def reproduced(self) -> bool:
        """The replay ran the captured step: same samples, and loss (and gradients, where
        captured) equal."""
        return self.same_samples and self.loss_equal is not False \
            and self.gradients_equal is not False

    def text(self) -> str:
        """The report as printed by the command."""
        s = self.step
        lines = [f"Replay of {self.capture}",
                 f"  step: epoch {s['epoch']}, batch {s['batch']}, global step "
                 f"{s['global_step']}, captured on {self.world_size} process(es) "
                 f"({self.captured_accelerator}); replayed on 1 process ({self.accelerator}) in "
                 f"{self.precision}",
                 "  captured because: " + self.reason.split(" The step is captured")[0]
                 .replace(ADVICE, "").strip()]
        lines.append("Reproduction")
        lines.append("  samples: " + ("the captured ones" if self.same_samples else
                                      "DIFFERENT from the capture (the data or order changed)"))
        lines.append(f"  loss: captured {_value(self.captured_loss)}, replayed {_value(self.loss)}"
                     f" -> {_verdict(self.loss_equal)}")
        if self.loss_equal is None and self.gradients_equal is None \
                and self.precision != self.captured_precision:
            lines.append(f"  not compared: replayed in {self.precision}, the run used "
                         f"{self.captured_precision}")
        elif self.gradients_equal is None:
            lines.append("  gradients: not in the capture (it stopped before the backward "
                         "pass)")
        else:
            lines.append(f"  gradients: largest difference {self.gradient_difference:.3g} -> "
                         f"{_verdict(self.gradients_equal)}")
        if self.world_size > 1 and self.batch_norm == "per-rank":
            lines.append("  note: the run's batch norm used each rank's own batch statistics "
                         "(no sync_batchnorm), which one process cannot reproduce")
        if not self.exact_state:
            lines.append("  note: a parameter was changed in place before the capture; its "
                         "value before the step is not in the capture")
        if not self.reproduced:
            lines.append("  THE REPLAY DIFFERS FROM THE CAPTURED STEP: randomness outside the "
                         "sample seeds (a transform drawing from another generator), changed "
                         "data, or another device/library version (see manifest.json)")
        lines.append("Loss terms")
        lines += [f"  {name}: {value:.6g}" for name, value in self.terms.items()] or [
            "  none logged"]
        lines.append("Non-finite values")
        lines.append(f"  first module with a non-finite output: "
                     f"{self.first_nonfinite_output or 'none'} ({self.nonfinite_outputs} "
                     "modules in all)")
        lines.append(f"  first module with a non-finite output gradient (backward order): "
                     f"{self.first_nonfinite_gradient or 'none'} ({self.nonfinite_gradients} "
                     "modules in all)")
        for title, norms in (("Largest finite output norms", self.largest_outputs),
                             ("Largest finite output-gradient norms", self.largest_gradients),
                             ("Largest finite parameter-gradient norms",
                              self.largest_parameter_gradients)):
            lines.append(title)
            lines += [f"  {name}: {value:.4g}" for name, value in norms] or ["  none"]
        lines.append("Schedules at this step")
        lines += [f"  {name}: {_format(value)}" for name, value in self.schedules.items()]
        lines.append(f"Images of the batch ({len(self.image_paths)})")
        lines += [f"  {path}" for path in self.image_paths]
        if self.views_written:
            lines.append(f"Views written: {len(self.views_written)} images in "
                         f"{Path(self.views_written[0]).parent}")
        return "\n".join(lines)


def _value(loss: Tensor | None) -> str:
    return "-" if loss is None else f"{float(loss):.10g}"


def _verdict(equal: bool | None) -> str:
    return {True: "equal", False: "DIFFERENT", None: "not compared"}[equal]


def _format(value: Any) -> str:
    if isinstance(value, list):
        return ", ".join(_format(v) for v in value)
    return f"{value:.6g}" if isinstance(value, float) else str(value)


def same_bits(a: Tensor, b: Tensor) -> bool:
    """Bitwise equality (a NaN equals a NaN of the same bits)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return bool(torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))


#: Relative tolerance of the comparisons that cannot be bitwise: a DDP capture replayed on one
#: process (another reduction order), or a replay on another device.
RELATIVE_TOLERANCE = 1e-6


def close(a: Tensor, b: Tensor) -> bool:
    """Equal to :data:`RELATIVE_TOLERANCE` of the largest value; NaN/inf in the same places."""
    a, b = a.double(), b.double()
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        return bool(torch.equal(torch.isnan(a), torch.isnan(b)) and torch.equal(
            a.nan_to_num(), b.nan_to_num()))
    return bool((a - b).abs().max() <= RELATIVE_TOLERANCE * b.abs().max().clamp_min(1e-30))


def compare_gradients(captured: dict[str, Tensor], replayed: dict[str, Tensor],
                       exact: bool) -> tuple[float, bool]:
    """(largest absolute difference, equal): bitwise when ``exact`` and the dtypes agree."""
    if captured.keys() != replayed.keys():
        return math.inf, False
    difference = 0.0
    equal = True
    for name, grad in captured.items():
        other = replayed[name]
        delta = (grad.double() - other.double()).abs().nan_to_num(nan=math.inf)
        both_nan = torch.isnan(grad.double()) & torch.isnan(other.double())
        difference = max(difference, float(delta.masked_fill(both_nan, 0).max()))
        same = same_bits(grad, other) if exact and grad.dtype == other.dtype \
            else close(grad, other)
        equal = equal and same
    return difference, equal
