"""Ranks that retry together: the collectives every attempt of ``OOMGuard.run`` ends in.

Under ``torch.distributed`` every attempt ends in the same collective sequence on every rank, so one rank's
OOM never leaves the others waiting: A1, an ``all_gather`` of each rank's status, right before the
optimizer step (a rank that failed earlier joins it from its error handler; the others learn of the failure
and abort their step before updating anything), and, when A1 was clean, A2 after the step (an OOM inside
the optimizer step on any rank makes every rank roll back its completed step, which needs the pre-step
copy; ``auto`` takes it on every rank alike). Rank 0 escalates and broadcasts the new plan. Gradient
collectives inside backward (DDP/FSDP) are outside this protocol: a rank that fails mid-backward leaves
its peers in an NCCL collective until the NCCL timeout; ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` turns that
into an error.

``RankAgreementMixin`` holds these methods of ``OOMGuard``; they read the attributes ``OOMGuard.__init__`` sets
(the process group, this rank, the world size, the attempt's state).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from memopt.guard.oom import OOMMeasurement
from memopt.plan.schema import Plan

__all__ = ["LOCATIONS", "STATUS_ERROR", "STATUS_OK", "STATUS_OOM", "Attempt", "PeerFailure", "RankAgreementMixin"]

# one logger for the OOM recovery, whichever of its modules logs
log = logging.getLogger("memopt.guard.recovery")


class PeerFailure(Exception):
    """Raised inside a rank's step when another rank failed (the step is abandoned before the update)."""


STATUS_OK, STATUS_OOM, STATUS_ERROR = 0, 1, 2
LOCATIONS = ("none", "before_optimizer", "optimizer_state_init", "optimizer", "after_optimizer", "completed",
             "peer")


@dataclass
class Attempt:
    phase: str = ""
    gathered: list[list[int]] | None = None  # A1's result
    a1_done: bool = False


class RankAgreementMixin:
    """``OOMGuard``'s collectives: the status rows every rank gathers, the plan rank 0 broadcasts."""

    def _device(self) -> torch.device:
        backend = torch.distributed.get_backend(self.pg)
        if backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _agree(self, row: list[int]) -> list[list[int]]:
        """All-gather one row of ints per rank: [status, location, can_restore, needed, peak_reserved, requested]."""
        dist = torch.distributed
        t = torch.tensor(row, dtype=torch.int64, device=self._device())
        out = [torch.empty_like(t) for _ in range(self.world)]
        dist.all_gather(out, t, group=self.pg)
        gathered = [o.tolist() for o in out]
        if not self._attempt.a1_done:
            self._attempt.a1_done = True
            self._attempt.gathered = gathered
        return gathered

    def _broadcast_plan(self, plan: Plan | None, error: str | None) -> tuple[Plan | None, str | None]:
        payload = [{"plan": plan.to_dict() if plan is not None else None, "error": error}]
        torch.distributed.broadcast_object_list(payload, src=0, group=self.pg,
                                                device=self._device() if self._device().type == "cuda" else None)
        data = payload[0]
        return (Plan.from_dict(data["plan"]) if data["plan"] is not None else None), data["error"]

    def _outcome(self, status: int, location: str, can_restore: bool,
                 failure: OOMMeasurement | None) -> list[list[int]]:
        row = [status, LOCATIONS.index(location), int(can_restore), (failure.needed_bytes or 0) if failure else 0,
               (failure.peak_reserved_bytes or 0) if failure else 0, (failure.requested_bytes or 0) if failure else 0]
        if not self.distributed:
            return [row]
        if not self._attempt.a1_done:
            return self._agree(row)  # A1 (this rank failed before the optimizer, or the step has no phases)
        a1 = self._attempt.gathered
        if any(r[0] != STATUS_OK for r in a1):
            # A1 already told everyone; only this rank's own row differs from what A1 carried
            return [row if i == self.rank else r for i, r in enumerate(a1)]
        return self._agree(row)  # A2: after the optimizer step

    def _share_error(self) -> None:
        if not self.distributed:
            return
        try:
            self._outcome(STATUS_ERROR, "none", True, None)
        except Exception:  # the original error matters more
            log.exception("could not tell the other ranks about an error")
