"""``loss.kernel=triton``'s two kernels, run by Triton's interpreter on CPU tensors, equal the
torch chunked path (the reference, tests/unit/test_losses.py) in loss, α, argmax and
gradients, for every kind they compute (``helpers/fused_loss_check.py``, in a process of its
own); ``loss.kernel`` resolves and refuses as documented. (bf16 on CUDA:
tests/gpu/test_fused_loss_cuda.py.)"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from eagleforge.draft.loss import TRITON_KINDS, LossConfig, LossKernel, LossKind
from eagleforge.errors import ConfigError

pytestmark = pytest.mark.unit

# make test installs triton where its wheels exist (the dev extra): there it must run
TRITON_WHEELS = sys.platform == "linux" and platform.machine() == "x86_64"
TESTS = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def interpreted() -> dict[str, str]:
    """Every case of ``helpers/fused_loss_check.py``: "ok" or what differed."""
    if not TRITON_WHEELS and importlib.util.find_spec("triton") is None:
        pytest.skip("triton has no wheel for this platform")
    env = dict(
        os.environ,
        TRITON_INTERPRET="1",
        PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
    )
    done = subprocess.run(
        [sys.executable, "-m", "helpers.fused_loss_check"],
        env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("kind", sorted(k.value for k in TRITON_KINDS))
def test_triton_kernels_equal_the_torch_path(
    interpreted: dict[str, str], kind: str, dtype: str
) -> None:
    assert interpreted[f"{kind}-{dtype}"] == "ok"


def test_argmax_keeps_the_first_of_equal_logits(interpreted: dict[str, str]) -> None:
    assert interpreted["first_of_equal_maxima"] == "ok"


def test_without_scale_no_gradient_and_an_empty_call(interpreted: dict[str, str]) -> None:
    assert interpreted["without_scale_and_empty"] == "ok"


def test_the_kernel_resolves_by_device_kind_and_package(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert LossConfig().kernel_for(cpu) == LossKernel.torch
    assert LossConfig(kernel=LossKernel.torch).kernel_for(cuda) == LossKernel.torch
    with pytest.raises(
        ConfigError, match=r"loss.kernel=triton: it runs on CUDA.*loss.kernel=torch"
    ):
        LossConfig(kernel=LossKernel.triton).kernel_for(cpu)
    reverse = LossConfig(kind=LossKind.reverse_kl)
    assert reverse.kernel_for(cuda) == LossKernel.torch  # auto: the torch path for that kind
    with pytest.raises(ConfigError, match="loss.kind=reverse_kl has no Triton kernel"):
        LossConfig(kind=LossKind.reverse_kl, kernel=LossKernel.triton).kernel_for(cuda)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert LossConfig().kernel_for(cuda) == LossKernel.torch
    with pytest.raises(ConfigError, match="the triton package is not installed"):
        LossConfig(kernel=LossKernel.triton).kernel_for(cuda)
    monkeypatch.undo()
    if importlib.util.find_spec("triton") is not None:
        assert LossConfig().kernel_for(cuda) == LossKernel.triton
    # the interpreter runs on CPU when asked for by name, never for auto
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert LossConfig().kernel_for(cpu) == LossKernel.torch
    assert LossConfig(kernel=LossKernel.triton).kernel_for(cpu) == LossKernel.triton
