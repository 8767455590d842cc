"""The bootstrap every layer stands on: joining the job and leaving it (world.py: `init`,
`shutdown`, the `World` record, and `distributed()`, the one answer to "is this a world of
one?"), how ranks meet (rendezvous.py), what a host is and which interface reaches
MASTER_ADDR (hosts.py), every rank reaching every other before the group forms
(preflight.py), SLURM without torchrun (slurm.py), leaving cleanly (teardown.py), and the
argument checks every operation shares (args.py).

Nothing here imports another microddp layer but errors: the typed operations users call
(`microddp.comms`) sit above the collectives and the hang monitor, and set them up on top of
the world this package forms (comms/session.py).
"""
