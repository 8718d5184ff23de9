"""Who holds each rollout of a gate, and when a holder counts as gone (pure rules).

A rollout opened with an owner (``X-Tokcap-Owner``: a `GateFleet`'s owner token) belongs
to it: opening, declaring the terminal, closing and releasing it are refused to anyone
else (409 ``rollout_owned``), so a second trainer on the same gates can neither close,
release nor reclaim a live trainer's rollouts, nor open one of its ids as its own. A
rollout opened without an owner is anyone's (the single-trainer case, and header-routed
rollouts nobody opened).

An owner is *live* while it keeps talking: every control request it signs renews it (the
driver calls `Owners.touch` with its clock). Once an owner has been silent for longer than
the lease (``GateConfig.owner_lease_s``), whoever asks next takes its rollouts over: what
a restarted trainer's reclaim needs, without ever taking from a trainer that still talks.
No I/O and no clock here: the time comes in as ``now``.
"""

from __future__ import annotations

from tokcap_core.ids import RolloutId

from ..errors import RolloutConflict

__all__ = ["Owners"]


class Owners:
    """The holder of each owned rollout and when each owner last spoke."""

    def __init__(self, lease_s: float) -> None:
        self.lease_s = lease_s
        self.takeovers = 0
        """Rollouts taken over from an owner silent past the lease."""
        self._holder: dict[RolloutId, str] = {}
        self._seen: dict[str, float] = {}

    def of(self, rollout_id: RolloutId) -> str | None:
        """The owner holding ``rollout_id`` (None: anyone's)."""
        return self._holder.get(rollout_id)

    def touch(self, owner: str | None, now: float) -> None:
        """``owner`` spoke at ``now``: its lease runs from here."""
        if owner is not None:
            self._seen[owner] = max(now, self._seen.get(owner, now))

    def check(self, rollout_id: RolloutId, owner: str | None, now: float) -> None:
        """Let ``owner`` act on ``rollout_id``, or raise `RolloutConflict` ``rollout_owned``.

        The holder itself, anyone on an unowned rollout, and anyone once the holder has
        been silent past the lease (the rollout is then ``owner``'s: a takeover) may act.
        """
        holder = self._holder.get(rollout_id)
        if holder is None or holder == owner:
            return
        if now - self._seen.get(holder, now) > self.lease_s:
            self.takeovers += 1
            self.forget(rollout_id)
            self.hold(rollout_id, owner)
            return
        raise RolloutConflict(
            "rollout_owned",
            f"{rollout_id} belongs to another trainer (owner token) that is still active; "
            "use your own rollout ids",
        )

    def hold(self, rollout_id: RolloutId, owner: str | None) -> None:
        """``owner`` holds ``rollout_id`` from now on (None: nobody does)."""
        if owner is not None:
            self._holder[rollout_id] = owner

    def forget(self, rollout_id: RolloutId) -> None:
        """``rollout_id`` is released: nobody holds it."""
        self._holder.pop(rollout_id, None)
