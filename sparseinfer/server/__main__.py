"""`python -m sparseinfer.server ...`: the same as `sparseinfer serve ...`."""
import sys

from sparseinfer.commands.serve import main

sys.exit(main())
