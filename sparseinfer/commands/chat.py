"""`sparseinfer chat`: interactive multi-turn chat on the terminal."""
from __future__ import annotations

import sys

from ..errors import SparseInferError
from .args import load_from_args, model_args, sampling_args, sampling_kw, sparse_args


def add_parser(subparsers):
    p = subparsers.add_parser("chat", help="interactive multi-turn chat")
    model_args(p)
    sampling_args(p, temp=0.8)  # llama.cpp's default: conversations loop less when sampled
    p.add_argument("--system", default=None, help="system prompt")
    sparse_args(p)
    return p


def run(a) -> int:
    llm = load_from_args(a)
    if not llm.tokenizer.chat_template:
        raise SparseInferError("this model has no chat template; use `sparseinfer run --raw -p ...`")
    messages = [{"role": "system", "content": a.system}] if a.system else []
    print("chat with the model; empty line or Ctrl-D to quit, /reset to start over", file=sys.stderr)
    while True:
        try:
            user = input("> ")
        except (EOFError, KeyboardInterrupt):
            print()
            return 0
        if not user.strip():
            return 0
        if user.strip() == "/reset":
            messages = messages[:1] if a.system else []
            continue
        messages.append({"role": "user", "content": user})
        reply = []
        for r in llm.chat(messages, **sampling_kw(a)):
            sys.stdout.write(r.text)
            sys.stdout.flush()
            reply.append(r.text)
        print()
        messages.append({"role": "assistant", "content": "".join(reply)})
