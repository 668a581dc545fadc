"""The row split in hindsight: the tokens its draft rows were expected to add against what verification accepted,
by load, and the correction the split reads.

Each request's acceptance is a running average over a few dozen draft positions (policy.AdaptivePolicy), so it is
right on average but noisy. The split gives rows to the requests whose estimates are highest, and the highest of
several noisy estimates is high by chance (the optimizer's curse): the rows it buys are accepted less often than it
expected, the more so the more requests it chooses among. At 8 streams a row pays only where it is accepted at
about 0.9 (Qwen2.5-1.5B: a 9th row costs a fifth of an 8-row pass); the rows bought were accepted at 0.81-0.92,
and every draft served 0.95-0.99x target-only.

Per load level (decoding requests 1, 2-3, 4-7, 8+), an exponentially weighted sum of the expected extra tokens of
each drafted request (costs.expected_tokens − 1 at its rows, from the estimates the split read, uncorrected) and of
the tokens accepted. Where 2+ requests decode the split reads each estimate's reaches scaled by their ratio
(accepted / expected, within [FLOOR, 1]): scaling α_1 scales Π_{j≤k} α_j at every k. A lone request is measured but
not corrected: it is chosen over no one, and its own running acceptance sizes its τ.

Rows sized on a draft's own values (a tree's node values: Demand.valued) are booked apart from rows sized on
measured acceptance: the two err differently, and one ratio let the better hide the worse. (Qwen2.5-Coder-1.5B's
feature draft at 8 streams: its trees bought where 5-7 requests decoded were accepted at 0.29 a node, while copies of
earlier answers were accepted at 0.88; booked together the trees were read at ~0.9 of their values, and lost
throughput.)
"""
from __future__ import annotations

from dataclasses import replace

from ..costs import expected_tokens
from ..scheduler import Demand

LEVELS = ("1", "2-3", "4-7", "8+")  # decoding requests
DECAY = 0.98  # per drafted pass at a level: about the last 50 passes count
PRIOR_TOKENS = 32.0  # expected = accepted = this at start: ratio 1 until a few passes of drafts were verified
FLOOR = 0.5  # the least ratio read: at 0.5 a long copy (α 0.98) still buys a deep chain at 8 streams


def level(decoding: int) -> int:
    return min(len(LEVELS) - 1, max(1, decoding).bit_length() - 1)


class Hindsight:
    def __init__(self):
        # per kind (False: rows sized on measured acceptance, True: on a draft's own values), per level
        self.expected = {kind: [PRIOR_TOKENS] * len(LEVELS) for kind in (False, True)}
        self.accepted = {kind: [PRIOR_TOKENS] * len(LEVELS) for kind in (False, True)}

    def ratio(self, decoding: int, valued: bool = False) -> float:
        """The split's correction at this load for that kind of rows: 1 for a lone request."""
        if decoding < 2:
            return 1.0
        i = level(decoding)
        return min(1.0, max(FLOOR, self.accepted[valued][i] / self.expected[valued][i]))

    def measured(self, i: int, valued: bool = False) -> float:
        """Accepted / expected at level i for that kind of rows, uncapped (what /metrics shows)."""
        return self.accepted[valued][i] / self.expected[valued][i]

    def scaled(self, demands: list[Demand], decoding: int) -> list[Demand]:
        out = []
        for d in demands:
            r = self.ratio(decoding, d.valued)
            # (a lone α is reused at every position: kept unscaled past the first)
            out.append(replace(d, alphas=[d.alphas[0] * r, *(d.alphas[1:] or d.alphas)]) if r < 1.0 and d.alphas
                       else d)
        return out

    def observe(self, decoding: int, expected: float, accepted: int, valued: bool = False) -> None:
        """One pass's drafted requests of one kind: their expected extra tokens (uncorrected) and the tokens
        accepted."""
        if expected <= 0.0:
            return
        i = level(decoding)
        self.expected[valued][i] = DECAY * self.expected[valued][i] + expected
        self.accepted[valued][i] = DECAY * self.accepted[valued][i] + accepted


def expected_extra(demand: Demand, rows: int) -> float:
    """The tokens `rows` draft rows of `demand` are expected to add to the one the pass emits anyway."""
    return expected_tokens(demand.alphas, rows) - 1.0 if rows else 0.0
