"""Training streamed from running producers (target=vllm, docs/streaming.md), with stand-in
capture engines (tests/helpers/fake_vllm.py: the same states for a prompt every time): one
engine, two, and two of which one dies mid-run train the same steps bit for bit, as a store
of the same states does; a resumed run continues from its data position bit for bit; servers
at URLs (``eagleforge.serve_target``) feed a run as started engines do, and one that serves
other layers or weights, or does not answer, is refused in one line; settings that do not
apply are refused. The real engine's tier: tests/engine/test_vllm_engine.py."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from eagleforge.config import compose_config, to_typed
from eagleforge.errors import ConfigError
from helpers.fake_vllm import fake_python
from helpers.runs import prepare_store, start_from, tiny_run_overrides, train_on_rank, weights

pytestmark = pytest.mark.integration

DATA = ("data.max_num_samples=40", "data.num_eval_samples=4", "data.max_length=64")
RUN = (*DATA, "trainer.max_num_steps=4", "draft.ttt_length=2", "trainer.eval_at_start=false")


@pytest.fixture
def engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """The stand-in engine as vllm.python."""
    monkeypatch.delenv("FAKE_VLLM_DIE_ONCE", raising=False)
    return f"vllm.python={fake_python(tmp_path)}"


def streamed(tmp_path: Path, name: str, engine: str, *extra: str) -> tuple[list[float], Path]:
    run = tmp_path / name
    losses, _, _ = train_on_rank(
        0,
        tiny_run_overrides(
            run, *RUN, "target=vllm", engine, "trainer.save_every_n_steps=2", *extra
        ),  # fmt: skip
    )
    return losses, run / "run"


def records(run: Path) -> list[dict]:  # type: ignore[type-arg]
    return json.loads((run / "producers.json").read_text())


def test_engines_and_an_engine_that_dies_train_the_same_steps(
    tmp_path: Path, engine: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whoever produced each sample, the trainer got every sample once, in the planned order:
    the same losses and weights bit for bit; producers.json says who fed the run."""
    one, one_run = streamed(tmp_path, "one", engine)
    two, two_run = streamed(tmp_path, "two", engine, "target.producers.engines=2")
    monkeypatch.setenv("FAKE_VLLM_DIE_ONCE", str(tmp_path / "died"))
    monkeypatch.setenv("FAKE_VLLM_DIE_AFTER", "5")
    dies, dies_run = streamed(tmp_path, "dies", engine, "target.producers.engines=2")
    assert (tmp_path / "died").exists()  # an engine was killed mid-run
    assert one == two == dies and len(one) == 4
    final = weights(one_run / "checkpoints" / "step_00000004")
    for run in (two_run, dies_run):
        other = weights(run / "checkpoints" / "step_00000004")
        assert all(torch.equal(final[k], other[k]) for k in final)
    [single] = records(one_run)
    samples = single["producers"][0]["samples"]
    assert single["first_step"] == 0 and single["last_step"] == 4
    assert [p["name"] for p in single["producers"]] == ["engine 0"]
    for run in (two_run, dies_run):
        [part] = records(run)
        assert [p["name"] for p in part["producers"]] == ["engine 0", "engine 1"]
        assert sum(p["samples"] for p in part["producers"]) == samples  # none twice, none lost
    # the engine that died handed its prompt in flight on and was started again
    [died] = [p for p in records(dies_run)[0]["producers"] if p["handed_on"]]
    assert died["given_up"] is None
    log = dies_run / ("vllm.log" if died["name"] == "engine 0" else "vllm-1.log")
    assert log.read_text().count("$ ") == 2


def test_a_stream_trains_as_a_store_of_the_same_states(tmp_path: Path, engine: str) -> None:
    """Packed rows from the stream are the rows a feature store of the same states gives:
    the same losses bit for bit (prepare captures through the same engines, two of them)."""
    data = ("+model=tiny", "data=chitchat", *DATA)
    store = prepare_store(tmp_path / "prep", *data, "target=vllm", engine,
                          "target.producers.engines=2")  # fmt: skip
    offline, _, _ = train_on_rank(
        0, tiny_run_overrides(tmp_path / "offline", *RUN, f"data.features={store}")
    )
    stream, _ = streamed(tmp_path, "stream", engine, "data.packing=true")
    assert stream == offline


