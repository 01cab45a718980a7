"""Experiment tracking: one small interface, with an MLflow and a console implementation.

Metric names are slash-scoped (``train/loss``, ``train/acc_3``, ``eval/tau_sim``). The default
MLflow store is ``sqlite:///<output_root>/mlflow.db`` with artifacts beside it, so no server is
needed; ``tracker.tracking_uri`` or ``MLFLOW_TRACKING_URI`` points at a shared server instead
(``make mlflow-server``). Only rank 0 builds a real tracker. Inside a Hydra job the run is
tagged with the job's command-line overrides (``override/<key>``), and in a sweep with the
sweep directory and job number, so the runs of one sweep can be filtered and compared.

MLflow logging never stalls training: a background thread sends what is logged, and what it
cannot send (server down or hung) is spooled in ``<run dir>/mlflow_spool/<run id>/`` and sent
when the server answers again, or later with::

    python -m eagleforge.tracking sync <run dir>
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import queue
import shlex
import shutil
import signal
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, suppress
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any, ClassVar, Protocol

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from eagleforge.atomic import atomic_file
from eagleforge.errors import ConfigError, InterruptedAtTheEnd, Stopped
from eagleforge.files import unwritable_reason

log = logging.getLogger(__name__)
# MLflow announces the creation and migration of a sqlite store at INFO on the console; it is
# routine here (the default store is created by the first run), not news for the user.
for _noisy in ("mlflow.store.db.utils", "alembic.runtime.migration"):
    logging.getLogger(_noisy).setLevel(logging.WARNING)

# The loggers MLflow gives console handlers of their own when it is imported.
MLFLOW_LOGGERS = ("mlflow", "sqlalchemy", "sqlalchemy.engine", "alembic", "huey")


def keep_mlflow_off_the_console() -> None:
    """MLflow's own loggers (and its SQLAlchemy's and alembic's) write into the run's log file
    only, never onto the console: a locked or full sqlite store makes them print tracebacks of
    dozens of lines, where the tracker's own one-line warning is what the user needs. Called
    once mlflow is imported (its import installs their console handlers)."""
    files = _root_handlers(files=True)
    for name in MLFLOW_LOGGERS:
        logger = logging.getLogger(name)
        logger.handlers = list(files) or [logging.NullHandler()]
        logger.propagate = False


class TrackerKind(str, Enum):
    mlflow = "mlflow"
    console = "console"


@dataclass
class TrackerConfig:
    """The `tracker` config section."""

    # Where metrics go (mlflow | console).
    kind: TrackerKind = TrackerKind.mlflow
    # MLflow tracking URI; null = $MLFLOW_TRACKING_URI, else sqlite:///<output_root>/mlflow.db.
    tracking_uri: str | None = None
    # MLflow experiment name.
    experiment: str = "eagleforge"
    # Run name; null = <model>-<data>-<time of the run dir> (in a sweep, also the job number).
    run_name: str | None = None
    # Seconds a run's end waits on one MLflow request before spooling what is left to send.
    close_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        if self.close_timeout_s < 0:
            raise ConfigError(
                f"tracker.close_timeout_s must be >= 0 seconds, got {self.close_timeout_s}."
            )


class Tracker(Protocol):
    # True when it logs into the MLflow run of the training run it resumes (whose params are
    # already logged: MLflow never changes a logged param)
    continued: bool

    def log_config(self, params: Mapping[str, Any], config_yaml: str) -> None: ...

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None: ...

    def log_artifact(self, path: str | Path) -> None: ...

    def close(self) -> None: ...


def metrics_line(metrics: Mapping[str, float], step: int) -> str:
    """Every metric of one ``log_metrics`` call, as the line the run's log file gets
    (``<run dir>/train.log``): ``step 20 train/loss=2.31 train/loss_0=1.02 ...``."""
    return f"step {step} " + " ".join(f"{k}={v:.4g}" for k, v in metrics.items())


def _tokens_per_s(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:.1f}"


# What the console line shows of a scope's metrics, in this order: (name after the scope,
# label, format). The rest (per-position loss, acc and alpha, counts, grad norm, epoch, the
# data report) goes to the log file and the tracker only. acc_0 is the first drafted token in
# every draft family: TTT position 0 of EAGLE-3, block slot 1 of DFlash.
CONSOLE_METRICS: tuple[tuple[str, str, Callable[[float], str]], ...] = (
    ("loss", "loss", "{:.4g}".format),
    ("acc_0", "acc_0", "{:.3f}".format),
    ("tau_sim", "τ_sim", "{:.3f}".format),
    ("tau", "τ", "{:.3f}".format),
    ("speedup", "speedup", "{:.2f}x".format),
    ("tokens_per_s", "tok/s", _tokens_per_s),
    ("lr", "lr", "{:.2e}".format),
    ("peak_mem_mib", "mem", lambda mib: f"{mib / 1024:.2f} GiB"),
)


def console_line(metrics: Mapping[str, float], step: int) -> str | None:
    """The few numbers of one ``log_metrics`` call a person watches, as one console line:
    ``step 20 train: loss 2.31  acc_0 0.412  τ_sim 1.52  tok/s 1,234  lr 3.00e-03  mem 1.43
    GiB``; each scope (``train``, ``eval``, ``eval/gsm8k``) in its own part. None when no
    metric is one of ``CONSOLE_METRICS``."""
    scopes: dict[str, dict[str, float]] = {}
    for key, value in metrics.items():
        scope, _, name = key.rpartition("/")
        scopes.setdefault(scope, {})[name] = value
    parts = []
    for scope, values in scopes.items():
        shown = [f"{label} {fmt(values[n])}" for n, label, fmt in CONSOLE_METRICS if n in values]
        if shown:
            parts.append(f"{scope}: {'  '.join(shown)}" if scope else "  ".join(shown))
    return f"step {step} " + "  |  ".join(parts) if parts else None


# The two loggers of metric lines: the console line (console_line) and every metric
# (metrics_line), each routed, when it is written, to the root logger's console handlers or
# to its log files (Hydra's <run dir>/train.log).
CONSOLE_LOG = logging.getLogger("eagleforge.metrics")
ALL_METRICS_LOG = logging.getLogger("eagleforge.metrics.all")


def _root_handlers(*, files: bool) -> list[logging.Handler]:
    """The root logger's handlers that write to files (``files``), or all the others (the
    console's)."""
    return [h for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler) is files]


