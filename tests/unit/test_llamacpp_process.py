"""How eagleforge runs llama.cpp's llama-server, without the server: its command line (loopback,
slots, metrics, the draft's flags), its token-id completions and stop ids against a stand-in
HTTP server, its counters from llama.cpp's Prometheus text, and the llama.cpp judge's one-line
refusals (no server, no target GGUF, more requests at once than slots)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from eagleforge.config import compose_config, to_typed
from eagleforge.engine.client import parse_spec_counters
from eagleforge.engine.config import LlamaCppConfig
from eagleforge.engine.llamacpp import LlamaCppClient, llama_server, server_command
from eagleforge.engine.server import EngineError
from eagleforge.errors import ConfigError
from eagleforge.judges import LlamaCppJudge
from helpers.http_stand_in import QuietHandler, serving

pytestmark = pytest.mark.unit


def test_the_command_binds_loopback_serves_slots_and_carries_the_draft() -> None:
    cfg = LlamaCppConfig(parallel=4, max_model_len=1024, threads=2, extra_args=["--no-warmup"])
    alone = server_command(cfg, Path("/bin/ls"), Path("/t.gguf"), 1234)
    assert alone[:3] == ["/bin/ls", "-m", "/t.gguf"]
    assert alone[alone.index("--host") + 1] == "127.0.0.1"
    assert alone[alone.index("--parallel") + 1] == "4" and alone[alone.index("-c") + 1] == "4096"
    assert "--metrics" in alone and alone[alone.index("-t") + 1] == "2"
    assert "-md" not in alone and alone[-1] == "--no-warmup"
    # unset: the command's own threads, not llama.cpp's default of every core
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        own = server_command(LlamaCppConfig(), Path("/bin/ls"), Path("/t.gguf"), 1234)
    finally:
        torch.set_num_threads(before)
    assert own[own.index("-t") + 1] == "1"
    drafted = server_command(
        cfg, Path("/bin/ls"), Path("/t.gguf"), 1234, Path("/d.gguf"), "draft-eagle3", 3
    )
    flags = dict(zip(drafted[::1], drafted[1::1], strict=False))
    assert flags["-md"] == "/d.gguf" and flags["--spec-type"] == "draft-eagle3"
    assert flags["--spec-draft-n-max"] == "3" and flags["--spec-draft-p-min"] == "0"
    with pytest.raises(ValueError, match="spec_type"):
        server_command(cfg, Path("/bin/ls"), Path("/t.gguf"), 1, Path("/d.gguf"))


LLAMACPP_METRICS = """\
# HELP llamacpp:spec_decode_num_draft_tokens_total Speculative: Total draft tokens generated
# TYPE llamacpp:spec_decode_num_draft_tokens_total counter
llamacpp:spec_decode_num_draft_tokens_total 120
llamacpp:spec_decode_num_accepted_tokens_total 30
llamacpp:spec_decode_num_drafts_total 40
llamacpp:prompt_tokens_seconds 812.5
# TYPE llamacpp:spec_decode_num_accepted_tokens_per_pos_total counter
llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="0"} 20
llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="1"} 8
llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="2"} 2
"""


def test_llamacpps_counters_give_tau_and_acceptance_by_position() -> None:
    counters = parse_spec_counters(LLAMACPP_METRICS, "llamacpp")
    assert (counters.drafts, counters.draft_tokens, counters.accepted_tokens) == (40, 120, 30)
    assert counters.accepted_per_position == [20.0, 8.0, 2.0]
    assert counters.mean_acceptance_length == pytest.approx(1.75)
    assert counters.acceptance_by_position == pytest.approx([0.5, 0.4, 0.25])
    assert parse_spec_counters(LLAMACPP_METRICS).drafts == 0  # vLLM's names are not these


class _StandIn(QuietHandler):
    """llama-server's /completion and /metrics as the real one answers them."""

    bodies: list[dict[str, Any]] = []

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        _StandIn.bodies.append(body)
        answer = {"content": "hi", "tokens": [5, 6, 2, 7], "stop_type": "limit"}
        self.send_body(json.dumps(answer).encode())

    def do_GET(self) -> None:  # noqa: N802
        self.send_body(LLAMACPP_METRICS.encode())


@pytest.fixture
def stand_in() -> Iterator[str]:
    with serving(_StandIn) as url:
        yield url


def test_a_completion_sends_ids_without_the_prompt_cache_and_cuts_at_a_stop_id(
    stand_in: str,
) -> None:
    client = LlamaCppClient(stand_in, 10.0)
    done = client.complete([1, 2, 3], 16, extra={"stop_token_ids": [2]})
    body = _StandIn.bodies[-1]
    assert body["prompt"] == [1, 2, 3] and body["n_predict"] == 16
    assert body["cache_prompt"] is False and body["return_tokens"] is True
    assert (body["top_k"], body["min_p"], body["temperature"]) == (0, 0.0, 0.0)
    assert "stop_token_ids" not in body
    assert done.token_ids == [5, 6, 2] and done.finish_reason == "stop"
    assert client.complete([1], 4).finish_reason == "length"  # stop_type limit
    assert client.spec_counters().accepted_per_position == [20.0, 8.0, 2.0]


def test_a_missing_server_is_one_line_naming_make_llamacpp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EAGLEFORGE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("EAGLEFORGE_LLAMA_SERVER", raising=False)
    with pytest.raises(EngineError, match=r"no llama-server: build it with `make llamacpp`"):
        llama_server(LlamaCppConfig())
    with pytest.raises(EngineError, match=r"llamacpp.server=/nowhere: no such file"):
        llama_server(LlamaCppConfig(server="/nowhere"))


def test_the_judge_refuses_in_one_line_what_it_cannot_serve(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = tmp_path / "llama-server"
    server.write_text("#!/bin/sh\n")
    server.chmod(0o755)
    base = ["+model=tiny", "eval.engine=llamacpp", f"llamacpp.server={server}", "output_dir=x"]
    with pytest.raises(ConfigError, match=r"needs the target as a GGUF file: set llamacpp.target"):
        LlamaCppJudge(to_typed(compose_config(base)))
    with pytest.raises(ConfigError, match=r"llamacpp.target_gguf=/no.gguf: no such file"):
        LlamaCppJudge(to_typed(compose_config([*base, "llamacpp.target_gguf=/no.gguf"])))
    with pytest.raises(ConfigError, match=r"set llamacpp.parallel >= 16 \(it is 8\)"):
        smollm2 = ["+model=smollm2", *base[1:], "eval.engine_batch=16"]
        LlamaCppJudge(to_typed(compose_config(smollm2)))
    with pytest.raises(ConfigError, match=r"llamacpp.draft_p_min must be in \[0, 1\]"):
        LlamaCppConfig(draft_p_min=2.0)
