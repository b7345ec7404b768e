"""sim_backend.device."""
