"""The command line as a user meets it: clear one-line errors, non-zero exit, no traceback."""
from __future__ import annotations

import subprocess
import sys

import pytest

from tiny import export_gguf, hf_model


def run_cli(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "sparseinfer.commands", *args], capture_output=True, text=True, timeout=timeout)


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


def test_help_lists_every_command():
    r = run_cli("--help")
    assert r.returncode == 0, r.stderr
    for cmd in ("run", "chat", "inspect", "pull", "bench", "ppl", "prepare", "plan", "serve"):
        assert cmd in r.stdout
    r = subprocess.run([sys.executable, "-m", "sparseinfer.server", "--help"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "--parallel" in r.stdout


def test_option_errors_come_before_the_load(tmp_path):
    """Bad options are one line and exit 1 without loading anything (the model does not exist)."""
    r = run_cli("ppl", "-m", str(tmp_path / "none.gguf"), "-f", str(tmp_path / "missing.txt"))
    assert r.returncode == 1 and "cannot read" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = run_cli("prepare", str(tmp_path / "none.gguf"), "--target-sparsity", "1.5")
    assert r.returncode == 1 and "--target-sparsity must be in [0, 1)" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    for flag, value, says in (("--steps", "0", "--steps must be at least 1"), ("--recall", "1.5", "--recall must be in")):
        r = run_cli("prepare", str(tmp_path / "none.gguf"), flag, value)
        assert r.returncode == 1 and says in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_load_from_args_passes_the_options(monkeypatch):
    """The one CLI-options -> `load` mapping: each command's options, the rest `load`'s defaults."""
    import argparse

    from sparseinfer import engine
    from sparseinfer.commands import args, build_parser

    seen, llm = {}, argparse.Namespace(notes=[])
    monkeypatch.setattr(engine, "load", lambda path, **kw: seen.update(path=path, **kw) or llm)
    a = build_parser().parse_args(["run", "-m", "x.gguf", "-t", "3", "-c", "64", "--density", "0.25",
                                   "--act-mode", "int8", "-p", "hi"])
    assert args.load_from_args(a) is llm
    assert seen == dict(path="x.gguf", ctx_size=64, threads=3, sparse="auto", dense=False, density=0.25,
                        device="auto", vram_budget=None, act_mode="int8", check_tensors=False, cache_type="f16",
                        progress=True)
    seen.clear()
    for cmd in (["run", "-p", "hi"], ["chat"], ["bench"], ["ppl"], ["serve"]):
        args.load_from_args(build_parser().parse_args([*cmd, "-m", "x.gguf", "--check-tensors", "--cache-type", "q8_0"]))
        assert seen["check_tensors"] is True and seen["cache_type"] == "q8_0", cmd
    seen.clear()
    args.load_from_args(argparse.Namespace(model=None, threads=None), dense=True)
    assert seen["device"] == "cpu" and seen["dense"] is True and seen["path"] is None


def test_default_data_outside_a_checkout(monkeypatch, tmp_path):
    """The CLI's default texts come from the checkout's shared/data; elsewhere it asks for the flag."""
    from sparseinfer.commands import args
    from sparseinfer.errors import SparseInferError

    monkeypatch.setattr(args, "__file__", str(tmp_path / "site-packages" / "sparseinfer" / "commands" / "args.py"))
    with pytest.raises(SparseInferError, match="pass -f FILE"):
        args.repo_data("wikitext-2-raw", "wiki.test.raw", flag="-f FILE")


@pytest.mark.parametrize("flag,value,says", [("--prefill-chunk", "0", "--prefill-chunk must be >= 1"),
                                             ("--cache-ram", "-1", "--cache-ram must be a number of MiB >= 0")])
def test_serve_batching_options_are_checked_before_the_load(tmp_path, flag, value, says):
    pytest.importorskip("uvicorn")
    r = run_cli("serve", "-m", str(tmp_path / "none.gguf"), flag, value)
    assert r.returncode == 1 and says in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = subprocess.run([sys.executable, "-m", "sparseinfer.server", "--help"], capture_output=True, text=True, timeout=300)
    assert flag in r.stdout
