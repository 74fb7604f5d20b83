"""The server's Prometheus metrics, in a registry of their own (several apps may live in one process):
HTTP answers by route and status, per-sequence latencies, and the engine's own counters and gauges from a
snapshot taken on the engine loop thread.

The main series are also exported under vLLM's names with a `model_name` label (vllm:num_requests_running,
vllm:num_requests_waiting, vllm:kv_cache_usage_perc, vllm:prompt_tokens_total, vllm:generation_tokens_total,
vllm:request_success_total{finished_reason}, vllm:time_to_first_token_seconds,
vllm:inter_token_latency_seconds and vllm:time_per_output_token_seconds, vllm:e2e_request_latency_seconds,
vllm:request_queue_time_seconds, vllm:request_prompt_tokens, vllm:request_generation_tokens, and with LoRA
slots vllm:lora_requests_info), so dashboards and routers built for vLLM read this server."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/v1/models", "/health", "/metrics",
          "/tokenize", "/detokenize", "/version")
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
# vLLM's finished_reason values: stop, length, abort (an error is an abort to vLLM's dashboards).
_VLLM_REASON = {"stop": "stop", "length": "length", "abort": "abort", "error": "abort"}


class Metrics:
    """The metrics of one app; /metrics renders `registry`."""

    def __init__(self, model_name: str = "model"):
        self.model_name = model_name
        self.registry = r = CollectorRegistry()
        self.http = Counter("tlaloc_http_requests", "HTTP requests by route and status code", ["route", "status"],
                            registry=r)
        self.finished = Counter("tlaloc_sequences_finished", "Sequences ended, by reason "
                                "(stop, length, abort: client gone, error)", ["reason"], registry=r)
        self.queue_time = Histogram("tlaloc_request_queue_seconds", "Arrival to the first call that reads the "
                                    "sequence", buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("tlaloc_time_to_first_token_seconds", "Arrival to the first generated token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("tlaloc_inter_token_latency_seconds", "Time between a sequence's consecutive tokens",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("tlaloc_request_seconds", "Arrival to a sequence's end", buckets=LATENCY_BUCKETS,
                             registry=r)
        m = ["model_name"]
        self.v_success = Counter("vllm:request_success", "Finished requests, by finished_reason",
                                 ["model_name", "finished_reason"], registry=r)
        self.v_queue = Histogram("vllm:request_queue_time_seconds", "Time in the waiting queue", m,
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.v_ttft = Histogram("vllm:time_to_first_token_seconds", "Time to the first token", m,
                                buckets=LATENCY_BUCKETS, registry=r)
        self.v_itl = Histogram("vllm:inter_token_latency_seconds", "Time between consecutive tokens", m,
                               buckets=LATENCY_BUCKETS, registry=r)
        self.v_tpot = Histogram("vllm:time_per_output_token_seconds", "Time per output token (vLLM's older name)",
                                m, buckets=LATENCY_BUCKETS, registry=r)
        self.v_e2e = Histogram("vllm:e2e_request_latency_seconds", "Arrival to the end of the request", m,
                               buckets=LATENCY_BUCKETS, registry=r)
        self.v_prompt = Histogram("vllm:request_prompt_tokens", "Prompt tokens per request", m,
                                  buckets=TOKEN_BUCKETS, registry=r)
        self.v_generation = Histogram("vllm:request_generation_tokens", "Generated tokens per request", m,
                                      buckets=TOKEN_BUCKETS, registry=r)
        self.engine = _EngineCollector(model_name)
        r.register(self.engine)

    def observe_sequence(self, info, arrival: float, reason: str) -> None:
        name = self.model_name
        self.finished.labels(reason).inc()
        self.v_success.labels(name, _VLLM_REASON.get(reason, reason)).inc()
        if info.first_scheduled is not None:
            self.queue_time.observe(max(0.0, info.first_scheduled - arrival))
            self.v_queue.labels(name).observe(max(0.0, info.first_scheduled - arrival))
        if info.first_token_time is not None:
            self.ttft.observe(max(0.0, info.first_token_time - arrival))
            self.v_ttft.labels(name).observe(max(0.0, info.first_token_time - arrival))
        times = info.token_times
        for a, b in zip(times, times[1:]):
            self.itl.observe(b - a)
            self.v_itl.labels(name).observe(b - a)
            self.v_tpot.labels(name).observe(b - a)
        self.e2e.observe(time.perf_counter() - arrival)
        self.v_e2e.labels(name).observe(time.perf_counter() - arrival)
        self.v_prompt.labels(name).observe(len(info.prompt))
        self.v_generation.labels(name).observe(len(info.generated))


class _EngineCollector:
    """The engine's own counters, from a snapshot the /metrics handler takes on the loop thread."""

    def __init__(self, model_name: str = "model"):
        self.model_name = model_name
        self.snapshot: dict | None = None

    def describe(self):
        return []

    def collect(self):
        s = self.snapshot
        if s is None:
            return
        for name, key, doc in (("tlaloc_engine_steps", "steps", "Engine scheduling steps that produced tokens"),
                               ("tlaloc_engine_executions", "executions", "Compiled-entry executions (calls)"),
                               ("tlaloc_engine_prefill_calls", "prefill_calls", "Prefill executions"),
                               ("tlaloc_engine_decode_calls", "decode_calls", "Decode executions"),
                               ("tlaloc_prompt_tokens", "prompt_tokens", "Prompt tokens prefilled"),
                               ("tlaloc_generation_tokens", "tokens_generated", "Tokens generated"),
                               ("tlaloc_requests_refused", "requests_refused", "Sequences the engine refused")):
            yield CounterMetricFamily(name, doc, value=s[key])
        for name, key, doc in (("tlaloc_kv_pages_in_use", "pages_in_use", "KV pages held by sequences"),
                               ("tlaloc_kv_pages_total", "num_pages", "KV pages in the pool"),
                               ("tlaloc_requests_running", "running", "Sequences the scheduler runs"),
                               ("tlaloc_requests_waiting", "waiting", "Sequences waiting to run"),
                               ("tlaloc_entries_cold", "cold_entries", "Entries neither run nor warmed up yet (the "
                                                                      "first run of each pays one-time costs)")):
            yield GaugeMetricFamily(name, doc, value=s[key])
        for name, key, doc in (("tlaloc_pool_pages_in_use", "pages_in_use", "Pages held by sequences, per pool"),
                               ("tlaloc_pool_pages_total", "num_pages", "Pages per pool")):
            g = GaugeMetricFamily(name, doc, labels=["pool"])
            for pool, st in (s.get("pools") or {}).items():
                g.add_metric([pool], st[key])
            yield g
        sizes = s["batch_sizes"]
        buckets = []
        for le in BATCH_BUCKETS:
            buckets.append((str(le), sum(c for b, c in sizes.items() if b <= le)))
        buckets.append(("+Inf", sum(sizes.values())))
        yield HistogramMetricFamily("tlaloc_batch_size", "Sequences per execution (its sum: sequence-steps run)",
                                    buckets=buckets, sum_value=sum(b * c for b, c in sizes.items()))
        label = [self.model_name]
        for name, value, doc in (("vllm:num_requests_running", s["running"], "Requests running"),
                                 ("vllm:num_requests_waiting", s["waiting"], "Requests waiting"),
                                 ("vllm:kv_cache_usage_perc", s["kv_cache_usage"], "KV-cache usage (1 is full)"),
                                 ("vllm:gpu_cache_usage_perc", s["kv_cache_usage"],
                                  "KV-cache usage (vLLM's older name)")):
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric(label, value)
            yield g
        for name, key, doc in (("vllm:prompt_tokens", "prompt_tokens", "Prompt tokens prefilled"),
                               ("vllm:generation_tokens", "tokens_generated", "Tokens generated"),
                               ("vllm:num_preemptions", "preemptions", "Sequences preempted (pages given back, "
                                                                       "recomputed when they run again)"),
                               ("vllm:prefix_cache_queries", "prefix_queries", "Tokens looked up in the prefix cache"),
                               ("vllm:prefix_cache_hits", "prefix_hits", "Tokens found in the prefix cache"),
                               ("vllm:spec_decode_num_drafts", "spec_decode_num_drafts", "Sequences' drafts verified"),
                               ("vllm:spec_decode_num_draft_tokens", "spec_decode_num_draft_tokens",
                                "Drafted tokens verified"),
                               ("vllm:spec_decode_num_accepted_tokens", "spec_decode_num_accepted_tokens",
                                "Drafted tokens accepted")):
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric(label, s.get(key, 0))
            yield c
        if "lora" in s:     # as vLLM: the labels carry the adapters, the value is when they were read
            lo = s["lora"]
            g = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on lora requests.",
                                  labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"])
            g.add_metric([str(lo["max_lora"]), ",".join(lo["waiting"]), ",".join(lo["running"])], time.time())
            yield g
        c = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos", "Drafted tokens accepted, by their "
                                "position in the draft", labels=["model_name", "position"])
        for pos, n in enumerate(s.get("spec_decode_num_accepted_tokens_per_pos") or ()):
            c.add_metric(label + [str(pos)], n)
        yield c


class CountRequests:
    """ASGI middleware: count every HTTP answer by route and status (streams included)."""

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = {"code": 500}

        async def send_(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_)
        finally:
            route = scope["path"] if scope["path"] in ROUTES else "other"
            self.metrics.http.labels(route, str(status["code"])).inc()
