"""End to end: a small batch through ``sluice serve`` with the shipped config (its
jobs folder moved to the test's) on the real CPU vLLM engine, with the ``openai``
SDK: every line answered by the engine, once, in the output file."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import openai
import pytest
import yaml

from loadtest.launch import CONFIG_DIR, gateway
from tests.support import wait_for_sync

pytestmark = pytest.mark.slow
MODEL = "gemma3-270m"


def test_a_batch_runs_on_the_real_engine(tmp_path: Path) -> None:
    for name in ("engines.yaml", "tenants.yaml"):
        shutil.copy(CONFIG_DIR / name, tmp_path / name)
    gw_cfg = yaml.safe_load((CONFIG_DIR / "gateway.yaml").read_text())
    gw_cfg["batch"] = {**gw_cfg.get("batch", {}), "dir": str(tmp_path / "batch")}
    (tmp_path / "gateway.yaml").write_text(yaml.safe_dump(gw_cfg))
    lines = [{"custom_id": f"q{i}", "method": "POST", "url": "/v1/completions",
              "body": {"model": MODEL, "prompt": f"{i} plus {i} is", "max_tokens": 4}}
             for i in range(6)]
    data = "".join(json.dumps(x) + "\n" for x in lines).encode()
    with gateway(tmp_path, log_path=tmp_path / "gateway.log") as gw:
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="sk-sluice-local",
                               max_retries=0)
        f = client.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch")
        batch = client.batches.create(input_file_id=f.id, endpoint="/v1/completions",
                                      completion_window="1h")
        seen = []

        def ended() -> bool:
            seen.append(client.batches.retrieve(batch.id))
            return seen[-1].status not in ("in_progress", "cancelling")

        wait_for_sync(ended, 300, "the batch to end")
        done = seen[-1]
        assert done.status == "completed", done
        assert done.request_counts.completed == 6 and done.error_file_id is None
        out = [json.loads(x) for x in client.files.content(done.output_file_id).text.splitlines()]
        assert sorted(x["custom_id"] for x in out) == [f"q{i}" for i in range(6)]
        for x in out:
            body = x["response"]["body"]
            assert x["response"]["status_code"] == 200 and body["model"] == MODEL
            assert 0 < body["usage"]["completion_tokens"] <= 4
