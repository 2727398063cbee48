"""Command line: a thin dispatcher. `sparseinfer run|chat|inspect|pull|bench|ppl|...`"""
from __future__ import annotations

import argparse
import sys
import time

from .errors import SparseInferError


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--model", default=None,
                   help="a .gguf file, a Hugging Face folder or a catalog name (default: smollm2)")
    p.add_argument("-t", "--threads", type=int, default=None, help="CPU threads (default: all cores)")
    p.add_argument("-c", "--ctx-size", type=int, default=None, help="context size in tokens (default: min(model, 4096))")
    p.add_argument("--verbose", action="store_true", help="show tracebacks and load details")
    p.add_argument("--device", default="auto", help="auto (CUDA when torch sees a GPU), cpu or cuda[:N]")
    p.add_argument("--vram-budget", default=None, metavar="SIZE",
                   help="GPU memory to use: 4GiB, 512MiB, or a number of GiB (default: free memory minus 1 GiB)")
    p.add_argument("--act-mode", default="auto", choices=("auto", "int8", "precise"),
                   help="activation rounding for 4/8-bit weights: int8 (llama.cpp's), precise (two int8 terms, "
                        "~f32; 10-25%% slower decode), auto (precise for models under 256 MiB; default)")


def _sparse_args(p: argparse.ArgumentParser) -> None:
    g = p.add_mutually_exclusive_group()
    g.add_argument("--dense", action="store_true", help="ignore the sparsity pack next to the model")
    g.add_argument("--sparse", default=None, metavar="PACK", help="use this sparsity pack (default: MODEL.sparse if present)")
    p.add_argument("--density", type=float, default=None, metavar="D",
                   help="force the FFN active fraction to D (speed measurement; top-D predicted neurons with a pack)")


def _sampling_args(p: argparse.ArgumentParser, temp: float) -> None:
    p.add_argument("-n", "--max-tokens", "--n-predict", dest="max_tokens", type=int, default=256)
    p.add_argument("--temp", type=float, default=temp, help=f"temperature; 0 = greedy (default {temp:g})")
    p.add_argument("--top-k", type=int, default=40)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--min-p", type=float, default=0.05)
    p.add_argument("--repeat-penalty", type=float, default=1.0)
    p.add_argument("--repeat-last-n", type=int, default=64)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def _sampling_kw(a) -> dict:
    return dict(max_tokens=a.max_tokens, temp=a.temp, top_k=a.top_k, top_p=a.top_p, min_p=a.min_p,
                repeat_penalty=a.repeat_penalty, repeat_last_n=a.repeat_last_n, seed=a.seed, stop=a.stop)


