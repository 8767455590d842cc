"""`python -m microddp` is the `microddp` command."""

import sys

from .commands import main

sys.exit(main())
