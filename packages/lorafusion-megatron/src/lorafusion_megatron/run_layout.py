"""What a run writes directly in its ``output_dir``, besides the jobs' adapter folders.

One list, so that the config can refuse a job folder that is one of them (the run would replace it,
or fail to write its own file there, after training). Torch-free, like the config.
"""

from __future__ import annotations

__all__ = [
    "CHECKPOINTS",
    "EVAL_HISTORY",
    "LOCK_FILE",
    "PIPELINE_SUMMARY",
    "PIPELINE_TRACE",
    "PLAN",
    "PROFILE_REPORT",
    "PROFILE_TABLE",
    "RUN_OUTPUTS",
    "SUMMARY",
    "TRAINER_STATE",
]

PLAN = "plan.json"
"""The schedule the run trains (written before the first step; a resume reads its checkpoint's copy)."""
SUMMARY = "summary.json"
"""Per-job results, written when the run ends."""
PIPELINE_SUMMARY = "pipeline_summary.json"
"""The pipeline runtime's summary (several processes)."""
PIPELINE_TRACE = "pipeline_trace.json"
"""Every rank's forwards and backwards as a Chrome trace (several processes)."""
EVAL_HISTORY = "eval_history.json"
"""Every evaluation of the run so far, by job."""
CHECKPOINTS = "checkpoints"
"""Folder of the ``checkpoint-<n>`` folders."""
TRAINER_STATE = "trainer_state.json"
"""A checkpoint's position, counters and fingerprint (written last: a checkpoint without it is none)."""
PROFILE_REPORT = "profile.json"
"""``lorafusion-megatron profile``'s measurements and choice of capacity."""
PROFILE_TABLE = "profile.md"
"""The same as a table."""
LOCK_FILE = ".lorafusion-run.lock"
"""The run lock: one run per output folder."""

RUN_OUTPUTS = (
    PLAN,
    SUMMARY,
    PIPELINE_SUMMARY,
    PIPELINE_TRACE,
    EVAL_HISTORY,
    CHECKPOINTS,
    PROFILE_REPORT,
    PROFILE_TABLE,
    LOCK_FILE,
)
