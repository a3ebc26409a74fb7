"""The OpenAI Batch API end to end: the ``openai`` SDK against ``sluice serve`` on
simulated engines (upload, create, poll, download, list, cancel, expiry, tenant
isolation, validation errors), and a gateway SIGKILLed mid-batch and restarted on
the same store (every ``custom_id`` in the output exactly once)."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import secrets
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import openai
import psutil
import pytest
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import free_port
from tests.integration.limits_support import (
    MODEL,
    GatewayProc,
    gateways,
    sim_engine,
    tenant,
    write_config,
)
from tests.support import wait_for_sync

pytestmark = pytest.mark.timeout(240)
PG = "postgresql://postgres@127.0.0.1:5432/test"


def config(directory: Path, *, speed: float = 50.0, **batch: Any) -> Path:
    gateway = {"batch": {"dir": str(directory / "batch"), **batch},
               "observability": {"access_log": False, "tracing": False}}
    return write_config(directory, tenants=[tenant("a"), tenant("b")],
                        engines=[sim_engine(speed=speed)], gateway=gateway)


def client(g: GatewayProc, name: str) -> OpenAI:
    return OpenAI(base_url=g.url + "/v1", api_key=f"key-{name}", max_retries=0)


def batch_file(n: int, max_tokens: int = 4, url: str = "/v1/chat/completions") -> bytes:
    return "".join(json.dumps({
        "custom_id": f"line-{i}", "method": "POST", "url": url,
        "body": {"model": MODEL, "max_tokens": max_tokens, "ignore_eos": True,
                 "messages": [{"role": "user", "content": f"question {i}"}]}}) + "\n"
        for i in range(n)).encode()


def submit(c: OpenAI, data: bytes, window: str = "24h") -> Any:
    f = c.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch")
    return c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                            completion_window=window, metadata={"job": "test"})


def wait_status(c: OpenAI, batch_id: str, statuses: set[str], timeout_s: float = 90) -> Any:
    seen: list[Any] = []

    def ended() -> bool:
        seen.append(c.batches.retrieve(batch_id))
        return seen[-1].status in statuses

    wait_for_sync(ended, timeout_s, f"batch {batch_id} to reach {statuses}")
    return seen[-1]


def in_flight(g: GatewayProc) -> float:
    """Batch lines the gateway process is running (its ``/metrics``)."""
    return sum(m.value for f in text_string_to_metric_families(httpx.get(g.url + "/metrics").text)
               for m in f.samples if m.name == "sluice_batch_lines_in_flight")


def lines_of(c: OpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(x) for x in c.files.content(file_id).text.splitlines()]


def test_the_sdk_uploads_runs_and_downloads_a_batch(tmp_path: Path) -> None:
    with gateways(config(tmp_path)) as (g,):
        a, b = client(g, "a"), client(g, "b")
        batch = submit(a, batch_file(20))
        assert batch.status == "in_progress" and batch.request_counts.total == 20
        done = wait_status(a, batch.id, {"completed"})
        assert done.request_counts.completed == 20 and done.request_counts.failed == 0
        assert done.metadata == {"job": "test"} and done.completed_at is not None
        out = lines_of(a, done.output_file_id)
        assert sorted(x["custom_id"] for x in out) == sorted(f"line-{i}" for i in range(20))
        assert all(x["response"]["status_code"] == 200 and x["error"] is None for x in out)
        assert all(x["response"]["body"]["usage"]["completion_tokens"] == 4 for x in out)
        assert done.error_file_id is None
        # listed, newest first, paginated
        second = submit(a, batch_file(1))
        wait_status(a, second.id, {"completed"})
        page = a.batches.list(limit=1)
        assert [x.id for x in page.data] == [second.id] and page.has_more
        assert [x.id for x in a.batches.list(limit=5, after=second.id).data] == [batch.id]
        # another tenant sees none of it
        assert b.batches.list().data == []
        with pytest.raises(openai.NotFoundError):
            b.batches.retrieve(batch.id)
        with pytest.raises(openai.NotFoundError):
            b.files.content(done.output_file_id)
        with pytest.raises(openai.NotFoundError):
            b.batches.cancel(batch.id)
        # files: retrieve and delete
        assert a.files.retrieve(batch.input_file_id).purpose == "batch"
        assert a.files.delete(batch.input_file_id).deleted
        with pytest.raises(openai.NotFoundError):
            a.files.retrieve(batch.input_file_id)
        # the lines ran in the batch band, as tenant a
        samples = {(m.name, tuple(sorted(m.labels.items()))): m.value for f in
                   text_string_to_metric_families(httpx.get(g.url + "/metrics").text)
                   for m in f.samples}
        assert samples[("sluice_queue_wait_seconds_count",
                        (("model", MODEL), ("priority", "batch")))] == 21
        assert samples[("sluice_requests_total", (
            ("endpoint", "chat"), ("model", MODEL), ("outcome", "ok"), ("status", "200"),
            ("tenant", "a")))] == 21
        assert samples[("sluice_batch_line_results_total", (("result", "ok"),))] == 21


def test_bad_files_and_batches_are_400s_that_name_the_problem(tmp_path: Path) -> None:
    with gateways(config(tmp_path, max_lines=5)) as (g,):
        a = client(g, "a")
        good = batch_file(2).splitlines()
        with pytest.raises(openai.BadRequestError, match="line 2: is not valid JSON"):
            a.files.create(file=("x.jsonl", io.BytesIO(good[0] + b"\n{oops\n")), purpose="batch")
        with pytest.raises(openai.BadRequestError, match="more than 5 requests"):
            a.files.create(file=("x.jsonl", io.BytesIO(batch_file(6))), purpose="batch")
        with pytest.raises(openai.BadRequestError, match="purpose"):
            a.files.create(file=("x.jsonl", io.BytesIO(batch_file(1))), purpose="fine-tune")
        f = a.files.create(file=("x.jsonl", io.BytesIO(batch_file(1))), purpose="batch")
        with pytest.raises(openai.BadRequestError, match="completion_window"):
            a.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                             completion_window="soon")  # type: ignore[arg-type]
        with pytest.raises(openai.NotFoundError):
            a.batches.create(input_file_id="file-nope", endpoint="/v1/chat/completions",
                             completion_window="24h")
        with pytest.raises(openai.BadRequestError, match="endpoint must be one of "
                           "/v1/chat/completions, /v1/completions"):
            a.batches.create(input_file_id=f.id, endpoint="/v1/moderations",  # type: ignore[arg-type]
                             completion_window="24h")
        wrong = a.batches.create(input_file_id=f.id, endpoint="/v1/completions",
                                 completion_window="24h")
        assert wrong.status == "failed" and wrong.errors.data[0].line == 1
        r = httpx.post(g.url + "/v1/batches", content=b"{", headers={
            "Authorization": "Bearer key-a", "Content-Type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
        # a forged internal header is refused, not trusted
        r = httpx.post(g.url + "/v1/chat/completions", json={}, headers={
            "x-sluice-internal": "guess", "x-sluice-batch-tenant": "a"})
        assert r.status_code == 401


def test_cancel_ends_the_lines_not_started_and_expiry_the_rest(tmp_path: Path) -> None:
    # slow lines: 200 tokens each at speed 1 keep the batch running for tens of seconds
    with gateways(config(tmp_path, speed=1.0, max_in_flight=4)) as (g,):
        a = client(g, "a")
        data = batch_file(40, max_tokens=200)
        batch = submit(a, data)
        wait_for_sync(lambda: a.batches.retrieve(batch.id).request_counts.completed >= 1, 60,
                      "a first line to finish")
        cancelling = a.batches.cancel(batch.id)
        assert cancelling.status in ("cancelling", "cancelled")
        done = wait_status(a, batch.id, {"cancelled"})
        counts = done.request_counts
        assert counts.cancelled > 0 and counts.completed >= 1
        assert counts.completed + counts.failed == counts.total == 40
        out, err = lines_of(a, done.output_file_id), lines_of(a, done.error_file_id)
        assert sorted(x["custom_id"] for x in out + err) == sorted(f"line-{i}" for i in range(40))
        assert {x["error"]["code"] for x in err} == {"batch_cancelled"}

        expiring = submit(a, data, window="3s")
        done = wait_status(a, expiring.id, {"expired"}, timeout_s=30)
        out, err = lines_of(a, done.output_file_id), lines_of(a, done.error_file_id)
        assert done.request_counts.expired == len(err) > 0
        assert sorted(x["custom_id"] for x in out + err) == sorted(f"line-{i}" for i in range(40))
        assert {x["error"]["code"] for x in err} == {"batch_expired"}


def test_operators_see_progress_and_cancel_with_the_cli(tmp_path: Path) -> None:
    with gateways(config(tmp_path, speed=1.0, max_in_flight=2)) as (g,):
        a = client(g, "a")
        batch = submit(a, batch_file(30, max_tokens=200))

        def samples() -> dict[tuple[str, str], float]:
            text = httpx.get(g.url + "/metrics").text
            return {(m.labels["batch"], m.labels.get("state", "")): m.value
                    for f in text_string_to_metric_families(text) for m in f.samples
                    if m.name == "sluice_batch_lines" and m.labels.get("batch") == batch.id}

        wait_for_sync(lambda: samples().get((batch.id, "running"), 0) >= 1, 60,
                      "the batch's progress on /metrics")
        assert samples()[(batch.id, "total")] == 30
        panel = httpx.get(g.url + "/admin/stats").json()["batches"]
        assert [(b["id"], b["tenant"], b["total"]) for b in panel] == [(batch.id, "a", 30)]

        def cli(*args: str) -> str:
            run = subprocess.run([sys.executable, "-m", "gateway.cli", "batches", *args,
                                  "--url", g.url], capture_output=True, text=True, timeout=30)
            assert run.returncode == 0, run.stderr
            return run.stdout

        listed = cli("list")
        assert batch.id in listed and " a " in listed and "in_progress" in listed
        assert '"tenant": "a"' not in cli("show", batch.id)  # the batch object, as OpenAI's
        assert json.loads(cli("show", batch.id))["request_counts"]["total"] == 30
        assert "cancel" in cli("cancel", batch.id)
        done = wait_status(a, batch.id, {"cancelled"})
        assert done.request_counts.cancelled > 0
        wait_for_sync(lambda: not samples(), 10, "the ended batch to leave /metrics")


def _kill_tree(proc: psutil.Process) -> None:
    """SIGKILL the gateway; then its engines, which a killed gateway cannot stop."""
    children = proc.children(recursive=True)
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    for child in children:
        with contextlib.suppress(psutil.NoSuchProcess):
            child.kill()


@pytest.fixture
def pg_url() -> Iterator[str]:
    """A schema of its own in the machine's PostgreSQL (database ``test``)."""
    schema = f"t_{secrets.token_hex(6)}"

    async def sql(stmt: str) -> None:
        conn = await asyncpg.connect(PG)
        try:
            await conn.execute(stmt)
        finally:
            await conn.close()

    asyncio.run(sql(f"CREATE SCHEMA {schema}"))
    yield f"{PG}?search_path={schema}"
    asyncio.run(sql(f"DROP SCHEMA {schema} CASCADE"))


