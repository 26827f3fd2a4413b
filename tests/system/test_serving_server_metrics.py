"""``/metrics`` is written by prometheus_client and read back by its own parser."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from selfspec.serving.server import create_app
from selfspec.serving.server.metrics import CONTENT_TYPE, Metrics

MODEL = "selfspec-demo"


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_metrics_are_prometheus_client_families() -> None:
    families = list(Metrics().families())
    assert families and all(isinstance(family, Metric) for family in families)
    assert CONTENT_TYPE.startswith("text/plain; version=0.0.4")


def test_metrics_parse_with_prometheus_clients_parser(demo_engine: Any) -> None:
    app = create_app(demo_engine, model_id=MODEL)
    with TestClient(app, base_url="http://localhost") as http:
        answer = http.post(
            "/v1/completions", json={"model": MODEL, "prompt": "Mr. Darcy", "max_tokens": 6, "temperature": 0}
        )
        assert answer.status_code == 200
        usage = answer.json()["usage"]
        response = http.get("/metrics")
    assert response.headers["content-type"] == CONTENT_TYPE
    families = {family.name: family for family in text_string_to_metric_families(response.text)}
    assert families["selfspec_requests"].type == "counter"
    assert families["selfspec_mean_accepted_length"].type == "gauge"
    samples = _samples(response.text)
    assert samples[("selfspec_requests_total", (("endpoint", "/v1/completions"), ("status", "200")))] == 1
    assert samples[("selfspec_completion_tokens_total", ())] == usage["completion_tokens"]
    assert samples[("selfspec_prompt_tokens_total", ())] == usage["prompt_tokens"]
    assert sum(v for (name, _), v in samples.items() if name == "selfspec_generations_total") == 1
    assert samples[("selfspec_requests_running", ())] == 0
    forwards = samples[("selfspec_target_forwards_total", ())]
    histogram = sum(v for (name, _), v in samples.items() if name == "selfspec_accepted_length_histogram_total")
    assert forwards >= 1 and histogram == forwards - 1  # one verify step per forward after the prefill
