"""A stand-in for a vLLM server process, for the tests of how eagleforge runs one: it takes
vLLM's command line, and by $FAKE_VLLM_MODE either fails at start ("exit"), or serves /health
with a child process of its own ("serve"), the way vLLM's engine-core process hangs below it.
With $FAKE_VLLM_HANG (a path) its first request makes that file and is never answered, as a
hung engine's; with $FAKE_VLLM_START_S it takes that long to start serving.

Started as a capture engine (``--kv-transfer-config`` and ``--speculative-config`` of
target=vllm), it captures as eagleforge's connector does: each completion writes the prompt's
"hidden states" -- a fixed function of the prompt's tokens up to each position, so every capture
of a prompt is the same -- for the configured layers of the ``--model`` directory's shape into
the connector's directory, and answers with its path. With $FAKE_VLLM_DIE_ONCE (a path) it dies
(SIGKILL, children and all) at its $FAKE_VLLM_DIE_AFTER-th completion unless that file exists,
which it makes first: an engine that dies once in a run; with $FAKE_VLLM_EXIT_IF (a path) it fails
to start where that file exists (an engine that cannot be started again), and with
$FAKE_VLLM_STALL_IF it never gets ready there (one whose start hangs).

    FAKE_VLLM_MODE=serve python fake_vllm.py -m vllm.entrypoints.openai.api_server --port P ...

``fake_python(directory)`` writes the interpreter a test points vllm.python at.
"""

from __future__ import annotations

import http.server
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any


def fake_python(directory: Path) -> Path:
    """An "interpreter" in ``directory`` that runs this stand-in whatever module it is asked
    for (what vllm.python points at)."""
    path = directory / "python"
    path.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{Path(__file__).resolve()}" "$@"\n')
    path.chmod(0o755)
    return path


def main() -> None:
    args = sys.argv[1:]
    port = int(args[args.index("--port") + 1])
    exit_if = os.environ.get("FAKE_VLLM_EXIT_IF")  # a path: fails to start once it exists
    if os.environ.get("FAKE_VLLM_MODE") == "exit" or (exit_if and Path(exit_if).exists()):
        print("INFO starting", flush=True)
        print("ValueError: the model is not one vLLM knows", flush=True)
        sys.exit(3)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    pids = os.environ.get("FAKE_VLLM_PIDS")
    if pids:
        Path(pids).write_text(f"{os.getpid()} {child.pid}\n")
    # what vLLM leaves in $TMPDIR: its IPC sockets
    Path(tempfile.gettempdir(), f"ipc-{os.getpid()}.sock").touch()
    time.sleep(float(os.environ.get("FAKE_VLLM_START_S", "0")))  # a slow start
    stall_if = os.environ.get("FAKE_VLLM_STALL_IF")  # a path: never ready once it exists
    if stall_if and Path(stall_if).exists():
        time.sleep(600)

    capture = Capture(args) if "--kv-transfer-config" in args else None

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            if self.path == "/v1/models" and capture is not None:
                self._answer({"data": [{"id": capture.name, "root": capture.model}]})
                return
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

        def do_POST(self) -> None:  # noqa: N802
            hang = os.environ.get("FAKE_VLLM_HANG")
            if hang:
                Path(hang).touch()
                time.sleep(3600)
            if capture is None or self.path != "/v1/completions":
                self.send_response(404)
                self.end_headers()
                return
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            path = capture.write(body["prompt"])
            self._answer({
                "choices": [{"token_ids": [0], "finish_reason": "length"}],
                "kv_transfer_params": {"hidden_states_path": path},
            })  # fmt: skip

        def _answer(self, data: dict[str, Any]) -> None:
            payload = json.dumps(data).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer
    server.request_queue_size = 256  # the connections of a batch in flight at once, as uvicorn's
    server(("127.0.0.1", port), Health).serve_forever()


class Capture:
    """What a capture engine writes (see the module docstring)."""

    def __init__(self, args: list[str]) -> None:
        self.model = args[args.index("--model") + 1]
        self.name = args[args.index("--served-model-name") + 1]
        spec = json.loads(args[args.index("--speculative-config") + 1])
        self.layer_ids = spec["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"]
        transfer = json.loads(args[args.index("--kv-transfer-config") + 1])
        self.files = Path(transfer["kv_connector_extra_config"]["shared_storage_path"])
        config = json.loads((Path(self.model) / "config.json").read_text())
        self.hidden_size, self.num_layers = config["hidden_size"], config["num_hidden_layers"]
        self.lock, self.count = threading.Lock(), 0

    def write(self, ids: list[int]) -> str:
        import torch
        from safetensors.torch import save_file

        with self.lock:
            self.count += 1
            count = self.count
        die_once = os.environ.get("FAKE_VLLM_DIE_ONCE")
        if die_once and count >= int(os.environ.get("FAKE_VLLM_DIE_AFTER", "1")):
            marker = Path(die_once)
            if not marker.exists():
                marker.touch()
                os.killpg(os.getpgid(0), signal.SIGKILL)
        tokens = torch.tensor(ids, dtype=torch.int64)
        # a function of the tokens up to each position (causal), layer by layer
        prefix = torch.cumsum(tokens.double() * 0.618, 0)
        h = torch.arange(self.hidden_size, dtype=torch.float64)
        states = [
            torch.sin(prefix[:, None] * (h + 1) * 1e-3 + layer) * (1 + layer / 10)
            for layer in self.layer_ids
        ]
        path = self.files / f"req-{os.getpid()}-{count}.safetensors"
        self.files.mkdir(parents=True, exist_ok=True)
        Path(f"{path}.lock").touch()
        save_file(
            {"hidden_states": torch.stack(states, 1).float(), "token_ids": tokens},
            str(path), metadata={"layer_ids": json.dumps(sorted(self.layer_ids))},
        )  # fmt: skip
        return str(path)


if __name__ == "__main__":
    main()
