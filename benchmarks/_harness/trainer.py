"""What measured Lightning runs have in common.

``QUIET``: ``Trainer`` keyword arguments of a run that is timed, not watched: no logger, checkpoint callback,
progress bar, model summary or sanity-check validation (each costs time or output a benchmark does not want).
"""

from __future__ import annotations

QUIET = {
    "logger": False,
    "enable_checkpointing": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
    "num_sanity_val_steps": 0,
}
