"""GET /metrics: Prometheus counters that the engine thread updates, and the engine's state at each scrape."""
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily


class Metrics:
    """Counters the engine thread updates, and the engine's state read at each scrape."""

    def __init__(self, engine):
        self.registry = registry = CollectorRegistry()
        self.prompt_tokens = Counter("npqwen_prompt_tokens", "Prompt tokens of the requests added", registry=registry)
        self.generation_tokens = Counter("npqwen_generation_tokens", "Tokens generated", registry=registry)
        self.finished = Counter("npqwen_requests_finished", "Requests finished, by finish reason",
                                ["finish_reason"], registry=registry)
        self.embedding_inputs = Counter("npqwen_embedding_inputs", "Inputs embedded by /v1/embeddings",
                                        registry=registry)
        self.rerank_documents = Counter("npqwen_rerank_documents", "Documents scored by /v1/rerank",
                                        registry=registry)
        self.api_requests = Counter("npqwen_api_requests", "Calls of the Messages API, by endpoint "
                                    "(messages, count_tokens)", ["endpoint"], registry=registry)
        self.time_to_first_token = Histogram(
            "npqwen_time_to_first_token_seconds", "From a request's arrival to its first token",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120), registry=registry)
        registry.register(EngineState(engine))


class EngineState:
    """A prometheus_client collector: the engine's stats at scrape time."""

    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        s = self.engine.stats
        used = s["kv_pages_total"] - s["kv_pages_free"] - s["kv_pages_cached"]
        yield GaugeMetricFamily("npqwen_requests_running", "Requests in the running batch", value=s["running"])
        yield GaugeMetricFamily("npqwen_requests_waiting", "Requests waiting to be admitted", value=s["waiting"])
        yield GaugeMetricFamily("npqwen_kv_pages_used", "KV-cache pages held by requests", value=used)
        yield GaugeMetricFamily("npqwen_kv_pages_cached", "Free KV-cache pages still holding a cached prefix",
                                value=s["kv_pages_cached"])
        yield GaugeMetricFamily("npqwen_kv_pages_total", "KV-cache pages in the pool", value=s["kv_pages_total"])
        yield CounterMetricFamily("npqwen_prefix_cache_hit_tokens", "Prompt tokens read from the prefix cache",
                                  value=s["prefix_cache_hit_tokens"])
        yield CounterMetricFamily("npqwen_preemptions", "Requests preempted for lack of pages",
                                  value=s["preemptions"])
