"""``calconsole bench serve``: closed-loop streaming load over real HTTP, client vs server figures.

Without --url it serves its own in-process simulator (timing-only unless --numerics) on
127.0.0.1:0, as ``calconsole serve`` would, and runs three phases:

sweep: clients 1, 2, 4, 8, 16 x mixes all short / all long / 10% long + 90% short,
  --requests per configuration, at --pacing (fast by default). Client-side TTFT / TPOT / ITL /
  E2E (host wall ms, vLLM's definitions), P50/P95/P99, throughput and goodput, beside the
  server's final-chunk timings and its /metrics deltas (simulated device ms).
overhead: HTTP overhead per token at fast pacing. The simulated ITL (~17 ms of priced device
  time per step) is not what fast pacing spends on the wall, so the wall ITL is compared with
  the same workload read straight from the in-process inference plane (no HTTP), legs in the
  order plane, HTTP, HTTP, plane: overhead = P50 of the client ITL over HTTP - P50 of the ITL
  on the plane (host wall ms per token; medians, which a loaded host disturbs less than means);
  also the same with means, and per output token of host CPU and of wall time.
sustained: at real-time pacing (--speed), clients 1, 2, 4, ... for --duration s each, all
  short; a stream falls behind when its mean client ITL exceeds its mean simulated ITL / speed
  by more than --lag-margin percent; the figure is the most clients whose streams all kept up
  (searching upward, stopping at the first that fell behind).

keepalive: GET /health median and P95 (host wall ms) on one kept-alive connection (what the
  OpenAI SDK and httpx do) beside a new connection per request; a kept-alive request should cost
  well under 1 ms on loopback.

paired: with --url, the same request mix (--mix x --clients, --requests each) and the keep-alive /health
  probe against that server and then against an in-process calconsole server (--pacing, --slots,
  --numerics), one after the other: a side-by-side table of client TTFT / TPOT / E2E P50 and P95
  (host wall ms), completed / failed requests and the /health median. It runs by itself when the
  server is a stock llama-server (its /props has build_info and no calconsole device), or when named
  in --phases.

With --url the keep-alive and sweep phases run against that server; the overhead needs the in-process plane and is
skipped; the sustained search runs if the server's /props says it paces in real time.
Host wall ms and simulated device ms are labelled everywhere; a benchmark, not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

import httpx

from ..commands.common import fail, print_json
from . import BenchParsers
from .serve_load import (
    MIXES,
    BenchError,
    Record,
    Shape,
    closed_loop,
    metrics_delta,
    mix_plan,
    plane_closed_loop,
    prompt_text,
    request_body,
    scrape,
    stream_chat,
    summarize,
    words_for,
)

PHASES = ("keepalive", "sweep", "overhead", "sustained")
#: phases run only when named in --phases (the soak takes half an hour by default; paired also runs by itself
#: against a llama-server)
EXTRA_PHASES = ("soak", "paired")
#: GET /health requests per leg of the keep-alive phase (the first 10 are warm-up)
KEEPALIVE_REQUESTS = 200
# Defaults from the operators' experiment matrix (facts.md F8): clients 1..16, the three mixes, prompt
# and output lengths from its length lists, 3 warm-up runs, at least 20 measured; kept out of the
# help texts, which cite no document the user does not have.
ENV_API_KEY = "CALCONSOLE_API_KEY"
MAX_CLIENTS = 64


def register(bsub: BenchParsers) -> None:
    p = bsub.add_parser(
        "serve", help="closed-loop streaming load over HTTP: client TTFT/TPOT/ITL/E2E beside the server's",
        description=__doc__.split("\n\n", 1)[1].replace("``", ""),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default=None, help="a running server (default: serve an in-process one on 127.0.0.1:0)")
    p.add_argument("--api-key-file", default=None, metavar="FILE",
                   help=f"API key for --url: the last field of the file's first line (or ${ENV_API_KEY})")
    p.add_argument("--clients", default="1,2,4,8,16", help="concurrent closed-loop clients (default 1,2,4,8,16)")
    p.add_argument("--mix", default="short,long,mixed",
                   help="mixes: short, long, mixed (10%% long + 90%% short) (default all three)")
    p.add_argument("--short", default="128:32", metavar="P:O",
                   help="short request: prompt:output tokens (default 128:32)")
    p.add_argument("--long", default="4096:128", metavar="P:O",
                   help="long request: prompt:output tokens (default 4096:128)")
    p.add_argument("--requests", type=int, default=20,
                   help="requests per sweep configuration and per overhead leg (default 20)")
    p.add_argument("--duration", type=float, default=6.0, metavar="S",
                   help="host wall seconds per sustained-streams configuration (default 6; running requests finish)")
    p.add_argument("--phases", default=None,
                   help=f"which phases (default {','.join(PHASES)}, and paired when --url is a llama-server; "
                        "also: soak and paired, when named)")
    p.add_argument("--soak-s", type=float, default=1800.0, metavar="S",
                   help="soak phase: host seconds of mixed traffic (streams, dropped streams, chat, tokenize, "
                        "health, metrics, snapshot); the server's RSS is printed every 1,000 requests (1800)")
    p.add_argument("--soak-clients", type=int, default=4, help="soak phase: concurrent clients (default 4)")
    p.add_argument("--soak-tracemalloc", type=int, default=0, metavar="N",
                   help="soak phase, in-process server only: the N source lines whose Python allocations grew "
                        "most over each half of the soak (tracemalloc; slows the run; default 0: off)")
    p.add_argument("--overhead-clients", default="1,8", help="client counts of the overhead phase (default 1,8)")
    p.add_argument("--lag-margin", type=float, default=10.0, metavar="PCT",
                   help="a real-time stream falls behind when its client ITL exceeds the simulated ITL by more "
                        "than PCT percent (default 10)")
    p.add_argument("--slo", default=None, metavar="SPEC",
                   help="goodput SLOs, vLLM style: ttft:MS,tpot:MS,e2el:MS (client: wall ms; server: simulated ms)")
    p.add_argument("--warmup", type=int, default=3, help="untimed short requests before each phase (default 3)")
    p.add_argument("--health-requests", type=int, default=KEEPALIVE_REQUESTS, metavar="N",
                   help=f"GET /health requests per leg of the keep-alive probe (default {KEEPALIVE_REQUESTS}; "
                        "10 more are warm-up)")
    p.add_argument("--timeout", type=float, default=300.0, metavar="S", help="per-request timeout, host s (300)")
    p.add_argument("--seed", type=int, default=0, help="seed of prompts and mix order (default 0)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    g = p.add_argument_group("in-process server (without --url)")
    g.add_argument("--bundle", metavar="NAME|DIR", default=None,
                   help="calbin bundle: an installed bundle's name or a directory (default: built-in)")
    g.add_argument("--pacing", choices=("fast", "realtime"), default="fast",
                   help="pacing of the sweep's server (default fast; the overhead is always fast, "
                        "the sustained search always real time)")
    g.add_argument("--speed", type=float, default=1.0, help="real-time pacing speed, 0.1..1000 (default 1)")
    g.add_argument("--slots", type=int, default=4,
                   help="slots of the sweep's server, 1..32 (default 4, as calconsole serve); the real-time "
                        "server has one slot per client of the largest configuration")
    g.add_argument("--numerics", action="store_true",
                   help="run the numerics (default timing-only: on this host a numeric decode step takes "
                        "longer than the 17 ms it is priced at, so real time cannot hold even for one stream)")
    p.set_defaults(func=run)


# --- options -------------------------------------------------------------------------------------

def _int_list(name: str, spec: str, lo: int, hi: int) -> list[int]:
    try:
        vals = [int(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--{name} must be a comma-separated list of integers, got {spec!r}") from None
    if not vals or any(not lo <= v <= hi for v in vals):
        raise ValueError(f"--{name} values must be in {lo}..{hi}, got {spec!r}")
    return sorted(set(vals))


def _names(name: str, spec: str, allowed: tuple[str, ...]) -> list[str]:
    vals = [x.strip() for x in spec.split(",") if x.strip()]
    bad = [v for v in vals if v not in allowed]
    if not vals or bad:
        raise ValueError(f"--{name}: expected some of {', '.join(allowed)}, got {spec!r}")
    return list(dict.fromkeys(vals))


def check_args(args: argparse.Namespace) -> dict[str, Any]:
    """The checked options; ValueError with a one-line message naming the option."""
    from ..commands.metrics import parse_slo

    o: dict[str, Any] = {
        "clients": _int_list("clients", args.clients, 1, MAX_CLIENTS),
        "overhead_clients": _int_list("overhead-clients", args.overhead_clients, 1, MAX_CLIENTS),
        "mixes": _names("mix", args.mix, tuple(MIXES)),
        "phases": _names("phases", args.phases or ",".join(PHASES), PHASES + EXTRA_PHASES),
        "phases_named": args.phases is not None,
        "shapes": {"short": Shape.parse("short", args.short), "long": Shape.parse("long", args.long)},
        "slo": parse_slo(args.slo) if args.slo is not None else None,
    }
    for name, v, lo, hi in (("requests", args.requests, 1, 100_000), ("warmup", args.warmup, 0, 1000),
                            ("health-requests", args.health_requests, 1, 100_000),
                            ("slots", args.slots, 1, 32), ("soak-clients", args.soak_clients, 1, MAX_CLIENTS),
                            ("soak-tracemalloc", args.soak_tracemalloc, 0, 100)):
        if not lo <= v <= hi:
            raise ValueError(f"--{name} must be in {lo}..{hi}, got {v}")
    for name, fv, flo, fhi in (("duration", args.duration, 0.5, 3600.0), ("timeout", args.timeout, 1.0, 3600.0),
                               ("lag-margin", args.lag_margin, 0.0, 1000.0), ("speed", args.speed, 0.1, 1000.0),
                               ("soak-s", args.soak_s, 1.0, 86400.0)):
        if not flo <= fv <= fhi:  # also refuses nan
            raise ValueError(f"--{name} must be in {flo:g}..{fhi:g}, got {fv:g}")
    if args.soak_tracemalloc and args.url:
        raise ValueError("--soak-tracemalloc traces this process: it needs the in-process server (no --url)")
    if not 0 <= args.seed < 2**32:
        raise ValueError(f"--seed must be in [0, 2**32), got {args.seed}")
    o["api_key"] = _api_key(args.api_key_file)
    if args.url is not None and not args.url.startswith(("http://", "https://")):
        raise ValueError(f"--url must start with http:// or https://, got {args.url!r}")
    return o


def _api_key(path: str | None) -> str | None:
    if path is None:
        return os.environ.get(ENV_API_KEY) or None
    try:
        with open(path, encoding="utf-8") as f:
            line = next((ln.strip() for ln in f if ln.strip() and not ln.lstrip().startswith("#")), "")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--api-key-file cannot be read: {e}") from None
    if not line:
        raise ValueError(f"--api-key-file holds no key: {path}")
    return line.split()[-1]


# --- in-process servers --------------------------------------------------------------------------

@contextlib.contextmanager
def in_process_server(args: argparse.Namespace, *, pacing: str, slots: int, queue: int, slo: Any
                      ) -> Iterator[tuple[str, Any]]:
    """(url, system): a fresh simulator behind the serving face on 127.0.0.1:0, stopped on exit."""
    from sim_backend.compose import Pacing, PacingMode, build_system

    from ..server.face import ServeConfig, ServingFace
    from ..server.run import ServerThread

    system = build_system(args.bundle, pacing=Pacing(PacingMode(pacing), args.speed), numerics=args.numerics,
                          n_slots=slots, queue_limit=queue, maintenance=False, slo=slo)
    try:
        face = ServingFace(system.inference, system.observation, None,
                           ServeConfig(host="127.0.0.1", port=0, max_streams=max(16, queue + slots),
                                       request_timeout_s=max(600.0, args.timeout)))
        thread = ServerThread(face).start()
        try:
            yield thread.url, system
        finally:
            thread.stop()
    finally:
        system.close()


# --- phases --------------------------------------------------------------------------------------

class Bench:
    """One run: the HTTP client, prompt sizes and what every phase shares."""

    def __init__(self, args: argparse.Namespace, opts: dict[str, Any]) -> None:
        self.args = args
        self.opts = opts
        self.shapes: dict[str, Shape] = opts["shapes"]
        self.headers = {"Authorization": f"Bearer {opts['api_key']}"} if opts["api_key"] else {}
        self.words: dict[str, int] = {}
        self.model: str | None = None
        self.next_index = 0  # every prompt of the run is a new one

    def client(self, url: str, clients: int) -> Any:

        n = clients + 4
        # trust_env=False: a proxy from the environment would be measured too
        return httpx.AsyncClient(base_url=url, trust_env=False, timeout=httpx.Timeout(self.args.timeout, connect=10.0),
                                 limits=httpx.Limits(max_connections=n, max_keepalive_connections=n))

    async def prepare(self, client: Any) -> None:
        """Prompt word counts from the server's tokenizer (once) and the untimed warm-up."""
        if not self.words:
            try:
                r = await client.get("/v1/models", headers=self.headers)
                if r.status_code == 200:
                    data = r.json().get("data") or []
                    self.model = data[0].get("id") if data else None
            except Exception:  # noqa: BLE001 - the model name is optional; the warm-up reports a dead server
                self.model = None
            for name, shape in self.shapes.items():
                self.words[name] = await words_for(client, shape, self.args.seed, self.headers)
        for i in range(self.args.warmup):
            rec = await stream_chat(client, self.body("short", -1 - i), "short", self.headers, self.args.timeout)
            if not rec.ok:
                raise BenchError(f"warm-up request failed: {rec.error}")

    def body(self, shape: str, index: int) -> dict[str, Any]:
        s = self.shapes[shape]
        return request_body(prompt_text(index, self.words[shape], self.args.seed), s.output_tokens,
                            (self.args.seed + index) % 2**32, self.model)

    async def config(self, client: Any, plan: list[str], clients: int, *, n_requests: int | None = None,
                     duration_s: float | None = None) -> tuple[dict[str, Any], list[Record]]:
        """One closed-loop configuration, with /metrics scraped before and after."""
        base = self.next_index

        async def send(i: int) -> Record:
            shape = plan[i % len(plan)]
            return await stream_chat(client, self.body(shape, base + i), shape, self.headers, self.args.timeout)

        before, why = await scrape(client, self.headers)
        cpu0 = time.process_time()
        records, dur = await closed_loop(send, clients, n_requests=n_requests, duration_s=duration_s)
        cpu = time.process_time() - cpu0
        self.next_index += len(records)  # request i of this run was prompt base + i
        after, why_after = await scrape(client, self.headers)
        res = summarize(records, dur, self.opts["slo"])
        res["clients"] = clients
        # fewer requests than clients: only that many were ever in flight at once
        res["effective_clients"] = min(clients, n_requests) if n_requests is not None else clients
        res["process_cpu_s"] = cpu
        res["per_request"] = [r.row() for r in records]
        if before is not None and after is not None:
            res["server_metrics"] = metrics_delta(before, after)
        else:
            res["server_metrics"] = {"unavailable": why or why_after}
        return res, records


