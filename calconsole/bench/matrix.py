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
import hashlib
import math
import os
import platform
import random
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from ..commands.common import fail, print_json
from . import BenchParsers
from .serve_load import (
    COMPLETION_PATH,
    WORDS,
    BenchError,
    Record,
    _error_text,
    closed_loop,
    dist,
    metrics_delta,
    scrape,
    stream_completion,
    summarize,
)

# --- measuring: the cells over HTTP -------------------------------------------------------------
#
# The report's length matrix over HTTP (``calconsole bench matrix``): prompt x output cells, batch 1.
#
# For every cell (prompt P tokens, output O tokens; facts.md F8's lists by default) one client sends
# ``warmups`` untimed-in-the-statistics requests, then ``runs`` measured ones, one after another, to
# llama.cpp's native streaming ``/completion`` with a prompt of exactly P token ids (cut from a pool
# the server's own ``/tokenize`` made of seeded words, each run from a different offset, with
# ``cache_prompt: false``: no run reuses another's KV), ``n_predict: O``, greedy, ``ignore_eos``.
#
# Per run, on the client's clock (host wall ms; ``serve_load.stream_completion``, the definitions of
# facts.md F7): TTFT = sent -> first visible token, ITL = the gaps between content chunks, TPOT =
# (E2E - TTFT) / (n - 1), E2E = sent -> the final chunk; the raw arrival time of every content chunk
# is kept. Beside them the server's own ``timings`` of the final chunk (calconsole serve: simulated
# device ms) and, per cell, the change of ``/metrics`` over its measured runs. A cell whose
# P + O exceeds the server's ``n_ctx`` (``/props``) is skipped and reported as such.
#
# Nothing here names a model: every label comes from the server (``/props``, ``/v1/models``, the
# final chunks), recorded in ``metadata``.

#: facts.md F8 (report §12.1): prompt and output lengths, 3 warm-ups and at least 20 measured runs
PROMPTS = (1, 16, 128, 512, 2048, 4096, 8192, 16384, 32768, 40900)
OUTPUTS = (1, 32, 128, 512)
WARMUPS = 3
RUNS = 20
#: --quick: a subset that takes about a minute against a real-time server at speed 1 (about
#: 4 s of simulated device time per pass over its six cells, 11 passes)
QUICK_PROMPTS = (16, 512, 2048)
QUICK_OUTPUTS = (1, 32)
QUICK_WARMUPS = 1
QUICK_RUNS = 10
#: offsets of the prompt pool: the runs of one cell start at different tokens
POOL_SLACK = 4096
#: a fixed text whose token ids fingerprint the server's tokenizer
TOKENIZER_PROBE = "Hello, world! 你好，世界。 <|im_start|>user\n1234567890 déjà vu\t\u00a0🙂"
#: the server's timings summarised per cell beside TTFT/TPOT/ITL/E2E (llama.cpp's and calconsole's names)
TIMING_FIELDS = ("prompt_ms", "predicted_ms", "predicted_per_token_ms", "cache_n")
#: calconsole's breakdown (facts.md F8's infer / H2D / D2H / framework / sampling / KV wait)
BREAKDOWN = {"device_ms": ("infer", "h2d", "d2h"),
             "host_ms": ("framework", "sampling", "kv_wait", "tokenize", "detokenize")}


@dataclass(frozen=True)
class Cell:
    """One matrix cell: ``prompt`` token ids sent, ``output`` = ``n_predict``."""

    prompt: int
    output: int

    @property
    def name(self) -> str:
        return f"p{self.prompt}-o{self.output}"


def cells(prompts: Sequence[int], outputs: Sequence[int]) -> list[Cell]:
    """Every (prompt, output) pair, prompt-major, in the given orders."""
    return [Cell(p, o) for p in prompts for o in outputs]


