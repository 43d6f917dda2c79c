"""With several trainers (``stage_steps="async"``) the swarm's epoch drives the LR schedule.

The stages then step on their own, once every ``target_batch_size`` samples of all trainers together (hivemind's
epoch), while each trainer's Lightning loop steps its schedulers after each of its own batches. Counted that way,
a schedule would run ``num_trainers`` times too fast (or as fast as the fastest trainer), and every trainer would
be at another point of it. So the strategy wraps every scheduler whose interval is ``"step"`` in a
:class:`SwarmEpochScheduler`: when Lightning steps it, it steps the user's scheduler once per swarm epoch that
passed since (zero, one or more times), so that after swarm epoch ``e`` every trainer's schedule, and with it the
hyper-parameters the stages receive, is the schedule's value at step ``e``: what one process stepping once per
global batch would use. A trainer that joins late catches up with the swarm's epoch at its first step.

``frequency=n`` keeps its meaning in swarm epochs (one scheduler step every ``n`` of them). A
``ReduceLROnPlateau`` with interval ``"step"`` sees the monitored value once per swarm epoch that passed (it judges
plateaus in optimizer steps, not in repeated readings of one value). Schedulers with interval ``"epoch"`` follow
the trainer's own data epochs, as they do in DDP (each trainer's epoch covers its share of the data).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_SEEN_KEY = "_swarm_epoch_seen"


class SwarmEpochScheduler:
    """Steps ``scheduler`` once per ``frequency`` swarm epochs that passed, whenever Lightning steps it.

    Everything else (``get_last_lr``, ``optimizer``, ``last_epoch``, ...) is the wrapped scheduler's; its
    ``state_dict`` also records the swarm epoch the schedule has reached, so that a resumed trainer does not replay
    the epochs before its checkpoint.

    Args:
        scheduler: the user's LR scheduler (``torch.optim.lr_scheduler.LRScheduler`` or ``ReduceLROnPlateau``, or
            any object with ``step``).
        swarm_epoch: returns the swarm's current epoch (the stages' optimizer steps so far).
        frequency: Lightning's ``frequency`` of the scheduler's config: step once every that many swarm epochs.
    """

    def __init__(self, scheduler: Any, swarm_epoch: Callable[[], int], frequency: int = 1) -> None:
        self.__dict__["_scheduler"] = scheduler
        self.__dict__["_swarm_epoch"] = swarm_epoch
        self.__dict__["_frequency"] = max(1, int(frequency))
        self.__dict__["_seen"] = 0  # the swarm epoch the schedule has caught up with

    @property
    def scheduler(self) -> Any:
        """The wrapped (user's) scheduler."""
        return self._scheduler

    def step(self, *args: Any, **kwargs: Any) -> None:
        """Step the wrapped scheduler once per ``frequency`` swarm epochs since the last call (a metric, for
        ``ReduceLROnPlateau``, is passed to each of those steps but counted once: see the module's doc)."""
        epoch = int(self._swarm_epoch())
        seen, n = self._seen, self._frequency
        steps = max(0, epoch // n - seen // n)
        self.__dict__["_seen"] = max(seen, epoch)
        if steps and (args or kwargs) and _is_plateau(self._scheduler):
            steps = 1  # one observation of the metric; see the module's doc
        for _ in range(steps):
            self._scheduler.step(*args, **kwargs)

    def state_dict(self) -> dict[str, Any]:
        state = dict(self._scheduler.state_dict())
        state[_SEEN_KEY] = self._seen
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state = dict(state_dict)
        self.__dict__["_seen"] = int(state.pop(_SEEN_KEY, self._seen))
        self._scheduler.load_state_dict(state)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_scheduler"], name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._scheduler, name, value)

    def __repr__(self) -> str:
        return f"SwarmEpochScheduler({self._scheduler!r}, frequency={self._frequency})"


def _is_plateau(scheduler: Any) -> bool:
    from torch.optim.lr_scheduler import ReduceLROnPlateau

    return isinstance(scheduler, ReduceLROnPlateau)


def follow_swarm_epochs(configs: list[Any], swarm_epoch: Callable[[], int]) -> None:
    """Wrap, in place, every Lightning ``LRSchedulerConfig`` in ``configs`` whose interval is ``"step"`` so that
    its scheduler follows the swarm's epoch (see the module's doc). Lightning then calls it after every trainer
    step (``frequency`` 1); the wrapper applies the config's frequency in swarm epochs."""
    for config in configs:
        if config.interval != "step" or isinstance(config.scheduler, SwarmEpochScheduler):
            continue
        config.scheduler = SwarmEpochScheduler(config.scheduler, swarm_epoch, config.frequency)
        config.frequency = 1
