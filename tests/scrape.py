"""One value from a service's Prometheus /metrics, as a test reads it."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families


def metric(service, name: str, **labels) -> float:
    """The sample `name` with exactly these labels (a counter's name ends in _total), or 0.0
    where the service has not reported it yet."""
    with urllib.request.urlopen(service.metrics_url, timeout=10) as response:
        text = response.read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return sample.value
    return 0.0
