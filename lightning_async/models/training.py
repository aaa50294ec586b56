"""``CausalLMTraining``: the training features every causal LM here shares (objective, logging, the zoo's
optimizers with warmup + cosine, tokens seen in checkpoints).

It lives in ``models`` so the models build on it without importing :mod:`lightning_async.lm` (which imports
the models): the arrows point one way, ``lm -> models``.
"""

from __future__ import annotations

import warnings

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities.warnings import PossibleUserWarning
from torchmetrics import MeanMetric

from lightning_async.models.objective import next_token_loss, split_next_token
from lightning_async.optim import build_optimizer, check_optimizer_settings
from lightning_async.optim.lr_schedules import warmup_cosine

# ``val/ppl`` and ``test/ppl`` come from the loss metric's compute(), which reduces across ranks itself: Lightning's
# advice to log them with sync_dist=True (given on every distributed run) does not apply
warnings.filterwarnings("ignore", message=r"It is recommended to use `self\.log\('(val|test)/ppl'",
                        category=PossibleUserWarning)


def _reset_outside_inference(metric: MeanMetric) -> None:
    """Start an evaluation epoch from an empty metric whose state is an ordinary tensor.

    Lightning evaluates ``validate``/``test`` under ``torch.inference_mode``: a reset there makes the metric's
    state inference tensors, which a later ``fit`` on the same module (its validation runs under ``no_grad``)
    cannot update in place, and whatever an interrupted epoch left would be averaged into the next one.
    """
    with torch.inference_mode(False):
        metric.reset()


class CausalLMTraining(LightningModule):
    """Next-token training shared by the causal LMs: objective, loss/perplexity/tokens logging, the zoo's
    optimizers with warmup + cosine, tokens seen in checkpoints.

    A subclass takes its own arguments and ``**training`` (the arguments below, which it passes on with
    ``super().__init__(**training)``: the CLI and ``save_hyperparameters`` see all of them, so every model shares
    one list of training settings). It defines ``forward(input_ids) -> logits``, ``pipeline_units()``,
    ``max_seq_len`` and ``_depth_and_width()`` (layers, hidden size: for :meth:`flops_per_token`).

    Args:
        optimizer: a name from the zoo (:data:`lightning_async.optim.OPTIMIZER_NAMES`).
        lr: peak learning rate (for the Muon family: of the matrices; see the optimizer recipes).
        weight_decay: decoupled weight decay of the decayed groups.
        optimizer_kwargs: extra arguments for the zoo (betas, momentum, a separate AdamW lr, ...).
        warmup_fraction: share of steps with linear warmup (paper: 0.1).
        min_lr_fraction: cosine decays to this fraction of the peak (paper: 0.1).
    """

    def __init__(
        self,
        optimizer: str = "adamw",
        lr: float = 3e-3,
        weight_decay: float = 0.1,
        optimizer_kwargs: dict | None = None,
        warmup_fraction: float = 0.1,
        min_lr_fraction: float = 0.1,
    ) -> None:
        super().__init__()
        check_optimizer_settings(optimizer, optimizer_kwargs or {})
        self.save_hyperparameters()  # (with the subclass's own arguments: Lightning collects the whole chain)
        # Losses reaching log_loss are already averaged over every rank (the pipeline reduces them),
        # so the metrics must not sync again.
        self.test_loss = MeanMetric(sync_on_compute=False)
        self.val_loss = MeanMetric(sync_on_compute=False)
        self.tokens_seen = 0

    pipeline_ignores_steps = True  # the steps below are the single-device path; log_loss logs the same under a pipeline
    pipeline_split_batch = staticmethod(split_next_token)
    pipeline_loss = staticmethod(next_token_loss)

    @property
    def max_seq_len(self) -> int:
        """The longest sequence the model's position encoding is built for."""
        raise NotImplementedError

    def _depth_and_width(self) -> tuple[int, int]:
        raise NotImplementedError

    # ---- plain training ----------------------------------------------------------------------
    def _loss(self, batch: torch.Tensor) -> torch.Tensor:
        inputs, targets = self.pipeline_split_batch(batch)
        return self.pipeline_loss(self(inputs), targets)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log_loss("train", loss, batch)
        return loss

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.log_loss("val", self._loss(batch), batch)

    def test_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.log_loss("test", self._loss(batch), batch)

    def log_loss(self, split: str, loss: torch.Tensor, batch: torch.Tensor) -> None:
        """Log loss and perplexity of ``split``; in training also tokens seen (all data-parallel ranks)."""
        loss = loss.detach()
        if split == "train":
            self.log("train/loss", loss, prog_bar=True)
            self.log("train/ppl", torch.exp(loss))
            self.log("train/tokens", float(self.tokens_seen))
            return
        metric = self.val_loss if split == "val" else self.test_loss
        metric.update(loss, weight=batch.shape[0])
        self.log(f"{split}/loss", metric, prog_bar=split == "val", sync_dist=False)

    def on_train_batch_start(self, batch: torch.Tensor, batch_idx: int) -> None:
        """Count tokens here, not where the loss is logged: a pipeline reports some losses a step late."""
        replicas = getattr(self.trainer.strategy, "data_parallel_size", self.trainer.world_size)
        self.tokens_seen += (batch.shape[0] * (batch.shape[1] - 1)) * replicas

    def on_validation_epoch_start(self) -> None:
        _reset_outside_inference(self.val_loss)

    def on_test_epoch_start(self) -> None:
        _reset_outside_inference(self.test_loss)

    def on_validation_epoch_end(self) -> None:
        self._log_perplexity("val")

    def on_test_epoch_end(self) -> None:
        self._log_perplexity("test")

    def _log_perplexity(self, split: str) -> None:
        metric = self.val_loss if split == "val" else self.test_loss
        if metric.update_called:
            mean = metric.compute()
            self.log(f"{split}/ppl", torch.exp(mean))  # of the metric's compute(): reduced already (no sync_dist)
            if split == "val" and self.logger is not None and self.tokens_seen:
                self.logger.log_metrics({"val/loss_by_tokens": float(mean)}, step=self.tokens_seen)

    # ---- optimization ------------------------------------------------------------------------
    def configure_optimizers(self):
        kwargs = dict(self.hparams.optimizer_kwargs or {})
        optimizer = build_optimizer(
            self.hparams.optimizer, self.named_parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay, **kwargs
        )
        total = max(1, int(self.trainer.estimated_stepping_batches)) if self._trainer is not None else 1
        warmup, floor = self.hparams.warmup_fraction, self.hparams.min_lr_fraction
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: warmup_cosine(step, total, warmup, floor))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["tokens_seen"] = self.tokens_seen

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        self.tokens_seen = checkpoint.get("tokens_seen", 0)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6N for the weights plus 12 L H T for attention (PaLM's estimate)."""
        layers, hidden = self._depth_and_width()
        return 6 * self.num_parameters() + 12 * layers * hidden * seq_len
