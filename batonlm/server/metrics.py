"""Prometheus metrics of one server instance (its own registry: no global state)."""

from __future__ import annotations

import time
from bisect import bisect_left
from itertools import accumulate

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from batonlm.ipc.messages import SchedulerStats

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_LENGTH_BUCKETS = (1, 4, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)


class TokenGaps:
    """A histogram observed once per streamed token (tens of thousands a second): counts by
    bucket in a list, read at scrape time. prometheus_client's Histogram takes a lock and walks
    its buckets in Python for every observation (~2 us of the main process's per-token cost)."""

    def __init__(self, name: str, doc: str, model_name: str, buckets: tuple[float, ...],
                 registry: CollectorRegistry) -> None:
        self.name, self.doc, self.model_name = name, doc, model_name
        self.bounds = list(buckets)
        self.counts = [0] * (len(buckets) + 1)  # the last: above every bound
        self.sum = 0.0
        registry.register(self)

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1  # the first bucket whose bound is >= value
        self.sum += value

    def collect(self):
        family = HistogramMetricFamily(self.name, self.doc, labels=["model_name"])
        cumulative = list(accumulate(self.counts))
        buckets = [(floatToGoString(b), c) for b, c in zip(self.bounds, cumulative)] + [("+Inf", cumulative[-1])]
        family.add_metric([self.model_name], buckets, self.sum)
        yield family


