"""Measurement logic of the ``calconsole bench ...`` commands that is more than a CLI wrapper.

``serve_load``: the HTTP load generator of ``calconsole bench serve`` (closed-loop streaming
clients over httpx, client-side TTFT / TPOT / ITL / E2E with vLLM's definitions, the server's
final-chunk timings and ``/metrics`` deltas beside them). Like the rest of ``calconsole`` it
imports only ``sim_backend.planes`` from the simulator.
"""
