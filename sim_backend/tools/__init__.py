"""sim_backend.tools."""
