"""sim_backend.planes."""