def _routed(logger: logging.Logger, handlers: list[logging.Handler]) -> logging.Logger:
    # the root's handlers as they are now: Hydra installs new ones for each job of a sweep
    logger.handlers = handlers or [logging.NullHandler()]
    logger.propagate = False
    return logger


def log_metric_lines(metrics: Mapping[str, float], step: int) -> None:
    """One ``log_metrics`` call in the log: every metric into the run's log file, and the
    few a person watches onto the console, above the progress bar (tqdm clears it, the line
    is written, the bar is drawn again), never in the middle of it."""
    from tqdm.auto import tqdm

    _routed(ALL_METRICS_LOG, _root_handlers(files=True)).info("%s", metrics_line(metrics, step))
    line = console_line(metrics, step)
    if line is not None:
        with tqdm.external_write_mode():
            _routed(CONSOLE_LOG, _root_handlers(files=False)).info("%s", line)


def param_text(value: Any) -> str:
    """A config value as a user types it: an Enum by its value (``random``, not
    ``ModelSource.random``), so that runs can be filtered by it."""
    if isinstance(value, Enum):
        return str(value.value)
    if isinstance(value, list | tuple):
        return str([value_.value if isinstance(value_, Enum) else value_ for value_ in value])
    return str(value)


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}; lists are kept as their string form."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat


class ConsoleTracker:
    """Logs metrics through the ``logging`` module (``log_metric_lines``)."""

    continued = False

    def log_config(self, params: Mapping[str, Any], config_yaml: str) -> None:
        log.debug("config:\n%s", config_yaml)

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        log_metric_lines(metrics, step)

    def log_artifact(self, path: str | Path) -> None:
        log.info("artifact %s", path)

    def close(self) -> None:
        pass


@contextmanager
def _flock(path: Path, *, wait: bool = True) -> Iterator[bool]:
    """An exclusive flock on ``path`` (made with its directory). Yields False when ``wait`` is
    off and another process holds it."""
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@contextmanager
def _store_setup_lock(tracking_uri: str) -> Iterator[None]:
    """Held while a sqlite store is created or migrated and the experiment looked up or made:
    the jobs of a sweep start at the same time (submitit, job arrays) and would otherwise
    race to create the same tables and experiment. A server serialises that itself."""
    if not tracking_uri.startswith("sqlite:///"):
        yield
        return
    db = Path(tracking_uri.removeprefix("sqlite:///"))
    with _flock(db.with_name(db.name + ".lock")):
        yield


# How long the sender waits after a failed request before it tries the server again; meanwhile
# what is logged goes straight to the spool.
RETRY_AFTER_S = 30.0
# Logging calls that wait in memory for the sender; beyond that they are spooled to disk.
QUEUE_SIZE = 1000


def _client(tracking_uri: str) -> Any:
    """An MlflowClient whose HTTP requests give up in seconds: mlflow's defaults (7 retries
    with backoff, 120 s timeout) would keep the sender on one request for many minutes."""
    from mlflow import MlflowClient

    keep_mlflow_off_the_console()
    if tracking_uri.startswith("http"):
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
    return MlflowClient(tracking_uri=tracking_uri)


def _rejected(error: Exception) -> bool:
    """True when the server answered and refused the entry (a 4xx: a param logged twice with
    two values, a bad name): sending it again would never succeed."""
    from mlflow.exceptions import MlflowException

    if not isinstance(error, MlflowException):
        return False
    status = error.get_http_status_code()
    return 400 <= status < 500 and status != 429


def _why(error: Exception) -> str:
    """An error in one short line (mlflow's connection errors run to several hundred
    characters)."""
    text = f"{type(error).__name__}: {error}".splitlines()[0]
    return text if len(text) <= 200 else text[:199] + "…"


def send_entry(client: Any, run_id: str, entry: Mapping[str, Any], base: Path) -> bool:
    """Sends one logging call, as the tracker queues and spools it (relative artifact paths
    are under ``base``, the spool directory). Returns False when the server refused it: it is
    dropped with a warning. Raises when the server cannot be reached."""
    try:
        _send(client, run_id, entry, base)
    except Exception as e:
        if not _rejected(e):
            raise
        log.warning("MLflow refused a %s entry (%s); it is dropped", entry["kind"], _why(e))
        return False
    return True


