"""The counters, gauges and histograms every part reports into.

One ``Metrics`` object per daemon, each with its own prometheus-client registry, so tests
can run several daemons in one process without the global registry clashing.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics import MetricWrapperBase

# Latency buckets from a millisecond to minutes: tiny models answer in ms, real ones take seconds.
_LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
    10,
    30,
    60,
    120,
)


class Metrics:
    """All of modeld's metrics, registered on one private registry."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        r = self.registry
        self.http_requests = Counter(
            "modeld_http_requests", "API requests answered", ["route", "status"], registry=r
        )
        self.http_latency = Histogram(
            "modeld_http_request_seconds",
            "API request latency until the response started",
            ["route"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.up_since = Gauge("modeld_start_time_seconds", "Daemon start time", registry=r)
        self.registry_errors = Gauge(
            "modeld_registry_errors",
            "Registry files skipped because they are invalid",
            registry=r,
        )
        # downloads
        self.download_bytes = Counter(
            "modeld_download_bytes", "Bytes received, by mirror host", ["mirror"], registry=r
        )
        self.download_errors = Counter(
            "modeld_download_errors", "Download errors by class", ["mirror", "kind"], registry=r
        )
        self.download_repairs = Counter(
            "modeld_download_repaired_pieces", "Pieces re-fetched after a mismatch", registry=r
        )
        self.download_mirror_speed = Gauge(
            "modeld_download_mirror_bytes_per_second",
            "Current speed per mirror",
            ["mirror"],
            registry=r,
        )
        self.downloads_active = Gauge("modeld_downloads_active", "Downloads running", registry=r)
        self.pulls = Counter("modeld_pulls", "Downloads ended, by result", ["result"], registry=r)
        # Each result from 0, so that an alert on its increase sees the first one.
        for result in ("installed", "failed", "cancelled"):
            self.pulls.labels(result)
        # engine pool
        self.engine_loads = Counter(
            "modeld_engine_loads", "Engines created", ["model", "result"], registry=r
        )
        self.engine_evictions = Counter(
            "modeld_engine_evictions", "Engines stopped, by reason", ["reason"], registry=r
        )
        self.engine_crashes = Counter(
            "modeld_engine_crashes", "Runner processes that died", ["model", "signal"], registry=r
        )
        self.engine_pss = Gauge(
            "modeld_engine_pss_bytes", "Measured PSS per engine", ["engine"], registry=r
        )
        self.budget_used = Gauge("modeld_memory_budget_used_bytes", "Sum of runner PSS", registry=r)
        self.budget_total = Gauge("modeld_memory_budget_bytes", "The memory budget", registry=r)
        self.queue_depth = Gauge(
            "modeld_queue_depth", "Requests waiting, per model", ["model"], registry=r
        )
        # generation phases
        self.phase_seconds = Histogram(
            "modeld_generate_phase_seconds",
            "Time per generation phase",
            ["phase"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.generated_tokens = Counter(
            "modeld_generated_tokens", "Tokens generated", ["model"], registry=r
        )
        self.turns = Counter(
            "modeld_turns",
            "Generations by how their conversation began: continued (a conversation kept "
            "after the last reply), else why not",
            ["model", "how"],
            registry=r,
        )
        # rm and prune
        self.removed_bytes = Counter(
            "modeld_removed_bytes",
            "Bytes freed by rm and prune, by kind of item",
            ["kind"],
            registry=r,
        )
        self.removed_items = Counter(
            "modeld_removed_items", "Items removed by rm and prune, by kind", ["kind"], registry=r
        )

    def child(self, metric: MetricWrapperBase, *labels: str) -> Any:
        """``metric.labels(*labels)``, kept: ``labels()`` locks and hashes on every call, and
        the request path calls it several times a request. Not for a metric whose children
        are removed (``engine_pss``): a kept child would outlive its removal."""
        key = (id(metric), labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*labels)
        return found

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