async def each_config(b: Bench, url: str) -> AsyncIterator[tuple[str, int, dict[str, Any]]]:
    """(mix, clients, result) of every (mix, clients) of the run against ``url``, one after another, over one
    prepared client (``Bench.config``'s result; its records are dropped)."""
    async with b.client(url, max(b.opts["clients"])) as client:
        await b.prepare(client)
        for mix in b.opts["mixes"]:
            plan = mix_plan(mix, b.args.requests, b.args.seed)
            for c in b.opts["clients"]:
                res, _ = await b.config(client, plan, c, n_requests=b.args.requests)
                yield mix, c, res


async def sweep(b: Bench, url: str, pacing: str) -> list[dict[str, Any]]:
    return [{"phase": "sweep", "mix": mix, "pacing": pacing, **res} async for mix, _, res in each_config(b, url)]


def _pooled_itl(records: list[Record]) -> tuple[float | None, float | None]:
    import numpy as np

    gaps = [g for r in records if r.ok for g in r.itl_ms]
    if not gaps:
        return None, None
    return float(np.mean(gaps)), float(np.median(gaps))


async def overhead(b: Bench, url: str, system: Any) -> dict[str, Any]:
    """HTTP vs the in-process plane, same workload, fast pacing (module docstring)."""
    from sim_backend.planes import ChatRequest, SamplingParams

    n = b.args.requests
    out: dict[str, Any] = {"method": (
        "legs plane, HTTP, HTTP, plane of --requests short requests each, fast pacing, same server; "
        "overhead_ms_per_token = P50 of the client's ITL over HTTP (gaps between content chunks) - P50 of the "
        "ITL of the same requests read straight from the in-process inference plane (gaps between TokenEvents), "
        "host wall ms, at the first --overhead-clients count; overhead_itl_ms: the same with means; "
        "overhead_cpu_ms_per_token: this process's CPU (client and server share it) per output token, "
        "HTTP - plane; overhead_wall_ms_per_token: wall time of the legs per output token, HTTP - plane"),
        "by_clients": []}
    async with b.client(url, max(b.opts["overhead_clients"])) as client:
        await b.prepare(client)
        for c in b.opts["overhead_clients"]:
            legs: dict[str, list[tuple[list[Record], float, float]]] = {"plane": [], "http": []}
            for kind in ("plane", "http", "http", "plane"):
                if kind == "http":
                    res, records = await b.config(client, ["short"], c, n_requests=n)
                    legs[kind].append((records, res["duration_s"], res["process_cpu_s"]))
                else:
                    base = b.next_index
                    b.next_index += n
                    cpu0 = time.process_time()
                    reqs = []
                    for i in range(n):
                        body = b.body("short", base + i)
                        reqs.append(("short", ChatRequest(
                            messages=tuple(body["messages"]), max_tokens=body["max_tokens"],
                            sampling=SamplingParams(temperature=0.0, seed=body["seed"]), client="bench-plane")))
                    records, dur = await asyncio.to_thread(plane_closed_loop, system.inference, reqs, c,
                                                           b.args.timeout)
                    legs[kind].append((records, dur, time.process_time() - cpu0))
            row: dict[str, Any] = {"clients": c}
            for kind, runs in legs.items():
                recs = [r for rs, _, _ in runs for r in rs]
                tokens = sum(r.output_tokens or 0 for r in recs if r.ok)
                mean, p50 = _pooled_itl(recs)
                row[kind] = {"requests": len(recs), "completed": sum(r.ok for r in recs), "output_tokens": tokens,
                             "itl_mean_ms": mean, "itl_p50_ms": p50,
                             "ttft_p50_ms": _p50([r.ttft_ms for r in recs if r.ok]),
                             "cpu_ms_per_token": sum(cpu for _, _, cpu in runs) * 1e3 / tokens if tokens else None,
                             "wall_ms_per_token": sum(d for _, d, _ in runs) * 1e3 / tokens if tokens else None}
            h, p = row["http"], row["plane"]
            for key, src in (("overhead_itl_ms", "itl_mean_ms"), ("overhead_itl_p50_ms", "itl_p50_ms"),
                             ("overhead_ttft_p50_ms", "ttft_p50_ms"), ("overhead_cpu_ms_per_token", "cpu_ms_per_token"),
                             ("overhead_wall_ms_per_token", "wall_ms_per_token")):
                row[key] = h[src] - p[src] if h[src] is not None and p[src] is not None else None
            out["by_clients"].append(row)
    # the headline: medians, which the load of a shared host disturbs far less than means
    first = out["by_clients"][0]
    out["overhead_ms_per_token"] = first["overhead_itl_p50_ms"]
    out["overhead_cpu_ms_per_token"] = first["overhead_cpu_ms_per_token"]
    out["at_clients"] = first["clients"]
    return out