def _send(client: Any, run_id: str, entry: Mapping[str, Any], base: Path) -> None:
    from mlflow.entities import Metric, Param, RunTag

    kind = entry["kind"]
    if kind == "metrics":
        metrics = [
            Metric(key, value, entry["timestamp"], entry["step"])
            for key, value in entry["metrics"].items()
        ]
        client.log_batch(run_id, metrics=metrics)
    elif kind == "params":
        client.log_batch(run_id, params=[Param(k, v) for k, v in entry["params"].items()])
    elif kind == "tags":
        client.log_batch(run_id, tags=[RunTag(k, v) for k, v in entry["tags"].items()])
    elif kind == "text":
        client.log_text(run_id, entry["text"], entry["name"])
    elif kind == "artifact":
        path = base / entry["path"]  # an absolute path stays as it is
        if path.is_dir():
            client.log_artifacts(run_id, str(path), artifact_path=entry["artifact_path"])
        else:
            client.log_artifact(run_id, str(path), artifact_path=entry["artifact_path"])
    elif kind == "end":
        client.set_terminated(run_id, entry["status"])
    else:
        raise ValueError(f"unknown tracker entry kind {kind!r}")


class Spool:
    """What a tracker could not send to its MLflow run, on disk until it can be:
    ``<spool root>/<run id>/run.json`` (which run, on which server), ``entries.jsonl`` (one
    logging call a line, in order, with its original timestamp) and ``files/`` (copies of the
    artifacts as they were when logged). Changes are made under an flock, so the training
    process and ``python -m eagleforge.tracking sync`` can both append and replay; replaying
    twice is harmless (MLflow drops a metric point it already has)."""

    def __init__(self, directory: Path, run: Mapping[str, str]) -> None:
        self.dir = directory
        self.run = dict(run)

    @classmethod
    def open(cls, directory: Path) -> Spool:
        return cls(directory, json.loads((directory / "run.json").read_text()))

    def _locked(self, name: str = "lock", *, wait: bool = True) -> AbstractContextManager[bool]:
        """An flock on ``<dir>/<name>``: ``lock`` around each change of entries.jsonl,
        ``replay.lock`` around a replay (one sender at a time). Yields False when ``wait`` is
        off and someone else holds it."""
        return _flock(self.dir / name, wait=wait)

    def entries(self) -> list[dict[str, Any]]:
        path = self.dir / "entries.jsonl"
        if not path.exists():
            return []
        # the last line may be half written by an append under way: only whole lines count
        return [json.loads(line) for line in path.read_text().split("\n")[:-1] if line]

    def has_entries(self) -> bool:
        try:
            return (self.dir / "entries.jsonl").stat().st_size > 0
        except FileNotFoundError:
            return False

    def counts(self) -> Counter[str]:
        return Counter(entry["kind"] for entry in self.entries())

    def append(self, entries: list[dict[str, Any]]) -> None:
        """Adds entries (texts and artifacts are copied under files/)."""
        if not entries:
            return
        with self._locked():
            if not (self.dir / "run.json").exists():
                (self.dir / "run.json").write_text(json.dumps(self.run, indent=2) + "\n")
            lines = [json.dumps(self._stored(entry)) + "\n" for entry in entries]
            with open(self.dir / "entries.jsonl", "a") as out:
                out.writelines(lines)

    def _stored(self, entry: dict[str, Any]) -> dict[str, Any]:
        if entry["kind"] not in ("text", "artifact"):
            return entry
        where = Path("files") / uuid.uuid4().hex
        (self.dir / where).mkdir(parents=True)
        if entry["kind"] == "text":
            (self.dir / where / entry["name"]).write_text(entry["text"])
            return {"kind": "artifact", "path": str(where / entry["name"]), "artifact_path": None}
        source = Path(entry["path"])
        if source.is_dir():
            shutil.copytree(source, self.dir / where / source.name)
        else:
            shutil.copy2(source, self.dir / where / source.name)
        return {**entry, "path": str(where / source.name)}

    def replay(self, client: Any, on_sent: Callable[[], None] = lambda: None) -> int:
        """Sends the entries in order, the run's end status (the last one spooled) after all
        others, and removes what was sent; the directory goes when nothing is left. Raises
        what the client raised when the server cannot be reached (what was sent before is
        removed all the same); an entry the server refuses is dropped with a warning. Calls
        ``on_sent`` after each entry. Returns
        the number of entries sent, or -1 when another process is replaying this spool."""
        with self._locked("replay.lock", wait=False) as mine:
            if not mine:
                return -1
            with self._locked():
                entries = self.entries()
            done: set[int] = set()
            ends = [i for i, entry in enumerate(entries) if entry["kind"] == "end"]
            order = [i for i in range(len(entries)) if i not in ends] + ends[-1:]
            try:
                for i in order:
                    send_entry(client, self.run["run_id"], entries[i], self.dir)
                    done.add(i)
                    on_sent()
                done.update(ends)  # the last end status is the one that counts
            finally:
                self._remove(entries, done)
            return len(done)

    def _remove(self, read: list[dict[str, Any]], done: set[int]) -> None:
        with self._locked():
            now = self.entries()  # what was read, then what was appended since
            left = [e for i, e in enumerate(now[: len(read)]) if i not in done]
            left += now[len(read) :]
            for i in done:
                if read[i]["kind"] == "artifact" and not Path(read[i]["path"]).is_absolute():
                    shutil.rmtree(self.dir / Path(read[i]["path"]).parent, ignore_errors=True)
            if left:
                text = "".join(json.dumps(entry) + "\n" for entry in left)
                (self.dir / "entries.tmp").write_text(text)
                os.replace(self.dir / "entries.tmp", self.dir / "entries.jsonl")
                return
            shutil.rmtree(self.dir, ignore_errors=True)
        with suppress(OSError):  # the spool root, when this was its last spool
            self.dir.parent.rmdir()

    def describe(self) -> str:
        """'<n> metric batches and <m> artifacts', then the params, tags and end status
        spooled."""
        counts = self.counts()
        text = f"{counts['metrics']} metric batches and {counts['artifact']} artifacts"
        names = {"params": "params", "tags": "tags", "end": "end status"}
        others = [name for kind, name in names.items() if counts[kind]]
        return text + (f" (and the run's {', '.join(others)})" if others else "")


