"""One Prometheus (Debian's) scraping two daemons' ``/metrics`` over their TCP listeners,
with the fleet's alert rules (docs/fleet/alerts.yml) loaded.

The daemons share one keys file (``MODELD_API_KEYS_FILE``), as a fleet that syncs it does,
so one ``use`` key opens every ``/metrics``. The test asks Prometheus's HTTP API, as a
dashboard would.
"""

from __future__ import annotations

import json
import signal
import subprocess
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.support.daemon import DaemonProcess, stop_process
from tests.support.fleet import (
    START_TIMEOUT,
    Daemons,
    free_port,
    http_get,
    need,
    wait_port,
    write_text,
)
from tests.support.state import MODELS, install_fixture
from tests.support.wait import wait_sync

pytestmark = pytest.mark.fleet

ALERTS = Path(__file__).resolve().parents[2] / "docs" / "fleet" / "alerts.yml"


@dataclass
class Scraped:
    daemons: list[tuple[DaemonProcess, str]]  # each daemon and its scrape target
    api: str

    def query(self, expr: str) -> list[dict[str, Any]]:
        doc = http_get(f"{self.api}/api/v1/query?query={urllib.parse.quote(expr)}")
        assert doc["status"] == "success", doc
        result: list[dict[str, Any]] = doc["data"]["result"]
        return result

    def instances(self, expr: str) -> set[str]:
        return {r["metric"]["instance"] for r in self.query(expr)}

    def wait_for(self, expr: str, instances: set[str]) -> None:
        """Wait until ``expr`` has a series for each of ``instances``."""
        wait_sync(lambda: self.instances(expr) == instances, 60.0, what=expr)


def _scrape_config(targets: list[str], key_file: Path) -> str:
    """docs/fleet.md's scrape config, every second, for ``targets``."""
    return json.dumps(  # JSON is YAML
        {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(ALERTS)],
            "scrape_configs": [
                {
                    "job_name": "modeld",
                    "authorization": {"type": "Bearer", "credentials_file": str(key_file)},
                    "static_configs": [{"targets": targets}],
                }
            ],
        },
        indent=2,
    )


def _ready(api: str) -> bool:
    try:
        with urllib.request.urlopen(f"{api}/-/ready", timeout=5.0) as resp:
            return bool(resp.status == 200)
    except OSError:  # HTTPError (503) included
        return False


@pytest.fixture
def scraped(short_tmp: Path) -> Iterator[Scraped]:
    binary = need("prometheus", "Debian's prometheus")
    daemons = Daemons(short_tmp / "d")
    keys = short_tmp / "api-keys"
    prometheus: subprocess.Popen[bytes] | None = None
    try:
        targets = []
        for name in ("a", "b"):
            home, registry = daemons.root / name, short_tmp / f"{name}-registry"
            install_fixture(home, "tiny-text", MODELS / "tiny-text.litertlm", registry=registry)
            port = free_port()
            d = daemons.start(
                name,
                MODELD_REGISTRY=str(registry),
                MODELD_LISTEN=f"127.0.0.1:{port}",
                MODELD_API_KEYS_FILE=str(keys),
            )
            targets.append((d, f"127.0.0.1:{port}"))
        added = targets[0][0].cli("key", "add", "prometheus")
        assert added.returncode == 0, added.stderr
        key_file = write_text(short_tmp / "prometheus.key", added.stdout.strip())
        for d, _ in targets:
            loaded = d.cli("load", "tiny-text")
            assert loaded.returncode == 0, loaded.stderr
        config = write_text(
            short_tmp / "prometheus.yml", _scrape_config([t for _, t in targets], key_file)
        )
        port = free_port()
        log = short_tmp / "prometheus.log"
        with log.open("ab") as out:
            prometheus = subprocess.Popen(
                [
                    binary,
                    f"--config.file={config}",
                    f"--storage.tsdb.path={short_tmp / 'tsdb'}",
                    f"--web.listen-address=127.0.0.1:{port}",
                ],
                stdout=out,
                stderr=out,
            )
        wait_port(port, prometheus, log, START_TIMEOUT)
        api = f"http://127.0.0.1:{port}"
        # It listens before its storage is open: its API answers 503 until then.
        wait_sync(lambda: _ready(api), START_TIMEOUT, what="Prometheus ready")
        yield Scraped(targets, api)
    finally:
        if prometheus is not None and prometheus.poll() is None:
            stop_process(prometheus, signal.SIGTERM, 20.0)
        daemons.stop()


def test_one_prometheus_finds_each_daemons_engines_pulls_and_budget(scraped: Scraped) -> None:
    """Both targets are up, and for each one Prometheus holds its engines (a load and the
    engine's PSS), its pulls (ended by result, running) and its budget (total and used)."""
    everyone = {target for _, target in scraped.daemons}
    series = (
        'up{job="modeld"} == 1',
        'modeld_engine_loads_total{model="tiny-text"}',
        "modeld_engine_pss_bytes",
        'modeld_pulls_total{result="failed"}',
        "modeld_downloads_active",
        "modeld_memory_budget_bytes",
        "modeld_memory_budget_used_bytes > 0",
    )
    for expr in series:
        scraped.wait_for(expr, everyone)


def test_the_fleets_alert_rules_load_and_evaluate(scraped: Scraped) -> None:
    """docs/fleet/alerts.yml passes ``promtool check rules``, and Prometheus evaluates every
    rule of it on the two daemons without error, none firing on a healthy fleet."""
    promtool = need("promtool", "Debian's prometheus (it ships promtool)")
    checked = subprocess.run(
        [promtool, "check", "rules", str(ALERTS)], check=False, capture_output=True
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr

    def evaluated() -> list[dict[str, Any]]:
        groups = http_get(f"{scraped.api}/api/v1/rules")["data"]["groups"]
        rules = [r for g in groups for r in g["rules"]]
        return [r for r in rules if r.get("lastEvaluation", "").startswith("2")]

    wait_sync(lambda: len(evaluated()) == 4, 60.0, what="every rule evaluated")
    rules = evaluated()
    assert {r["name"] for r in rules} == {
        "ModeldDown",
        "ModeldPullFailed",
        "ModeldEvictionsUnderPressure",
        "ModeldLyingMirror",
    }
    assert all(r["health"] == "ok" and r["state"] == "inactive" for r in rules), rules
