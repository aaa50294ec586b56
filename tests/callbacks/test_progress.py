"""``StepProgress``: the lines it prints during a fit, and how it takes the place of Lightning's default bar."""

from __future__ import annotations

import re

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ProgressBar, TQDMProgressBar

from lightning_async.callbacks.progress import StepProgress, replace_default_bar, total_steps


class Regression(L.LightningModule):
    """A linear model on fixed random data that logs ``train/loss`` and ``val/loss`` as the language models do."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(5, 1)
        self.logged: dict[int, float] = {}

    def training_step(self, batch, batch_idx):
        loss = self.layer(batch.float()).pow(2).mean()
        self.log("train/loss", loss)
        self.logged[self.global_step + 1] = float(loss.detach())  # the step count after this batch's update
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val/loss", self.layer(batch.float()).pow(2).mean())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.randn(64, 5), batch_size=8)

    def val_dataloader(self):
        return torch.utils.data.DataLoader(torch.randn(16, 5), batch_size=8)


def _trainer(**kwargs) -> L.Trainer:
    return L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_model_summary=False,
                     num_sanity_val_steps=0, **kwargs)


LINE = re.compile(r"^step (\d+)/6 \| train/loss (\S+) \| ([\d,]+) tokens/s \| val/loss (\S+)(?: \(step (\d+)\))? \| "
                  r"\d+:\d\d:\d\d elapsed, ~\d+:\d\d:\d\d left$")


def test_a_line_every_n_steps_with_the_loss_the_model_logged(capsys):
    model = Regression()
    trainer = _trainer(max_steps=6, val_check_interval=3, limit_val_batches=2, callbacks=[StepProgress(every_n_steps=2)],
                       enable_progress_bar=False)
    trainer.fit(model)
    lines = capsys.readouterr().out.splitlines()
    steps = [LINE.match(line) for line in lines if line.startswith("step ")]
    assert all(steps) and [int(m.group(1)) for m in steps] == [2, 4, 6], lines
    for match in steps:
        assert float(match.group(2)) == pytest.approx(model.logged[int(match.group(1))], abs=1e-4)
    assert [m.group(4) for m in steps][0] == "-"  # no validation before step 3
    validations = [line for line in lines if line.startswith("validation at step")]
    assert [line.split(":")[0] for line in validations] == ["validation at step 3", "validation at step 6"]
    assert steps[1].group(5) == "3" and float(steps[1].group(4)) == pytest.approx(float(validations[0].split()[-1]))
    assert lines[0] == "training 6 steps from step 0; a line every 2 steps" and lines[-1].startswith("trained 6 steps in ")


def test_disabled_it_prints_nothing_and_bad_settings_are_refused(capsys):
    _trainer(max_steps=2, limit_val_batches=0, callbacks=[StepProgress(enabled=False)], enable_progress_bar=False).fit(Regression())
    assert capsys.readouterr().out == ""
    with pytest.raises(ValueError, match="every_n_steps must be >= 1"):
        StepProgress(every_n_steps=0)


def test_it_replaces_only_the_bar_lightning_added_by_default():
    progress = StepProgress()
    trainer = _trainer(callbacks=[progress])
    assert isinstance(trainer.progress_bar_callback, ProgressBar)  # Lightning's default: Rich or TQDM
    assert replace_default_bar(trainer, progress, configured=[progress]) and trainer.progress_bar_callback is None
    assert progress.enabled

    own, progress = TQDMProgressBar(refresh_rate=5), StepProgress()
    trainer = _trainer(callbacks=[own, progress])
    assert not replace_default_bar(trainer, progress, configured=[own, progress])
    assert trainer.progress_bar_callback is own and not progress.enabled  # the user's bar, no lines beside it

    progress = StepProgress()
    assert not replace_default_bar(_trainer(callbacks=[progress], enable_progress_bar=False), progress, [progress])
    assert not progress.enabled  # --trainer.enable_progress_bar false: quiet

    progress = StepProgress(enabled=False)
    trainer = _trainer(callbacks=[progress])
    assert not replace_default_bar(trainer, progress, [progress]) and trainer.progress_bar_callback is not None


def test_total_steps_is_max_steps_or_the_estimate():
    assert total_steps(_trainer(max_steps=7)) == 7
