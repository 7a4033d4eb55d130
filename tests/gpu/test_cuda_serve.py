"""``trioserve serve`` on a GPU host with the default ``--device auto``: the worker lands on CUDA (its
log says so), the KV pool is not prefaulted on the CPU, and a completion streams."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.multiproc.conftest import free_port
from tests.multiproc.test_embedded_model_convert import NEEDS_EMBEDDED_MODEL

pytestmark = [pytest.mark.multiproc, NEEDS_EMBEDDED_MODEL]


def test_serve_auto_lands_on_cuda_and_answers(tmp_path: Path) -> None:
    port = free_port()
    log_path = tmp_path / "serve.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "trioserve", "serve", "--host", "127.0.0.1", "--port", str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, log_path.read_text()
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.2)
        body = json.dumps(
            {"model": "SmolLM2-135M-Instruct", "prompt": "The capital of France is", "max_tokens": 8}
        )
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions", body.encode(), {"content-type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=60) as r:
            answer = json.loads(r.read())
        assert answer["usage"]["completion_tokens"] >= 1 and answer["choices"][0]["text"]
        text = log_path.read_text()
        assert " on cuda " in text and "(bfloat16)" in text, text
        assert "KV pool resident" not in text  # no CPU pool was prefaulted
    finally:
        proc.terminate()
        proc.wait(30)