def skip_reason(cell: Cell, n_ctx: int) -> str | None:
    """Why ``cell`` cannot run on a server of context ``n_ctx`` (P + O > n_ctx), or None."""
    if cell.prompt + cell.output > n_ctx:
        return f"prompt + output = {cell.prompt + cell.output} tokens exceeds the server's n_ctx {n_ctx}"
    return None


def _sha256(data: str | bytes) -> str:
    return hashlib.sha256(data.encode("utf-8") if isinstance(data, str) else data).hexdigest()


def ids_sha256(ids: Sequence[int]) -> str:
    """SHA-256 of token ids as comma-separated decimal text (reproducible from the JSON)."""
    return _sha256(",".join(map(str, ids)))


# --- the server --------------------------------------------------------------------------------

async def _get_json(client: httpx.AsyncClient, path: str, headers: Mapping[str, str], *, required: bool) -> Any:
    """GET ``path`` as JSON; BenchError (one line) if required and it fails, else None."""
    try:
        r = await client.get(path, headers=dict(headers))
        if r.status_code != 200:
            if required:
                raise BenchError(f"GET {path}: {_error_text(r.status_code, r.content)}")
            return None
        return r.json()
    except httpx.HTTPError as e:
        if required:
            raise BenchError(f"cannot reach {client.base_url}: {type(e).__name__}: {e}".rstrip(": ")) from None
        return None
    except ValueError:
        if required:
            raise BenchError(f"GET {path}: the reply is not JSON (not a llama-server-compatible server?)") from None
        return None


async def tokenize(client: httpx.AsyncClient, text: str, headers: Mapping[str, str]) -> list[int]:
    """POST /tokenize (llama-server) -> token ids; BenchError on anything else."""
    try:
        r = await client.post("/tokenize", json={"content": text}, headers=dict(headers))
        if r.status_code != 200:
            raise BenchError(f"POST /tokenize: {_error_text(r.status_code, r.content)}")
        toks = r.json()["tokens"]
        ids = [t["id"] if isinstance(t, dict) else t for t in toks]
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise BenchError("POST /tokenize: 'tokens' is not a list of token ids")
        return ids
    except httpx.HTTPError as e:
        raise BenchError(f"POST /tokenize: {type(e).__name__}: {e}") from None
    except (ValueError, KeyError, TypeError) as e:
        raise BenchError(f"POST /tokenize: unexpected reply: {type(e).__name__}: {e}") from None


async def prompt_pool(client: httpx.AsyncClient, n_tokens: int, seed: int, headers: Mapping[str, str]) -> list[int]:
    """At least ``n_tokens`` token ids of seeded words, tokenized by the server (so valid for its
    vocabulary whatever the model). Each word of WORDS is about one token; a short result is
    topped up (at most three tries)."""
    rng = random.Random(seed)
    words: list[str] = []
    ids: list[int] = []
    for _ in range(3):
        words += [rng.choice(WORDS) for _ in range(n_tokens - len(ids) + 16)]
        ids = await tokenize(client, " " + " ".join(words), headers)
        if len(ids) >= n_tokens:
            return ids[:n_tokens]
    raise BenchError(f"the server's /tokenize gave {len(ids)} tokens for {len(words)} words; "
                     f"{n_tokens} were needed")


