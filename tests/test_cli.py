"""The command line as a user meets it: clear one-line errors, non-zero exit, no traceback."""
from __future__ import annotations

import subprocess
import sys

import pytest

from tiny import export_gguf, hf_model


def run_cli(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "sparseinfer.cli", *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("content,needle", [(b"NOTGGUF" * 10, "not a GGUF file"), (b"GGUF\x03\x00\x00\x00", "truncated GGUF header")])
def test_bad_model_file(tmp_path, content, needle):
    p = tmp_path / "bad.gguf"
    p.write_bytes(content)
    r = run_cli("run", "-m", str(p), "-p", "hi")
    assert r.returncode != 0
    assert needle in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_missing_tokenizer(tmp_path):
    """A GGUF without tokenizer metadata cannot run a text prompt."""
    p = export_gguf(hf_model("llama"), tmp_path / "notok.gguf", "F32")
    r = run_cli("run", "-m", str(p), "-p", "hi")
    assert r.returncode != 0 and "tokenizer" in r.stderr.lower() and "Traceback" not in r.stderr


def test_verbose_shows_traceback(tmp_path):
    p = tmp_path / "bad.gguf"
    p.write_bytes(b"NOTGGUF" * 10)
    r = run_cli("run", "-m", str(p), "-p", "hi", "--verbose")
    assert r.returncode != 0 and "Traceback" in r.stderr


def test_context_overflow(smollm2_path):
    r = run_cli("run", "-m", str(smollm2_path), "-c", "32", "--raw", "-p", "word " * 100)
    assert r.returncode != 0 and "context" in r.stderr and "Traceback" not in r.stderr


def test_run_default_flags(smollm2_path):
    """`run` is greedy unless --temp is given (the README's first command must answer right)."""
    r = run_cli("run", "-m", str(smollm2_path), "-p", "What is the capital of France?", "-n", "16")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    assert "decode" in r.stderr and "tok/s" in r.stderr


def test_inspect(smollm2_path):
    r = run_cli("inspect", str(smollm2_path))
    assert r.returncode == 0, r.stderr
    assert "llama" in r.stdout and "Q4_1" in r.stdout and "chat template: yes" in r.stdout
