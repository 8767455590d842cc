"""`python -m microddp` is the `microddp` command."""

import sys

from .cli import main

sys.exit(main())