def test_a_replica_that_dies_leaves_its_lines_to_the_one_alive(tmp_path: Path,
                                                               pg_url: str) -> None:
    cfg = config(tmp_path, speed=5.0, store_url=pg_url, lease_ttl_s=2.0, max_in_flight=8)
    n = 60
    with gateways(cfg, n=2) as (g1, g2):
        a1, a2 = client(g1, "a"), client(g2, "a")
        batch = submit(a1, batch_file(n, max_tokens=16))
        assert a2.batches.retrieve(batch.id).request_counts.total == n  # one store
        wait_for_sync(lambda: a2.batches.retrieve(batch.id).request_counts.completed >= n // 4,
                      90, "a quarter of the lines")
        wait_for_sync(lambda: in_flight(g1) >= 1, 30, "the first replica to hold lines")
        _kill_tree(psutil.Process(g1.proc.pid))
        done = wait_status(a2, batch.id, {"completed"}, timeout_s=120)
        ids = [x["custom_id"] for x in lines_of(a2, done.output_file_id)]
        assert sorted(ids) == sorted(f"line-{i}" for i in range(n))  # each exactly once
        assert done.request_counts.completed == n


def test_a_gateway_killed_mid_batch_finishes_it_after_a_restart(tmp_path: Path) -> None:
    cfg = config(tmp_path, speed=5.0, lease_ttl_s=2.0, max_in_flight=8)
    n = 60
    with gateways(cfg) as (g,):
        a = client(g, "a")
        batch = submit(a, batch_file(n, max_tokens=16))
        wait_for_sync(lambda: a.batches.retrieve(batch.id).request_counts.completed >= n // 4,
                      90, "a quarter of the lines")
        assert a.batches.retrieve(batch.id).request_counts.completed < n  # killed mid-batch
        _kill_tree(psutil.Process(g.proc.pid))
    with gateways(cfg) as (g,):
        a = client(g, "a")
        done = wait_status(a, batch.id, {"completed"}, timeout_s=120)
        out = lines_of(a, done.output_file_id)
        ids = [x["custom_id"] for x in out]
        assert sorted(ids) == sorted(f"line-{i}" for i in range(n))  # each exactly once
        assert done.request_counts.completed == n and done.error_file_id is None


def test_an_unreachable_store_is_a_503_and_online_traffic_goes_on(tmp_path: Path) -> None:
    dead = f"postgresql://postgres@127.0.0.1:{free_port()}/test"
    with gateways(config(tmp_path, store_url=dead)) as (g,):
        a = client(g, "a")
        with pytest.raises(openai.InternalServerError) as e:
            a.batches.list()
        assert e.value.status_code == 503
        assert e.value.response.headers["Retry-After"] == "5"
        assert e.value.body["code"] == "overloaded"
        r = a.chat.completions.create(model=MODEL, max_tokens=2,
                                      messages=[{"role": "user", "content": "hi"}])
        assert r.usage.completion_tokens == 2
