"""The low layer of parallelism that the model code uses: which rank does what (``layout``,
``partition``) and the tensor-parallel collectives (``tp_collectives``). Nothing here starts a
process; the orchestration of ranks (spawning, driving, other nodes) is ``moeserve.executor``."""
