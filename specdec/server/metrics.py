"""Prometheus metrics, on a registry of the app's own (several apps can live in one process, e.g. tests).
Acceptance rate = accepted / drafted; mean accepted length = accepted / cycles (as vLLM users compute them)."""
from __future__ import annotations

from pathlib import Path
from time import monotonic

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from ..analyze import STALE
from ..batch.hindsight import LEVELS

STALE_AFTER = 3  # passes of a size timed before its price is compared with where it started (analyze: min_cycles)
MS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


def draft_label(name: str) -> str:
    """A drafter's name as a metric label: a model draft's file by its stem (`keep:/x/coder05.gguf` -> coder05)."""
    return Path(name.split(":", 1)[-1]).stem if "/" in name else name


class Metrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("specdec_requests", "HTTP requests by endpoint and status", ["endpoint", "status"],
                                registry=r)
        self.generated = Counter("specdec_generated_tokens", "Tokens generated", registry=r)
        self.prompt_tokens = Counter("specdec_prompt_tokens", "Prompt tokens processed", registry=r)
        self.drafted = Counter("specdec_draft_tokens", "Draft tokens proposed", registry=r)
        self.accepted = Counter("specdec_accepted_tokens", "Draft tokens accepted", registry=r)
        self.drafted_by = Counter("specdec_draft_tokens_by_draft", "Draft tokens proposed, by the drafter that "
                                  "proposed them (a chain's member, or `prediction`)", ["draft"], registry=r)
        self.accepted_by = Counter("specdec_accepted_tokens_by_draft", "Draft tokens accepted, by the drafter that "
                                   "proposed them", ["draft"], registry=r)
        self.accepted_pos = Counter("specdec_accepted_tokens_by_position", "Accepted draft tokens by position",
                                    ["position"], registry=r)
        self.cycles = Counter("specdec_cycles", "Target passes (one speculative cycle of every request in them)",
                              registry=r)
        self.draft_time = Histogram("specdec_draft_seconds", "Draft time per cycle", buckets=MS_BUCKETS, registry=r)
        self.verify_time = Histogram("specdec_verify_seconds", "Time per target pass", buckets=MS_BUCKETS,
                                     registry=r)
        self.tau = Histogram("specdec_tau", "Block size chosen per cycle", buckets=(0, 1, 2, 3, 4, 6, 8, 12, 16),
                             registry=r)
        self.queue_depth = Gauge("specdec_queue_depth", "Requests waiting or running", registry=r)
        self.batch_rows = Histogram("specdec_batch_rows", "Rows per target pass (all requests' tokens and drafts)",
                                    buckets=(1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128), registry=r)
        self.running = Gauge("specdec_requests_running", "Requests in the running batch", registry=r)
        self.stored = Gauge("specdec_stored_bytes", "Stored responses and conversations (their JSON), by kind",
                            ["kind"], registry=r)
        self.waiting = Gauge("specdec_requests_waiting", "Requests queued for a place in the batch", registry=r)
        # the same two figures under the names inference gateways and routers scrape (vLLM's)
        self.running_alias = Gauge("vllm:num_requests_running", "Alias of specdec_requests_running", registry=r)
        self.waiting_alias = Gauge("vllm:num_requests_waiting", "Alias of specdec_requests_waiting", registry=r)
        self.kv_bytes = Gauge("specdec_kv_cache_bytes", "K/V bytes held by running requests and the prefix cache",
                              registry=r)
        self.kv_budget = Gauge("specdec_kv_cache_budget_bytes", "The KV pool's size (--kv-memory)", registry=r)
        self.kv_usage = Gauge("specdec_kv_cache_usage", "Share of the KV pool in use, 0..1", registry=r)
        self.catchups = Gauge("specdec_draft_catchups_pending", "A draft model's catch-ups put off for idle time, "
                              "queued or under way", registry=r)
        self.probes = Gauge("specdec_pass_probes_pending", "Pass sizes due to be timed in idle time (a stored curve's "
                            "guesses, or sizes no pass timed for 5 minutes)", registry=r)
        self.kv_usage_alias = Gauge("vllm:kv_cache_usage_perc", "Alias of specdec_kv_cache_usage (0..1, as vLLM's)",
                                    registry=r)
        self.preemptions = Counter("vllm:num_preemptions", "Requests preempted for KV memory (recomputed later)",
                                   registry=r)
        self.refused = Counter("specdec_requests_refused", "Requests refused with 429 (queue full, or no start in time)",
                               registry=r)
        self.queue_time = Histogram("vllm:request_queue_time_seconds", "Time a request waited before it started",
                                    buckets=(0.01, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300), registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time from a request's arrival to its first token",
                              buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60), registry=r)
        self.prefix_queries = Counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                      registry=r)
        self.prefix_hits = Counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache (copied, not "
                                   "computed)", registry=r)
        self.pass_start = Gauge("specdec_pass_start_ms", "The pass curve the server started from (stored, or measured "
                                "at start), by rows", ["rows"], registry=r)
        self.pass_priced = Gauge("specdec_pass_priced_ms", "The pass time the verification budget prices now (the "
                                 "start curve refined by the passes timed), by rows", ["rows"], registry=r)
        self.pass_timed = Gauge("specdec_pass_timed", "Passes of this size the server timed", ["rows"], registry=r)
        self.pass_stale = Gauge("specdec_pass_curve_stale", "1 where a size timed STALE_AFTER times or more is priced "
                                "now at 1/2 or 2x its start time or beyond: the start curve was wrong (analyze: "
                                "stale_costs), and the server has corrected it", registry=r)
        self.hindsight = Gauge("specdec_draft_hindsight", "Draft tokens accepted / the tokens the row split expected "
                               "of the rows it gave (recent passes), by decoding requests; below 1 the split reads "
                               "its estimates scaled down where 2+ decode (batch/hindsight.py)", ["decoding"],
                               registry=r)
        self.tree_hindsight = Gauge("specdec_tree_hindsight", "The same for rows sized on a draft's own values (token "
                                    "trees' nodes), booked apart", ["decoding"], registry=r)
        self._prefix_seen = (0, 0)
        self._preempted_seen = 0

    def observe_engine(self, engine) -> None:
        """The batch engine's memory and prefix-cache figures, after a step."""
        stale = 0
        for rows, start, priced, timed in engine.pass_curve_report():
            self.pass_start.labels(rows=str(rows)).set(start)
            self.pass_priced.labels(rows=str(rows)).set(priced)
            self.pass_timed.labels(rows=str(rows)).set(timed)
            stale |= timed >= STALE_AFTER and not 1 / STALE <= priced / max(start, 1e-9) <= STALE
        self.pass_stale.set(stale)
        for i, name in enumerate(LEVELS):
            self.hindsight.labels(decoding=name).set(engine.hindsight.measured(i))
            self.tree_hindsight.labels(decoding=name).set(engine.hindsight.measured(i, valued=True))
        self.kv_bytes.set(engine.kv_bytes())
        self.kv_budget.set(engine.model.kv_pool_bytes())  # the pool's size: no /proc/meminfo read a step
        usage = engine.kv_usage()
        self.kv_usage.set(usage)
        self.kv_usage_alias.set(usage)
        self.catchups.set(engine.idle_work())
        self.probes.set(engine.probes_pending())
        self.preemptions.inc(engine.preemptions - self._preempted_seen)
        self._preempted_seen = engine.preemptions
        cache = engine.prefixes
        if cache is not None:
            queried, reused = cache.queried, cache.reused
            self.prefix_queries.inc(queried - self._prefix_seen[0])
            self.prefix_hits.inc(reused - self._prefix_seen[1])
            self._prefix_seen = (queried, reused)

    def set_load(self, running: int, waiting: int) -> None:
        for g, v in ((self.running, running), (self.running_alias, running), (self.waiting, waiting),
                     (self.waiting_alias, waiting)):
            g.set(v)

    def observe_pass(self, verify_ms: float) -> None:
        """One target pass, counted once however many requests shared it."""
        self.cycles.inc()
        self.verify_time.observe(verify_ms / 1e3)

    def first_token(self, job, rec) -> None:
        """A request's cycle: the first that emitted tokens is its time to first token."""
        if rec.emitted and job.first_token_at is None:
            job.first_token_at = monotonic()
            self.ttft.observe(job.first_token_at - job.queued)

    def observe_cycle(self, rec) -> None:
        """One request's cycle: its drafts, acceptance and tokens."""
        self.drafted.inc(len(rec.proposed))
        self.accepted.inc(rec.accepted)
        if rec.proposed and rec.by:
            self.drafted_by.labels(draft=draft_label(rec.by)).inc(len(rec.proposed))
            self.accepted_by.labels(draft=draft_label(rec.by)).inc(rec.accepted)
        for k in range(rec.accepted):
            self.accepted_pos.labels(position=str(k + 1)).inc()
        self.generated.inc(len(rec.emitted))
        self.draft_time.observe(rec.draft_ms / 1e3)
        self.tau.observe(rec.tau)