def sync_hint(directory: Path) -> str:
    return f"python -m eagleforge.tracking sync {shlex.quote(str(directory))}"


class MLflowTracker:
    """An MLflow run: params, slash-scoped metrics with steps, artifacts.

    Logging never waits for the server: calls are queued and a background thread sends them.
    What cannot be sent (server down or hung, queue full) goes to a ``Spool`` under
    ``spool_root``, which the sender replays when the server answers again. ``close`` waits
    while the sender gets entries through, at most ``close_timeout_s`` for any one of them,
    and spools the rest; ``python -m eagleforge.tracking sync`` sends it later and ends the
    run with its status."""

    # The tracker this process built last: record_failure and record_stop mark its run.
    last: ClassVar[MLflowTracker | None] = None

    def __init__(
        self,
        tracking_uri: str,
        experiment: str,
        run_name: str,
        artifact_root: Path,
        tags: Mapping[str, str] | None = None,
        *,
        spool_root: Path | None = None,
        close_timeout_s: float = 5.0,
        queue_size: int = QUEUE_SIZE,
        continue_run: str | None = None,
    ) -> None:
        import mlflow

        keep_mlflow_off_the_console()
        active = mlflow.active_run()
        # Inside a run someone else started (a notebook, a sweep driver): log into it.
        self.owns_run = active is None
        self.continued = False
        if active is not None:
            self.tracking_uri = mlflow.get_tracking_uri()
            self.client = _client(self.tracking_uri)
            self.run_id = active.info.run_id
        else:
            self.tracking_uri = tracking_uri
            continued = self._continue_run(continue_run) if continue_run else None
            self.continued = continued is not None
            self.run_id = continued or self._start_run(experiment, run_name, artifact_root, tags)
        self.spool = Spool(
            (spool_root or artifact_root.parent / "mlflow_spool") / self.run_id,
            {"tracking_uri": self.tracking_uri, "run_id": self.run_id},
        )
        self.close_timeout_s = close_timeout_s
        self.closed = False
        self.stopped_by: int | None = None  # a signal that arrived while close wrote the end
        self._queue: queue.Queue[dict[str, Any]] = queue.Queue(maxsize=queue_size)
        self._closing = threading.Event()
        self._state = threading.Lock()  # guards _in_flight and _abandoned
        self._in_flight: dict[str, Any] | None = None
        self._abandoned = False  # close stopped waiting: the sender must not touch the spool
        self._down = False
        self._warned = False
        self._last_attempt = 0.0
        self._progress_at = time.monotonic()  # when the sender last finished with an entry
        self._sender = threading.Thread(target=self._send_all, name="mlflow-sender", daemon=True)
        self._sender.start()
        MLflowTracker.last = self

    def _continue_run(self, run_id: str) -> str | None:
        """Mark the run a resumed training run started RUNNING again and log into it (its
        steps go on); None, with a warning, where the store no longer has it."""
        from mlflow.exceptions import MlflowException

        try:
            self.client = _client(self.tracking_uri)
            if self.client.get_run(run_id).info.lifecycle_stage != "active":
                raise MlflowException(f"run {run_id} was deleted")
            self.client.update_run(run_id, status="RUNNING")
        except MlflowException as e:
            log.warning("cannot continue MLflow run %s (%s); starting a new run", run_id, _why(e))
            return None
        log.info("continuing MLflow run %s", run_id)
        return run_id

    def _start_run(
        self,
        experiment: str,
        run_name: str,
        artifact_root: Path,
        tags: Mapping[str, str] | None,
    ) -> str:
        # Through a client, not mlflow.start_run: the fluent API's active run belongs to the
        # thread that started it, and ending it would wait for the server.
        from mlflow.exceptions import MlflowException
        from mlflow.tracking.context.registry import resolve_tags

        try:
            with _store_setup_lock(self.tracking_uri):
                self.client = _client(self.tracking_uri)
                found = self.client.get_experiment_by_name(experiment)
                if found is None:
                    # A sqlite store would otherwise put artifacts in ./mlruns of whatever the
                    # cwd is.
                    location = (
                        artifact_root.resolve().as_uri()
                        if self.tracking_uri.startswith("sqlite")
                        else None
                    )
                    experiment_id = self.client.create_experiment(
                        experiment, artifact_location=location
                    )
                else:
                    experiment_id = found.experiment_id
            run = self.client.create_run(
                experiment_id, run_name=run_name, tags=resolve_tags(dict(tags or {}))
            )
            return str(run.info.run_id)
        except MlflowException as e:  # no run yet, so nothing to spool: say what to do
            reason = str(e).splitlines()[0][:300]
            raise ConfigError(
                f"tracker.tracking_uri={self.tracking_uri}: MLflow could not start the run "
                f"({reason}); start the server (make mlflow-server), point tracker.tracking_uri "
                "at a reachable one, or log locally with tracker.tracking_uri=null."
            ) from None

    def log_config(self, params: Mapping[str, Any], config_yaml: str) -> None:
        # MLflow caps param values at 6000 characters and a batch at 100 params.
        items = [(k, param_text(v)[:6000]) for k, v in params.items()]
        for start in range(0, len(items), 100):
            self._put({"kind": "params", "params": dict(items[start : start + 100])})
        self._put({"kind": "text", "text": config_yaml, "name": "config.yaml"})

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        values = {k: float(v) for k, v in metrics.items()}
        log_metric_lines(values, step)
        timestamp = int(time.time() * 1000)
        self._put({"kind": "metrics", "step": step, "timestamp": timestamp, "metrics": values})

    def log_artifact(self, path: str | Path) -> None:
        path = Path(path).resolve()
        self._put(
            {
                "kind": "artifact",
                "path": str(path),
                "artifact_path": path.name if path.is_dir() else None,
            }
        )

    def close(self, status: str = "FINISHED", tags: Mapping[str, str] | None = None) -> None:
        """Ends the run with ``status`` (and ``tags``). Waits for the sender as long as it gets
        entries through, and at most close_timeout_s for any one of them: what is not sent by
        then is spooled, with one warning that says how to send it.

        Ctrl-C or a stop signal that arrives meanwhile is held until the end is written, then
        handed to its handler; where that ends the command (KeyboardInterrupt, ``Stopped``, the
        default action) the run is marked KILLED first, with the ``stopped_by`` tag."""
        if self.closed:
            return
        self.closed = True
        signals = HeldSignals()
        with signals:
            self._end(status, tags)
        try:
            signals.hand_on(lambda signum: self._stopped(signum, status))
        except KeyboardInterrupt as e:
            if status != "FINISHED" or isinstance(e, InterruptedAtTheEnd):
                raise
            raise InterruptedAtTheEnd() from None

    def _stopped(self, signum: int, status: str) -> None:
        self.stopped_by = signum
        if status != "FINISHED" or not self.owns_run:  # FAILED, KILLED: it says so already
            return
        try:
            self.amend({"stopped_by": signal.Signals(signum).name}, "KILLED")
        except Exception as e:  # the stop goes on: the record of it is a courtesy
            log.warning("could not mark the MLflow run stopped (%s: %s)", type(e).__name__, e)

    def _end(self, status: str, tags: Mapping[str, str] | None) -> None:
        if tags:
            self._put({"kind": "tags", "tags": dict(tags)}, closing=True)
        if self.owns_run:
            self._put({"kind": "end", "status": status}, closing=True)
        self._made_progress()
        self._closing.set()
        while self._sender.is_alive():
            idle_s = time.monotonic() - self._progress_at
            if idle_s >= self.close_timeout_s:
                break
            self._sender.join(self.close_timeout_s - idle_s)
        if self._sender.is_alive():
            with self._state:
                self._abandoned = True
                left = [self._in_flight] if self._in_flight is not None else []
                while not self._queue.empty():
                    left.append(self._queue.get_nowait())
                self.spool.append(left)
        self._report_spool()

    def amend(self, tags: Mapping[str, str], status: str) -> None:
        """After close: adds ``tags`` and sets the run's ``status`` now, or spools them when
        the run's own entries are spooled or the server cannot be reached."""
        entries: list[dict[str, Any]] = [
            {"kind": "tags", "tags": dict(tags)},
            {"kind": "end", "status": status},
        ]
        if not self.spool.has_entries():
            try:
                for entry in entries:
                    _send(self.client, self.run_id, entry, self.spool.dir)
                return
            except Exception as e:
                log.warning("MLflow at %s is unreachable (%s)", self.tracking_uri, e)
        self.spool.append(entries)
        self._report_spool()

    def _report_spool(self) -> None:
        if self.spool.has_entries():
            log.warning(
                "MLflow at %s was unreachable: %s are spooled in %s; send them with: %s",
                self.tracking_uri,
                self.spool.describe(),
                self.spool.dir,
                sync_hint(self.spool.dir),
            )

    def _put(self, entry: dict[str, Any], *, closing: bool = False) -> None:
        if self.closed and not closing:
            log.warning("tracker already closed: %s is spooled", entry["kind"])
            self.spool.append([entry])
            return
        try:
            self._queue.put_nowait(entry)
        except queue.Full:  # the sender is stuck on the server: spool rather than wait
            self.spool.append([entry])
            self._warn_once("the server does not keep up")

    # The sender thread: the only one that talks to the server while the run is open.

    def _send_all(self) -> None:
        self._sync_earlier_spools()
        while not self._abandoned:
            try:
                entry = self._queue.get(timeout=0.1)
            except queue.Empty:
                if self._closing.is_set():
                    break
                continue
            with self._state:
                self._in_flight = entry
            try:
                retry_due = time.monotonic() - self._last_attempt >= RETRY_AFTER_S
                if self._down and (self._closing.is_set() or not retry_due):
                    self._spool_from_sender(entry)
                else:
                    self._attempt(entry)
            except Exception:  # a bug or a full disk: say so, and keep the sender alive
                log.exception("the MLflow sender could not handle a %s entry", entry["kind"])
            finally:
                with self._state:
                    self._in_flight = None
                self._made_progress()
        if not self._abandoned and self.spool.has_entries():
            self._replay()  # the last try, at close

    def _attempt(self, entry: dict[str, Any]) -> None:
        self._last_attempt = time.monotonic()
        try:
            if not send_entry(self.client, self.run_id, entry, self.spool.dir):
                return
        except Exception as e:
            self._spool_from_sender(entry)
            self._warn_down(_why(e))
            return
        if self.spool.has_entries():
            self._replay()
        elif self._down:
            self._back()

    def _replay(self) -> None:
        self._last_attempt = time.monotonic()
        try:
            self.spool.replay(self.client, self._made_progress)
        except Exception as e:
            self._warn_down(_why(e))
            return
        if self._down:
            self._back()

    def _made_progress(self) -> None:
        self._progress_at = time.monotonic()

    def _spool_from_sender(self, entry: dict[str, Any]) -> None:
        with self._state:
            if not self._abandoned:  # else close has spooled it
                self.spool.append([entry])

    def _warn_down(self, why: str) -> None:
        self._down = True
        self._warn_once(why)

    def _warn_once(self, why: str) -> None:
        if not self._warned:
            self._warned = True
            log.warning(
                "MLflow at %s is unreachable (%s); training goes on, and what is logged is "
                "kept in %s and sent when it is back.",
                self.tracking_uri,
                why,
                self.spool.dir,
            )

    def _back(self) -> None:
        self._down = self._warned = False
        log.warning("MLflow at %s is reachable again; spooled entries sent.", self.tracking_uri)

    def _sync_earlier_spools(self) -> None:
        """The spools an earlier process left beside ours (a resumed run in the same run
        directory), sent now that the server answers."""
        for directory in find_spools(self.spool.dir.parent):
            if directory == self.spool.dir:
                continue
            try:
                earlier = Spool.open(directory)
                if earlier.run.get("tracking_uri") != self.tracking_uri:
                    continue
                if earlier.replay(self.client, self._made_progress) > 0:
                    log.info("sent the entries spooled in %s", directory)
            except Exception as e:
                log.info("could not send the entries spooled in %s (%s)", directory, e)