def _p50(v: Sequence[float | None]) -> float | None:
    import numpy as np

    x = [a for a in v if a is not None]
    return float(np.median(x)) if x else None


async def sustained(b: Bench, url: str, speed: float) -> dict[str, Any]:
    """Upward search over --clients at real-time pacing (module docstring)."""
    from .serve_load import mean_itl, mean_sim_itl

    margin = b.args.lag_margin / 100.0
    out: dict[str, Any] = {
        "method": (f"all-short closed loop for {b.args.duration:g} host s per client count at real-time pacing "
                   f"(speed {speed:g}); a stream falls behind when its mean client ITL (host wall ms) exceeds "
                   f"its mean simulated ITL (final-chunk itl_ms) / speed by more than {b.args.lag_margin:g}%; "
                   "a client count is sustained when every request finished and no stream fell behind; "
                   "the search goes up the client counts and stops at the first one not sustained"),
        "speed": speed, "lag_margin_pct": b.args.lag_margin, "by_clients": [], "sustained_streams": 0}
    async with b.client(url, max(b.opts["clients"])) as client:
        await b.prepare(client)
        for c in b.opts["clients"]:
            res, records = await b.config(client, ["short"], c, duration_s=b.args.duration)
            lags, behind, judged = [], 0, 0
            for r in records:
                wall, sim = mean_itl(r), mean_sim_itl(r)
                if not r.ok or wall is None or sim is None:
                    continue
                judged += 1
                target = sim / speed
                lags.append(wall - target)
                behind += wall > target * (1 + margin)
            ok = res["requests"]["failed"] == 0 and judged > 0 and behind == 0
            row = {"clients": c, "sustained": ok, "streams_judged": judged, "streams_behind": behind,
                   "lag_ms_per_token": _p50(lags),  # client ITL - simulated ITL / speed, median over streams
                   "client_itl_p50_ms": (res["client"]["itl_ms"] or {}).get("p50"),
                   "sim_itl_p50_ms": (res["server_timings"]["itl_ms"] or {}).get("p50"),
                   # one clock at speed 1: simulated ms are wall ms, so these two compare directly
                   "client_ttft_p50_ms": (res["client"]["ttft_ms"] or {}).get("p50"),
                   "sim_ttft_p50_ms": (res["server_timings"]["ttft_ms"] or {}).get("p50"),
                   "requests": res["requests"], "duration_s": res["duration_s"], "process_cpu_s": res["process_cpu_s"],
                   "per_request": res["per_request"]}
            out["by_clients"].append(row)
            if not ok:
                break
            out["sustained_streams"] = c
    # every count tried kept up: the figure is a lower bound (try larger --clients)
    out["limit_found"] = not all(r["sustained"] for r in out["by_clients"])
    return out


