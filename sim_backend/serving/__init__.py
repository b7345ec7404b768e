"""sim_backend.serving."""
