"""Property of every registered method: its loss computes in fp32 under mixed precision.

For each method of the registry, its small instance takes one ``bf16-mixed`` step through the
Trainer on CPU. Every loss module (a class of ``ssl_lightning.losses``) the step calls is
recorded with its inputs as they arrived (rounded to bf16 where the networks ran in bf16) and
its state before the call; then, outside autocast, a copy of it in that state computes the loss
of the same values in fp32. The stated tolerance: the loss under autocast equals that fp32 loss
to 1e-5 relative, so it really computes in fp32 inside (a bf16 softmax / matmul is off by
~1e-2, :func:`test_a_bf16_loss_would_fail_the_tolerance`). The same inputs rounded to fp16 under
``autocast(float16)`` (``16-mixed``) are held to the same tolerance. A method that opts out of
``autocast`` (:attr:`MethodEntry.opt_outs`) is skipped with its reason printed.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable
from typing import Any

import pytest
import torch
from opt_outs import skip_opted_out
from torch import Tensor, nn

import ssl_lightning.losses as losses
from ssl_lightning.methods.registry import MethodEntry, method_entries
from ssl_lightning.testing.trainer_runs import (
    entry_data,
    fit_and_dump,
)

ENTRIES = method_entries()
OPTIM = dict(optimizer="sgd", lr=0.1, lr_scaling="none", warmup_epochs=0)
RTOL, ATOL = 1e-5, 1e-6


def _map(value: Any, fn: Callable[[Tensor], Tensor]) -> Any:
    """``fn`` on the floating-point tensors in ``value`` (nested lists, tuples, dicts); labels,
    masks and numbers stay as they are."""
    if isinstance(value, Tensor):
        return fn(value) if value.is_floating_point() else value.clone()
    if isinstance(value, (list, tuple)):
        return type(value)(_map(v, fn) for v in value)
    if isinstance(value, dict):
        return {k: _map(v, fn) for k, v in value.items()}
    return value


def _floats(value: Any) -> list[Tensor]:
    """The floating-point tensors in ``value``, in order."""
    if isinstance(value, Tensor):
        return [value] if value.is_floating_point() else []
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _floats(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _floats(v)]
    return []


#: The loss modules' entry points a method calls: ``forward``, or the separate terms (MSN).
ENTRY_POINTS = ("forward", "terms")


def _plain_copy(module: nn.Module) -> nn.Module:
    """A deep copy of ``module`` without the recording wrappers."""
    clone = copy.deepcopy(module)
    for name in ENTRY_POINTS:
        clone.__dict__.pop(name, None)
    return clone


class LossCall:
    """One call of a loss module: its state before, its inputs and output, the RNG state."""

    def __init__(self, module: nn.Module, entry_point: str, args: tuple, kwargs: dict) -> None:
        self.module, self.entry_point = _plain_copy(module), entry_point
        self.args = _map(args, lambda t: t.detach().clone())
        self.kwargs = _map(kwargs, lambda t: t.detach().clone())
        self.rng = torch.get_rng_state()
        self.output: Any = None

    def rerun(self, cast: Callable[[Tensor], Tensor]) -> Any:
        """The loss of a fresh copy on the inputs mapped by ``cast``, from the same RNG state."""
        torch.set_rng_state(self.rng)
        with torch.no_grad():
            call = getattr(copy.deepcopy(self.module), self.entry_point)
            return call(*_map(self.args, cast), **_map(self.kwargs, cast))


def record_loss_calls(model: nn.Module) -> dict[str, LossCall]:
    """Wrap the entry points of every loss module of ``model`` to record their first call
    (keyed by module path and entry point)."""
    calls: dict[str, LossCall] = {}
    for path, module in model.named_modules():
        if not type(module).__module__.startswith("ssl_lightning.losses"):
            continue
        for name in ENTRY_POINTS:
            if hasattr(module, name):
                setattr(module, name, _recording(module, name, f"{path}.{name}", calls))
    return calls


def _recording(module: nn.Module, name: str, key: str,
               calls: dict[str, LossCall]) -> Callable[..., Any]:
    method = getattr(module, name)

    def record(*args: Any, **kwargs: Any) -> Any:
        first = key not in calls
        if first:
            calls[key] = LossCall(module, name, args, kwargs)
        output = method(*args, **kwargs)
        if first:
            calls[key].output = _map(output, lambda t: t.detach().clone())
        return output

    return record


def bf16_step_loss_calls(entry: MethodEntry) -> dict[str, LossCall]:
    """One ``bf16-mixed`` Trainer step of ``entry``'s small instance; its loss calls."""
    torch.manual_seed(0)
    model = entry.small(**OPTIM)
    calls = record_loss_calls(model)
    fit_and_dump(model, entry_data(entry, 8, 8), max_steps=1, precision="bf16-mixed")
    return calls


def assert_close(got: Any, want: Any, what: str) -> None:
    got, want = _floats(got), _floats(want)
    assert len(got) == len(want) and got, what
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.float(), w.float(), rtol=RTOL, atol=ATOL,
                                   msg=lambda m: f"{what}: {m}")


#: Tiny tensors: one intra-op thread is faster (and fair to a shared machine).
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("entry", ENTRIES, ids=[e.name for e in ENTRIES])
def test_the_loss_computes_in_fp32_under_autocast(entry: MethodEntry) -> None:
    skip_opted_out(entry, "autocast")
    calls = bf16_step_loss_calls(entry)
    assert calls, f"{entry.name}: no loss module of ssl_lightning.losses ran in the step"
    for path, call in calls.items():
        name = f"{entry.name}.{path} ({type(call.module).__name__})"
        loss = _floats(call.output)[0]
        assert loss.dtype == torch.float32 and torch.isfinite(loss).all(), f"{name}: {loss}"
        assert_close(call.output, call.rerun(lambda t: t.float()), f"{name} in bf16")
        with torch.autocast("cpu", dtype=torch.float16):
            half = call.rerun(lambda t: t.half())
        assert _floats(half)[0].dtype == torch.float32, name
        assert_close(half, call.rerun(lambda t: t.half().float()), f"{name} in fp16")


def test_every_loss_class_runs_in_some_registered_method() -> None:
    """The property above covers every loss class of ``ssl_lightning.losses``."""
    classes = {name for name in losses.__all__ if inspect.isclass(getattr(losses, name))
               and issubclass(getattr(losses, name), nn.Module)}
    used = {type(m).__name__ for entry in ENTRIES for m in entry.small().modules()}
    assert classes <= used, f"loss classes no registered method uses: {classes - used}"


def test_a_bf16_loss_would_fail_the_tolerance() -> None:
    """The 1e-5 tolerance bites: NT-Xent computed in bf16 is off by more."""
    torch.manual_seed(0)
    z1, z2 = torch.randn(8, 16).bfloat16(), torch.randn(8, 16).bfloat16()
    fp32 = losses.NTXentLoss(0.2, chunk_size=None)(z1.float(), z2.float())
    z = torch.nn.functional.normalize(torch.cat([z1, z2]), dim=1)
    logits = (z @ z.T / 0.2).fill_diagonal_(float("-inf"))
    target = torch.cat([torch.arange(8, 16), torch.arange(8)])
    bf16 = torch.nn.functional.cross_entropy(logits, target)
    assert bf16.dtype == torch.bfloat16
    assert (bf16.float() - fp32).abs() > RTOL * fp32.abs()