class HeldSignals:
    """While active (main thread only), Ctrl-C, SIGTERM and SIGHUP are recorded instead of
    acted on, so that a run's last MLflow write completes: raised inside MLflow's SQLAlchemy
    (in a finalizer, a pool callback), a KeyboardInterrupt is printed as "Exception ignored"
    and lost, and the command goes on to exit 0 with its run FINISHED. A second Ctrl-C raises
    at once. ``hand_on`` then gives the first signal to the handler it was meant for."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __init__(self) -> None:
        self.held: list[int] = []
        self._previous: dict[int, Any] = {}

    def _hold(self, signum: int, _frame: object) -> None:
        if signum == signal.SIGINT and signal.SIGINT in self.held:
            raise KeyboardInterrupt
        self.held.append(signum)

    def __enter__(self) -> HeldSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                if signal.getsignal(sig) not in (signal.SIG_IGN, None):  # None: set outside Python
                    self._previous[sig] = signal.signal(sig, self._hold)
        return self

    def __exit__(self, *_: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def hand_on(self, before_stop: Callable[[int], None]) -> None:
        """The first held signal to its handler; ``before_stop(signum)`` runs first where the
        signal ends the command: its default action, or a handler that raises (Ctrl-C's
        KeyboardInterrupt, ``Stopped``). A handler that returns (submitit's, which logs a
        SIGTERM) lets the command go on, as the signal would have."""
        if not self.held:
            return
        signum = self.held[0]
        handler = self._previous[signum]
        if not callable(handler):  # SIG_DFL: the process ends by the signal
            before_stop(signum)
            signal.raise_signal(signum)
            return
        try:
            handler(signum, None)
        except BaseException:
            before_stop(signum)
            raise


class NullTracker:
    """What ranks other than 0 get: nothing is written or logged."""

    continued = False

    def log_config(self, params: Mapping[str, Any], config_yaml: str) -> None:
        pass

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        pass

    def log_artifact(self, path: str | Path) -> None:
        pass

    def close(self) -> None:
        pass


def default_tracking_uri(output_root: str | Path) -> str:
    return f"sqlite:///{Path(output_root).resolve() / 'mlflow.db'}"


def resolve_tracking_uri(cfg: TrackerConfig, output_root: str | Path) -> str:
    """tracker.tracking_uri, else $MLFLOW_TRACKING_URI, else the sqlite store in output_root."""
    return (
        cfg.tracking_uri
        or os.environ.get("MLFLOW_TRACKING_URI")
        or default_tracking_uri(output_root)
    )


def store_paths(uri: str) -> list[Path]:
    """The local places an MLflow tracking URI writes: a sqlite file and its directory (the
    journal goes beside it), or a file store's directory; none for a server or a database
    elsewhere."""
    if uri.startswith("sqlite:///"):
        store = Path(uri.removeprefix("sqlite:///"))
        return [store.parent, store]
    if uri.startswith("file:"):
        return [Path(uri.removeprefix("file:").removeprefix("//"))]
    if "://" not in uri and not uri.startswith("databricks"):
        return [Path(uri)]  # a bare path: MLflow's file store
    return []


def server_down(uri: str, timeout_s: float = 5.0) -> str | None:
    """Why the MLflow server of an http(s) tracking URI does not answer (its ``/health``);
    None when it answers, or when ``uri`` names no server (a local store, a database)."""
    if not uri.startswith(("http://", "https://")):
        return None
    try:
        urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=timeout_s).close()
    except urllib.error.HTTPError:
        return None  # something answers (a proxy, an auth layer): MLflow's own errors will tell
    except (OSError, ValueError) as e:
        return str(getattr(e, "reason", None) or e)
    return None


def hydra_job_tags() -> dict[str, str]:
    """Tags that say which Hydra job a run is: ``overrides`` (the job's command-line overrides,
    as typed), ``override/<key>`` for each of them and, in a sweep (-m), ``sweep/dir`` and
    ``sweep/job_num``. Empty outside a Hydra job (tests, notebooks)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized():
        return {}
    hydra_cfg = HydraConfig.get()
    overrides = [str(o) for o in hydra_cfg.overrides.task]
    tags = {"overrides": " ".join(overrides)[:MAX_TAG_CHARS]}
    for override in overrides:
        key, _, value = override.partition("=")
        tags[f"override/{key.lstrip('+~')}"] = value[:MAX_TAG_CHARS]
    if hydra_cfg.mode == RunMode.MULTIRUN:
        tags["sweep/dir"] = str(Path(hydra_cfg.sweep.dir).resolve())
        tags["sweep/job_num"] = str(hydra_cfg.job.num)
    return tags


