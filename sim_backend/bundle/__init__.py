"""sim_backend.bundle."""
