"""A stand-in for a vLLM server process, for the tests of how eagleforge runs one: it takes
vLLM's command line, and by $FAKE_VLLM_MODE either fails at start ("exit"), or serves /health
with a child process of its own ("serve"), the way vLLM's engine-core process hangs below it.
With $FAKE_VLLM_HANG (a path) its first request makes that file and is never answered, as a
hung engine's.

    FAKE_VLLM_MODE=serve python fake_vllm.py -m vllm.entrypoints.openai.api_server --port P ...

``fake_python(directory)`` writes the interpreter a test points vllm.python at.
"""

from __future__ import annotations

import http.server
import os
import subprocess
import sys
import time
from pathlib import Path


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
    if os.environ.get("FAKE_VLLM_MODE") == "exit":
        print("INFO starting", flush=True)
        print("ValueError: the model is not one vLLM knows", flush=True)
        sys.exit(3)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    pids = os.environ.get("FAKE_VLLM_PIDS")
    if pids:
        Path(pids).write_text(f"{os.getpid()} {child.pid}\n")

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

        def do_POST(self) -> None:  # noqa: N802
            hang = os.environ.get("FAKE_VLLM_HANG")
            if hang:
                Path(hang).touch()
                time.sleep(3600)
            self.send_response(404)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()


if __name__ == "__main__":
    main()
