"""SIGTERM to any rank of a pipeline stops the whole pipeline within seconds, with exit status 1.

Lightning 2.6 broadcasts a SIGTERM flag from rank 0 before every training batch, and from its signal handler.
Under a pipeline both hang: a world collective per step would hold the stages in lockstep (and deadlock against
the 2BW stream, where the stages are in different batches at the same moment), and a handler on a rank other
than 0 would wait for a broadcast rank 0 never makes. So the signalled rank stops by itself at its next batch
boundary, training or evaluation (after a checkpoint save in progress, which stays whole), or at the end of a
validation, test or the final drain, and the ranks it started get the signal too; the other stages raise
``PeerFailure`` once it has gone.
"""

from __future__ import annotations

from lightning.pytorch.utilities.exceptions import SIGTERMException

from lightning_async import compat


class StageTerminated(SIGTERMException):
    """SIGTERM reached this pipeline stage; it stopped at the next batch boundary (exit status 1, with the message)."""


class SigtermStop:
    """One rank's SIGTERM state: set by the signal, checked at batch boundaries. ``describe()`` names the rank."""

    def __init__(self, describe) -> None:
        self.received = False
        self._describe = describe

    def install(self, trainer, launcher) -> None:
        """Take over Lightning's SIGTERM hooks for ``trainer``; the ranks ``launcher`` started get the signal too."""
        self.received = False

        def on_sigterm(signum, frame) -> None:
            if not self.received:
                compat.kill_started(launcher, signum)
            self.received = True

        compat.install_sigterm_hooks(trainer, on_sigterm, lambda: self.stop_if_received(f"at step {trainer.global_step}"))

    def stop_if_received(self, where: str) -> None:
        """Raise :class:`StageTerminated` if this rank received SIGTERM (``where``: "at step N", ...)."""
        if self.received:
            raise StageTerminated(
                f"SIGTERM: {self._describe()} stopped {where}. "
                "The other stages stop when they notice (PeerFailure, within timeout)."
            )

    def stop_if_received_in_evaluation(self, trainer, batch_idx: int | None = None) -> None:
        """:meth:`stop_if_received` at an evaluation batch (``None``: at the end of the evaluation)."""
        what = trainer.state.stage.value if trainer.state.stage is not None else "evaluation"
        at = f"at {what} batch {batch_idx}" if batch_idx is not None else f"at the end of {what}"
        self.stop_if_received(f"{at} (step {trainer.global_step})")