# MLflow's limit on a tag value (and a param value) is 8000 / 6000 characters.
MAX_TAG_CHARS = 5000


def default_run_name(model: str, data: str, output_dir: Path) -> str:
    """<model>-<data>-<run dir time>, or in a sweep <model>-<data>-<sweep time>-<job number>."""
    # a sweep job's dir is <sweep dir>/<job number> (hydra.sweep.subdir)
    parts = output_dir.parts[-2:] if output_dir.name.isdigit() else output_dir.parts[-1:]
    return "-".join([model, data, *parts])


def build_tracker(
    cfg: TrackerConfig,
    output_root: str | Path,
    run_name: str,
    *,
    is_main: bool = True,
    tags: Mapping[str, str] | None = None,
    output_dir: str | Path | None = None,
    resume: bool = False,
) -> Tracker:
    """The tracker of this process: a NullTracker on every process but the main one
    (``world.is_main``), so that one run is logged however many processes train. ``tags`` go
    on the MLflow run; null = ``hydra_job_tags()``. What MLflow cannot take is spooled in
    ``<output_dir>/mlflow_spool`` (null = ``<output_root>/mlflow_spool``).

    The run's id is recorded in ``<output_dir>/mlflow_run.json``; with ``resume`` (a training
    run continued from its checkpoint) the run recorded there, in the same store, goes on
    instead of a new one starting, so one training run is one MLflow run however often it
    was stopped."""
    if not is_main:
        return NullTracker()
    if cfg.kind == TrackerKind.console:
        return ConsoleTracker()
    uri = resolve_tracking_uri(cfg, output_root)
    Path(output_root).mkdir(parents=True, exist_ok=True)
    record = Path(output_dir) / RUN_RECORD if output_dir is not None else None
    tracker = MLflowTracker(
        uri,
        cfg.experiment,
        cfg.run_name or run_name,
        Path(output_root) / "mlartifacts",
        hydra_job_tags() if tags is None else tags,
        spool_root=Path(output_dir or output_root) / "mlflow_spool",
        close_timeout_s=cfg.close_timeout_s,
        continue_run=_recorded_run(record, uri) if resume and record is not None else None,
    )
    if record is not None and tracker.owns_run:
        record.parent.mkdir(parents=True, exist_ok=True)
        with atomic_file(record) as tmp:
            tmp.write_text(json.dumps({"tracking_uri": uri, "run_id": tracker.run_id}) + "\n")
    return tracker


