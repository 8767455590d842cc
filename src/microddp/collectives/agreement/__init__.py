"""The metadata check: before data moves, every rank of a call learns that the others passed
the same shape, dtype, op and root, so a mistake is the same clear MicroDDPError on every
rank instead of a hang, a wrong result, or gloo aborting on a message of the wrong size.

checks.py checks this rank's own arguments (each `try_*` returns its error so it can be
shared first); agree.py exchanges them: a butterfly of log2 p rounds, or where the group's
ranks share memory, numbers written and read there (shm/agreement.py). On 2 gloo ranks the
ring fuses the check with its first message: carried.py (the header sent beside the data, or
with the first chunk) where ranks do not share memory, early.py (checked in shared memory,
the first step sent before the check is read) where they do, on tags that fix a message's
size (transport/sized_tags.py) so nothing sent early can abort a rank whose call differs.
"""