async def server_metadata(client: httpx.AsyncClient, headers: Mapping[str, str]) -> dict[str, Any]:
    """What the server says it is: ``/props`` (build info, model alias and path, n_ctx, template hash,
    defaults, calconsole's ``device`` block: CalRT version, firmware, numerics, pacing), ``/v1/models``,
    ``/snapshot``'s device (calconsole only: bundle, status code, decode batch) and a tokenizer
    fingerprint. ``missing`` names what this server does not expose. BenchError if /props fails."""
    props = await _get_json(client, "/props", headers, required=True)
    if not isinstance(props, dict):
        raise BenchError("GET /props: not a JSON object (not a llama-server-compatible server?)")
    dgs = props.get("default_generation_settings") or {}
    n_ctx = dgs.get("n_ctx") if isinstance(dgs, dict) else None
    models = await _get_json(client, "/v1/models", headers, required=False) or {}
    model_ids = [m.get("id") for m in (models.get("data") or []) if isinstance(m, dict)]
    if not isinstance(n_ctx, int):
        meta = next((m.get("meta") for m in (models.get("data") or []) if isinstance(m, dict)), None) or {}
        n_ctx = meta.get("n_ctx") if isinstance(meta.get("n_ctx"), int) else None
    if not isinstance(n_ctx, int) or n_ctx < 2:
        raise BenchError("the server's /props gives no n_ctx (default_generation_settings.n_ctx)")
    dev: dict[str, Any] = props["device"] if isinstance(props.get("device"), dict) else {}
    snap = await _get_json(client, "/snapshot", headers, required=False)
    sdev: dict[str, Any] = snap["device"] if isinstance(snap, dict) and isinstance(snap.get("device"), dict) else {}
    template = props.get("chat_template")
    probe = await tokenize(client, TOKENIZER_PROBE, headers)
    md: dict[str, Any] = {
        "build_info": props.get("build_info"),
        "model_alias": props.get("model_alias"),
        "model_path": props.get("model_path"),
        "models": model_ids,
        "n_ctx": n_ctx,
        "total_slots": props.get("total_slots"),
        "chat_template_sha256": _sha256(template) if isinstance(template, str) else None,
        "bos_token": props.get("bos_token"), "eos_token": props.get("eos_token"),
        "tokenizer_probe_sha256": ids_sha256(probe),
        "default_params": dgs.get("params") if isinstance(dgs, dict) else None,
        "device": {k: dev.get(k) for k in ("name", "calrt_version", "firmware_commit", "context_tokens", "numerics",
                                           "pacing", "pacing_speed", "clock") if k in dev},
        "bundle": {k: sdev.get(k) for k in ("bundle", "bundle_status", "bundle_label", "decode_batch") if k in sdev},
    }
    wanted = {"build_info": md["build_info"], "model_alias": md["model_alias"],
              "chat_template": md["chat_template_sha256"], "calrt_version": md["device"].get("calrt_version"),
              "bundle": md["bundle"].get("bundle"),
              # no server route gives a hash of the calbin files (calconsole serve neither)
              "bundle_hash": None}
    md["missing"] = [k for k, v in wanted.items() if v is None]
    return md


def identity(md: Mapping[str, Any]) -> dict[str, Any]:
    """The fields that must not change during a run (a restarted or swapped server would)."""
    return {k: md.get(k) for k in ("build_info", "model_alias", "model_path", "n_ctx", "chat_template_sha256",
                                   "tokenizer_probe_sha256", "device", "bundle")}


# --- the runs ----------------------------------------------------------------------------------

def request_body(ids: Sequence[int], n_predict: int, seed: int) -> dict[str, Any]:
    """The /completion body of every run: token-id prompt, greedy, EOS ignored, no prompt cache."""
    return {"prompt": list(ids), "n_predict": n_predict, "stream": True, "temperature": 0.0, "seed": seed,
            "ignore_eos": True, "cache_prompt": False}


#: what every request sets (the rest are the server's defaults, recorded from /props)
REQUEST_TEMPLATE = {"endpoint": COMPLETION_PATH, "stream": True, "temperature": 0.0, "ignore_eos": True,
                    "cache_prompt": False, "prompt": "token ids (exact length) from the pool",
                    "seed": "base seed + run index"}


