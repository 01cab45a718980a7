"""How eagleforge runs the vLLM engine, with a stand-in server (tests/helpers/fake_vllm.py):
a missing environment and a failed start are one error naming the setting and the log; a
started server is stopped as a whole process group on return and on SIGTERM; vLLM's counters
are read from its Prometheus text."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import eagleforge.engine.server as engine_server
from eagleforge.engine.client import SpecCounters, parse_spec_counters
from eagleforge.engine.config import VLLMConfig
from eagleforge.engine.server import (
    EngineError,
    PortTaken,
    VLLMServer,
    engine_python,
    serve_command,
)
from eagleforge.errors import ConfigError
from helpers.fake_vllm import fake_python
from helpers.processes import alive, wait_gone

pytestmark = pytest.mark.unit


def test_a_missing_environment_names_the_setting_and_make_vllm(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("EAGLEFORGE_VLLM_PYTHON", raising=False)
    with pytest.raises(EngineError, match=r"vllm.python=/nowhere/python .*make vllm"):
        engine_python(VLLMConfig(python="/nowhere/python"))
    monkeypatch.setenv("EAGLEFORGE_VLLM_PYTHON", str(fake_python(tmp_path)))
    assert engine_python(VLLMConfig()) == tmp_path / "python"


def test_the_advice_names_only_what_the_command_takes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The judge (evaluate, train) and target=vllm start engines of their own: their advice
    is `make vllm` or vllm.python, never vllm.url, which they refuse; regenerate takes a
    running server, and its advice says so."""
    monkeypatch.delenv("EAGLEFORGE_VLLM_PYTHON", raising=False)
    monkeypatch.chdir(tmp_path)  # no .venv-vllm here
    missing = VLLMConfig(python="/nowhere/python")
    with pytest.raises(EngineError) as starts_its_own:
        engine_python(missing)
    assert "vllm.url" not in str(starts_its_own.value)
    assert "vllm.python (or $EAGLEFORGE_VLLM_PYTHON)" in str(starts_its_own.value)
    with pytest.raises(EngineError, match=r"make vllm.*, or vllm.url to a running vLLM server"):
        engine_python(missing, url_accepted=True)
    server = VLLMConfig(python=str(fake_python(tmp_path)), url="http://127.0.0.1:8000")
    with pytest.raises(ConfigError, match=r"^vllm.url=http://127.0.0.1:8000: .*unset vllm.url"):
        engine_python(server)
    assert engine_python(server, url_accepted=True) == tmp_path / "python"


def test_the_command_binds_loopback_and_carries_the_draft(tmp_path: Path) -> None:
    cfg = VLLMConfig(enforce_eager=True, extra_args=["--max-num-batched-tokens", "4096"])
    spec = {"method": "eagle3", "model": "/d", "num_speculative_tokens": 3}
    command = serve_command(cfg, Path("/py"), "/m", 1234, "float32", spec)
    assert command[:4] == ["/py", "-m", "vllm.entrypoints.openai.api_server", "--model"]
    assert command[command.index("--host") + 1] == "127.0.0.1"
    assert command[command.index("--dtype") + 1] == "float32"
    assert '"num_speculative_tokens": 3' in command[command.index("--speculative-config") + 1]
    assert "--enforce-eager" in command and command[-2:] == ["--max-num-batched-tokens", "4096"]


def test_a_failed_start_is_one_error_with_the_reason_and_the_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_VLLM_MODE", "exit")
    cfg = VLLMConfig(python=str(fake_python(tmp_path)))
    log = tmp_path / "run" / "vllm.log"
    with pytest.raises(EngineError) as error:
        VLLMServer(cfg, "/m", log, "float32", name="vLLM (target alone)").start()
    message = str(error.value)
    assert "vLLM (target alone) exited with status 3 while starting" in message
    assert "ValueError: the model is not one vLLM knows" in message and str(log) in message
    assert "$ " in log.read_text()  # the command line heads the log


