"""sim_backend.runtime."""
