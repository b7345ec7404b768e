"""``bench serve --phases soak`` against a real serving face: the server's RSS every N requests.

The breaker saw server RSS grow 129 -> 219 MB over 8 minutes and nothing printed it; ``bench serve``
now reads the server's own ``/snapshot`` ``host.rss_bytes`` every ``SAMPLE_EVERY`` requests (1,000 in
the bench). Here the interval is 7 requests (one of each kind) so a short run takes several samples.
"""

from __future__ import annotations

import asyncio
from typing import Any

from calconsole.bench import serve as soak_mod


def test_soak_samples_the_servers_rss_every_n_requests_and_every_request_succeeds(make_server: Any,
                                                                                   monkeypatch: Any) -> None:
    monkeypatch.setattr(soak_mod, "SAMPLE_EVERY", len(soak_mod.KINDS))
    monkeypatch.setattr(soak_mod, "SAMPLE_EVERY_S", 1e9)  # only the request count takes samples here
    s = make_server()
    seen: list[dict[str, Any]] = []
    rep = asyncio.run(soak_mod.soak(s.url, {}, clients=2, duration_s=3.0, timeout_s=120.0, progress=seen.append))
    assert rep["requests"] >= 1 and rep["failed"] == 0, rep["errors"]
    assert sum(v["sent"] for v in rep["by_kind"].values()) == rep["requests"]
    samples = rep["samples"]
    assert samples == seen  # each sample was reported as it was taken (bench serve prints them)
    # one at the start, one at the end, and one each time the count passed a multiple of SAMPLE_EVERY
    every = soak_mod.SAMPLE_EVERY
    assert len(samples) == 2 + rep["requests"] // every
    between = samples[1:-1]
    assert [x["requests"] for x in between] == sorted(x["requests"] for x in between)
    for k, x in enumerate(between, start=1):
        assert x["requests"] >= k * every
    # the RSS is the serving process's own (psutil, MiB), read from its /snapshot: here this process
    assert all(isinstance(x["rss_mb"], float) and x["rss_mb"] > 10 for x in samples)
    assert rep["rss_start_mb"] == samples[0]["rss_mb"] and rep["rss_end_mb"] == samples[-1]["rss_mb"]
