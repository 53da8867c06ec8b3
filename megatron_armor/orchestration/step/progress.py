"""Progress bars for the rollout and training phases (tqdm; off when not a terminal)."""

from __future__ import annotations

import sys

from megatron_armor.algo.anchors import AcceptanceStats


class PhaseProgress:
    """One bar per phase of a step: ``rollout`` counts accepted groups, ``train`` updates.

    ``enabled=False`` (``logging.progress``) turns bars off; when stderr is not a terminal
    tqdm disables itself, so CI logs get only the one-line step summaries.
    """

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.bar = None

    def start(self, desc: str, total: int) -> None:
        self.close()
        if not self.enabled:
            return
        from tqdm import tqdm

        self.bar = tqdm(total=total, desc=desc, leave=False, dynamic_ncols=True,
                        disable=None, file=sys.stderr)  # fmt: skip

    def rollout_update(self, accepted: int, need: int, stats: AcceptanceStats) -> None:
        """Callback of :class:`AnchorRollout` after each generation batch."""
        if self.bar is None:
            return
        self.bar.n = accepted
        rate = stats.accepted / max(stats.queries_seen, 1)
        self.bar.set_postfix(gen_batches=stats.gen_batches, accept=f"{rate:.2f}", refresh=False)
        self.bar.refresh()

    def advance(self, n: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
