"""The serving face: the simulated device behind llama-server's and OpenAI's HTTP API.

``face``: the routes over the three planes assembled into the app (``build_app``; ``ServingFace``
and ``ServeConfig`` re-exported); ``context``: the state the routes share (``ServingFace``, ``ServeConfig``);
``wire``: request parsing and response shapes; ``keys``: API/admin keys; ``leases``: expiring
maintenance leases; ``maintenance_routes``: ``/maintenance/...``; ``run``: uvicorn in the
foreground or a thread (``ServerThread``).
"""