def run_row(rec: Record, cell: Cell, run: int, index: int, warmup: bool, seed: int, offset: int,
            sent_s: float) -> dict[str, Any]:
    """One run as kept in the report: client figures (host wall ms) with the raw arrival times,
    the server's final-chunk timings (its clock), the model and settings it says it used."""
    fin = rec.final or {}
    return {"cell": cell.name, "prompt": cell.prompt, "output": cell.output, "run": run, "index": index,
            "warmup": warmup, "seed": seed, "pool_offset": offset, "sent_s": sent_s, "ok": rec.ok,
            "error": rec.error, "prompt_tokens": rec.prompt_tokens, "output_tokens": rec.output_tokens,
            "ttft_ms": rec.ttft_ms, "tpot_ms": rec.tpot_ms, "e2e_ms": rec.e2e_ms, "itl_ms": rec.itl_ms,
            "arrivals_ms": rec.arrivals_ms, "arrival_tokens": rec.arrival_tokens,
            "model": fin.get("model"), "stop_type": fin.get("stop_type"),
            "generation_settings": fin.get("generation_settings"), "server_timings": rec.server}


def _breakdown(records: Sequence[Record]) -> dict[str, Any]:
    srv = [r.server for r in records if r.ok and r.server]
    out: dict[str, Any] = {k: dist([t.get(k) for t in srv]) for k in TIMING_FIELDS}
    for group, keys in BREAKDOWN.items():
        for k in keys:
            vals = [(t.get(group) or {}).get(k) for t in srv if isinstance(t.get(group), dict)]
            if any(v is not None for v in vals):
                out[f"{group}.{k}"] = dist(vals)
    return out


def cell_summary(cell: Cell, records: Sequence[Record], duration_s: float, before: Any, after: Any,
                 why: str | None) -> dict[str, Any]:
    """``serve_load.summarize`` of the measured runs, the server's breakdown and the /metrics delta."""
    res = summarize(records, duration_s)
    res["server_timings"].update(_breakdown(records))
    res["server_timings"]["clock"] = "the server's final-chunk timings (calconsole serve: simulated device ms)"
    res["server_metrics"] = metrics_delta(before, after) if before is not None and after is not None \
        else {"unavailable": why}
    ok = [r for r in records if r.ok]
    res["short_outputs"] = sum(1 for r in ok if (r.output_tokens or 0) < cell.output)
    res["prompt_tokens_exact"] = all(r.prompt_tokens == cell.prompt for r in ok)
    tpot = (res["client"]["tpot_ms"] or {}).get("p50")
    stpot = (res["server_timings"]["tpot_ms"] or {}).get("p50") if res["server_timings"]["tpot_ms"] else None
    res["decode_tok_s_p50"] = {"client": 1e3 / tpot if tpot else None, "server": 1e3 / stpot if stpot else None}
    return res


Progress = Callable[[str, int], None]  # (cell name, requests just finished)


async def run_matrix(client: httpx.AsyncClient, headers: Mapping[str, str], report: dict[str, Any],
                     todo: Sequence[Cell], *, warmups: int, runs: int, seed: int, timeout_s: float,
                     progress: Progress | None = None) -> None:
    """Run ``todo`` against the server into ``report`` (mutated as it goes, so an interrupted run
    keeps what it measured): ``metadata``, ``cells`` (one entry per cell, skipped ones with
    ``skipped``; each run with its raw times in ``runs``). BenchError if the server cannot be used."""
    t0 = time.perf_counter()
    md = await server_metadata(client, headers)
    report["metadata"]["server"] = md
    n_ctx = md["n_ctx"]
    longest = max((c.prompt for c in todo if skip_reason(c, n_ctx) is None), default=1)
    per_cell = warmups + runs
    pool = await prompt_pool(client, longest + min(POOL_SLACK, per_cell * len(todo)), seed, headers)
    report["metadata"]["prompt_pool"] = {"tokens": len(pool), "sha256": ids_sha256(pool), "seed": seed,
                                         "source": "seeded words, tokenized by the server's /tokenize"}
    index = 0
    for cell in todo:
        entry: dict[str, Any] = {"cell": cell.name, "prompt": cell.prompt, "output": cell.output}
        report["cells"].append(entry)
        why = skip_reason(cell, n_ctx)
        if why is not None:
            entry["skipped"] = why
            continue
        entry["skipped"] = None
        entry["runs"] = []  # filled run by run: an interrupted cell keeps the runs it finished
        entry["complete"] = False
        entry.update(await _run_cell(client, headers, cell, pool, index, entry["runs"], warmups=warmups, runs=runs,
                                     seed=seed, timeout_s=timeout_s, t0=t0, progress=progress))
        entry["complete"] = True
        index += per_cell
    end = await server_metadata(client, headers)
    report["metadata"]["server_identity_changed"] = identity(end) != identity(md)