class ServerMetrics:
    """Implements the TokenizerManager's RequestObserver; gauges are refreshed per scrape."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r = self.registry
        self.running = Gauge("batonlm_num_requests_running", "Requests being decoded", labels, registry=r)
        self.queued = Gauge("batonlm_num_requests_waiting", "Requests waiting for admission", labels, registry=r)
        self.compiling = Gauge("batonlm_num_requests_compiling_grammar", "Constrained requests waiting for their "
                               "grammar to compile", labels, registry=r)
        self.kv_usage = Gauge("batonlm_kv_cache_usage_ratio", "Fraction of KV slots in use", labels, registry=r)
        self.kv_used = Gauge("batonlm_kv_cache_used_slots", "KV slots in use", labels, registry=r)
        self.kv_total = Gauge("batonlm_kv_cache_total_slots", "KV slots in the cache", labels, registry=r)
        self.kv_evictable = Gauge("batonlm_kv_cache_evictable_slots", "KV slots of cached prefixes no running "
                                  "request reads (evicted when room is needed)", labels, registry=r)
        self.cache_hit = Gauge("batonlm_prefix_cache_hit_ratio", "Share of admitted prompt tokens the prefix cache "
                               "served, since start", labels, registry=r)
        self.cached_tokens = Gauge("batonlm_prefix_cache_hit_tokens", "Prompt tokens the prefix cache served, "
                                   "since start", labels, registry=r)
        self.retractions = Gauge("batonlm_scheduler_retractions", "Requests retracted (the KV pool was full) "
                                 "since start", labels, registry=r)
        self.preemptions = Gauge("batonlm_scheduler_preemptions", "Requests retracted for a request of higher "
                                 "priority since start (--schedule-policy priority), by their priority",
                                 [*labels, "priority"], registry=r)
        self.req_slots_used = Gauge("batonlm_request_slots_used", "Request slots in use", labels, registry=r)
        self.lora_placements = Gauge("batonlm_lora_adapter_placements", "LoRA adapters copied into a device slot "
                                     "since start (--max-loras-per-batch slots, fewer than the loaded adapters: "
                                     "they take turns)", labels, registry=r)
        self.sched_cpu = Gauge("batonlm_scheduler_cpu_seconds", "Scheduler CPU work so far (building batches, "
                               "launching, processing results)", labels, registry=r)
        self.device_wait = Gauge("batonlm_scheduler_device_wait_seconds", "Scheduler time blocked on device results",
                                 labels, registry=r)
        self.device_compute = Gauge("batonlm_device_compute_seconds", "Device compute so far (the CPU and null devices)",
                                    labels, registry=r)
        self.batches = Gauge("batonlm_scheduler_batches", "Forward passes run so far", labels, registry=r)
        self.prompt_tokens = Counter("batonlm_prompt_tokens", "Prompt tokens of finished requests (aborted "
                                     "ones included)", labels, registry=r)
        self.generation_tokens = Counter("batonlm_generation_tokens", "Generated tokens (of aborted requests "
                                         "too)", labels, registry=r)
        self.requests = Counter("batonlm_requests_finished", "Requests that ended, by finish reason (stop, length, "
                                "abort)", [*labels, "finish_reason"], registry=r)
        self.ttft = Histogram("batonlm_time_to_first_token_seconds", "Time to first token", labels,
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = TokenGaps("batonlm_inter_token_latency_seconds", "Time between tokens", model_name,
                             _LATENCY_BUCKETS, r)
        self.e2e = Histogram("batonlm_e2e_request_latency_seconds", "Request latency", labels,
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram("batonlm_request_queue_time_seconds", "Time a request waited in the scheduler "
                                    "before its first admission", labels, buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_len = Histogram("batonlm_request_prompt_tokens", "Prompt length of finished requests", labels,
                                    buckets=_LENGTH_BUCKETS, registry=r)
        self.generation_len = Histogram("batonlm_request_generation_tokens", "Tokens generated per finished "
                                        "request", labels, buckets=_LENGTH_BUCKETS, registry=r)
        self.device_idle = Gauge("batonlm_device_idle_ratio", "Share of the time since start the device computed "
                                 "nothing (the CPU and null devices)", labels, registry=r)
        self.hidden_cpu = Gauge("batonlm_overlap_hidden_cpu_ratio", "Share of the scheduler's CPU work done while "
                                "the device computed (the overlap loop's aim: near 1; the normal loop: near 0)",
                                labels, registry=r)
        self.sched_cpu_per_iter = Gauge("batonlm_host_scheduler_cpu_per_iteration_seconds", "Scheduler CPU work per "
                                        "iteration since start (benchmarks/host_overhead.py)", labels, registry=r)
        self.main_cpu_per_token = Gauge("batonlm_host_main_cpu_per_token_seconds", "Main-process CPU time (HTTP, "
                                        "tokenizer, detokenization, streaming) per generated token since start",
                                        labels, registry=r)
        self._spec_metrics()
        self.label = {"model_name": model_name}
        self.started = time.monotonic()
        self.main_cpu_at_start = time.process_time()

    def on_first_token(self, ttft_s: float, queued_s: float | None) -> None:
        self.ttft.labels(**self.label).observe(ttft_s)
        if queued_s is not None:
            self.queue_time.labels(**self.label).observe(queued_s)

    def on_token(self, itl_s: float) -> None:
        self.itl.observe(itl_s)

    def on_finish(self, e2e_s: float, prompt_tokens: int, completion_tokens: int, finish_reason: str) -> None:
        self.e2e.labels(**self.label).observe(e2e_s)
        self.prompt_tokens.labels(**self.label).inc(prompt_tokens)
        self.generation_tokens.labels(**self.label).inc(completion_tokens)
        self.requests.labels(**self.label, finish_reason=finish_reason).inc()
        self.prompt_len.labels(**self.label).observe(prompt_tokens)
        self.generation_len.labels(**self.label).observe(completion_tokens)

    def _spec_metrics(self) -> None:
        r, labels = self.registry, ["model_name"]
        self.spec_steps = Gauge("batonlm_spec_verify_steps", "Speculative decoding: verification steps (one per "
                                "verifying request and step) since start", labels, registry=r)
        self.spec_drafts = Gauge("batonlm_spec_draft_tokens", "Draft tokens verified since start", labels, registry=r)
        self.spec_accepted = Gauge("batonlm_spec_accepted_tokens", "Draft tokens accepted since start", labels,
                                   registry=r)
        self.spec_accept_len = Gauge("batonlm_spec_accept_length", "Tokens emitted per verification step (accepted "
                                     "drafts + 1), since start", labels, registry=r)
        self.spec_hist = Gauge("batonlm_spec_verify_steps_by_accepted", "Verification steps that accepted `accepted` "
                               "drafts, since start (the distribution of accepted drafts per step)",
                               [*labels, "accepted"], registry=r)

    def _update_spec(self, stats: SchedulerStats) -> None:
        if not stats.spec_accept_hist:
            return
        self.spec_steps.labels(**self.label).set(stats.spec_verify_steps)
        self.spec_drafts.labels(**self.label).set(stats.spec_draft_tokens)
        self.spec_accepted.labels(**self.label).set(stats.spec_accepted_tokens)
        steps = max(1, stats.spec_verify_steps)
        self.spec_accept_len.labels(**self.label).set((stats.spec_verify_steps + stats.spec_accepted_tokens) / steps)
        for k, n in enumerate(stats.spec_accept_hist):
            self.spec_hist.labels(**self.label, accepted=str(k)).set(n)

    def update(self, stats: SchedulerStats) -> None:
        self._update_spec(stats)
        self.running.labels(**self.label).set(stats.num_running)
        self.queued.labels(**self.label).set(stats.num_waiting)
        self.compiling.labels(**self.label).set(stats.num_compiling)
        self.kv_used.labels(**self.label).set(stats.kv_used)
        self.kv_total.labels(**self.label).set(stats.kv_capacity)
        self.kv_usage.labels(**self.label).set(stats.kv_used / max(1, stats.kv_capacity))
        self.req_slots_used.labels(**self.label).set(stats.req_slots_used)
        self.kv_evictable.labels(**self.label).set(stats.kv_evictable)
        self.cache_hit.labels(**self.label).set(stats.cached_prompt_tokens / max(1, stats.admitted_prompt_tokens))
        self.cached_tokens.labels(**self.label).set(stats.cached_prompt_tokens)
        self.retractions.labels(**self.label).set(stats.retractions)
        self.lora_placements.labels(**self.label).set(stats.lora_placements)
        for priority, count in stats.preemptions.items():
            self.preemptions.labels(**self.label, priority=priority).set(count)
        self.sched_cpu.labels(**self.label).set(stats.scheduler_cpu_s)
        self.device_wait.labels(**self.label).set(stats.device_wait_s)
        self.device_compute.labels(**self.label).set(stats.device_compute_s)
        self.batches.labels(**self.label).set(stats.batches)
        if stats.batches:
            self.sched_cpu_per_iter.labels(**self.label).set(stats.scheduler_cpu_s / stats.batches)
        if stats.generated_tokens:
            main_cpu = time.process_time() - self.main_cpu_at_start
            self.main_cpu_per_token.labels(**self.label).set(main_cpu / stats.generated_tokens)
        uptime = max(1e-9, time.monotonic() - self.started)
        if stats.device_compute_s:
            self.device_idle.labels(**self.label).set(max(0.0, 1.0 - stats.device_compute_s / uptime))
        # Device time the scheduler did not spend waiting for overlapped its CPU work.
        hidden = (stats.device_compute_s - stats.device_wait_s) / stats.scheduler_cpu_s if stats.scheduler_cpu_s else 0.0
        self.hidden_cpu.labels(**self.label).set(min(1.0, max(0.0, hidden)))

    def render(self) -> bytes:
        return generate_latest(self.registry)