def test_a_resumed_stream_continues_from_its_data_position(tmp_path: Path, engine: str) -> None:
    whole, whole_run = streamed(tmp_path, "whole", engine)
    resumed_dir = tmp_path / "resumed" / "run"
    start_from(whole_run / "checkpoints" / "step_00000002", resumed_dir)
    resumed, resumed_run = streamed(tmp_path, "resumed", engine)
    assert resumed == whole[2:]
    final, other = (weights(r / "checkpoints" / "step_00000004") for r in (whole_run, resumed_run))
    assert all(torch.equal(final[k], other[k]) for k in final)
    [part] = records(resumed_run)
    assert (part["first_step"], part["last_step"]) == (2, 4)


@pytest.fixture
def servers(tmp_path: Path) -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)


def serve(servers: list[subprocess.Popen[str]], tmp_path: Path, name: str, *extra: str) -> str:
    """A capture server (``eagleforge.serve_target`` over the stand-in engine); its URL."""
    from eagleforge.engine.server import free_port

    port = free_port()
    out = tmp_path / f"{name}.out"
    command = [sys.executable, "-m", "eagleforge.serve_target", "+model=tiny",
               f"vllm.python={fake_python(tmp_path)}", f"serve_target.port={port}",
               f"serve_target.files_dir={tmp_path / 'shared'}", *extra]  # fmt: skip
    with out.open("w") as sink:
        proc = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, text=True)
    servers.append(proc)
    deadline = time.monotonic() + 120
    while "ready: train with" not in out.read_text():
        assert proc.poll() is None and time.monotonic() < deadline, out.read_text()[-2000:]
        time.sleep(0.2)
    assert f"'target.producers.urls=[http://127.0.0.1:{port}]'" in out.read_text()
    return f"http://127.0.0.1:{port}"


def test_servers_at_urls_feed_a_run_as_started_engines_do(
    tmp_path: Path, engine: str, servers: list[subprocess.Popen[str]]
) -> None:
    urls = [serve(servers, tmp_path, f"server{i}") for i in range(2)]
    started, _ = streamed(tmp_path, "started", engine)
    fed, run = streamed(tmp_path, "urls", engine, f"target.producers.urls=[{','.join(urls)}]")
    assert fed == started
    [part] = records(run)
    assert [p["name"] for p in part["producers"]] == urls
    assert not list((tmp_path / "shared").glob("*.safetensors"))  # each read, then deleted
    assert all(proc.poll() is None for proc in servers)  # not ours to stop


def test_servers_that_do_not_fit_the_run_are_refused_in_one_line(
    tmp_path: Path, engine: str, servers: list[subprocess.Popen[str]]
) -> None:
    from eagleforge.engine.server import free_port

    other_layers = serve(servers, tmp_path, "layers", "model.aux_layer_ids=[0,1,2]")
    other_weights = serve(servers, tmp_path, "weights", "model.random.seed=7")
    silent = f"http://127.0.0.1:{free_port()}"
    for url, said in [
        (other_layers, rf"^target.producers.urls\[0\]={other_layers} captures vLLM layers "
                       r"\[1, 2, 3, 6\], and this run needs \[2, 3, 5, 6\]"),
        (other_weights, rf"^target.producers.urls\[0\]={other_weights} serves .*, other weights "
                        r"than model.path="),
        (silent, rf"^target.producers.urls\[0\]={silent} does not answer /health"),
    ]:  # fmt: skip
        with pytest.raises(ConfigError, match=said):
            streamed(tmp_path, f"refused{len(said)}", engine, f"target.producers.urls=[{url}]")