# Where a training run's directory records its MLflow run (``build_tracker``).
RUN_RECORD = "mlflow_run.json"


def _recorded_run(record: Path, uri: str) -> str | None:
    """The run id ``record`` holds for the store ``uri``; None where there is none."""
    try:
        recorded = json.loads(record.read_text())
    except (OSError, ValueError):
        return None
    return recorded.get("run_id") if recorded.get("tracking_uri") == uri else None


def _config_text(cfg: DictConfig, key: str, default: str) -> str:
    """``cfg``'s value at a dotted ``key``, or ``default`` where a section on the way is
    missing (a job started without +model) or cannot be resolved outside its Hydra job."""
    node: Any = cfg
    for part in key.split("."):
        try:
            if not isinstance(node, DictConfig) or OmegaConf.is_missing(node, part):
                return default
            node = node[part]
        except (OmegaConfBaseException, KeyError):
            return default
    return default if node is None else param_text(node)


def record_failure(error: BaseException, cfg: DictConfig, *, is_main: bool = True) -> None:
    """After ``error`` stopped a run: end the MLflow run it left open as ``end_status`` says
    (FAILED with the error as the ``error`` tag; KILLED for Ctrl-C). A job that failed before
    it had a run (a bad config value, an unreadable data file, no +model) gets a FAILED run of
    its own, so that every job of a sweep shows in MLflow. ``cfg`` is the run's composed root
    config; never raises."""
    if not is_main or _config_text(cfg, "tracker.kind", "") != TrackerKind.mlflow.value:
        return
    status, tags = end_status(error)
    try:
        tracker = MLflowTracker.last
        # a run whose end a signal interrupted is marked already: no run of its own for the job
        if tracker is None or (tracker.closed and tracker.stopped_by is None):
            tracker_cfg = OmegaConf.to_object(cfg.tracker)
            assert isinstance(tracker_cfg, TrackerConfig)
            server = tracker_cfg.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or ""
            if server_down(server, timeout_s=2.0):  # MLflow's retries would only add warnings
                log.debug("failure not recorded: no MLflow server answers at %s", server)
                return
            output_dir = Path(_config_text(cfg, "output_dir", "run"))
            root = _config_text(cfg, "output_root", "outputs")
            places = [Path(root), *store_paths(resolve_tracking_uri(tracker_cfg, root))]
            if any(unwritable_reason(place) for place in places):
                return  # nowhere to record it; the error names the setting to change
            model, data = (_config_text(cfg, f"{key}.name", "unknown") for key in ("model", "data"))
            # a run directory that records its MLflow run keeps it: the failed job gets a run
            # of its own, and a later resume goes on in the run its checkpoints belong to
            recorded = (output_dir / RUN_RECORD).exists()
            built = build_tracker(
                tracker_cfg,
                root,
                default_run_name(model, data, output_dir),
                output_dir=None if recorded else output_dir,
            )
            assert isinstance(built, MLflowTracker)
            tracker = built
        tracker.close(status, tags=tags)
    except Exception as e:  # the failure being reported matters more than this record of it
        log.warning("could not record the failure in MLflow (%s: %s)", type(e).__name__, e)


