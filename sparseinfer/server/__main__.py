"""`python -m sparseinfer.server ...`: the same as `sparseinfer serve ...`."""
import sys

from .cli import main

sys.exit(main())