def test_more_engines_than_the_machine_fits_are_refused_before_any_starts(
    tmp_path: Path, engine: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One engine per core, and what each holds within the memory available: past either,
    one line before anything starts or is written (no capture directory left in $TMPDIR)."""
    import os

    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    cores = len(os.sched_getaffinity(0))
    with pytest.raises(ConfigError, match=rf"^target.producers.engines=100: this machine fits "
                                          rf"\d+ vLLM engine\(s\), one per core \({cores}\)"):  # fmt: skip
        streamed(tmp_path, "hundred", engine, "target.producers.engines=100")
    assert list((tmp_path / "tmp").iterdir()) == []
    # memory: each engine's KV cache alone past what is available
    from eagleforge.engine.config import VLLMConfig
    from eagleforge.engine.server import refuse_cpu_engines_past_machine

    with pytest.raises(ConfigError, match=r"^target.producers.engines=2: this machine fits 1 "):
        refuse_cpu_engines_past_machine(2, VLLMConfig(kv_cache_space_gib=1e5), tmp_path,
                                        "target.producers.engines")  # fmt: skip


def test_producer_settings_that_do_not_apply_are_refused() -> None:
    base = ["+model=tiny", "output_dir=/tmp/unused"]
    with pytest.raises(ConfigError, match=r"^target.producers.engines applies to target=vllm"):
        to_typed(compose_config([*base, "target=hf", "target.producers.engines=2"]))
    with pytest.raises(ConfigError, match=r"^target.producers.engines=2 with target.producers"):
        to_typed(compose_config([*base, "target=vllm", "target.producers.engines=2",
                                 "target.producers.urls=[http://a:1]"]))  # fmt: skip
    for url in ("http://127.0.0.1:80O0", "http://127.0.0.1:70000", "http://:8000", "10.0.0.2:80"):
        with pytest.raises(ConfigError, match=rf"^target.producers.urls\[0\]='{url}': give a"):
            to_typed(compose_config([*base, "target=vllm", f"target.producers.urls=[{url}]"]))
    with pytest.raises(ConfigError, match=r"^vllm.url=http://a:1: target=vllm needs capture"):
        from eagleforge.targets.vllm import VLLMTarget

        VLLMTarget.__init__(
            object.__new__(VLLMTarget), Path("/m"), torch.float32, torch.device("cpu"),
            to_typed(compose_config([*base, "vllm.url=http://a:1"])).vllm, Path("/l"),
        )  # fmt: skip


def test_prepare_refuses_the_training_queue(tmp_path: Path, engine: str) -> None:
    from eagleforge.prepare import run as prepare

    config = to_typed(compose_config(["+model=tiny", "data=chitchat", *DATA, "target=vllm", engine,
                                      "target.producers.queue_batches=2",
                                      f"prepare.output_dir={tmp_path / 'f'}",
                                      f"output_dir={tmp_path / 'p'}"]))  # fmt: skip
    with pytest.raises(ConfigError, match=r"^target.producers.queue_batches=2 sizes training"):
        prepare(config)
    assert not (tmp_path / "f").exists()


def test_a_stop_while_engines_start_ends_in_one_line_and_leaves_nothing(
    tmp_path: Path, engine: str
) -> None:
    """SIGTERM while the engines start (minutes for a real vLLM): exit 143, one line, the
    engines stopped, their capture directories and temporary files removed."""
    import os
    import signal
    import subprocess
    import sys
    import time

    pids, tmp = tmp_path / "pids", tmp_path / "tmp"
    tmp.mkdir()
    env = os.environ | {"FAKE_VLLM_PIDS": str(pids), "FAKE_VLLM_START_S": "120",
                        "TMPDIR": str(tmp)}  # fmt: skip
    command = [sys.executable, "-m", "eagleforge.train",
               *tiny_run_overrides(tmp_path, *RUN, "target=vllm", engine,
                                   "target.producers.engines=2")]  # fmt: skip
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)  # fmt: skip
    deadline = time.monotonic() + 120
    while not pids.is_file() and time.monotonic() < deadline and process.poll() is None:
        time.sleep(0.2)
    assert pids.is_file(), process.communicate()
    engine_pid = int(pids.read_text().split()[0])
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=60)
    assert process.returncode == 143, err
    assert err.strip().splitlines()[-1] == (
        "stopped by SIGTERM while the run was being set up, before its first step: run the same "
        "command again to go on"
    ), err
    assert "Traceback" not in err, err
    assert list(tmp.iterdir()) == []  # capture directories, the engines' own temporary files
    time.sleep(1)
    assert (
        not Path(f"/proc/{engine_pid}").exists()
        or "zombie" in Path(f"/proc/{engine_pid}/status").read_text().lower()
    )


def test_serve_target_refuses_a_taken_port_and_a_directory_it_cannot_write(
    tmp_path: Path, engine: str
) -> None:
    """Before any engine starts: a port something listens on (a capture server started before
    would answer the new one's health check) and a files_dir that is a file or on /proc."""
    import socket

    from eagleforge.engine.server import free_port
    from eagleforge.serve_target import serve

    def config(*extra: str):  # type: ignore[no-untyped-def]
        return to_typed(compose_config(["+model=tiny", engine, f"output_dir={tmp_path / 'o'}",
                                        f"serve_target.files_dir={tmp_path / 'shared'}",
                                        *extra]))  # fmt: skip

    port = free_port()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen()
        with pytest.raises(ConfigError, match=rf"^serve_target.port={port}: 127.0.0.1:{port} "
                                              "is taken"):  # fmt: skip
            serve(config(f"serve_target.port={port}"))
    (tmp_path / "a-file").write_text("")
    for where, why in [(tmp_path / "a-file", "File exists"), (Path("/proc/eagleforge"), "")]:
        with pytest.raises(ConfigError, match=rf"^serve_target.files_dir={where}: the server "
                                              rf"cannot write there \({why}"):  # fmt: skip
            serve(config(f"serve_target.files_dir={where}"))


def test_a_server_at_a_url_that_does_not_capture_is_named_with_the_fix() -> None:
    """A server that answers /health and /v1/models but has no completions endpoint (HTTP
    501 to a POST): one line naming the setting, what it is not, and what to start there."""
    from eagleforge.targets.vllm import ServerAtURL
    from helpers.http_stand_in import QuietHandler, serving

    class NoCompletions(QuietHandler):  # GET only: a POST is answered 501
        def do_GET(self) -> None:  # noqa: N802
            self.send_body(b'{"data": [{"id": "target"}]}' if self.path == "/v1/models" else b"{}")

    with serving(NoCompletions) as url:
        producer = ServerAtURL("target.producers.urls[0]", url, 10, [1, 2])
        with pytest.raises(ConfigError, match=rf"^target.producers.urls\[0\]={url} answers "
                           r"/health but not completions \(HTTP 501\): it is not a capture "
                           r"server; start one there \(python -m eagleforge.serve_target\)"):  # fmt: skip
            producer.capture([0, 1])


def test_producers_given_up_mid_run_save_the_steps_trained_first(
    tmp_path: Path, engine: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its only engine dies and cannot be started again: the run stops in one line, and the
    steps it trained since its last checkpoint are saved before it does."""
    from eagleforge.engine.server import EngineError

    monkeypatch.setenv("FAKE_VLLM_DIE_ONCE", str(tmp_path / "died"))
    monkeypatch.setenv("FAKE_VLLM_DIE_AFTER", "16")
    monkeypatch.setenv("FAKE_VLLM_EXIT_IF", str(tmp_path / "died"))  # and does not start again
    with pytest.raises(EngineError, match=r"^every producer of the target's states stopped .*"
                       r"run the same command again to resume. \(step (\d+) was saved first: "
                       r".*step_0+\1\)$") as stopped:  # fmt: skip
        streamed(tmp_path, "gone", engine, "target.producers.recover_timeout_s=60",
                 "trainer.save_every_n_steps=0", "trainer.max_num_steps=40",
                 "target.producers.queue_batches=1")  # fmt: skip
    step = int(str(stopped.value).rsplit("step_", 1)[1].rstrip(")"))
    assert 0 < step < 40
    assert (tmp_path / "gone" / "run" / "checkpoints" / f"step_{step:08d}" / "run.json").is_file()


def test_a_restart_that_hangs_is_given_up_within_recover_timeout_s(
    tmp_path: Path, engine: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine dies and its new start never gets ready: it is given up when
    recover_timeout_s is spent, not after vllm.startup_timeout_s (15 minutes)."""
    from eagleforge.engine.server import EngineError

    monkeypatch.setenv("FAKE_VLLM_DIE_ONCE", str(tmp_path / "died"))
    monkeypatch.setenv("FAKE_VLLM_DIE_AFTER", "16")
    monkeypatch.setenv("FAKE_VLLM_STALL_IF", str(tmp_path / "died"))
    with pytest.raises(EngineError, match=r"did not answer .*/health within the time left of "
                                          r"target.producers.recover_timeout_s="):  # fmt: skip
        streamed(tmp_path, "stalled", engine, "target.producers.recover_timeout_s=4",
                 "trainer.max_num_steps=40", "target.producers.queue_batches=1")  # fmt: skip
