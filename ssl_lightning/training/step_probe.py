"""Watch every module of a model through one step: the first module whose forward output or
output gradient is not finite, and the largest output and gradient norms per module (the
replay of a captured step, ``python -m ssl_lightning replay``).

Forward hooks see each module's output when its forward returns (inner modules before the
modules that hold them, so the first non-finite output names the innermost module where the
NaN/inf appears); a hook on each output tensor sees its gradient in the backward pass, in the
order the backward pass runs. A module called several times in the step (once per view)
reports its largest norm.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle


def _tensors(value: Any) -> Iterator[Tensor]:
    """The floating-point tensors of a module output (a tensor, or tuples/lists/dicts of them)."""
    if isinstance(value, Tensor):
        if value.is_floating_point():
            yield value
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


def _norm(tensor: Tensor) -> float:
    """The L2 norm in float64 (inf when an element is inf, nan when one is nan)."""
    return float(tensor.detach().double().norm())


def _merge(previous: float | None, norm: float) -> float:
    """The larger of two norms, nan once either is nan."""
    if previous is None:
        return norm
    return math.nan if math.isnan(previous) or math.isnan(norm) else max(previous, norm)


def largest(norms: dict[str, float], count: int) -> list[tuple[str, float]]:
    """The ``count`` largest finite norms of ``norms`` (name -> norm)."""
    finite = [(name, norm) for name, norm in norms.items() if math.isfinite(norm)]
    return sorted(finite, key=lambda item: item[1], reverse=True)[:count]


def nonfinite(norms: dict[str, float]) -> list[str]:
    """The names whose norm is NaN or inf."""
    return [name for name, norm in norms.items() if not math.isfinite(norm)]


@dataclass
class StepProbe:
    """Hooks on every submodule of a model (:meth:`attach`, :meth:`detach`).

    Attributes:
        first_nonfinite_output: The first module whose forward output held NaN/inf.
        first_nonfinite_gradient: The first module (in backward order) whose output gradient
            held NaN/inf.
        output_norms: Module -> largest L2 norm of its outputs.
        gradient_norms: Module -> largest L2 norm of the gradient of its outputs.
    """

    first_nonfinite_output: str | None = None
    first_nonfinite_gradient: str | None = None
    output_norms: dict[str, float] = field(default_factory=dict)
    gradient_norms: dict[str, float] = field(default_factory=dict)
    _hook_handles: list[RemovableHandle] = field(default_factory=list, repr=False)

    def attach(self, model: nn.Module) -> None:
        """Hook every submodule of ``model`` (the model itself is named ``<model>``)."""
        for name, module in model.named_modules():
            self._hook_handles.append(module.register_forward_hook(self._forward_hook(name or
                                                                                "<model>")))

    def detach(self) -> None:
        """Remove the hooks."""
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles.clear()

    def _forward_hook(self, name: str) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            for tensor in _tensors(output):
                norm = _norm(tensor)
                self.output_norms[name] = _merge(self.output_norms.get(name), norm)
                if not math.isfinite(norm) and self.first_nonfinite_output is None:
                    self.first_nonfinite_output = name
                if tensor.requires_grad:
                    tensor.register_hook(self._gradient_hook(name))
        return hook

    def _gradient_hook(self, name: str) -> Any:
        def hook(gradient: Tensor) -> None:
            norm = _norm(gradient)
            self.gradient_norms[name] = _merge(self.gradient_norms.get(name), norm)
            if not math.isfinite(norm) and self.first_nonfinite_gradient is None:
                self.first_nonfinite_gradient = name
        return hook

    def largest_outputs(self, count: int = 5) -> list[tuple[str, float]]:
        """The modules with the largest output norms."""
        return largest(self.output_norms, count)

    def largest_gradients(self, count: int = 5) -> list[tuple[str, float]]:
        """The modules with the largest output-gradient norms."""
        return largest(self.gradient_norms, count)


def parameter_gradient_norms(model: nn.Module) -> dict[str, float]:
    """Module -> L2 norm of the gradients of its own (not its children's) parameters."""
    norms: dict[str, float] = {}
    for name, module in model.named_modules():
        grads = [p.grad for p in module.parameters(recurse=False) if p.grad is not None]
        if grads:
            norms[name or "<model>"] = math.sqrt(sum(_norm(g) ** 2 for g in grads))
    return norms


__all__ = ["StepProbe", "largest", "nonfinite", "parameter_gradient_norms"]