# --- the command ---------------------------------------------------------------------------------

def _is_llama_server(props: dict[str, Any]) -> bool:
    """A stock llama-server's /props: build_info and no calconsole ``device`` block."""
    return "build_info" in props and "device" not in props


async def paired_target(b: Bench, url: str) -> dict[str, Any]:
    """One side of the paired phase: the keep-alive probe and every (mix, clients) of the run at ``url``."""
    out: dict[str, Any] = {"url": url, "health": await keepalive(b, url), "configurations": []}
    async for mix, c, res in each_config(b, url):
        cl = res["client"]
        out["configurations"].append({
            "mix": mix, "clients": c, "requests": res["requests"],
            **{k: {q: (cl[k] or {}).get(q) for q in ("p50", "p95")} for k in ("ttft_ms", "tpot_ms", "e2e_ms")},
            "prompt_tokens_per_request": (res["prompt_tokens_per_request"] or {}).get("p50")})
    return out


def paired(args: argparse.Namespace, opts: dict[str, Any], url: str, kind: str) -> dict[str, Any]:
    """The paired phase: the server at ``url`` first, then an in-process calconsole server, one at a time (so they
    never compete for the host's CPU), each with its own prompt sizing (its own tokenizer counts the tokens) and
    the same request sequence (prompt i of the run is the same text on both)."""
    theirs = asyncio.run(paired_target(Bench(args, opts), url))
    with in_process_server(args, pacing=args.pacing, slots=args.slots, queue=max(16, max(opts["clients"])),
                           slo=opts["slo"]) as (ours_url, _):
        ours = asyncio.run(paired_target(Bench(args, opts), ours_url))
    return {"clock": "host wall ms (client side), both targets",
            "targets": [{"name": kind, "url": url},
                        {"name": "calconsole", "url": ours_url,
                         "server": {"pacing": args.pacing, "speed": args.speed, "slots": args.slots,
                                    "numerics": args.numerics, "in_process": True}}],
            "results": [theirs, ours]}


