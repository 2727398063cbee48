"""`sparseinfer inspect`: what a model file holds (see `sparseinfer.describe`)."""
from __future__ import annotations


def add_parser(subparsers):
    p = subparsers.add_parser("inspect", help="describe a model file: architecture, sizes, tensor types")
    p.add_argument("model_path", nargs="?", default=None)
    p.add_argument("--verbose", action="store_true")
    p.add_argument("--check-tensors", action="store_true",
                   help="also read every weight the model uses and check it for NaN and infinite values")
    return p


def run(a) -> int:
    from ..describe import describe

    print(describe(a.model_path, check_tensors=a.check_tensors))
    return 0
