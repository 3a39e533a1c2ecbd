"""Where memory goes: saved-tensor accounting (saved_tensors), and, to come, checkpointing
policies and the analytic memory model."""
