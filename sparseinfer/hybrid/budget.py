"""Devices and VRAM budgets: `--device auto|cpu|cuda[:N]`, `--vram-budget 4GiB|512MiB|1.5`."""
from __future__ import annotations

import re

import torch

from ..errors import SparseInferError

GiB = 1 << 30
MiB = 1 << 20
DEFAULT_MARGIN = 1 * GiB  # left free for the CUDA context, other processes and fragmentation
_UNITS = {"": GiB, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": MiB, "mb": MiB, "mib": MiB,
          "g": GiB, "gb": GiB, "gib": GiB, "t": 1 << 40, "tb": 1 << 40, "tib": 1 << 40}
_BUDGET_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")


class BudgetError(SparseInferError, ValueError):
    """A VRAM budget string that cannot be read."""


def parse_vram_budget(text: str | int | float) -> int:
    """'4GiB' -> bytes. A bare number means GiB (as PowerInfer's --vram-budget); MB/GB are taken
    as MiB/GiB, the way GPU memory is usually quoted."""
    if isinstance(text, bool):
        raise BudgetError(f"invalid VRAM budget {text!r}")
    if isinstance(text, (int, float)):
        if text < 0:
            raise BudgetError(f"VRAM budget must be >= 0, got {text}")
        return int(text * GiB)
    m = _BUDGET_RE.match(str(text))
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise BudgetError(f"invalid VRAM budget {text!r}: write a size like 4GiB, 512MiB or 1.5 (GiB)")
    return int(float(m.group(1)) * _UNITS[unit])


def format_bytes(n: int) -> str:
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def resolve_device(device: str | torch.device | None = "auto") -> torch.device:
    """'auto' -> cuda when torch sees a GPU, else cpu; 'cuda' without a GPU is a clear error."""
    name = "auto" if device is None else str(device)
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise SparseInferError(f"unknown device {name!r}: use auto, cpu or cuda[:N]") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise SparseInferError(
                f"device {name!r} asked for, but torch sees no CUDA GPU (torch {torch.__version__}, "
                f"built with CUDA {torch.version.cuda}); install a CUDA build of torch or use --device cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise SparseInferError(f"device {name!r}: only {torch.cuda.device_count()} CUDA device(s) visible")
    elif dev.type != "cpu":
        raise SparseInferError(f"device {name!r} is not supported: use auto, cpu or cuda[:N]")
    return dev


def default_budget(device: torch.device, margin: int = DEFAULT_MARGIN) -> int:
    """Free memory on `device` minus a margin (0 for the CPU)."""
    if device.type != "cuda":
        return 0
    free, _total = torch.cuda.mem_get_info(device)
    return max(0, free - margin)


def budget_bytes(vram_budget: str | int | float | None, device: torch.device) -> int:
    """The budget in bytes: parsed, or the default for `device` when None."""
    if vram_budget is None:
        return default_budget(device)
    return parse_vram_budget(vram_budget)
