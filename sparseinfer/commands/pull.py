"""`sparseinfer pull NAME`: fetch a catalog model into the cache; `pull list` lists them."""
from __future__ import annotations


def add_parser(subparsers):
    p = subparsers.add_parser("pull", help="fetch a catalog model into the cache (`pull list` lists them)")
    p.add_argument("name", nargs="?", default="smollm2")
    p.add_argument("--verbose", action="store_true")
    return p


def run(a) -> int:
    from ..catalog import CATALOG, pull

    if a.name == "list":
        for e in CATALOG.values():
            print(f"{e.name:22s} {e.description}")
        return 0
    print(pull(a.name))
    return 0
