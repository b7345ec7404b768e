"""sim_backend.model."""
