"""Checkpoints and resume: the crash-safe store (re-exported here: ``checkpoint.save``,
``checkpoint.load_latest``, ...), what a checkpoint may resume with (:mod:`.compat`), the groups
each step consumed (:mod:`.consumed`), durable file writes (:mod:`.durable`), the manifest and
requeued groups (:mod:`.resume`), fault injection for the crash tests (:mod:`.crash_points`) and
``miles export`` (:mod:`.export`, the one reader of a checkpoint's policy tensors)."""

from miles_engine.checkpoint.store import (
    FILES,
    FORMAT,
    Loaded,
    RolloutState,
    check_trainer_state,
    checkpoint_dir,
    latest,
    list_checkpoints,
    load,
    load_latest,
    remove_partial,
    rng_states,
    save,
    set_rng_states,
    stage,
)

__all__ = ["FILES", "FORMAT", "Loaded", "RolloutState", "check_trainer_state", "checkpoint_dir", "latest",
           "list_checkpoints", "load", "load_latest", "remove_partial", "rng_states", "save", "set_rng_states",
           "stage"]
