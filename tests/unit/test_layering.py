"""The import rule (design §13, docs/architecture.md): imports only go down.

protocol and config at the bottom; transport, process utilities (runtime) and model assets (models)
above them; the mock core; then engine, frontend, coordinator and worker side by side, none importing
another;
launch on top, and the command line above everything. Two checks: every ``trioserve`` import in
``src/`` (read from the source, so a lazy import inside a function counts too) goes to a lower layer
or stays in its own package; and each pure module imports with trio, zmq and torch blocked.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "trioserve"

# Top-level package (or module) -> layer. Same layer, different package: not allowed.
LAYERS = {
    "config": 0,
    "protocol": 0,
    "config_file": 1,
    "transport": 1,
    "runtime": 1,
    "models": 1,
    "metrics": 1,
    "mock": 2,
    "engine": 3,
    "frontend": 3,
    "coordinator": 3,
    "worker": 3,
    "launch": 4,
    "cli": 5,
    "__main__": 6,
}
# Within layer 0, config is below protocol: protocol may carry config sections, never the reverse.
BELOW = {("protocol", "config")}

PURE = [
    "trioserve.config",
    "trioserve.protocol.messages",
    "trioserve.protocol.codec",
    "trioserve.protocol.fold",
    "trioserve.protocol.step",
    "trioserve.protocol.worker_messages",
    "trioserve.protocol.ring_layout",
    "trioserve.protocol.sse",
    "trioserve.protocol.ws_frames",
    "trioserve.engine.block_hash",
    "trioserve.engine.kv_ledger",
    "trioserve.engine.request",
    "trioserve.engine.scheduler",
    "trioserve.engine.step_watch",
    "trioserve.engine.load_report",
    "trioserve.coordinator.core",
    "trioserve.frontend.dispatch",
    "trioserve.protocol.block_hash",
    "trioserve.protocol.kv_batch",
    "trioserve.engine.kv_events",
    "trioserve.launch.addresses",
    "trioserve.models.shard_plan",
    "trioserve.mock.core",
    "trioserve.frontend.text.stop_strings",
    "trioserve.frontend.request.admission",
    "trioserve.frontend.engine_health",
    "trioserve.frontend.output.responses",
    "trioserve.frontend.output.chunks",
    "trioserve.frontend.edge.auth",
    "trioserve.frontend.edge.cors",
    "trioserve.frontend.edge.access",
    "trioserve.frontend.access_log",
    "trioserve.config_file",
    "trioserve.runtime.placement",
    "trioserve.frontend.replica_health",
    "trioserve.frontend.replica_pool",
    "trioserve.frontend.replica_slots",
    "trioserve.worker.thread_learner",
]


def _package(module: str) -> str:
    parts = module.split(".")
    assert parts[0] == "trioserve"
    return parts[1] if len(parts) > 1 else ""


def _module_name(path: Path, src: Path) -> str:
    rel = path.relative_to(src.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "trioserve":  # from trioserve import x: x is the package
                found += [(node.lineno, f"trioserve.{alias.name}") for alias in node.names]
            elif node.module.startswith("trioserve."):
                found.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.startswith("trioserve.")]
    return found


def _violations(src: Path = SRC) -> list[str]:
    out: list[str] = []
    for path in sorted(src.rglob("*.py")):
        here = _package(_module_name(path, src))
        if here not in LAYERS:
            if here:
                out.append(f"{path.relative_to(src)}: package {here!r} has no layer in this test")
            continue
        for line, target in _imports(path):
            there = _package(target)
            if there == here or there not in LAYERS:
                continue
            if (here, there) in BELOW:
                continue
            if LAYERS[there] >= LAYERS[here]:
                out.append(f"{path.relative_to(src)}:{line}: {here} (layer {LAYERS[here]}) imports {target}")
    return out


def test_imports_only_go_down() -> None:
    assert _violations() == []


def test_the_rule_catches_upward_and_sideways_imports(tmp_path: Path) -> None:
    """The checker itself, on a made-up tree: upward, sideways and lazy imports are reported; a
    downward one and one inside the package are not."""
    src = tmp_path / "trioserve"
    files = {
        "engine/bad.py": "from trioserve.frontend.api_server import ApiServer\n",
        "protocol/bad.py": "def f():\n    import trioserve.engine.scheduler\n",
        "config.py": "from trioserve.protocol import messages\n",
        "engine/good.py": "from trioserve.protocol import messages\nfrom trioserve.engine import bad\n",
        "protocol/good.py": "from trioserve.config import ServeConfig\n",
    }
    for name, text in files.items():
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        (src / name).write_text(text)
    assert _violations(src) == [
        "config.py:1: config (layer 0) imports trioserve.protocol",
        "engine/bad.py:1: engine (layer 3) imports trioserve.frontend.api_server",
        "protocol/bad.py:2: protocol (layer 0) imports trioserve.engine.scheduler",
    ]


@pytest.mark.parametrize("module", PURE)
def test_pure_modules_import_without_trio_zmq_or_torch(module: str) -> None:
    code = (
        "import sys\n"
        "for name in ('trio', 'zmq', 'torch', 'transformers'):\n"
        "    sys.modules[name] = None\n"
        f"import {module}\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr.strip().splitlines()[-1]