async def _run_cell(client: httpx.AsyncClient, headers: Mapping[str, str], cell: Cell, pool: Sequence[int],
                    base: int, rows: list[dict[str, Any]], *, warmups: int, runs: int, seed: int, timeout_s: float,
                    t0: float, progress: Progress | None) -> dict[str, Any]:
    """One cell: ``warmups`` then ``runs`` requests in a row (one client), /metrics scraped around the
    measured ones. Run k of the whole matrix (``base`` + i) has seed ``seed + k`` and its prompt from
    pool offset k * 7919 mod the free offsets (a prime stride: neighbouring runs start far apart).
    Each run is appended to ``rows`` as it ends."""

    async def one(i: int) -> Record:
        k, warm = base + i, i < warmups
        off = (k * 7919) % (len(pool) - cell.prompt + 1)
        s = (seed + k) % 2**32
        sent = time.perf_counter() - t0
        rec = await stream_completion(client, request_body(pool[off:off + cell.prompt], cell.output, s),
                                      cell.name, headers, timeout_s)
        rows.append(run_row(rec, cell, i if warm else i - warmups, k, warm, s, off, sent))
        if progress is not None:
            progress(cell.name, 1)
        return rec

    for i in range(warmups):
        await one(i)
    before, why_b = await scrape(client, headers)
    measured, dur = await closed_loop(lambda i: one(warmups + i), 1, n_requests=runs)
    after, why_a = await scrape(client, headers)
    return cell_summary(cell, measured, dur, before, after, why_b or why_a)


def new_report(url: str | None, argv_opts: Mapping[str, Any]) -> dict[str, Any]:
    """The report skeleton: options, client host facts, clocks, empty cells."""
    from .. import __version__

    return {"tool": "calconsole bench matrix", "url": url, "in_process": url is None, "options": dict(argv_opts),
            "clocks": {"client": "host wall ms (time.perf_counter, client side)",
                       "server_timings": "the server's own (calconsole serve: simulated device ms)",
                       "server_metrics": "the server's /metrics histograms (calconsole serve: simulated)"},
            "metadata": {"client": {"calconsole": __version__, "python": platform.python_version(),
                                    "host": platform.node(), "cpus": os.cpu_count(),
                                    "load_average_before": list(os.getloadavg())},
                         "request": REQUEST_TEMPLATE},
            "cells": []}


def counts(report: Mapping[str, Any]) -> dict[str, int]:
    """Cells run / skipped, runs sent (warm-ups included), measured, ok, failed."""
    ran = [c for c in report["cells"] if not c.get("skipped")]
    rows = [r for c in ran for r in c.get("runs", [])]
    meas = [r for r in rows if not r["warmup"]]
    return {"cells": len(report["cells"]), "cells_run": len(ran), "cells_skipped": len(report["cells"]) - len(ran),
            "runs_sent": len(rows), "warmups_sent": len(rows) - len(meas), "measured": len(meas),
            "measured_ok": sum(r["ok"] for r in meas), "measured_failed": sum(not r["ok"] for r in meas)}


# --- files -------------------------------------------------------------------------------------

CELL_COLUMNS = ("cell", "prompt", "output", "skipped", "runs", "ok", "failed", "short_outputs")
STATS = ("mean", "p50", "p95", "p99")


