"""The training sampler: a per-epoch shuffle that a resumed run can pick up in the middle of an epoch.

Lightning resumes a mid-epoch checkpoint with a fresh iterator over the training loader, i.e. from the
epoch's first batch again, unless the loader restores its own position. Long pretraining runs are resumed
mid-epoch all the time (preemption), so the sampler does it: the permutation of epoch ``e`` depends only
on ``(seed, e)`` (the rule of ``DistributedSampler``, which this class extends, so Lightning never
replaces it), and when an epoch's iteration starts (at the first batch drawn, after Lightning has restored
the checkpoint's loop state) it asks the Trainer which epoch it is in and how many batches of it were
already trained, and skips those. Nothing has to be saved: the checkpoint's loop state is the position.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sized

from torch.utils.data import DataLoader, DistributedSampler

#: returns ``(epoch, batches of that epoch this replica already trained on)``
ResumePoint = Callable[[], "tuple[int, int]"]


def trainer_position(trainer) -> ResumePoint:
    """The :data:`ResumePoint` of a Lightning ``Trainer``: its epoch and the batches of it already trained."""
    from lightning_async import compat

    return lambda: (trainer.current_epoch, compat.batches_started_this_epoch(trainer))


class ResumableShuffleSampler(DistributedSampler):
    """Shuffle per epoch from ``(seed, epoch)``, shard over data-parallel replicas, resume mid-epoch.

    Args:
        dataset: the training windows.
        batch_size: windows per batch (per replica), to turn trained batches into samples to skip.
        seed: shuffle seed.
        num_replicas, rank: data-parallel sharding (1 and 0 without data parallelism).
        resume_point: where the Trainer stands (see :data:`ResumePoint`); ``None`` outside a Trainer, in
            which case each iteration starts the next epoch (``set_epoch`` chooses one explicitly).
    """

    def __init__(
        self,
        dataset: Sized,
        batch_size: int,
        seed: int,
        num_replicas: int = 1,
        rank: int = 0,
        resume_point: ResumePoint | None = None,
    ) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed, drop_last=True)
        self.batch_size = batch_size
        self.resume_point = resume_point
        self.skipped = 0  # samples skipped at the start of the current iteration (a resumed epoch)

    @property
    def batches_per_epoch(self) -> int:
        return self.num_samples // self.batch_size

    def __iter__(self) -> Iterator[int]:
        done = 0
        if self.resume_point is not None:
            self.epoch, done = self.resume_point()
            if done >= self.batches_per_epoch:  # the checkpoint closed its epoch: the next one starts afresh
                self.epoch, done = self.epoch + 1, 0
        indices = list(super().__iter__())
        if self.resume_point is None:
            self.epoch += 1
        self.skipped = done * self.batch_size
        return iter(indices[self.skipped :])


class ResumableDataLoader(DataLoader):
    """A ``DataLoader`` that tells Lightning it resumes mid-epoch (its ``ResumableShuffleSampler`` does).

    Lightning checks for ``state_dict``/``load_state_dict`` and otherwise warns on every mid-epoch resume
    that the loader "is not resumable". The position lives in the checkpoint's loop state already, so the
    state is empty.
    """

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state_dict: dict) -> None:
        """Nothing to restore: the sampler reads the restored loop state of the Trainer."""
