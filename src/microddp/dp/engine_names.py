"""The names of the data-parallel engines, the one list (`dp.wrap` builds each: engines.py).

Apart from the engines themselves, and free of torch, so that `microddp train --help` and
argument checks can show and check them without loading torch.
"""

ENGINES = ("naive", "hooks", "buckets", "overlap", "microddp", "torch")
