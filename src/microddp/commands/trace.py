"""`microddp trace`: its arguments and what it runs live with the library (trace/steps.py), which
other code calls too; this file is its place in the command line, and --help shows the
library's docstring."""

from ..trace import steps as library

__doc__ = library.__doc__
EPILOG, add_arguments, run = library.EPILOG, library.add_arguments, library.run
