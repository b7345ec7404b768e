"""The serving face: the simulated device behind llama-server's and OpenAI's HTTP API.

``face``: the routes over the three planes (``ServingFace``, ``ServeConfig``, ``build_app``);
``wire``: request parsing and response shapes; ``keys``: API/admin keys; ``leases``: expiring
maintenance leases; ``maintenance_routes``: ``/maintenance/...``; ``run``: uvicorn in the
foreground or a thread (``ServerThread``).
"""