def _load(a):
    from . import load

    t0 = time.perf_counter()
    llm = load(a.model, ctx_size=a.ctx_size, threads=a.threads, sparse=getattr(a, "sparse", None) or "auto",
               dense=getattr(a, "dense", False), density=getattr(a, "density", None),
               device=getattr(a, "device", "cpu"), vram_budget=getattr(a, "vram_budget", None),
               act_mode=getattr(a, "act_mode", "auto"))
    if a.verbose:
        print(f"loaded {llm.info.path} in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
        if getattr(llm, "sparsity", None) is not None:
            print(f"sparsity pack: {llm.sparsity.path}", file=sys.stderr)
        if getattr(llm, "placement", None) is not None:
            print(llm.placement.describe(), file=sys.stderr)
    return llm


def cmd_run(a) -> int:
    llm = _load(a)
    prompt = a.prompt
    if a.file:
        prompt = open(a.file, encoding="utf-8").read()
    if prompt is None:
        raise SparseInferError("no prompt: pass -p TEXT or -f FILE (or use `sparseinfer chat`)")
    last = None
    for r in llm.stream_generate(prompt, chat=not a.raw, **_sampling_kw(a)):
        sys.stdout.write(r.text)
        sys.stdout.flush()
        last = r
    print()
    if last is not None and not a.quiet:
        print(f"\nprompt: {last.prompt_tokens} tokens, {last.prompt_tps:.1f} tok/s | "
              f"decode: {last.generation_tokens} tokens, {last.generation_tps:.1f} tok/s", file=sys.stderr)
    return 0


def cmd_chat(a) -> int:
    llm = _load(a)
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
        for r in llm.chat(messages, **_sampling_kw(a)):
            sys.stdout.write(r.text)
            sys.stdout.flush()
            reply.append(r.text)
        print()
        messages.append({"role": "assistant", "content": "".join(reply)})


def cmd_inspect(a) -> int:
    from .inspect import describe

    print(describe(a.model_path))
    return 0


def cmd_pull(a) -> int:
    from .catalog import CATALOG, pull

    if a.name == "list":
        for e in CATALOG.values():
            print(f"{e.name:22s} {e.description}")
        return 0
    print(pull(a.name))
    return 0


def cmd_bench(a) -> int:
    from .bench import run_bench

    return run_bench(a)


def cmd_ppl(a) -> int:
    import json

    from .perplexity import DEFAULT_TEXT, perplexity

    path = a.file or DEFAULT_TEXT
    try:
        text = open(path, encoding="utf-8").read()
    except OSError as e:
        raise SparseInferError(f"cannot read {path}: {e.strerror}; pass -f FILE") from None
    llm = _load(a)
    from .sparse.apply import perplexity_mode

    mode = perplexity_mode(llm)
    r = perplexity(llm, text, ctx=a.ctx_size or 512, n_chunks=a.chunks)
    print(f"perplexity ({mode}): {r['ppl']:.4f} over {r['tokens_scored']} tokens ({r['chunks']} chunks of {r['ctx']}) "
          f"in {r['seconds']:.1f}s")
    if a.json:
        rec = {k: v for k, v in r.items() if k != "per_chunk"} | {"model": str(llm.info.path), "file": str(path),
                                                                   "mode": mode}
        with open(a.json, "a") as f:
            f.write(json.dumps(rec) + "\n")
    return 0


def cmd_prepare(a) -> int:
    from .sparse.prepare import run_prepare

    return run_prepare(a)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="sparseinfer", description="Fast local LLM inference with activation sparsity")
    sub = ap.add_subparsers(dest="command", required=True)
    from .hybrid.plan import add_plan_parser

    add_plan_parser(sub)
    from .server.cli import add_serve_parser

    add_serve_parser(sub)

    p = sub.add_parser("run", help="generate from a prompt (streams)")
    _model_args(p)
    # one-shot answers are greedy by default, as in the Python API: small models sample a wrong
    # first token often enough at 0.8 (SmolLM2 answers the README's question right 2 times in 6)
    _sampling_args(p, temp=0.0)
    p.add_argument("-p", "--prompt", default=None)
    p.add_argument("-f", "--file", default=None, help="read the prompt from a file")
    p.add_argument("--raw", action="store_true", help="do not apply the chat template")
    p.add_argument("-q", "--quiet", action="store_true", help="no timing line")
    _sparse_args(p)
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("chat", help="interactive multi-turn chat")
    _model_args(p)
    _sampling_args(p, temp=0.8)  # llama.cpp's default: conversations loop less when sampled
    p.add_argument("--system", default=None, help="system prompt")
    _sparse_args(p)
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("inspect", help="describe a model file: architecture, sizes, tensor types")
    p.add_argument("model_path", nargs="?", default=None)
    p.add_argument("--verbose", action="store_true")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("pull", help="fetch a catalog model into the cache (`pull list` lists them)")
    p.add_argument("name", nargs="?", default="smollm2")
    p.add_argument("--verbose", action="store_true")
    p.set_defaults(func=cmd_pull)

    p = sub.add_parser("bench", help="prompt and decode throughput")
    _model_args(p)
    p.add_argument("--n-prompt", type=int, default=512)
    p.add_argument("--n-gen", type=int, default=128)
    p.add_argument("--repetitions", type=int, default=1)
    p.add_argument("--json", default=None, help="append results as JSON records to this file")
    _sparse_args(p)
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("ppl", help="perplexity on a text file (default: WikiText-2 test), llama.cpp's method")
    _model_args(p)
    p.add_argument("-f", "--file", default=None, help="text file (default: ../shared/data/wikitext-2-raw/wiki.test.raw)")
    p.add_argument("--chunks", type=int, default=None, help="score only the first N chunks")
    p.add_argument("--json", default=None, help="append the result as a JSON record to this file")
    _sparse_args(p)
    p.set_defaults(func=cmd_ppl)

    p = sub.add_parser("prepare", help="make the sparsity pack of a model (thresholds, profile, predictors)")
    p.add_argument("model", help="a .gguf file, a Hugging Face folder or a catalog name")
    p.add_argument("-t", "--threads", type=int, default=None)
    p.add_argument("--data", default=None, help="calibration text: a file or folder (default: a mix of ../shared/data)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--target-sparsity", type=float, default=None, metavar="S", help="gated FFNs: zero this fraction of neurons")
    g.add_argument("--max-ppl-increase", type=float, default=None, metavar="P",
                   help="gated FFNs: largest sparsity within (1+P) x dense perplexity on a held-out slice (default 0.03)")
    p.add_argument("--allocation", choices=("uniform", "error"), default="uniform",
                   help="per-layer sparsity: the same fraction everywhere (default) or an equal output-error share")
    p.add_argument("--tokens", type=int, default=8192, help="calibration tokens (default 8192)")
    p.add_argument("--recall", type=float, default=0.99, help="predictor recall target (default 0.99)")
    p.add_argument("--steps", type=int, default=400, help="training steps per predictor size")
    p.add_argument("--sizes", default=None, help="predictor hidden-size ladder, e.g. 64,128,256")
    p.add_argument("-o", "--output", default=None, help="pack path (default: MODEL.sparse / FOLDER/sparsity.sparse)")
    p.add_argument("--no-plot", action="store_true", help="skip the activation-frequency PNG")
    p.add_argument("--no-eval", action="store_true", help="skip the held-out perplexity check")
    p.add_argument("--verbose", action="store_true")
    p.set_defaults(func=cmd_prepare)
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    a = ap.parse_args(argv)
    try:
        return a.func(a) or 0
    except SparseInferError as e:
        if getattr(a, "verbose", False):
            raise
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
