"""Run a capture server: the target in vLLM, producing its hidden states for training runs
elsewhere that name it in ``target.producers.urls`` (docs/streaming.md).

    python -m eagleforge.serve_target +model=llama3 model.path=/models/Llama-3.1-8B-Instruct \\
        serve_target.host=0.0.0.0 serve_target.port=8000 serve_target.files_dir=/shared/hs

The server captures the layers the run's model settings name (``model.aux_layer_ids``, in
vLLM's numbering, and the last layer), with eagleforge's connector writing each prompt's
states into ``files_dir``, which the trainers read and delete: a directory both machines mount
at the same path. It runs until stopped (Ctrl-C, SIGTERM), and prints the URL to give.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import hydra
from omegaconf import DictConfig

from eagleforge.config import (
    EagleForgeConfig,
    check_cli_overrides,
    conf_dir,
    register_configs,
    to_typed,
)
from eagleforge.engine.server import EngineError, VLLMServer
from eagleforge.errors import ConfigError, exit_on_user_error, stop_on_signals
from eagleforge.parallel import resolve_device
from eagleforge.preflight import check_inputs
from eagleforge.targets.custom import local_model_dir
from eagleforge.targets.source import checked_aux_layer_ids, resolve_model_dir
from eagleforge.targets.vllm import capture_config, capture_layer_ids


def serve(config: EagleForgeConfig) -> None:
    cfg = config.serve_target
    if not cfg.files_dir:
        raise ConfigError(
            "serve_target.files_dir is required: the directory the server writes the states "
            "into, on a filesystem the trainers mount at the same path."
        )
    check_inputs(config, data=False)
    files = writable_directory(Path(cfg.files_dir).resolve(), "serve_target.files_dir")
    refuse_taken_port(cfg.host, cfg.port)
    model_dir = local_model_dir(
        resolve_model_dir(config.model, config.resolved_cache_dir()), config.model.revision
    )
    from transformers import AutoConfig

    text = AutoConfig.from_pretrained(model_dir).get_text_config()
    aux = checked_aux_layer_ids(config.model.aux_layer_ids, text.num_hidden_layers)
    settings = capture_config(capture_layer_ids(aux, text.num_hidden_layers), str(files))
    dtype = config.model.dtype.torch_dtype(resolve_device(config.parallel))
    server = VLLMServer(
        config.vllm, model_dir, files / f"server-{cfg.port}.log", str(dtype).removeprefix("torch."),
        settings["speculative"], settings["kv_transfer"], name="vLLM (capture server)",
        host=cfg.host, port=cfg.port,
    )  # fmt: skip
    where = socket.getfqdn() if cfg.host in ("0.0.0.0", "::") else cfg.host
    with stop_on_signals(), server:
        print(
            f"capture server of {config.model.name} ({model_dir}) ready: train with target=vllm "
            f"'target.producers.urls=[http://{where}:{cfg.port}]' (its log: {server.log_path}; "
            "Ctrl-C stops it)",
            flush=True,
        )
        while server.alive():
            time.sleep(2.0)
        raise EngineError(f"the capture server stopped; its log: {server.log_path}")


def writable_directory(path: Path, setting: str) -> Path:
    """``path``, made if missing and written once (a file made and removed), or one line
    naming ``setting``: a file there, a read-only or special filesystem, no space left."""
    probe = path / f".eagleforge-write-{os.getpid()}"
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"0")
        probe.unlink()
    except OSError as e:
        raise ConfigError(
            f"{setting}={path}: the server cannot write there ({e.strerror or e}); give a "
            "directory it can write, on a filesystem the trainers mount at the same path."
        ) from e
    return path


def refuse_taken_port(host: str, port: int) -> None:
    """One line where something already listens on ``host:port`` (a capture server started
    before: its health check would pass for this one)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server's own
        try:
            probe.bind((host, port))
        except OSError as e:
            raise ConfigError(
                f"serve_target.port={port}: {host}:{port} is taken ({e.strerror or e}), by a "
                "capture server started before or another program; give another port, or stop "
                "what listens there."
            ) from e


@hydra.main(version_base="1.3", config_path=str(conf_dir()), config_name="no_run_dir")
@exit_on_user_error
def _hydra_main(cfg: DictConfig) -> None:
    serve(to_typed(cfg))


def main() -> None:
    register_configs()
    check_cli_overrides()
    _hydra_main()


if __name__ == "__main__":
    main()
