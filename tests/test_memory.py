"""A loaded model is held once: the weights in our formats, not also the file's pages."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

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
def test_model_is_resident_once(smollm2_path):
    out = subprocess.run([sys.executable, "-c", PROBE, str(smollm2_path)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    m = json.loads(out.stdout.strip().splitlines()[-1])
    # the file's pages left the process after conversion (decoding reads only our copies)
    assert m["file_rss"] < 0.05 * m["file"], m
    # load grew the process by the weights plus buffers, not by the weights plus the file
    assert m["growth"] < m["weights"] + 0.9 * m["file"], m
