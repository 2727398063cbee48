"""`sparseinfer run`: generate from a prompt, streaming, with a timing line."""
from __future__ import annotations

import sys

from ..errors import SparseInferError
from .args import load_from_args, model_args, sampling_args, sampling_kw, sparse_args


def add_parser(subparsers):
    p = subparsers.add_parser("run", help="generate from a prompt (streams)")
    model_args(p)
    # one-shot answers are greedy by default, as in the Python API: small models sample a wrong
    # first token often enough at 0.8 (SmolLM2 answers the README's question right 2 times in 6)
    sampling_args(p, temp=0.0)
    p.add_argument("-p", "--prompt", default=None)
    p.add_argument("-f", "--file", default=None, help="read the prompt from a file")
    p.add_argument("--raw", action="store_true", help="do not apply the chat template")
    p.add_argument("-q", "--quiet", action="store_true", help="no timing line")
    sparse_args(p)
    return p


def run(a) -> int:
    llm = load_from_args(a)
    prompt = a.prompt
    if a.file:
        prompt = open(a.file, encoding="utf-8").read()
    if prompt is None:
        raise SparseInferError("no prompt: pass -p TEXT or -f FILE (or use `sparseinfer chat`)")
    last = None
    for r in llm.stream_generate(prompt, chat=not a.raw, **sampling_kw(a)):
        sys.stdout.write(r.text)
        sys.stdout.flush()
        last = r
    print()
    if last is not None and not a.quiet:
        print(f"\nprompt: {last.prompt_tokens} tokens, {last.prompt_tps:.1f} tok/s | "
              f"decode: {last.generation_tokens} tokens, {last.generation_tps:.1f} tok/s", file=sys.stderr)
    return 0
