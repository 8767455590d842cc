"""Calls a lower layer makes into a higher one that it may not import: where they are kept.

`comms.init` starts the hang monitor and `comms.all_reduce` may take the shared-memory route;
both live above comms (monitor/, collectives/), so comms cannot import them
(tests/test_layout.py). The package (microddp/__init__.py) puts them here when it is
imported, which Python does before any of its sub-packages, and comms looks them up here
each time it needs them (`init`, `shutdown`, every all-reduce). So `import microddp.comms` or
`from microddp.comms import init` alone finds both in place, and `import microddp` puts them
in place without importing comms, and so without torch: `microddp --help` stays quick.

This module imports nothing: it sits below every layer that fills or reads it.
"""

from typing import Any

# A comms.world.Watcher: started by `init` when it forms a process group, stopped by
# `shutdown` before the group goes. None: no monitor.
watcher: Any = None

# A comms.route.Route: the path a group's all-reduce takes. None: every call goes to the
# group's backend.
route: Any = None