async def keepalive(b: Bench, url: str, n: int | None = None) -> dict[str, Any]:
    """GET /health latency (host wall ms) on one kept-alive connection and on a new connection each time,
    and this process's CPU ms per request (the client's, plus the server's when it runs in this process):
    on a loaded host the wall figure waits for time slices, the CPU figure does not."""
    import statistics


    n = b.args.health_requests if n is None else n
    out: dict[str, Any] = {"requests": n, "clock": "host wall ms", "path": "/health",
                           "load_average": os.getloadavg()[0]}
    for name, keep in (("kept_alive", 1), ("new_connection", 0)):
        times: list[float] = []
        cpu = 0.0
        limits = httpx.Limits(max_connections=1, max_keepalive_connections=keep)
        async with httpx.AsyncClient(base_url=url, trust_env=False, timeout=10.0, limits=limits) as client:
            for i in range(n + 10):
                t0, c0 = time.perf_counter(), time.process_time()
                try:
                    r = await client.get("/health", headers=b.headers)
                except httpx.TransportError as e:  # an unreachable server is the user's one-line error
                    raise BenchError(f"GET {url}/health: {type(e).__name__}: {e}") from None
                if i >= 10:
                    times.append((time.perf_counter() - t0) * 1e3)
                    cpu += time.process_time() - c0
                if r.status_code != 200:
                    raise BenchError(f"GET /health answered {r.status_code}: {r.text[:200]}")
        times.sort()
        out[name] = {"median_ms": statistics.median(times), "p95_ms": times[int(0.95 * (len(times) - 1))],
                     "cpu_ms_per_request": cpu / n * 1e3}
    return out


async def _props(b: Bench, url: str) -> dict[str, Any] | None:
    async with b.client(url, 1) as client:
        try:
            r = await client.get("/props", headers=b.headers)
            return r.json() if r.status_code == 200 else None
        except Exception:  # noqa: BLE001 - /props is optional (the device block is ours)
            return None