def end_status(error: BaseException) -> tuple[str, dict[str, str]]:
    """The MLflow status and tags of a run that ``error`` ended: KILLED for Ctrl-C and a stop
    signal (the ``stopped_by`` tag names it), else FAILED with the error as the ``error``
    tag."""
    if isinstance(error, Stopped):
        return "KILLED", {"stopped_by": error.signal_name}
    if isinstance(error, KeyboardInterrupt):
        return "KILLED", {"stopped_by": signal.SIGINT.name}
    return "FAILED", {"error": f"{type(error).__name__}: {error}"[:MAX_TAG_CHARS]}


@contextmanager
def ended_on_error(tracker: Tracker) -> Iterator[None]:
    """When the block raises -- Ctrl-C and stop signals (``Stopped``) included -- the tracker's
    run is ended as ``end_run`` says, and the error goes on."""
    try:
        yield
    except BaseException as e:
        end_run(tracker, e)
        raise


def end_run(tracker: Tracker, error: BaseException) -> None:
    """Close ``tracker`` after ``error`` stopped the command before its end: an MLflow run is
    ended as ``end_status`` says rather than left RUNNING. Never raises."""
    try:
        if isinstance(tracker, MLflowTracker):
            tracker.close(*end_status(error))
        else:
            tracker.close()
    except Exception as e:  # the error being reported matters more than this record of it
        log.warning("could not end the MLflow run (%s: %s)", type(e).__name__, e)


def record_stop(signum: int, cfg: DictConfig, *, is_main: bool = True) -> None:
    """After a signal stopped a run that then saved and closed its MLflow run: mark that run
    KILLED with the signal as the ``stopped_by`` tag. A requeued job continues that run
    (``build_tracker``'s ``resume``), which is RUNNING again until it ends. ``cfg`` is the
    run's composed root config; never raises."""
    tracker = MLflowTracker.last  # the run this job's tracker started and closed
    if not is_main or tracker is None:
        return
    if _config_text(cfg, "tracker.kind", "") != TrackerKind.mlflow.value:
        return
    try:
        tracker.amend({"stopped_by": signal.Signals(signum).name}, "KILLED")
    except Exception as e:  # the checkpoint is saved; the MLflow status is a courtesy
        log.warning("could not mark the MLflow run stopped (%s: %s)", type(e).__name__, e)


def find_spools(path: Path) -> list[Path]:
    """The spools at or under ``path``: a spool itself, a run directory's ``mlflow_spool``,
    or any directory above them (an output root)."""
    if (path / "run.json").is_file() and path.parent.name == "mlflow_spool":
        return [path]
    if not path.is_dir():
        return []
    found = (run.parent for run in path.rglob("run.json"))
    return sorted(spool for spool in found if spool.parent.name == "mlflow_spool")


def sync(path: str | Path, tracking_uri: str | None = None) -> int:
    """Sends every spool at or under ``path`` to its run (on ``tracking_uri``, null = the
    server it was logged to), the run's end status last. Returns the number of spools left
    (0 = all sent); prints one line per spool."""
    spools = find_spools(Path(path))
    if not spools:
        print(f"nothing to sync: no mlflow_spool under {path}", flush=True)
    left = 0
    for directory in spools:
        spool = Spool.open(directory)
        uri = tracking_uri or spool.run["tracking_uri"]
        what = spool.describe()
        try:
            sent = spool.replay(_client(uri))
        except Exception as e:
            left += 1
            print(
                f"MLflow at {uri} is still unreachable ({_why(e)}); "
                f"what is left stays in {directory}: run this again when it is back.",
                flush=True,
            )
            continue
        if sent < 0:
            left += 1
            print(
                f"{directory} is being sent by another process (a live run); skipped.", flush=True
            )
            continue
        print(f"sent {what} to run {spool.run['run_id']} at {uri}.", flush=True)
    return left


def main(argv: list[str] | None = None) -> int:
    """``python -m eagleforge.tracking sync PATH``: send what runs spooled while MLflow was
    unreachable."""
    parser = argparse.ArgumentParser(
        prog="python -m eagleforge.tracking",
        description="Send to MLflow what runs spooled while the server was unreachable.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    sync_parser = commands.add_parser(
        "sync", help="send the spools at or under PATH (a run dir, an output root, a spool)"
    )
    sync_parser.add_argument("path", type=Path)
    sync_parser.add_argument(
        "--tracking-uri", default=None, help="send there (default: the server each run used)"
    )
    args = parser.parse_args(argv)
    if not args.path.exists():
        print(f"error: {args.path} does not exist; give a run directory.", flush=True)
        return 2
    return 1 if sync(args.path, args.tracking_uri) else 0


if __name__ == "__main__":
    raise SystemExit(main())
