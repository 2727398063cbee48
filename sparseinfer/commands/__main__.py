"""`python -m sparseinfer.commands ...`: the same as `sparseinfer ...`."""
import sys

from . import main

sys.exit(main())