def run(args: argparse.Namespace) -> int:
    from sim_backend.planes import CalError

    try:
        opts = check_args(args)
    except ValueError as e:
        return fail(str(e))
    b = Bench(args, opts)
    rep: dict[str, Any] = {"tool": "calconsole bench serve", "url": args.url, "in_process": args.url is None,
                           "load_average_before": list(os.getloadavg()), "cpus": os.cpu_count(),
                           "clocks": {"client": "host wall ms",
                                      "server_timings": "simulated ms (device + booked host work)",
                                      "server_metrics": "simulated ms (device + booked host work)"},
                           "shapes": {k: {"prompt_tokens": s.prompt_tokens, "output_tokens": s.output_tokens}
                                      for k, s in b.shapes.items()},
                           "slo": opts["slo"].to_dict() if opts["slo"] is not None else None,
                           "configurations": [], "overhead": None, "sustained": None, "soak": None,
                           "keepalive": None, "paired": None}
    t0 = time.perf_counter()
    try:
        if args.url is not None:
            _run_remote(b, rep)
        else:
            _run_in_process(b, rep)
    except BenchError as e:
        return fail(str(e))
    except (CalError, OSError, RuntimeError) as e:
        return fail(f"{type(e).__name__}: {e}")
    except KeyboardInterrupt:  # the servers were stopped on the way out
        return fail("interrupted; no report", 130)
    rep["prompt_words"] = b.words
    rep["wall_s"] = time.perf_counter() - t0
    rep["load_average_after"] = list(os.getloadavg())
    if args.json:
        print_json(rep)
    else:
        print_report(rep)
    return 0


def _run_in_process(b: Bench, rep: dict[str, Any]) -> None:
    args, opts = b.args, b.opts
    top = max(opts["clients"] + opts["overhead_clients"])
    queue = max(16, top)
    rep["server"] = {"numerics": args.numerics, "sweep_pacing": args.pacing, "speed": args.speed,
                     "sweep_slots": args.slots, "note": "client and server share this process (one interpreter)"}
    if {"keepalive", "sweep", "overhead"} & set(opts["phases"]):
        with in_process_server(args, pacing=args.pacing, slots=args.slots, queue=queue, slo=opts["slo"]) as (url, sys_):
            if "keepalive" in opts["phases"]:
                rep["keepalive"] = asyncio.run(keepalive(b, url))
            if "sweep" in opts["phases"]:
                rep["configurations"] = asyncio.run(sweep(b, url, args.pacing))
            if "overhead" in opts["phases"] and args.pacing == "fast":
                rep["overhead"] = asyncio.run(overhead(b, url, sys_))
        if "overhead" in opts["phases"] and args.pacing != "fast":
            with in_process_server(args, pacing="fast", slots=args.slots, queue=queue, slo=opts["slo"]) as (url, sys_):
                rep["overhead"] = asyncio.run(overhead(b, url, sys_))
    if "sustained" in opts["phases"]:
        slots = min(32, max(args.slots, max(opts["clients"])))
        rep["server"]["sustained_slots"] = slots
        with in_process_server(args, pacing="realtime", slots=slots, queue=queue, slo=opts["slo"]) as (url, _):
            rep["sustained"] = asyncio.run(sustained(b, url, args.speed))
    if "paired" in opts["phases"]:
        rep["paired"] = {"skipped": "the paired phase compares the server at --url with an in-process one; "
                                    "give --url"}
    if "soak" in opts["phases"]:
        rep["server"]["soak_note"] = ("in-process: the RSS is of this process, client and server together; "
                                      "serve in another process and pass --url for the server's alone")
        with in_process_server(args, pacing="fast", slots=args.slots, queue=queue, slo=opts["slo"]) as (url, _):
            rep["soak"] = _soak(b, url, trace_top=args.soak_tracemalloc)


def _run_remote(b: Bench, rep: dict[str, Any]) -> None:
    url, opts = b.args.url, b.opts
    props = asyncio.run(_props(b, url)) or {}
    dev = props.get("device") or {}
    pacing, speed = dev.get("pacing"), dev.get("pacing_speed")
    llama = _is_llama_server(props)
    rep["server"] = {"numerics": dev.get("numerics"), "pacing": pacing, "speed": speed,
                     "slots": props.get("total_slots"), "kind": "llama-server" if llama else "calconsole"}
    if llama and not opts["phases_named"]:
        # a stock llama-server: the paired phase runs its sweep and health probe beside calconsole's; the
        # other phases would repeat it (sweep, keepalive) or cannot run there (overhead, sustained)
        opts = {**opts, "phases": ["paired"]}
    if "keepalive" in opts["phases"]:
        rep["keepalive"] = asyncio.run(keepalive(b, url))
    if "sweep" in opts["phases"]:
        rep["configurations"] = asyncio.run(sweep(b, url, str(pacing or "unknown")))
    if "overhead" in opts["phases"]:
        rep["overhead"] = {"skipped": "the overhead is measured against the in-process inference plane; "
                                      "run without --url"}
    if "sustained" in opts["phases"]:
        if pacing == "realtime" and isinstance(speed, (int, float)) and speed > 0:
            rep["sustained"] = asyncio.run(sustained(b, url, float(speed)))
        else:
            rep["sustained"] = {"skipped": f"the server's /props says pacing {pacing!r}; the sustained search "
                                           "needs real-time pacing (calconsole serve --pacing realtime)"}
    if "soak" in opts["phases"]:
        rep["soak"] = _soak(b, url)
    if "paired" in opts["phases"]:
        rep["paired"] = paired(b.args, opts, url, "llama-server" if llama else "server at --url")


