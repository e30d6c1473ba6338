"""docs/writing_a_method.md cannot rot: its example method is written out and run through the
CLI command and the Python snippet the page shows, and its claim of exactness under DDP is
checked (2 processes with half the batch each = 1 process with the whole batch, float64)."""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

import pytest
import torch
from distributed_utils import backward_like_ddp, run_in_processes

from ssl_lightning.backbones import SmallConvNet

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
PAGE = (ROOT / "docs" / "writing_a_method.md").read_text()
PYTHON_BLOCKS = re.findall(r"```python\n(.*?)```", PAGE, re.DOTALL)
BASH_BLOCKS = re.findall(r"```bash\n(.*?)```", PAGE, re.DOTALL)
MODULE = next(block for block in PYTHON_BLOCKS if block.startswith("# my_methods.py"))
WORLD, BATCH = 2, 6


@pytest.fixture
def my_methods(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "my_methods.py").write_text(MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))  # for spawned processes
    yield tmp_path
    sys.modules.pop("my_methods", None)


def test_the_python_snippet_runs(my_methods: Path, capsys: pytest.CaptureFixture) -> None:
    snippet = next(block for block in PYTHON_BLOCKS if "from my_methods import" in block)
    exec(compile(snippet, "writing_a_method.md", "exec"), {})
    assert re.fullmatch(r"loss -?\d+\.\d{3}\n", capsys.readouterr().out)


def test_the_cli_command_trains_the_example(my_methods: Path, tiny_image_folder: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from conftest import TINY_TRAINER_ARGS

    from ssl_lightning.cli import main

    command = next(block for block in BASH_BLOCKS if "my_methods.AlignUniform" in block)
    words = shlex.split(command.replace("\\\n", " "))
    assert words[:4] == ["PYTHONPATH=.", "python", "-m", "ssl_lightning"]
    monkeypatch.chdir(my_methods)  # the run's files go to a temporary folder, not the checkout
    words = [str(ROOT / word) if word.startswith("configs/") else word for word in words]
    args = [*words[4:], "--data.root", str(tiny_image_folder), "--data.batch_size", "4",
            "--data.num_workers", "0", *TINY_TRAINER_ARGS]
    cli = main(args)
    assert type(cli.model).__name__ == "AlignUniform" and cli.trainer.global_step == 1
    assert torch.isfinite(cli.trainer.callback_metrics["train/loss"])
    assert "val/knn_top1" in cli.trainer.callback_metrics  # the features reached the callbacks


def _model():
    from my_methods import AlignUniform

    torch.manual_seed(0)
    return AlignUniform(SmallConvNet(widths=(4, 8)), projection_dim=8,
                        head_batch_norm=False).double()


def _views() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(WORLD * BATCH, 3, 8, 8, generator=generator, dtype=torch.float64)
            for _ in range(2)]


def _rank_step(rank: int, world: int, gather: bool) -> tuple[float, list[torch.Tensor]]:
    model = _model()
    if not gather:  # known-bad: uniformity against this rank's embeddings only
        model.gather = lambda x: x  # type: ignore[method-assign]
        model.rank_offset = lambda batch: 0  # type: ignore[method-assign]
    local = [view[rank * BATCH:(rank + 1) * BATCH] for view in _views()]
    loss = backward_like_ddp(model, model.loss_from_outputs(model.forward_views(local)), world)
    return float(loss), [p.grad.clone() for p in model.parameters()]


def test_the_example_is_exact_under_ddp(my_methods: Path) -> None:
    single_loss, single_grads = _single()
    for gather, equal in ((True, True), (False, False)):
        ranks = run_in_processes(_rank_step, WORLD, gather)
        loss, grads = ranks[0]
        matches = abs(loss - single_loss) < 1e-10 and all(
            torch.allclose(g, s, rtol=0, atol=1e-10)
            for g, s in zip(grads, single_grads, strict=True))
        assert matches is equal, f"gather={gather}: loss {loss} vs {single_loss}"


def _single() -> tuple[float, list[torch.Tensor]]:
    model = _model()
    loss = model.loss_from_outputs(model.forward_views(_views()))
    loss.backward()
    return float(loss), [p.grad.clone() for p in model.parameters()]


def test_the_pages_checks_pass_on_the_example(my_methods: Path, tmp_path: Path) -> None:
    """The page's test module (the ``ssl_lightning.testing`` checks) passes on the example;
    the known-bad variant without gathers is ``test_the_example_is_exact_under_ddp``'s."""
    block = next(block for block in PYTHON_BLOCKS if block.startswith("# test_my_methods.py"))
    (my_methods / "test_my_methods.py").write_text(block)
    import test_my_methods

    try:
        test_my_methods.test_micro_batches_equal_the_whole_batch()
        test_my_methods.test_two_processes_equal_one()
        test_my_methods.test_resume_is_exact(tmp_path / "checkpoints")
    finally:
        sys.modules.pop("test_my_methods", None)
