"""A loaded model is held once: the weights in our formats, not also the file's pages."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest



PROBE = r"""
import json, os, sys
import torch, sparseinfer
from sparseinfer.quant import qweight_nbytes

def rss():
    return int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0]) * 1024

def file_rss(path):
    # resident bytes of this process's mappings of `path` (/proc/self/smaps)
    total, inside = 0, False
    real = os.path.realpath(path)
    for line in open("/proc/self/smaps"):
        head = line.split()
        if head and "-" in head[0] and len(head) >= 5:  # a mapping's first line
            inside = len(head) >= 6 and os.path.realpath(head[-1]) == real if head[-1].startswith("/") else False
        elif inside and line.startswith("Rss:"):
            total += int(head[1]) * 1024
    return total

path = sys.argv[1]
r0 = rss()
llm = sparseinfer.load(path, ctx_size=256, threads=2)
after_load = rss() - r0
list(llm.stream_generate("Hello", max_tokens=4, temp=0))
print(json.dumps(dict(growth=after_load, weights=qweight_nbytes(llm.model), file=os.path.getsize(path),
                      file_rss=file_rss(path))))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.slow
def test_model_is_resident_once(smollm2_path):
    out = subprocess.run([sys.executable, "-c", PROBE, str(smollm2_path)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    m = json.loads(out.stdout.strip().splitlines()[-1])
    # the file's pages left the process after conversion (decoding reads only our copies)
    assert m["file_rss"] < 0.05 * m["file"], m
    # load grew the process by the weights plus buffers, not by the weights plus the file
    assert m["growth"] < m["weights"] + 0.9 * m["file"], m


PEAK_PROBE = r"""
import json, sys
import torch, sparseinfer
from sparseinfer.quant import qweight_nbytes

def status(key):
    return int(open("/proc/self/status").read().split(key + ":")[1].split()[0]) * 1024

r0 = status("VmRSS")
torch.empty(0)
llm = sparseinfer.load(sys.argv[1], ctx_size=64, threads=2)
peak = status("VmHWM") - r0  # VmHWM: the most this process has held, the load's transients included
print(json.dumps(dict(peak_growth=peak, weights=qweight_nbytes(llm.model))))
"""


def write_random_llama(path, layers: int, hidden: int, ffn: int, vocab: int = 256):
    """A Llama GGUF whose matrices are random Q8_0 blocks (small finite scales): a model of a
    few hundred MB written in a second, with no reference weights needed."""
    import gguf
    import numpy as np

    from sparseinfer.io.tokenizer import bytes_to_unicode

    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(layers)
    w.add_embedding_length(hidden)
    w.add_context_length(256)
    w.add_head_count(hidden // 64)
    w.add_head_count_kv(hidden // 64)
    w.add_vocab_size(vocab)
    w.add_feed_forward_length(ffn)
    w.add_layer_norm_rms_eps(1e-5)
    b2u = bytes_to_unicode()
    w.add_tokenizer_model("gpt2")
    tokens = [b2u[b] for b in range(256)] + [f"<t{i}>" for i in range(vocab - 256)]
    tokens[0], tokens[1] = b2u[ord(" ")] + "t", "he"
    w.add_token_list(tokens)
    w.add_token_types([1] * vocab)
    w.add_token_merges([f"{b2u[ord(' ')]} t", "h e"])
    w.add_bos_token_id(2)
    w.add_eos_token_id(3)
    scale = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)

    def q8(rows, cols):
        blocks = rng.integers(-64, 64, (rows, cols // 32, 34), dtype=np.int8).view(np.uint8)
        blocks[..., :2] = scale
        return blocks.reshape(rows, cols // 32 * 34)

    def mat(name, rows, cols):
        w.add_tensor(name, q8(rows, cols), raw_dtype=gguf.GGMLQuantizationType.Q8_0)

    mat("token_embd.weight", vocab, hidden)
    w.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    for i in range(layers):
        for n, r, c in (("attn_q", hidden, hidden), ("attn_k", hidden, hidden), ("attn_v", hidden, hidden),
                        ("attn_output", hidden, hidden), ("ffn_gate", ffn, hidden), ("ffn_up", ffn, hidden),
                        ("ffn_down", hidden, ffn)):
            mat(f"blk.{i}.{n}.weight", r, c)
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_load_peak_holds_no_second_copy(tmp_path):
    """Loading a model of a few hundred MB never holds two copies of it: the file's pages of a
    tensor leave as it is converted, and repacking's temporaries are returned as they go, so
    the peak stays within the weights plus a fraction of them (two copies would be twice)."""
    path = write_random_llama(tmp_path / "big.gguf", layers=10, hidden=1024, ffn=4096)
    out = subprocess.run([sys.executable, "-c", PEAK_PROBE, str(path)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    m = json.loads(out.stdout.strip().splitlines()[-1])
    assert m["weights"] > 150 * 2**20, m
    assert m["peak_growth"] < 1.3 * m["weights"] + 16 * 2**20, m
