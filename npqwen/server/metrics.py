"""GET /metrics: what the engine thread records as requests go, and the engine's state at each scrape.

Names follow vLLM's with npqwen's prefix (npqwen:time_to_first_token_seconds beside
vllm:time_to_first_token_seconds), so a serving dashboard reads either; docs/server.md#metrics
has the table.
"""
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

SECONDS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120, 300)
TOKEN_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 2.5, 5)
TOKENS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)


class Metrics:
    """Counters and histograms the engine thread updates (observe_*), and the engine's state read at each scrape."""

    def __init__(self, engine):
        self.registry = registry = CollectorRegistry()

        def histogram(name, text, buckets):
            return Histogram("npqwen:" + name, text, buckets=buckets, registry=registry)

        self.prompt_tokens = Counter("npqwen:prompt_tokens", "Prompt tokens of the requests added", registry=registry)
        self.generation_tokens = Counter("npqwen:generation_tokens", "Tokens generated", registry=registry)
        self.finished = Counter("npqwen:requests_finished", "Requests finished, by finish reason",
                                ["finish_reason"], registry=registry)
        self.embedding_inputs = Counter("npqwen:embedding_inputs", "Inputs embedded by /v1/embeddings",
                                        registry=registry)
        self.rerank_documents = Counter("npqwen:rerank_documents", "Documents scored by /v1/rerank",
                                        registry=registry)
        self.api_requests = Counter("npqwen:api_requests", "Calls of the Messages API, by endpoint "
                                    "(messages, count_tokens)", ["endpoint"], registry=registry)
        self.time_to_first_token = histogram("time_to_first_token_seconds", "From a request's arrival to its first "
                                             "token", SECONDS)
        self.time_per_output_token = histogram("time_per_output_token_seconds", "Between two tokens of a request",
                                               TOKEN_SECONDS)
        self.e2e_latency = histogram("e2e_request_latency_seconds", "From a request's arrival to its end", SECONDS)
        self.queue_time = histogram("request_queue_time_seconds", "From a request's arrival to its admission "
                                    "(pages given)", SECONDS)
        self.request_prompt_tokens = histogram("request_prompt_tokens", "Prompt tokens per finished request", TOKENS)
        self.request_generation_tokens = histogram("request_generation_tokens", "Tokens generated per finished "
                                                   "request", TOKENS)
        registry.register(EngineState(engine))

    def observe_token(self, request, first: bool, now: float):
        """A request's token was sampled: its time to first token, or the time since its last one."""
        if first:
            self.time_to_first_token.observe(now - request.arrival)
        elif len(request.token_times) >= 2:
            self.time_per_output_token.observe(request.token_times[-1] - request.token_times[-2])

    def observe_finished(self, request, now: float):
        """A generation request ended: its latency, time in the queue and token counts."""
        self.e2e_latency.observe(now - request.arrival)
        if request.admitted is not None:
            self.queue_time.observe(request.admitted - request.arrival)
        self.request_prompt_tokens.observe(len(request.prompt_ids))
        self.request_generation_tokens.observe(len(request.output_ids))


class EngineState:
    """A prometheus_client collector: the engine's stats at scrape time."""

    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        s = self.engine.stats
        used = s["kv_pages_total"] - s["kv_pages_free"] - s["kv_pages_cached"]
        yield GaugeMetricFamily("npqwen:num_requests_running", "Requests in the running batch", value=s["running"])
        yield GaugeMetricFamily("npqwen:num_requests_waiting", "Requests waiting to be admitted", value=s["waiting"])
        yield GaugeMetricFamily("npqwen:kv_cache_usage_perc", "Share of the KV-cache pages held by requests (0 .. 1)",
                                value=used / s["kv_pages_total"])
        yield GaugeMetricFamily("npqwen:kv_pages_used", "KV-cache pages held by requests", value=used)
        yield GaugeMetricFamily("npqwen:kv_pages_cached", "Free KV-cache pages still holding a cached prefix",
                                value=s["kv_pages_cached"])
        yield GaugeMetricFamily("npqwen:kv_pages_total", "KV-cache pages in the pool", value=s["kv_pages_total"])
        yield CounterMetricFamily("npqwen:prefix_cache_hit_tokens", "Prompt tokens read from the prefix cache",
                                  value=s["prefix_cache_hit_tokens"])
        yield CounterMetricFamily("npqwen:num_preemptions", "Requests preempted for lack of pages",
                                  value=s["preemptions"])
        yield CounterMetricFamily("npqwen:prefix_cache_disk_pages_read", "KV pages read from --prefix-cache-dir",
                                  value=s["prefix_cache_disk_pages_read"])
        yield CounterMetricFamily("npqwen:prefix_cache_disk_pages_written", "KV pages written to --prefix-cache-dir",
                                  value=s["prefix_cache_disk_pages_written"])
        # speculative decoding, vLLM's spec_decode_* names: verification steps, drafts verified, drafts kept
        for name, text in (("num_drafts", "Verification steps of speculating requests"),
                           ("num_draft_tokens", "Draft tokens verified"),
                           ("num_accepted_tokens", "Draft tokens accepted")):
            yield CounterMetricFamily(f"npqwen:spec_decode_{name}", text, value=s[f"spec_decode_{name}"])
