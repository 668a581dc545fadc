"""How τ is chosen each cycle.

- fixed: τ every cycle.
- heuristic: τ += 2 after a fully accepted block, τ -= 1 otherwise, within [1, max_tau].
- adaptive: cost-aware. Keeps running estimates of α_k (acceptance at draft position k given all earlier drafts
  accepted), draft cost per token, the target's verify cost as a function of tokens verified, and per-cycle
  overhead; each cycle picks the τ in [0, max_tau] (0 = no speculation) maximising
      E[tokens](τ) / time(τ),  E[tokens](τ) = 1 + Σ_{k≤τ} Π_{j≤k} α_j,
      time(τ) = τ·c_draft + T_verify(τ+1) + overhead            (costs.py)
  A τ of 0 is re-probed with τ=1 every `probe_every` cycles so a draft that recovers is noticed.
"""
from __future__ import annotations

from .costs import expected_tokens, interpolate, predicted_speedup
from .errors import InvalidRequest
from .trace import asked_of

POLICIES = ("fixed", "heuristic", "adaptive")


class FixedPolicy:
    name = "fixed"

    def __init__(self, tau: int, max_tau: int | None = None):
        self.tau = tau

    def start(self) -> None:
        pass

    def next_tau(self) -> int:
        return self.tau

    def observe(self, record) -> None:
        pass


class HeuristicPolicy(FixedPolicy):
    name = "heuristic"

    def __init__(self, tau: int, max_tau: int | None = None):
        self.initial, self.max_tau = tau, max_tau or max(16, tau)
        self.tau = tau

    def start(self) -> None:
        self.tau = self.initial

    def observe(self, record) -> None:
        if not record.proposed:
            return  # nothing was drafted (e.g. no n-gram match): no evidence either way
        full = record.accepted == len(record.proposed) == record.tau
        self.tau = min(self.max_tau, self.tau + 2) if full else max(1, self.tau - 1)


class Ema:
    def __init__(self, value: float, weight: float = 1.0, decay: float = 0.9):
        self.value, self.weight, self.decay, self.n = value, weight, decay, 0

    def update(self, x: float) -> None:
        self.n += 1
        self.weight = self.decay * self.weight + 1.0
        self.value += (x - self.value) / self.weight


class AdaptivePolicy:
    name = "adaptive"

    def __init__(self, tau: int, max_tau: int | None = None, probe_every: int = 8, prior_alpha: float = 0.6):
        self.max_tau = max_tau or max(8, tau)
        self.initial, self.probe_every, self.prior = tau, probe_every, prior_alpha
        # estimates persist across generations: hardware costs and a drafter's quality carry over
        self.alpha = [Ema(prior_alpha, weight=2.0, decay=0.95) for _ in range(self.max_tau)]
        self.draft_ms = None  # per drafted token
        self.verify_ms: dict[int, Ema] = {}  # tokens verified -> ms
        self.overhead_ms = Ema(0.0, weight=0.0)
        self.tau, self._since_probe, self._cycle = tau, 0, 0

    def start(self) -> None:
        self._cycle = 0

    def alphas(self) -> list[float]:
        """α by position; a position seen fewer than 5 times is assumed no better than the one before it, and one
        never seen as good as it: a draft's conditional acceptance hardly falls with depth (the pair's 0.5B on
        completions: 1.00 at position 1, 0.87 at 2), and the flat prior (0.6) had priced positions 2+ of a draft
        right 0.93 of the time so low that it drafted 1-2 tokens a cycle, and so never measured them."""
        out = []
        for k, a in enumerate(self.alpha):
            out.append(a.value if a.n >= 5 or k == 0 else out[-1] if a.n == 0 else min(a.value, out[-1]))
        return out

    def expected_tokens(self, tau: int) -> float:
        return expected_tokens(self.alphas(), tau)

    def verify_cost(self, n: int) -> float | None:
        """T_verify(n): measured where seen, else the cost model's interpolation of the sizes seen."""
        if not self.verify_ms:
            return None
        return interpolate({k: e.value for k, e in self.verify_ms.items()}, n)

    def predicted_rate(self, tau: int) -> float | None:
        """Tokens per ms at τ: the cost model (costs.predicted_speedup) with one target step counted as 1 ms."""
        if not self.verify_ms or (tau and self.draft_ms is None):
            return None
        curve = {k: e.value for k, e in self.verify_ms.items()}
        cost = (0.0, self.draft_ms.value if tau else 0.0)
        return predicted_speedup([(1.0, tau, self.alphas())], cost, curve, self.overhead_ms.value, 1.0)

    def next_tau(self) -> int:
        if self._cycle < 2:  # first cycles: prefill pollutes timings; just draft the initial τ
            return self.tau
        rates = {t: self.predicted_rate(t) for t in range(self.max_tau + 1)}
        rates = {t: r for t, r in rates.items() if r is not None}
        best = max(rates, key=rates.get) if rates else self.tau
        if best == 0:
            self._since_probe += 1
            if self._since_probe >= self.probe_every:
                self._since_probe = 0
                return 1
        return best

    def observe(self, record) -> None:
        self._cycle += 1
        n = len(record.proposed)
        if record.cycle > 0:  # cycle 0 includes the prompt prefill
            self.verify_ms.setdefault(n + 1, Ema(record.verify_ms, weight=0.0, decay=0.8)).update(record.verify_ms)
            self.overhead_ms.update(max(0.0, record.cycle_ms - record.draft_ms - record.verify_ms))
        if n:  # a catch-up over the prompt is paid once: not a drafted token's cost
            per_token = max(0.0, record.draft_ms - record.draft_prefill_ms) / n
            if self.draft_ms is None:
                self.draft_ms = Ema(per_token, weight=0.0, decay=0.8)
            self.draft_ms.update(per_token)
        elif asked_of(record) > 0 and not record.drafted:
            self.alpha[0].update(0.0)  # asked for a draft and got none (no n-gram match): worth nothing
        # positions past max_tau (a grammar's forced drafts can be longer) have no estimate to update
        for k in range(min(n, record.accepted + 1, len(self.alpha))):
            if k and not self.alpha[k].n:  # its first observation starts from where alphas() read it
                self.alpha[k].value = self.alpha[k - 1].value
            self.alpha[k].update(1.0 if k < record.accepted else 0.0)


def make_policy(name: str, tau: int, max_tau: int | None = None):
    cls = {"fixed": FixedPolicy, "heuristic": HeuristicPolicy, "adaptive": AdaptivePolicy}.get(name)
    if cls is None:
        raise InvalidRequest(f"policy must be one of {', '.join(POLICIES)}, got {name!r}")
    return cls(tau, max_tau)
