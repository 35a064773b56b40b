"""examples/grafana/specdec-dashboard.json queries only series the server exports, and shows every
metric family it exports (the server's own and, with ``--scheduler``, the cluster's)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from unittest.mock import MagicMock

import pytest

from specdec.cluster.node import Cluster
from specdec.server.metrics import ServerMetrics

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "examples" / "grafana" / "specdec-dashboard.json"
SERVER_DOCS = (ROOT / "docs" / "server.md").read_text()
#: The series a Prometheus scrape holds for one metric family of each type.
SUFFIXES = {"counter": ("_total", "_created"), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count", "_created")}


def exported_families() -> dict[str, str]:
    """Family name -> type, for every metric on a real server's registry with the cluster's added
    (``Cluster._metrics`` registers them there when ``--scheduler`` is given)."""
    metrics = ServerMetrics("m")
    Cluster._metrics(MagicMock(model_name="m"), metrics)  # the cluster's state is read only at scrape time
    return {family.name: family.type for family in metrics.registry.collect()}


def panels(dashboard: dict) -> list[dict]:
    """Every panel, those inside collapsed rows included."""
    found = []
    for panel in dashboard["panels"]:
        found.append(panel)
        found.extend(panel.get("panels", []))
    return found


def queried_series(dashboard: dict) -> set[str]:
    exprs = [target["expr"] for panel in panels(dashboard) for target in panel.get("targets", [])]
    return {name for expr in exprs for name in re.findall(r"\bspecdec_[a-z0-9_]+", expr)}


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def exported_series() -> dict[str, str]:
    """Series name -> its family's name, as a scrape holds them."""
    return {family + suffix: family for family, kind in exported_families().items() for suffix in SUFFIXES[kind]}


def test_every_queried_series_is_exported(dashboard):
    assert sorted(queried_series(dashboard) - exported_series().keys()) == []


def test_every_exported_family_is_on_the_dashboard(dashboard):
    queried = queried_series(dashboard)
    missing = [family for family, kind in exported_families().items()
               if not any(family + suffix in queried for suffix in SUFFIXES[kind])]
    assert missing == []


def test_every_queried_metric_is_documented(dashboard):
    families, series = exported_families(), exported_series()
    for name in queried_series(dashboard):
        family = series[name]
        shown = family + ("_total" if families[family] == "counter" else "")
        assert f"`{shown}" in SERVER_DOCS, f"{shown} is not in docs/server.md"


def test_panels_use_the_datasource_variable(dashboard):
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    ids = [panel["id"] for panel in panels(dashboard)]
    assert len(ids) == len(set(ids))
    for panel in panels(dashboard):
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"] and all(t["datasource"] == panel["datasource"] for t in panel["targets"])


def test_the_check_catches_an_unknown_series():
    fake = {"panels": [{"id": 1, "targets": [{"expr": "rate(specdec_tokens_generated_total[5m])"}]}]}
    assert queried_series(fake) - exported_series().keys() == {"specdec_tokens_generated_total"}
