"""`microddp run`: its arguments and what it runs live with the library (launch/run.py), which
other code calls too; this file is its place in the command line, and --help shows the
library's docstring."""

from ..launch import run as library

__doc__ = library.__doc__
EPILOG, add_arguments, run = library.EPILOG, library.add_arguments, library.run
