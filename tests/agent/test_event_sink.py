"""events.jsonl, the console event handler, the metrics configuration and the health port, each on
its own (the e2e test of all of them with real agents: tests/agent/test_observability.py).
"""

from __future__ import annotations

import io
import json
import threading
import urllib.error
import urllib.request

import pytest

from etcdrun.agent.report.event_sink import EventSink, check_handler, read
from etcdrun.agent.report.health import HealthServer
from etcdrun.agent.report.metrics import MetricsConfig, MetricStore, prometheus_text
from etcdrun.rendezvous.events import EventLog


def test_every_event_is_one_line_with_time_ms_run_node_round(tmp_path):
    path = str(tmp_path / "logs" / "events.jsonl")
    console = io.StringIO()
    sinks = [EventSink(path, "console", console=console), EventSink(path)]  # two agents
    logs = [EventLog("job"), EventLog("job")]
    for i, (log, sink) in enumerate(zip(logs, sinks, strict=True)):
        log.node = f"n{i}"
        log.subscribe(sink)

    def emit(i: int) -> None:
        for k in range(200):
            logs[i].emit("node_joined", round=k, by="t")

    threads = [threading.Thread(target=emit, args=(i,)) for i in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    logs[0].emit("session_opened")
    for sink in sinks:
        sink.close()
    got = read(path)  # every line whole: no two writers interleaved
    assert len(got) == 401
    assert sorted((e["node"], e["round"]) for e in got[:-1]) == sorted(
        (f"n{i}", k) for i in range(2) for k in range(200)
    )
    last = got[-1]
    assert list(last)[:6] == ["event", "time_ms", "time", "run_id", "node", "round"]
    assert (last["event"], last["run_id"], last["node"], last["round"]) == (
        "session_opened",
        "job",
        "n0",
        None,
    )
    assert isinstance(last["time_ms"], int) and abs(last["time_ms"] / 1000 - last["time"]) < 0.002
    lines = console.getvalue().splitlines()  # the console handler: agent 0's events only
    assert len(lines) == 201 and all(json.loads(ln)["node"] == "n0" for ln in lines)


def test_an_unknown_event_handler_is_one_clear_error():
    assert check_handler("dynamic_rendezvous") == "dynamic_rendezvous"  # torch's name: null
    with pytest.raises(ValueError, match="use one of null, console"):
        check_handler("file")


def test_metrics_cfg_is_checked():
    assert MetricsConfig.from_cfg({}) == MetricsConfig("null", None, "0.0.0.0", True)
    got = MetricsConfig.from_cfg({"port": "9400"})
    assert (got.handler, got.port, got.implicit) == ("prometheus", 9400, True)
    assert MetricsConfig.from_cfg({"handler": "console"}).handler == "console"
    for bad, match in (
        ({"prot": "1"}, "unknown key"),
        ({"port": "x"}, "not a port"),
        ({"port": "70000"}, "not a port"),
        ({"handler": "statsd"}, "use one of null, console, prometheus"),
        ({"handler": "prometheus"}, "needs a port"),
    ):
        with pytest.raises(ValueError, match=match):
            MetricsConfig.from_cfg(bad)


def test_the_console_metrics_handler_prints_torchs_lines():
    out = io.StringIO()
    m = MetricStore("console", console=out)
    m.on_event({"event": "session_lost"})
    m.round_took(1.5)
    m.etcd_call("Txn", 0.001, None)  # the hot path: never a console line
    lines = out.getvalue().splitlines()
    assert len(lines) == 2
    assert lines[0].endswith("[etcdrun]: lease_lost_total=1")
    assert lines[1].endswith("[etcdrun]: round_duration_ms=1500")


def _get(url: str) -> tuple[int, str, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.headers["Content-Type"], r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.headers["Content-Type"], e.read().decode()


def test_the_health_port_answers_healthz_livez_metrics():
    state = {"healthy": True, "why": "", "round": 3}
    store = MetricStore("prometheus")
    store.etcd_call("Range", 0.002, None)
    store.etcd_call("Txn", 0.2, "EtcdConnectionError")
    store.live = lambda: {"gauges": {"lease_time_to_expiry_seconds": 1.5}, "workers": {"run": 2}}
    server = HealthServer("127.0.0.1", 0, lambda: dict(state), lambda: prometheus_text(store))
    server.start()
    try:
        base = f"http://127.0.0.1:{server.port}"
        code, ctype, body = _get(base + "/healthz")
        assert (code, ctype, json.loads(body)["round"]) == (200, "application/json", 3)
        state["healthy"] = False
        assert _get(base + "/healthz")[0] == 503
        assert _get(base + "/livez")[:1] == (200,)
        code, ctype, text = _get(base + "/metrics")
        assert code == 200 and ctype.startswith("text/plain; version=0.0.4")
        assert 'etcdrun_etcd_request_duration_seconds_count{method="Range"} 1.0' in text
        assert (
            'etcdrun_etcd_request_errors_total{error="EtcdConnectionError",method="Txn"} 1.0'
            in text
        )
        assert "etcdrun_lease_time_to_expiry_seconds 1.5" in text
        assert _get(base + "/nothing")[0] == 404
    finally:
        server.close()


def test_every_counter_is_exposed_from_the_first_scrape():
    """A fresh agent's /metrics lacked lease_lost, fenced, worker exits and etcd errors until
    each first happened, so an alert on them read "no data" instead of 0 (a new user's trial).
    """
    fresh = prometheus_text(MetricStore("prometheus")).decode()
    for name in ("rounds", "worker_exits", "etcd_request_errors", "lease_lost", "fenced"):
        assert f"# TYPE etcdrun_{name}_total counter" in fresh, name
    assert "etcdrun_lease_lost_total 0.0" in fresh and "etcdrun_fenced_total 0.0" in fresh
    m = MetricStore("prometheus")
    m.on_event({"event": "fenced"})
    m.on_event({"event": "worker_exited", "how": "SIGKILL"})
    once = prometheus_text(m).decode()
    samples = [line for line in once.splitlines() if line.startswith("etcdrun_fenced_total")]
    assert samples == ["etcdrun_fenced_total 1.0"]
    assert 'etcdrun_worker_exits_total{how="SIGKILL"} 1.0' in once
