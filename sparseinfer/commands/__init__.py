"""The command line: `sparseinfer run|chat|inspect|pull|bench|ppl|prepare|plan|serve ...`.

One module per command, each with `add_parser(subparsers)` (its options) and `run(args) -> int`;
they parse options and load the model (`args.load_from_args`), then call library functions
that take plain arguments.  This dispatcher builds the argparse tree and turns a
`SparseInferError` into a one-line `error: ...` and exit status 1 (`--verbose`: the traceback).
"""
from __future__ import annotations

import argparse
import sys

from ..errors import SparseInferError
from . import bench, chat, inspect_cmd, plan, ppl, prepare, pull, run, serve

# in the order `sparseinfer --help` lists them
COMMANDS = (plan, serve, run, chat, inspect_cmd, pull, bench, ppl, prepare)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="sparseinfer", description="Fast local LLM inference with activation sparsity")
    sub = ap.add_subparsers(dest="command", required=True)
    for cmd in COMMANDS:
        cmd.add_parser(sub).set_defaults(run_command=cmd.run)
    return ap


def guarded(fn, a: argparse.Namespace) -> int:
    """`fn(a)`'s exit status; a `SparseInferError` is one line on stderr and status 1."""
    try:
        return fn(a) or 0
    except SparseInferError as e:
        if getattr(a, "verbose", False):
            raise
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    return guarded(a.run_command, a)