def _soak(b: Bench, url: str, trace_top: int = 0) -> dict[str, Any]:
    """The soak phase (``calconsole.bench.soak``), printing each RSS sample on stderr as it is taken."""
    import sys

    from .soak import soak

    def show(s: dict[str, Any]) -> None:  # on stderr, also with --json: a long run shows it is alive
        print(f"soak: {s['requests']:>7} requests  {s['wall_s']:>7.1f} s wall  server RSS "
              f"{'-' if s['rss_mb'] is None else format(s['rss_mb'], '.1f')} MiB", file=sys.stderr, flush=True)

    return asyncio.run(soak(url, b.headers, clients=b.args.soak_clients, duration_s=b.args.soak_s,
                            seed=b.args.seed, timeout_s=min(b.args.timeout, 120.0), progress=show,
                            trace_top=trace_top))


# --- human output --------------------------------------------------------------------------------

def _f(v: Any, nd: int = 1) -> str:
    return "-" if v is None else f"{v:.{nd}f}"


def _pair(client: dict[str, Any] | None, server: dict[str, Any] | None, key: str = "p50") -> str:
    return f"{_f((client or {}).get(key))} / {_f((server or {}).get(key))}"


def print_report(rep: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console(width=max(140, Console().width))
    la = rep["load_average_before"]
    con.print(f"[bold]calconsole bench serve[/] {rep['url'] or '(in-process server, 127.0.0.1)'}; "
              f"load average {la[0]:.2f} / {rep['load_average_after'][0]:.2f} (before / after) on {rep['cpus']} CPUs; "
              f"{rep['wall_s']:.0f} s")
    sh = rep["shapes"]
    con.print(f"short {sh['short']['prompt_tokens']}->{sh['short']['output_tokens']} tokens, long "
              f"{sh['long']['prompt_tokens']}->{sh['long']['output_tokens']}; cells are "
              "client (host wall ms) / server (simulated device ms, final-chunk timings)")
    if rep["configurations"]:
        t = Table(title="sweep (closed loop)", show_lines=False)
        for col in ("mix", "clients", "ok/sent", "TTFT P50", "TTFT P99", "TPOT P50", "ITL P50", "ITL P99",
                    "E2E P50", "queue P50 sim", "req/s", "out tok/s", "good (SLO)"):
            t.add_column(col, justify="right" if col not in ("mix",) else "left")
        for r in rep["configurations"]:
            c, s = r["client"], r["server_timings"]
            t.add_row(r["mix"], str(r["clients"]), f"{r['requests']['completed']}/{r['requests']['sent']}",
                      _pair(c["ttft_ms"], s["ttft_ms"]), _pair(c["ttft_ms"], s["ttft_ms"], "p99"),
                      _pair(c["tpot_ms"], s["tpot_ms"]), _pair(c["itl_ms"], s["itl_ms"]),
                      _pair(c["itl_ms"], s["itl_ms"], "p99"), _pair(c["e2e_ms"], s["e2e_ms"]),
                      _f((s["queue_ms"] or {}).get("p50")), _f(c["request_throughput_rps"], 2),
                      _f(c["output_throughput_tok_s"]),
                      "-" if c["good_requests"] is None else f"{c['good_requests']} / {s['good_requests']}")
        con.print(t)
        m = Table(title="server /metrics deltas (simulated device ms, bucket-interpolated)")
        for col in ("mix", "clients", "finished", "good", "tokens", "TTFT P50", "ITL P50", "TPOT P50", "E2E P50",
                    "queue P50"):
            m.add_column(col, justify="right" if col != "mix" else "left")
        for r in rep["configurations"]:
            sm = r["server_metrics"]
            if "histograms" not in sm:
                m.add_row(r["mix"], str(r["clients"]), "-", "-", "-", sm.get("unavailable", "?"), "", "", "", "")
                continue
            h, cn = sm["histograms"], sm["counters"]
            m.add_row(r["mix"], str(r["clients"]), str(cn.get("requests_finished_total", "-")),
                      str(cn.get("requests_good_total", "-")), str(cn.get("tokens_predicted_total", "-")),
                      *(_f((h.get(k) or {}).get("p50"))
                        for k in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms", "queue_ms")))
        con.print(m)
        for r in rep["configurations"]:
            if r["requests"]["errors"]:
                con.print(f"[red]{r['mix']} x{r['clients']} errors:[/] {r['requests']['errors']}")
    ov = rep["overhead"]
    if ov is not None:
        if "skipped" in ov:
            con.print(f"HTTP overhead per token: skipped ({ov['skipped']})")
        else:
            con.print(f"[bold]HTTP overhead per token: {_f(ov['overhead_ms_per_token'], 3)} ms[/] wall "
                      f"(ITL P50 difference at {ov['at_clients']} client(s)), "
                      f"{_f(ov['overhead_cpu_ms_per_token'], 3)} ms CPU ({ov['method']})")
            for row in ov["by_clients"]:
                h, p = row["http"], row["plane"]
                con.print(f"  {row['clients']:>2} clients: ITL mean {_f(h['itl_mean_ms'], 3)} over HTTP vs "
                          f"{_f(p['itl_mean_ms'], 3)} on the plane -> [bold]{_f(row['overhead_itl_ms'], 3)} ms/token[/]"
                          f" (P50 {_f(row['overhead_itl_p50_ms'], 3)}; CPU {_f(row['overhead_cpu_ms_per_token'], 3)} "
                          f"ms/token; wall per output token {_f(row['overhead_wall_ms_per_token'], 3)}; "
                          f"TTFT P50 +{_f(row['overhead_ttft_p50_ms'], 2)} ms)")
    ka = rep.get("keepalive")
    if ka is not None:
        k, nc = ka["kept_alive"], ka["new_connection"]
        con.print(f"[bold]GET /health, kept-alive connection: median {_f(k['median_ms'], 3)} ms[/] "
                  f"(P95 {_f(k['p95_ms'], 3)}); new connection each: median {_f(nc['median_ms'], 3)} ms "
                  f"(host wall ms, {ka['requests']} requests each, load average {_f(ka.get('load_average'), 2)}); "
                  f"CPU of this process {_f(k.get('cpu_ms_per_request'), 3)} / {_f(nc.get('cpu_ms_per_request'), 3)} "
                  "ms a request (kept-alive / new; the in-process server's included)")
    pa = rep.get("paired")
    if pa is not None:
        _print_paired(con, pa)
    so = rep.get("soak")
    if so is not None:
        v = so["verdict"]
        word = {True: "settles", False: "GROWS", None: "undecided"}[v["settles"]]
        con.print(f"[bold]soak: {so['requests']} requests in {so['duration_s']:.0f} s wall, {so['failed']} failed; "
                  f"server RSS {_f(so['rss_start_mb'])} -> {_f(so['rss_end_mb'])} MiB: {word}[/] "
                  + (f"(first half of the samples +{_f(v['first_half_growth_mb'])} MiB, last half "
                     f"+{_f(v['last_half_growth_mb'])} MiB; {v['rule']})" if v["settles"] is not None
                     else f"({v['why']})"))
        con.print("  server RSS (MiB) by requests served, every 1,000 and every minute: " + " ".join(
            f"{s['requests']}:{_f(s['rss_mb'])}" for s in so["samples"]))
        if v.get("last_half_growth_pct") is not None:
            con.print(f"  last half of the samples: +{_f(v['last_half_growth_pct'])} % of the RSS at its start")
        tm = so.get("tracemalloc")
        if tm:
            con.print(f"  tracemalloc (Python allocations only; {_f(tm['traced_mb'])} MiB traced at the end):")
            for half in ("first_half", "last_half"):
                con.print(f"    grew most over the {half.replace('_', ' ')}:")
                for g in tm[half]:
                    con.print(f"      {g['grew_kib']:>+9.1f} KiB {g['blocks_grew']:>+7d} blocks  "
                              f"(live {g['live_kib']:.1f} KiB)  {g['where']}")
        for e in so["errors"]:
            con.print(f"  [red]error:[/] {e}")
    su = rep["sustained"]
    if su is not None:
        if "skipped" in su:
            con.print(f"streams sustained at real time: skipped ({su['skipped']})")
        else:
            n = su["sustained_streams"]
            figure = str(n) if su["limit_found"] else f">= {n} (every count tried kept up)"
            con.print(f"[bold]streams sustained at real time: {figure}[/] ({su['method']})")
            for row in su["by_clients"]:
                con.print(f"  {row['clients']:>2} clients: {'kept up' if row['sustained'] else 'FELL BEHIND'}; "
                          f"{row['streams_behind']}/{row['streams_judged']} streams behind; lag "
                          f"{_f(row['lag_ms_per_token'], 2)} ms/token; ITL P50 {_f(row['client_itl_p50_ms'])} wall "
                          f"vs {_f(row['sim_itl_p50_ms'])} sim; TTFT P50 {_f(row['client_ttft_p50_ms'])} wall vs "
                          f"{_f(row['sim_ttft_p50_ms'])} sim; failed {row['requests']['failed']}")


def _print_paired(con: Any, pa: dict[str, Any]) -> None:
    """The paired phase's side-by-side table: each cell is "<--url server> | calconsole" (host wall ms)."""
    from rich.table import Table

    if "skipped" in pa:
        con.print(f"paired: skipped ({pa['skipped']})")
        return
    a, b = pa["targets"]
    ra, rb = pa["results"]
    srv = b["server"]
    t = Table(title=f"paired, client side (host wall ms): {a['name']} {a['url']} | calconsole in-process "
                    f"({srv['pacing']} pacing{'' if srv['numerics'] else ', timing-only'}, {srv['slots']} slots)")
    for col in ("mix", "clients", "ok/sent", "failed", "TTFT P50", "TTFT P95", "TPOT P50", "TPOT P95", "E2E P50",
                "E2E P95"):
        t.add_column(col, justify="left" if col == "mix" else "right")

    def two(x: Any, y: Any, nd: int = 1) -> str:
        return f"{_f(x, nd)} | {_f(y, nd)}"

    for x, y in zip(ra["configurations"], rb["configurations"], strict=True):
        qa, qb = x["requests"], y["requests"]
        t.add_row(x["mix"], str(x["clients"]), f"{qa['completed']}/{qa['sent']} | {qb['completed']}/{qb['sent']}",
                  f"{qa['failed']} | {qb['failed']}",
                  *(two(x[k][q], y[k][q]) for k in ("ttft_ms", "tpot_ms", "e2e_ms") for q in ("p50", "p95")))
    con.print(t)
    ha, hb = ra["health"]["kept_alive"], rb["health"]["kept_alive"]
    con.print(f"[bold]paired GET /health, kept-alive: median {_f(ha['median_ms'], 3)} | {_f(hb['median_ms'], 3)} ms[/] "
              f"(P95 {_f(ha['p95_ms'], 3)} | {_f(hb['p95_ms'], 3)}; {a['name']} | calconsole)")
    for name, r in ((a["name"], ra), ("calconsole", rb)):
        for c in r["configurations"]:
            if c["requests"]["errors"]:
                con.print(f"[red]{name} {c['mix']} x{c['clients']} errors:[/] {c['requests']['errors']}")
