"""DORA's policy as plain Python, free of JAX: the scheduler (version window, dispatch, slot shares, batches)
and the ledger of every sample's state."""