def test_the_server_and_its_children_stop_when_the_block_ends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pids = tmp_path / "pids"
    monkeypatch.setenv("FAKE_VLLM_PIDS", str(pids))
    cfg = VLLMConfig(python=str(fake_python(tmp_path)))
    with VLLMServer(cfg, "/m", tmp_path / "vllm.log", "float32") as server:
        assert server.alive() and server.url.startswith("http://127.0.0.1:")
        server_pid, child_pid = (int(p) for p in pids.read_text().split())
        assert alive(child_pid)
    assert wait_gone(server_pid) and wait_gone(child_pid)


def test_sigterm_stops_the_engine_before_the_process_exits(tmp_path: Path) -> None:
    """A `kill` of an evaluation stops its engine (and the engine's children) too."""
    pids = tmp_path / "pids"
    script = f"""
import sys
from eagleforge.engine.config import VLLMConfig
from eagleforge.engine.server import VLLMServer
from eagleforge.errors import stop_on_signals
with stop_on_signals(), VLLMServer(VLLMConfig(python={str(fake_python(tmp_path))!r}), "/m",
                                   {str(tmp_path / "vllm.log")!r}, "float32"):
    print("ready", flush=True)
    import time
    time.sleep(600)
"""
    env = {**os.environ, "FAKE_VLLM_PIDS": str(pids)}
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, env=env)
    assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
    server_pid, child_pid = (int(p) for p in pids.read_text().split())
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 128 + signal.SIGTERM
    assert wait_gone(server_pid) and wait_gone(child_pid)


METRICS = """\
# HELP vllm:spec_decode_num_drafts Number of spec decoding drafts.
vllm:spec_decode_num_drafts_total{engine="0",model_name="target"} 40.0
vllm:spec_decode_num_drafts_created{engine="0",model_name="target"} 1.79e+09
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="target"} 120.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="target"} 30.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="target",position="0"} 20.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="target",position="1"} 8.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="target",position="2"} 2.0
"""


def test_vllms_counters_give_tau_and_acceptance_by_position() -> None:
    counters = parse_spec_counters(METRICS)
    assert (counters.drafts, counters.draft_tokens, counters.accepted_tokens) == (40, 120, 30)
    assert counters.accepted_per_position == [20.0, 8.0, 2.0]
    assert counters.mean_acceptance_length == pytest.approx(1.75)
    # conditional, as eagleforge's decoder reports it: 20/40, 8/20, 2/8
    assert counters.acceptance_by_position == pytest.approx([0.5, 0.4, 0.25])
    delta = counters - SpecCounters(10, 30, 5, [4.0, 1.0])
    assert (delta.drafts, delta.accepted_tokens, delta.accepted_per_position) == (
        30,
        25,
        [16.0, 7.0, 2.0],
    )
    assert parse_spec_counters("").mean_acceptance_length == 1.0  # no speculation at all


def test_a_port_taken_before_the_server_binds_it_is_chosen_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """free_port()'s port is free only until someone binds it (a vLLM starting beside it took
    one in CI): a server on a port eagleforge chose starts again on another; a port the user
    gave is kept, and its server fails in one line."""
    monkeypatch.setenv("FAKE_VLLM_MODE", "serve")
    cfg = VLLMConfig(python=str(fake_python(tmp_path)))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))  # bound, not listening: /health is refused at once
        port = taken.getsockname()[1]
        chosen = iter([port])
        free_port = engine_server.free_port
        monkeypatch.setattr(engine_server, "free_port", lambda: next(chosen, None) or free_port())
        log = tmp_path / "vllm.log"
        with VLLMServer(cfg, "/m", log, "float32") as server:
            assert server.port != port and server.url.endswith(f":{server.port}")
            assert server.client().healthy()
        text = log.read_text()
        assert "Address already in use" in text and text.count("$ ") == 2
        assert f"--port {port} " in text and f"--port {server.port} " in text
        with pytest.raises(PortTaken, match=r"exited with status 1 while starting \(OSError"):
            VLLMServer(cfg, "/m", tmp_path / "given.log", "float32", port=port).start()
