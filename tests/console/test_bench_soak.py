"""``bench serve --phases soak``: the settles-or-grows verdict over the server's RSS samples."""

from __future__ import annotations

from calconsole.bench.serve import verdict


def samples(rss: list[float]) -> list[dict[str, float | int | None]]:
    return [{"requests": i * 1000, "wall_s": float(i), "rss_mb": v} for i, v in enumerate(rss)]


def test_growth_that_stops_settles() -> None:
    v = verdict(samples([120, 140, 150, 154, 155, 155.5, 156, 156]))
    assert v["settles"] is True and v["first_half_growth_mb"] == 35.0 and v["last_half_growth_mb"] == 1.0


def test_steady_growth_is_a_leak() -> None:
    v = verdict(samples([120 + 10 * i for i in range(8)]))
    assert v["settles"] is False and v["last_half_growth_mb"] == 30.0


def test_too_few_samples_decide_nothing() -> None:
    v = verdict(samples([120, 200, None]))  # type: ignore[list-item]
    assert v["settles"] is None and "at least 4" in v["why"]
