"""Where a run stands (:class:`RunState`, saved in every checkpoint and sent to a rank healed from a peer), what the
loop of one invocation carries (:class:`LoopState`), and the trainer's whole state as one dict
(:func:`trainer_state`, :func:`load_trainer_state`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Protocol

from data.common import resumed_step_in_epoch, steps_per_epoch


@dataclass
class RunState:
    """The position in the run and its evaluations. Epochs are numbered from 1 wherever a user reads or sets them,
    so the epoch in progress is ``epoch + 1``."""

    epoch: int = 0  # epochs completed
    step: int = 0  # optimizer steps completed
    step_in_epoch: int = 0  # steps of the epoch in progress
    epoch_samples: int = 0  # samples the world trained on in the epoch in progress: a prefix of its permutation
    last_eval: dict[str, Any] | None = None
    best_eval: dict[str, Any] | None = None

    @property
    def last_epoch(self) -> int:
        """The last epoch trained in, from 1 (the one in progress when a run stopped within it)."""
        return self.epoch + (1 if self.step_in_epoch else 0)

    def stepped(self, samples: int) -> None:
        """One optimizer step done by a world that trained on ``samples`` samples in it."""
        self.step += 1
        self.step_in_epoch += 1
        self.epoch_samples += samples

    def finish_epoch(self, epoch: int) -> None:
        self.epoch, self.step_in_epoch, self.epoch_samples = epoch, 0, 0

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Exactly the position of ``state`` (a peer's, in the same world)."""
        self.epoch, self.step = state["epoch"], state["step"]
        self.step_in_epoch, self.epoch_samples = state["step_in_epoch"], state["epoch_samples"]
        self.last_eval, self.best_eval = state.get("last_eval"), state.get("best_eval")

    def resume(self, state: dict[str, Any], num_train: int, world_size: int, batch_size: int) -> None:
        """The position of a checkpoint written by a world of ``state["world_size"]`` ranks, for a world of
        ``world_size`` (torchrun may have grown or shrunk it between the stop and the restart): it skips the samples
        already trained on and runs the steps of the rest."""
        before = state.get("world_size", world_size)
        samples = state.get("epoch_samples", state["step_in_epoch"] * batch_size * before)
        self.load_state_dict({**state, "step_in_epoch": 0, "epoch_samples": samples})
        if state["step_in_epoch"]:
            self.step_in_epoch = resumed_step_in_epoch(num_train, self.epoch_samples, world_size, batch_size)
            if self.step_in_epoch >= steps_per_epoch(num_train, world_size, batch_size):
                self.finish_epoch(self.epoch + 1)  # less than a step per rank was left: the epoch is done


@dataclass
class LoopState:
    """What the loop of one invocation carries from part to part: sent to a healed rank with the run's state, never
    checkpointed (a resumed run starts its loop afresh)."""

    agreed_at_step: int | None = None  # the step at which the replicas were last settled (drain, before_eval)
    reshard_next_epoch: bool = False  # a reshard asked mid-epoch, done when the next epoch starts
    epochs_this_run: int = 0  # for trainer.max_epochs_per_run

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.agreed_at_step, self.epochs_this_run = state["agreed_at_step"], state["epochs_this_run"]
        self.reshard_next_epoch = self.reshard_next_epoch or state["reshard_next_epoch"]


class Stateful(Protocol):
    """What the trainer's state is made of."""

    raw_model: Any
    optimizer: Any
    amp: Any  # engine.amp's backend
    schedule: Any  # engine.optim's LR schedule
    sync: Any  # the sync algorithm
    run: RunState
    loop: LoopState
    membership: Any  # distributed.membership.Membership


def trainer_state(t: Stateful) -> dict[str, Any]:
    """The replica, the sync algorithm's shared state and the position in the run (a checkpoint's content, the
    config aside); under ``loop``, what the loop of this invocation carries (never checkpointed)."""
    return {
        "model": t.raw_model.state_dict(),
        "optimizer": t.optimizer.state_dict(),
        "amp": t.amp.state_dict(),
        "schedule": t.schedule.state_dict(),
        "sync": t.sync.state_dict(),
        **t.run.state_dict(),
        "world_size": t.membership.size,
        "loop": t.loop.state_dict(),
    }


def load_replica(t: Stateful, state: dict[str, Any], partial_model: bool = False) -> None:
    """Take the model, optimizer and AMP state of ``state`` (a checkpoint's or a peer's; a joiner takes the
    optimizer's later, and with ``partial_model`` keeps the model's tensors ``state`` lacks)."""
    t.raw_model.load_state_dict(state["model"], strict=not partial_model)
    if "optimizer" in state:
        t.optimizer.load_state_dict(state["optimizer"])
    t.amp.load_state_dict(state["amp"])


def load_trainer_state(t: Stateful, state: dict[str, Any]) -> None:
    """Become the replica of a peer's :func:`trainer_state` (this rank's own algorithm state stays its own)."""
    load_replica(t, state)
    t.run.load_state_dict(state)
    t.sync.load_state_dict(state["sync"])
    t.loop.load_state_dict(state["loop"])
