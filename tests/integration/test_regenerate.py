"""Regenerating assistant turns: through a real OpenAI-compatible server (`transformers serve`
with SmolLM2, started here on 127.0.0.1), resumed after a kill, with failures recorded, and
in-process with the hf backend."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from eagleforge.config import compose_config, to_typed
from eagleforge.data.split import build_datasets
from eagleforge.errors import ConfigError
from eagleforge.regenerate import run
from helpers.ranks import free_port

pytestmark = pytest.mark.integration
FIXTURE = Path(__file__).parents[1] / "fixtures" / "sharegpt_small.jsonl"


@pytest.fixture(scope="module")
def server(smollm2_dir: Path) -> Iterator[str]:
    """`transformers serve` on a free port, its own process group, stopped after the tests."""
    port = free_port()
    proc = subprocess.Popen(
        [str(Path(sys.executable).with_name("transformers")), "serve", str(smollm2_dir),
         "--host", "127.0.0.1", "--port", str(port), "--device", "cpu"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    try:
        for _ in range(300):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except OSError:
                assert proc.poll() is None, "transformers serve exited"
                time.sleep(0.2)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def overrides(output: Path, *extra: str) -> list[str]:
    return ["+model=smollm2", "data=sharegpt", f"data.path={FIXTURE}",
            f"regenerate.output={output}", "regenerate.max_new_tokens=12",
            "regenerate.retry_backoff_s=0.05", f"output_dir={output.parent}", *extra]  # fmt: skip


def rows(path: Path) -> list[dict]:  # type: ignore[type-arg]
    return [json.loads(line) for line in path.read_text().splitlines()]


def source_rows() -> list[list[dict]]:  # type: ignore[type-arg]
    return [json.loads(line)["conversations"] for line in FIXTURE.read_text().splitlines()]


def test_server_backend_rewrites_every_assistant_turn(server: str, tmp_path: Path) -> None:
    """Two base URLs, one of them down: its requests are retried on the other."""
    output = tmp_path / "regen.jsonl"
    dead = f"http://127.0.0.1:{free_port()}/v1"
    config = to_typed(compose_config(overrides(output, f"regenerate.base_urls=[{server},{dead}]",
                                               "regenerate.max_rows=3")))  # fmt: skip
    summary = run(config)
    assert summary.written == 3 and summary.failed == 0
    for row, source in zip(rows(output), source_rows(), strict=False):
        messages = row["messages"]
        assert [m["role"] for m in messages] == [
            {"human": "user", "gpt": "assistant", "system": "system"}[t["from"]] for t in source
        ]
        kept = [m["content"] for m in messages if m["role"] != "assistant"]
        assert kept == [t["value"] for t in source if t["from"] != "gpt"]
        assert all(m["content"].strip() for m in messages if m["role"] == "assistant")
    assert not (tmp_path / "regen.jsonl.chunks").exists()
    # the training data path reads it
    data = to_typed(compose_config(["+model=smollm2", "data=jsonl", f"data.path={output}",
                                    "data.num_eval_samples=0", "output_dir=/tmp/unused"]))  # fmt: skip
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(config.model.path or _model_dir())
    prepared = build_datasets(data.data, tokenizer, tmp_path / "cache", 0)
    assert len(prepared.train) == 3


def _model_dir() -> Path:
    from eagleforge.targets.source import bundled_smollm2_dir

    return bundled_smollm2_dir(Path(os.environ["EAGLEFORGE_CACHE_DIR"]))


def test_killed_job_resumes_without_duplicates_or_losses(server: str, tmp_path: Path) -> None:
    output = tmp_path / "regen.jsonl"
    args = overrides(output, f"regenerate.base_urls=[{server}]", "regenerate.chunk_rows=1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "eagleforge.regenerate", *args],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    chunks = tmp_path / "regen.jsonl.chunks"
    while len(list(chunks.glob("*-*[0-9].jsonl"))) < 2 and proc.poll() is None:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    finished = {p.name: p.read_text() for p in chunks.glob("*-*[0-9].jsonl")}
    assert len(finished) >= 2 and not output.exists()
    summary = run(to_typed(compose_config(args)))
    assert summary.rows == 6 - len(finished)  # only the unfinished chunks ran again
    written = rows(output)
    assert len(written) == 6 and len({r["id"] for r in written}) == 6
    for name, text in finished.items():  # finished chunks (named start-end) kept as they were
        assert written[int(name.split("-")[0])] == json.loads(text)


def test_failed_requests_are_retried_then_recorded(tmp_path: Path) -> None:
    output = tmp_path / "regen.jsonl"
    dead = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens there
    config = to_typed(compose_config(overrides(
        output, f"regenerate.base_urls=[{dead}]", "regenerate.model=smollm2",
        "regenerate.max_retries=2", "regenerate.max_rows=2")))  # fmt: skip
    summary = run(config)
    assert summary.written == 0 and summary.failed == 2
    failures = rows(tmp_path / "regen.jsonl.failed.jsonl")
    assert [f["index"] for f in failures] == [0, 1]
    assert all("after 3 attempts" in f["reason"] and dead in f["reason"] for f in failures)


def test_hf_backend_in_process(tmp_path: Path) -> None:
    output = tmp_path / "regen.jsonl"
    config = to_typed(compose_config(overrides(
        output, "regenerate.backend=hf", "regenerate.max_rows=4", "regenerate.batch_size=4",
        "parallel.device=cpu")))  # fmt: skip
    summary = run(config)
    assert summary.written == 4
    for row in rows(output):
        assert all(m["content"].strip() for m in row["messages"] if m["role"] == "assistant")


def test_output_to_a_file_holds_no_progress_bar(tmp_path: Path) -> None:
    """`python -m eagleforge.regenerate ... > log 2>&1`: no bar (its own, transformers',
    datasets') is redrawn into the file; the lines that are there end with newlines."""
    output, log = tmp_path / "regen.jsonl", tmp_path / "log"
    tiny = ["+model=tiny" if o == "+model=smollm2" else o for o in overrides(
        output, "regenerate.backend=hf", "regenerate.max_rows=2", "regenerate.max_new_tokens=4",
        "parallel.device=cpu")]  # fmt: skip
    with log.open("wb") as out:
        done = subprocess.run(
            [sys.executable, "-m", "eagleforge.regenerate", *tiny],
            stdout=out, stderr=subprocess.STDOUT, timeout=600,
        )  # fmt: skip
    text = log.read_bytes().decode()
    assert done.returncode == 0, text[-3000:]
    assert "\r" not in text
    assert text.splitlines()[-1].startswith(f"2 conversations written to {output}")


def magpie_overrides(output: Path, *extra: str) -> list[str]:
    return overrides(output, "regenerate.backend=hf", "parallel.device=cpu",
                     "regenerate.batch_size=8", "regenerate.magpie.num_prompts=4",
                     "regenerate.magpie.held_out=2", "regenerate.magpie.max_new_tokens=48",
                     *extra)  # fmt: skip


def test_magpie_target_writes_and_answers_its_own_prompts(tmp_path: Path) -> None:
    output = tmp_path / "regen.jsonl"
    summary = run(to_typed(compose_config(magpie_overrides(output))))
    assert summary.written == 4 and summary.failed == 0
    written = rows(output)
    prompts = [row["messages"][0]["content"] for row in written]
    assert [[m["role"] for m in row["messages"]] for row in written] == [["user", "assistant"]] * 4
    assert all(p.strip() and "<|im" not in p for p in prompts) and len(set(prompts)) == 4
    assert all(row["messages"][1]["content"].strip() for row in written)
    held_out = rows(tmp_path / "regen.heldout.jsonl")
    assert len(held_out) == 2 and not {r["turns"][0] for r in held_out} & set(prompts)
    settings = json.loads((tmp_path / "regen.jsonl.settings.json").read_text())
    assert settings["source"]["format"] == "magpie" and settings["magpie"]["num_prompts"] == 4
    assert not (tmp_path / "regen.jsonl.chunks").exists()
    # the held-out prompts are an eval.prompts file
    from eagleforge.speculative.prompts import load_prompt_set

    assert len(load_prompt_set(str(tmp_path / "regen.heldout.jsonl"), False, None).items) == 2


def test_magpie_resume_reuses_the_written_prompts(tmp_path: Path) -> None:
    """A job killed after writing its prompts answers those prompts, and never writes others;
    a resume asking for another number of prompts is refused."""
    from eagleforge.regeneration.rows import Reply

    output = tmp_path / "regen.jsonl"
    chunks = tmp_path / "regen.jsonl.chunks"
    chunks.mkdir()
    written = [f"question {i}?" for i in range(6)]
    (chunks / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in written))
    with pytest.raises(ConfigError, match="holds the 6 an earlier call wrote"):
        run(to_typed(compose_config(magpie_overrides(output, "regenerate.magpie.held_out=3"))))

    def answer(histories: list[list[dict]]) -> list[Reply]:  # type: ignore[type-arg]
        return [Reply(f"answer to {h[-1]['content']}") for h in histories]

    summary = run(to_typed(compose_config(magpie_overrides(output))), answer)
    assert summary.written == 4
    assert [r["messages"][1]["content"] for r in rows(output)] == [
        f"answer to question {i}?" for i in range(4)
    ]
    assert [r["turns"] for r in rows(tmp_path / "regen.heldout.jsonl")] == [
        ["question 4?"],
        ["question 5?"],
    ]


def test_magpie_needs_the_hf_backend(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="regenerate.backend=hf"):
        to_typed(compose_config(overrides(tmp_path / "r.jsonl", "regenerate.magpie.num_prompts=4")))
