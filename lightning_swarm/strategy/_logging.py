"""What the strategies log through ``LightningModule.log``, and when."""

from __future__ import annotations

from typing import Any


def logs_written_this_step(module: Any) -> bool:
    """Whether the logger writes this training step's logs (``Trainer(log_every_n_steps)``; the last step too).

    A ``LightningModule.log`` call costs about 0.1 ms: a strategy's own counters logged at every step would be
    a per-step cost on top of what the same Lightning run pays without the strategy.
    """
    trainer = module.trainer if module is not None else None
    connector = getattr(trainer, "_logger_connector", None)
    return bool(getattr(connector, "should_update_logs", True))