def cell_rows(report: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One flat row per cell (cells.csv): counts, client TTFT/TPOT/ITL/E2E (wall ms) and the server's
    (its clock), each mean/P50/P95/P99; the server's /metrics token and request deltas."""
    out = []
    for c in report["cells"]:
        row: dict[str, Any] = {"cell": c["cell"], "prompt": c["prompt"], "output": c["output"],
                               "skipped": c.get("skipped") or ""}
        if not c.get("skipped") and "requests" not in c:  # interrupted inside this cell: runs only
            meas = [r for r in c.get("runs") or [] if not r["warmup"]]
            row.update(runs=len(meas), ok=sum(r["ok"] for r in meas), failed=sum(not r["ok"] for r in meas))
        elif not c.get("skipped"):
            req = c["requests"]
            row.update(runs=req["sent"], ok=req["completed"], failed=req["failed"], short_outputs=c["short_outputs"])
            for side, block in (("client", c["client"]), ("server", c["server_timings"])):
                for m in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
                    d = block.get(m) or {}
                    for st in STATS:
                        row[f"{side}_{m}_{st}"] = d.get(st)
            sm = (c.get("server_metrics") or {}).get("counters") or {}
            row["metrics_tokens_predicted"] = sm.get("tokens_predicted_total")
            row["metrics_requests_finished"] = sm.get("requests_finished_total")
        out.append(row)
    return out


RUN_COLUMNS = ("cell", "prompt", "output", "run", "index", "warmup", "seed", "pool_offset", "sent_s", "ok", "error",
               "prompt_tokens", "output_tokens", "ttft_ms", "tpot_ms", "e2e_ms", "model", "stop_type",
               "server_ttft_ms", "server_tpot_ms", "server_e2e_ms", "server_prompt_ms", "server_predicted_ms",
               "server_cache_n")


def write_outputs(report: Mapping[str, Any], out_dir: str) -> dict[str, str]:
    """``matrix.json`` (the whole report), ``cells.csv`` (one row per cell), ``runs.csv`` (one row per
    run, warm-ups included) and ``tokens.csv`` (one row per content chunk of every run: arrival in
    host wall ms since the run was sent, tokens generated by then) into ``out_dir``. OSError as raised."""
    import csv
    import json

    paths = {k: os.path.join(out_dir, f) for k, f in (("json", "matrix.json"), ("cells", "cells.csv"),
                                                      ("runs", "runs.csv"), ("tokens", "tokens.csv"))}
    with open(paths["json"], "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1, default=str, ensure_ascii=False)
        f.write("\n")
    crow = cell_rows(report)
    cols = list(dict.fromkeys([*CELL_COLUMNS, *(k for r in crow for k in r)]))
    with open(paths["cells"], "w", encoding="utf-8", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols)
        w.writeheader()
        w.writerows(crow)
    runs = [r for c in report["cells"] for r in c.get("runs") or []]
    with open(paths["runs"], "w", encoding="utf-8", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(RUN_COLUMNS))
        w.writeheader()
        for r in runs:
            t = r.get("server_timings") or {}
            w.writerow({**{k: r.get(k) for k in RUN_COLUMNS if not k.startswith("server_")},
                        **{f"server_{k}": t.get(k) for k in ("ttft_ms", "tpot_ms", "e2e_ms", "prompt_ms",
                                                             "predicted_ms", "cache_n")}})
    with open(paths["tokens"], "w", encoding="utf-8", newline="") as f:
        w2 = csv.writer(f)
        w2.writerow(["cell", "index", "warmup", "chunk", "arrival_ms", "tokens"])
        for r in runs:
            for j, (ms, n) in enumerate(zip(r["arrivals_ms"], r["arrival_tokens"], strict=True)):
                w2.writerow([r["cell"], r["index"], r["warmup"], j, ms, n])
    return paths


# --- the command: options, run, printed summary -----------------------------------------------

MAX_PROMPT = 1_000_000
MAX_OUTPUT = 4096


def register(bsub: BenchParsers) -> None:
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
    from .serve import _api_key

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
            from .serve import in_process_server

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
