"""Where memory goes: saved-tensor accounting (saved_tensors), bytes a forward leaves alive
(live_bytes), and activation-checkpointing policies applied from outside (checkpointing).
The analytic memory model and the `cs336-bench memory` suite are still to come."""
