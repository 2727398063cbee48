"""The AArch64 kernel levels (`neon`, `neon_dotprod`), built with a cross compiler and run under
qemu-user against the scalar level (tests/c/run_arm_tests.sh, tests/c/arm_kernels.c): bit for
bit on the integer formats and every axpy, within the accuracy contract on float weights, on an
emulated CPU with and without the dotprod feature."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CC = os.environ.get("CC_AARCH64", "aarch64-linux-gnu-gcc")


@pytest.mark.skipif(not (shutil.which(CC) and shutil.which("qemu-aarch64")),
                    reason="needs gcc-aarch64-linux-gnu and qemu-user (apt-get install gcc-aarch64-linux-gnu qemu-user)")
def test_neon_levels_match_the_scalar_level_under_emulation():
    env = dict(os.environ, CC=CC)
    p = subprocess.run(["bash", os.path.join(ROOT, "tests", "c", "run_arm_tests.sh")], capture_output=True,
                       text=True, timeout=600, env=env)
    sys.stdout.write(p.stdout)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "2 NEON level(s) tested (neon_dotprod supported)" in p.stdout and ", 0 failures" in p.stdout
    assert "1 NEON level(s) tested (neon_dotprod not supported)" in p.stdout
