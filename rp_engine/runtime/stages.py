"""Stage map: which host layers each forward / head / backward stage of a plan runs.

Layer indices follow the LayerSequence order ``[prefix?] + blocks + [head]``. Cuts count decoder
blocks, with the plan package's convention (``sum(fwd_cuts) == sum(bwd_cuts) == L``):

- forward stage s covers ``fwd_cuts[s]`` blocks (stage 0 also runs the prefix), but never runs
  the blocks that belong to the HEAD stage: those are computed once, by the HEAD stage, with
  autograd (so the head stage needs no recomputation, as the paper intends); a forward stage
  whose blocks all belong to the head stage just passes its input on;
- the HEAD stage (backward stage 0) runs the last ``bwd_cuts[0]`` blocks and the head, forward
  and backward at once, starting from the last forward stage's output;
- backward stage j >= 1 runs the next ``bwd_cuts[j]`` blocks toward the input (the last one
  also runs the prefix), recomputing them from the input saved during the forward.

Example, 5 blocks, fwd_cuts (3, 2), bwd_cuts (0, 2, 3), with prefix P and head H::

    index      0  1  2  3  4  5  6
    layer      P  b0 b1 b2 b3 b4 H
    forward   [F0 ------ ][F1 -]
    backward  [B2 ------ ][B1 -][HEAD]
"""

from __future__ import annotations

from dataclasses import dataclass

from rp_engine.plan.partition import CutsError

__all__ = ["StageMap"]


@dataclass(frozen=True)
class StageMap:
    """Layer indices per stage; ``bwd[0]`` is the HEAD stage (its last index is the head)."""

    fwd: tuple[tuple[int, ...], ...]
    bwd: tuple[tuple[int, ...], ...]
    has_prefix: bool

    @staticmethod
    def min_bwd_stages(has_prefix: bool) -> int:
        """Fewest backward stages (head stage included) ``from_cuts`` accepts: the embedding
        prefix runs in the last backward stage, which must come after the head stage."""
        return 2 if has_prefix else 1

    @classmethod
    def from_cuts(
        cls,
        *,
        num_blocks: int,
        has_prefix: bool,
        fwd_cuts: tuple[int, ...],
        bwd_cuts: tuple[int, ...],
    ) -> StageMap:
        """Build from block counts; raises CutsError (a ValueError) naming the cuts when they do
        not add up.

        Each message starts with the bad cuts' name (``fwd_cuts`` or ``bwd_cuts``), not a config
        key: the caller knows whether the user wrote them (``Planner`` then names the
        ``roundpipe.*`` key) or the planner chose them.
        """
        p = 1 if has_prefix else 0
        if not bwd_cuts or sum(bwd_cuts) != num_blocks or any(c < 0 for c in bwd_cuts):
            raise CutsError(
                f"bwd_cuts {list(bwd_cuts)} must be non-negative and sum to the "
                f"{num_blocks} decoder blocks"
            )
        if not fwd_cuts or sum(fwd_cuts) != num_blocks or any(c <= 0 for c in fwd_cuts):
            raise CutsError(
                f"fwd_cuts {list(fwd_cuts)} must be positive and sum to the "
                f"{num_blocks} decoder blocks"
            )
        if any(c <= 0 for c in bwd_cuts[1:]):
            raise CutsError(f"bwd_cuts {list(bwd_cuts)}: stages after the first need >= 1 block")
        fwd: list[tuple[int, ...]] = []
        start = 0
        for s, n in enumerate(fwd_cuts):
            idx = list(range(p + start, p + start + n))
            if s == 0 and has_prefix:
                idx.insert(0, 0)
            fwd.append(tuple(idx))
            start += n
        head_blocks = bwd_cuts[0]
        head_idx = p + num_blocks
        bwd: list[tuple[int, ...]] = [tuple(range(head_idx - head_blocks, head_idx + 1))]
        head_first = head_idx - head_blocks
        fwd = [tuple(i for i in idx if i < head_first) for idx in fwd]
        end = num_blocks - head_blocks
        for n in bwd_cuts[1:]:
            bwd.append(tuple(range(p + end - n, p + end)))
            end -= n
        if has_prefix:
            if len(bwd) < cls.min_bwd_stages(has_prefix):
                raise CutsError(
                    f"bwd_cuts {list(bwd_cuts)}: the embedding prefix needs a backward stage "
                    "after the head stage (at least 2 backward stages)"
                )
            bwd[-1] = (0, *bwd[-1])
        return cls(tuple(fwd), tuple(bwd), has_prefix)

    @property
    def head_index(self) -> int:
        return self.bwd[0][-1]

    def saved_inputs(self) -> dict[int, int]:
        """layer index -> backward stage j whose saved input is the state entering that layer.

        Stage j's input is saved by whichever forward stage computes it; the prefix's input is
        the micro-batch itself (already on the host) and is not listed.
        """
        return {self.bwd[j][0]: j for j in range(1, len(self.bwd)) if self.bwd[j][0] != 0}
