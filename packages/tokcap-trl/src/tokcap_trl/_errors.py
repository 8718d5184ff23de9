"""Errors of the TRL adapter: one class, split by stable codes, picklable."""

from __future__ import annotations

from tokcap_core import TokcapError

__all__ = ["TRLAdapterError"]


class TRLAdapterError(TokcapError, RuntimeError):
    """The adapter could not give TRL what it asked for, and says why (``code``).

    Codes: ``no_valid_rollouts`` (every rollout of a batch was poisoned or failed in its
    harness: training on placeholders alone would learn nothing, silently),
    ``group_mismatch`` (TRL's repeated prompts do not line up in groups of
    ``num_generations``), ``weight_version_mismatch`` (the gates do not serve the trainer's
    current step: no weight push after the last optimizer step, or gates that served
    another run), ``weight_push_failed`` (a push after an optimizer step failed on a gate:
    the fleet is held until a push succeeds), ``not_started`` (the adapter was used
    outside its ``with`` block).

    ``AsyncGRPOTrainer``'s worker adds: ``rollouts_failed`` (a group's collection raised;
    the cause is chained), ``rollouts_stopped`` (never started, or stopped),
    ``rollouts_stalled`` (no group finished within TRL's ``stale_after_s``),
    ``stop_timeout``, ``already_started``, ``no_prompts``, ``bad_config``.
    """
