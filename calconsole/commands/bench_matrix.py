"""``calconsole bench matrix``: the report's prompt x output length matrix over HTTP, batch 1.

Against --url (any llama-server-compatible server: calconsole serve, or llama-server on the
real device), or without it an in-process simulator on 127.0.0.1:0 (timing-only, fast pacing
unless told otherwise). For each cell (prompt P tokens x output O tokens): warm-ups, then
measured runs, one request at a time, to the native streaming /completion with a prompt of
exactly P token ids (from the server's /tokenize), n_predict O, greedy, EOS ignored, no prompt
cache. A cell whose P + O exceeds the server's n_ctx (/props) is skipped and reported.

Per cell: TTFT (sent -> first visible token), TPOT ((E2E - TTFT) / (n - 1)), ITL (gaps between
tokens) and E2E (sent -> final chunk), P50/P95/P99, in host wall ms on this client; beside them
the server's own final-chunk timings (calconsole serve: simulated device ms, with the infer /
H2D / D2H / framework / sampling / KV-wait split) and its /metrics deltas. Every run keeps its
raw per-token arrival times, seed and the settings the server echoed; the server's identity
(/props build info, model alias and path, CalRT version, bundle, chat template and tokenizer
hashes) is recorded, never assumed. Writes matrix.json, cells.csv, runs.csv and tokens.csv to
--out. Exit 0; 1 if a measured run failed (the files are written); 2 on bad options or a server
that cannot be used; 130 on Ctrl-C (what was measured is written).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import sys
import time
from typing import Any

from ..bench.matrix import (
    OUTPUTS,
    PROMPTS,
    QUICK_OUTPUTS,
    QUICK_PROMPTS,
    QUICK_RUNS,
    QUICK_WARMUPS,
    RUNS,
    WARMUPS,
    cells,
    counts,
    new_report,
    run_matrix,
    skip_reason,
    write_outputs,
)
from ..bench.serve_load import BenchError
from .common import fail, print_json

MAX_PROMPT = 1_000_000
MAX_OUTPUT = 4096


def register(bsub) -> None:
    p = bsub.add_parser(
        "matrix", help="the prompt x output length matrix over HTTP: TTFT/TPOT/ITL/E2E P50/P95/P99, raw token times",
        description=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default=None,
                   help="a running llama-server-compatible server (default: an in-process one on 127.0.0.1:0)")
    p.add_argument("--api-key-file", default=None, metavar="FILE",
                   help="API key for --url: the last field of the file's first line (or $CALCONSOLE_API_KEY)")
    p.add_argument("--prompts", default=None, metavar="LIST",
                   help=f"prompt lengths in tokens (default {','.join(map(str, PROMPTS))}; "
                        f"--quick: {','.join(map(str, QUICK_PROMPTS))})")
    p.add_argument("--outputs", default=None, metavar="LIST",
                   help=f"output lengths in tokens, 1..{MAX_OUTPUT} (default {','.join(map(str, OUTPUTS))}; "
                        f"--quick: {','.join(map(str, QUICK_OUTPUTS))})")
    p.add_argument("--warmups", default=None, metavar="N",
                   help=f"warm-up runs per cell, kept but not in the statistics (default {WARMUPS}; "
                        f"--quick {QUICK_WARMUPS})")
    p.add_argument("--runs", default=None, metavar="N",
                   help=f"measured runs per cell (default {RUNS}; --quick {QUICK_RUNS})")
    p.add_argument("--quick", action="store_true",
                   help="a small subset (about a minute against a real-time server at speed 1); "
                        "--prompts/--outputs/--warmups/--runs still override it")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="directory for matrix.json, cells.csv, runs.csv, tokens.csv "
                        "(default ./bench-matrix-<UTC time>; created; refused if it holds a matrix.json)")
    p.add_argument("--timeout", default="600", metavar="S",
                   help="per-request deadline, host s (default 600; a 40900-token prefill at real time takes ~46 s)")
    p.add_argument("--seed", default="0", metavar="N", help="seed of the prompt pool and request seeds (default 0)")
    p.add_argument("--json", action="store_true", help="print the whole report as JSON instead of the table")
    p.add_argument("--plot", action="store_true", help="also draw TTFT and TPOT against prompt length (plotext)")
    g = p.add_argument_group("in-process server (without --url)")
    g.add_argument("--bundle", metavar="NAME|DIR", default=None,
                   help="calbin bundle: an installed bundle's name or a directory (default: built-in)")
    g.add_argument("--pacing", choices=("fast", "realtime"), default="fast", help="pacing (default fast)")
    g.add_argument("--speed", type=float, default=1.0, help="real-time pacing speed, 0.1..1000 (default 1)")
    g.add_argument("--numerics", action="store_true", help="run the numerics (default timing-only)")
    p.set_defaults(func=run)


# --- options -----------------------------------------------------------------------------------

def _int(name: str, v: str, lo: int, hi: int) -> int:
    try:
        n = int(v)
    except ValueError:
        raise ValueError(f"--{name} must be an integer, got {v!r}") from None
    if not lo <= n <= hi:
        raise ValueError(f"--{name} must be in {lo}..{hi}, got {n}")
    return n


def _ints(name: str, spec: str, lo: int, hi: int) -> list[int]:
    """A comma-separated list, order kept, duplicates dropped."""
    vals = [x.strip() for x in spec.split(",") if x.strip()]
    if not vals:
        raise ValueError(f"--{name} must be a comma-separated list of integers, got {spec!r}")
    return list(dict.fromkeys(_int(name, v, lo, hi) for v in vals))


def check_args(args: argparse.Namespace) -> dict[str, Any]:
    """The checked options; ValueError with a one-line message naming the option."""
    from .bench_serve import _api_key

    q = args.quick
    o: dict[str, Any] = {
        "prompts": _ints("prompts", args.prompts, 1, MAX_PROMPT) if args.prompts is not None
        else list(QUICK_PROMPTS if q else PROMPTS),
        "outputs": _ints("outputs", args.outputs, 1, MAX_OUTPUT) if args.outputs is not None
        else list(QUICK_OUTPUTS if q else OUTPUTS),
        "warmups": _int("warmups", args.warmups, 0, 1000) if args.warmups is not None
        else (QUICK_WARMUPS if q else WARMUPS),
        "runs": _int("runs", args.runs, 1, 100_000) if args.runs is not None else (QUICK_RUNS if q else RUNS),
        "seed": _int("seed", args.seed, 0, 2**32 - 1),
        "quick": q,
    }
    try:
        timeout = float(args.timeout)
    except ValueError:
        timeout = math.nan
    if not 1.0 <= timeout <= 3600.0:  # also refuses nan
        raise ValueError(f"--timeout must be in 1..3600 host seconds, got {args.timeout!r}")
    o["timeout_s"] = timeout
    if not 0.1 <= args.speed <= 1000.0:
        raise ValueError(f"--speed must be in 0.1..1000, got {args.speed:g}")
    if args.url is not None:
        if not args.url.startswith(("http://", "https://")) or len(args.url.split("//", 1)[1]) == 0:
            raise ValueError(f"--url must be http://HOST:PORT or https://..., got {args.url!r}")
        for name in ("bundle", "numerics"):
            if getattr(args, name) not in (None, False):
                raise ValueError(f"--{name} is for the in-process server; the server at --url has its own")
    o["api_key"] = _api_key(args.api_key_file)
    o["out"] = _out_dir(args.out)
    # the report's repetition rule (facts.md F8): say when a run is below it
    o["meets_report_repetitions"] = o["warmups"] >= WARMUPS and o["runs"] >= RUNS
    return o


def _out_dir(path: str | None) -> str:
    if path is None:
        path = time.strftime("bench-matrix-%Y%m%dT%H%M%SZ", time.gmtime())
    if os.path.exists(os.path.join(path, "matrix.json")):
        raise ValueError(f"--out {path} already holds a matrix.json; give another directory")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise ValueError(f"--out {path}: cannot create the directory: {e.strerror or e}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"--out {path}: the directory is not writable")
    return path


# --- the command -------------------------------------------------------------------------------

def run(args: argparse.Namespace) -> int:
    from sim_backend.planes import CalError

    try:
        opts = check_args(args)
    except ValueError as e:
        return fail(str(e))
    todo = cells(opts["prompts"], opts["outputs"])
    shown = {k: v for k, v in opts.items() if k != "api_key"}
    report = new_report(args.url, shown)
    t0 = time.perf_counter()
    code = 0
    try:
        if args.url is not None:
            _measure(args.url, opts, report, todo)
        else:
            from .bench_serve import in_process_server

            args.timeout = opts["timeout_s"]
            with in_process_server(args, pacing=args.pacing, slots=1, queue=4, slo=None) as (url, _):
                report["server_in_process"] = {"pacing": args.pacing, "speed": args.speed,
                                               "numerics": args.numerics, "slots": 1,
                                               "note": "client and server share this process"}
                _measure(url, opts, report, todo)
    except BenchError as e:
        return fail(str(e))
    except (CalError, RuntimeError) as e:
        return fail(f"{type(e).__name__}: {e}")
    except KeyboardInterrupt:
        report["interrupted"] = True
        code = 130
    report["wall_s"] = time.perf_counter() - t0
    report["metadata"]["client"]["load_average_after"] = list(os.getloadavg())
    report["counts"] = counts(report)
    try:
        paths = write_outputs(report, opts["out"])
    except OSError as e:
        return fail(f"--out {opts['out']}: cannot write the results: {e}")
    if code == 130:
        return fail(f"interrupted; what was measured is in {paths['json']}", 130)
    if args.json:
        print_json(report)
    else:
        print_summary(report, paths)
    if args.plot:
        sys.stdout.write(plot(report) + "\n")
    if report["counts"]["measured_failed"]:
        print(f"calconsole: {report['counts']['measured_failed']} measured runs failed (see {paths['runs']})",
              file=sys.stderr)
        code = 1
    return code


def _measure(url: str, opts: dict[str, Any], report: dict[str, Any], todo: list[Any]) -> None:
    import httpx
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    headers = {"Authorization": f"Bearer {opts['api_key']}"} if opts["api_key"] else {}
    per_cell = opts["warmups"] + opts["runs"]

    async def main() -> None:
        # trust_env=False: a proxy from the environment would be measured too
        async with httpx.AsyncClient(base_url=url, trust_env=False,
                                     timeout=httpx.Timeout(opts["timeout_s"], connect=10.0)) as client:
            err = Console(stderr=True)
            # a bar only on a terminal: redirected, it would leave a half-drawn line in the log
            with Progress(TextColumn("{task.description:<18}"), BarColumn(), MofNCompleteColumn(),
                          TextColumn("requests"), TimeElapsedColumn(), console=err, transient=False,
                          disable=not err.is_terminal) as prog:
                task = prog.add_task("server", total=None)

                def step(cell: str, n: int) -> None:
                    if prog.tasks[0].total is None:  # n_ctx known now: the cells that will run
                        n_ctx = report["metadata"]["server"]["n_ctx"]
                        prog.update(task, total=per_cell * sum(skip_reason(c, n_ctx) is None for c in todo))
                    prog.update(task, advance=n, description=cell)

                await run_matrix(client, headers, report, todo, warmups=opts["warmups"], runs=opts["runs"],
                                 seed=opts["seed"], timeout_s=opts["timeout_s"], progress=step)

    asyncio.run(main())


# --- human output ------------------------------------------------------------------------------

def _f(v: Any, nd: int = 1) -> str:
    return "-" if v is None else f"{v:.{nd}f}"


def _ppp(d: dict[str, Any] | None) -> str:
    d = d or {}
    return "/".join(_f(d.get(k)) for k in ("p50", "p95", "p99"))


def print_summary(rep: dict[str, Any], paths: dict[str, str]) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    con = Console(width=max(150, Console().width))
    md = rep["metadata"]
    srv, cl = md["server"], md["client"]
    dev = srv.get("device") or {}
    n = rep["counts"]
    con.print(f"[bold]calconsole bench matrix[/] {escape(rep['url'] or '(in-process server, 127.0.0.1)')}: "
              f"{escape(str(srv.get('build_info')))}; model {escape(str(srv.get('model_alias')))} "
              f"({escape(str(srv.get('model_path')))}); CalRT {dev.get('calrt_version', '-')}; n_ctx {srv['n_ctx']}; "
              f"pacing {dev.get('pacing', '-')}, numerics {dev.get('numerics', '-')}")
    con.print(f"{n['cells_run']} cells run, {n['cells_skipped']} skipped; {n['measured_ok']}/{n['measured']} measured "
              f"runs ok (+{n['warmups_sent']} warm-ups) in {rep['wall_s']:.1f} s; load average "
              f"{cl['load_average_before'][0]:.2f} / {cl['load_average_after'][0]:.2f} (before / after) on "
              f"{cl['cpus']} CPUs" + ("" if rep["options"]["meets_report_repetitions"]
                                      else f"; fewer than the report's {WARMUPS} warm-ups + {RUNS} runs"))
    t = Table(title="client: host wall ms P50/P95/P99 | srv: the server's timings P50 "
                    f"({escape(str(dev.get('clock', 'its own clock')))})")
    for col in ("prompt", "out", "ok", "TTFT", "TTFT srv", "TPOT", "TPOT srv", "ITL", "E2E", "E2E srv",
                "tok/s srv"):
        t.add_column(col, justify="right")
    for c in rep["cells"]:
        if c.get("skipped"):
            t.add_row(str(c["prompt"]), str(c["output"]), "skip",
                      f"[dim]P+O {c['prompt'] + c['output']} > n_ctx {srv['n_ctx']}[/]")
            continue
        cli, s = c["client"], c["server_timings"]
        t.add_row(str(c["prompt"]), str(c["output"]), f"{c['requests']['completed']}/{c['requests']['sent']}",
                  _ppp(cli["ttft_ms"]), _f((s["ttft_ms"] or {}).get("p50")), _ppp(cli["tpot_ms"]),
                  _f((s["tpot_ms"] or {}).get("p50")), _ppp(cli["itl_ms"]), _ppp(cli["e2e_ms"]),
                  _f((s["e2e_ms"] or {}).get("p50")), _f(c["decode_tok_s_p50"]["server"]))
    con.print(t)
    for c in rep["cells"]:
        if not c.get("skipped") and c.get("requests", {}).get("errors"):
            con.print(f"[red]{c['cell']} errors:[/] {escape(str(c['requests']['errors']))}")
    if srv.get("missing"):
        con.print(f"not exposed by this server: {', '.join(srv['missing'])}")
    if md.get("server_identity_changed"):
        con.print("[red]the server's identity (/props) changed during the run[/]")
    con.print(f"results: {escape(paths['json'])}, {escape(paths['cells'])}, {escape(paths['runs'])}, "
              f"{escape(paths['tokens'])}")


def plot(rep: dict[str, Any], width: int = 110, height: int = 22) -> str:
    """TTFT P50 and TPOT P50 (client wall ms, and the server's) against prompt length, one line per
    output length: two plotext plots one above the other (plotext 5.x: clf, plot, xscale, build;
    no subplots, whose state outlives ``clf`` in plotext's one global figure and breaks later plots)."""
    import plotext as plt

    ran = [c for c in rep["cells"] if not c.get("skipped")]
    out = []
    for key, title in (("ttft_ms", "TTFT P50 ms"), ("tpot_ms", "TPOT P50 ms")):
        plt.clf()
        plt.plotsize(width, height)
        plt.theme("clear")
        drawn = False
        for o in dict.fromkeys(c["output"] for c in ran):
            row = sorted((c for c in ran if c["output"] == o), key=lambda c: c["prompt"])
            for side, marker in (("client", "hd"), ("server_timings", "dot")):
                pts = [(c["prompt"], (c[side][key] or {}).get("p50")) for c in row]
                pts = [(x, y) for x, y in pts if y is not None and y > 0]
                if pts:
                    drawn = True
                    plt.plot([x for x, _ in pts], [y for _, y in pts], marker=marker,
                             label=f"out {o} {'wall' if side == 'client' else 'srv'}")
        if not drawn:
            continue  # e.g. TPOT when every output is 1 token
        plt.xscale("log")
        plt.yscale("log")
        plt.title(f"{title} vs prompt tokens (wall: client; srv: the server's timings)")
        plt.xlabel("prompt tokens")
        out.append(plt.build())
    plt.clf()
    text = "\n".join(out)
    return text if sys.stdout.isatty() else plt.uncolorize(text)
