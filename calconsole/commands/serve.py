"""``calconsole serve``: the simulated device behind llama-server's and OpenAI's HTTP API.

Real clients (the openai SDK, curl, Prometheus, benchmark tools) drive the same in-process
simulator the console runs. Binds 127.0.0.1 by default; binding any other address without an
API key is refused. Maintenance routes exist only with an admin key. One log line per request
on stderr; SIGINT/SIGTERM stop it cleanly (streams end with an error event, KV freed).
"""

from __future__ import annotations

import argparse
import logging
import socket
import sys
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sim_backend.compose import System

    from ..server.face import ServeConfig, ServingFace
    from ..server.keys import KeyRing

from .common import Subparsers, add_common_options, build_from_args, fail
from .metrics import parse_slo


def add_key_options(p: argparse.ArgumentParser) -> None:
    """``--api-key KEY``, ``--api-key-file FILE``, ``--admin-key-file FILE`` on ``serve``.

    The two file options default to ``argparse.SUPPRESS``: the top-level parser defines the same names (for
    ``--listen`` / ``--connect``) with default None, so ``calconsole --api-key-file F serve`` keeps F. A
    default of None here overwrote it, and the server then listened with no API key (``API key off``) and no
    maintenance routes, silently."""
    g = p.add_argument_group("keys (prefer the files or the environment: a flag is visible in ps)")
    g.add_argument("--api-key", default=None, metavar="KEY",
                   help="API key every route but /health needs (Authorization: Bearer KEY, or X-Api-Key: KEY "
                        "as llama-server takes it); "
                        "also $CALCONSOLE_API_KEY")
    g.add_argument("--api-key-file", default=argparse.SUPPRESS, metavar="FILE",
                   help="file of API keys, one per line ('KEY' or 'LABEL KEY'; mode 600)")
    g.add_argument("--admin-key-file", default=argparse.SUPPRESS, metavar="FILE",
                   help="file of admin keys for /maintenance/... (without one, or $CALCONSOLE_ADMIN_KEY, "
                        "no maintenance route exists)")


def register(sub: Subparsers, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "serve", help="serve the simulated device over HTTP (llama-server + OpenAI routes)",
        description="Serve the simulated device behind llama-server's and OpenAI's HTTP routes: /health, "
                    "/props, /slots, /metrics, /tokenize, /detokenize, /apply-template, /completion, /infill, "
                    "/v1/models, /v1/completions, /v1/chat/completions (SSE streaming), /snapshot and "
                    "/snapshot/stream (read-only), and with an admin key /maintenance/... (leases that expire, "
                    "audited). Timings in responses are simulated ms: device time plus the host work "
                    "booked on the same clock (--host-time).")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind, or several as a comma list (default 127.0.0.1; any non-loopback "
                        "address needs an API key)")
    p.add_argument("--port", type=int, default=8080, help="port (default 8080; 0 picks a free one)")
    add_key_options(p)
    p.add_argument("--no-slots-endpoint", action="store_true", help="disable /slots (501, as llama-server)")
    p.add_argument("--no-metrics", action="store_true", help="disable /metrics (501)")
    p.add_argument("--slot-save-path", default=None, metavar="DIR",
                   help="directory of slot state files: POST /slots/{id}?action=save|restore|erase with "
                        "{\"filename\": NAME} (a plain file name in DIR); without it the slot actions answer 501 "
                        "(llama-server's --slot-save-path). With an admin key they need it, else the API key")
    p.add_argument("--max-streams", type=int, default=16, metavar="N",
                   help="generation requests in flight at once, streaming or not (default 16; more: 503)")
    p.add_argument("--queue-limit", type=int, default=16, metavar="N",
                   help="requests that may wait for a slot beyond the free ones (default 16; more: 503)")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20, metavar="N", help="request body limit (1 MiB)")
    p.add_argument("--request-timeout", type=float, default=600.0, metavar="S",
                   help="per-request deadline in host seconds (default 600): then a request is cancelled (503), "
                        "or one without a limit (max_tokens -1) ends as at its limit (finish_reason length)")
    p.add_argument("--send-timeout", type=float, default=30.0, metavar="S",
                   help="a stream whose reader takes no chunk for S seconds is closed and cancelled (default 30)")
    p.add_argument("--lease-ttl", type=float, default=30.0, metavar="S",
                   help="a maintenance lease not renewed for S seconds lapses (default 30)")
    p.add_argument("-n", "--n-predict", type=int, default=-1, metavar="N",
                   help="default generation limit when a request gives none (-1: until the context is full)")
    p.add_argument("-b", "--batch-size", type=int, default=2048, metavar="N",
                   help="llama-server's logical batch (default 2048): sizes /infill's cuts of its prefix (the last "
                        "3*(N/4) tokens) and suffix, as there")
    p.add_argument("--spm-infill", action="store_true",
                   help="/infill puts the suffix before the prefix (suffix-prefix-middle), as llama-server's")
    p.add_argument("--alias", default=None,
                   help="model name reported by /v1/models and responses; a comma list gives aliases (the first "
                        "is reported; default: the bundle's name)")
    p.add_argument("--tags", default="", help="comma list of tags /v1/models shows (llama-server's --tags)")
    p.add_argument("-c", "--ctx-size", type=int, default=None, metavar="N",
                   help="slot context in tokens, 1..40960: a longer prompt is refused (exceed_context_size_error), "
                        "generation stops at it (default: the calbin's 40960, which it stays)")
    p.add_argument("--context-shift", action=argparse.BooleanOptionalAction, default=False,
                   help="when a slot's context fills during generation, keep n_keep tokens, discard half of the "
                        "rest and go on (llama-server's --context-shift / --no-context-shift; default: off, as "
                        "there: generation stops with finish_reason length)")
    p.add_argument("--seed", type=int, default=None, metavar="N",
                   help="seed of requests that give none; -1 (as llama-server) or none: a fresh random seed each, "
                        "reported per result; another negative is read modulo 2**32, as llama-server")
    p.add_argument("--slo", default=None, metavar="SPEC",
                   help="goodput SLOs the engine checks, vLLM style: ttft:MS,tpot:MS,e2el:MS (simulated ms, each a "
                        "positive finite number, each key at most once); /metrics and /snapshot report goodput "
                        "against them and an attached console names them (default: none, every finished request "
                        "counts)")
    p.add_argument("--http", choices=("auto", "h11", "httptools"), default="h11",
                   help="HTTP/1.1 implementation: httptools (C parser on uvloop), h11 (pure Python), "
                        "auto: httptools when installed (default h11)")
    p.add_argument("--cors-origins", default=None, metavar="LIST",
                   help="browser origins allowed (CORS), a comma list or '*' (default: pages on localhost)")
    g = p.add_argument_group("chat template (llama-server's options)")
    g.add_argument("--chat-template-file", metavar="FILE", default=None,
                   help="a Hugging Face chat template (Jinja) that replaces the model's: rendered with jinja2 in a "
                        "sandbox, as transformers renders it (raise_exception, strftime_now, tojson); /props reports "
                        "it, /apply-template renders it")
    g.add_argument("--chat-template", metavar="NAME|JINJA", default=None,
                   help="llama-server's built-in template NAME (chatml, llama3, command-r, gemma, phi3, mistral-v7, "
                        "...: the Jinja equivalents of llama.cpp's formatters; a name not offered is refused with the "
                        "list) or a template's Jinja text")
    g.add_argument("--jinja", action="store_true",
                   help="accepted as llama-server takes it; chat templates are always rendered as Jinja here (the "
                        "built-in Qwen3 template is the real one's equivalent, checked against it)")
    g.add_argument("-rea", "--reasoning", metavar="on|off|auto", default=None,
                   help="thinking by default (llama-server's): on, or off (a request gets Qwen3's empty think "
                        "block), or auto (the template decides: on when it has a thinking mode); a request's "
                        "chat_template_kwargs.enable_thinking still decides for itself. Also llama-server's "
                        "spellings enabled/true/1, disabled/false/0, -1. Over --chat-template-kwargs' "
                        "enable_thinking")
    g.add_argument("--chat-template-kwargs", metavar="JSON", default=None,
                   help="template variables every request gets under its own chat_template_kwargs, a JSON object "
                        "(e.g. '{\"enable_thinking\": false}': thinking off unless a request turns it on)")
    g = p.add_argument_group("many boards (trials of the fleet view)")
    g.add_argument("--boards", type=int, default=None, metavar="N",
                   help="start N isolated simulator processes (1..64), one per board, on consecutive ports from "
                        "--port (0: each picks a free one), each with its own audit log; writes a fleet file for "
                        "'calconsole --fleet FILE'; Ctrl-C stops them all")
    g.add_argument("--boards-dir", metavar="DIR", default=None,
                   help="with --boards: where the audit logs and the fleet file go (default: the user state dir)")
    g.add_argument("--fleet-out", metavar="FILE", default=None,
                   help="with --boards: write the fleet file here (default DIR/fleet.yaml)")
    add_common_options(p, default_pacing="realtime")
    p.set_defaults(func=run)


def load_serving_keys(args: argparse.Namespace) -> tuple[KeyRing | None, KeyRing | None]:
    """(API keys, admin keys) from the options and environment; refuses a non-loopback bind without an
    API key. Raises KeySourceError / ValueError with a one-line reason."""
    from ..server.keys import load_keys
    from ..server.run import is_loopback

    api = load_keys("api", key=getattr(args, "api_key", None), key_file=getattr(args, "api_key_file", None))
    admin = load_keys("admin", key_file=getattr(args, "admin_key_file", None))
    for host in hosts_of(args.host):
        if not is_loopback(host) and api is None:
            raise ValueError(f"refusing to listen on {host} without an API key: give --api-key-file "
                             "(or $CALCONSOLE_API_KEY), or bind 127.0.0.1")
    return api, admin


def hosts_of(spec: str) -> list[str]:
    """The addresses of a ``--host`` comma list (llama-server's form); ValueError for an empty one."""
    hosts = [h.strip() for h in str(spec).split(",") if h.strip()]
    if not hosts:
        raise ValueError("--host must name an address")
    return hosts


def _list(spec: str | None) -> tuple[str, ...]:
    return tuple(x.strip() for x in (spec or "").split(",") if x.strip())


#: longest --chat-template-file read (bytes; real templates are 1-20 KB)
MAX_TEMPLATE_FILE_BYTES = 1 << 20


def chat_template_of(args: argparse.Namespace) -> tuple[str | None, str]:
    """(Jinja source or None, its name for messages) from ``--chat-template-file`` / ``--chat-template``.
    ValueError (one line) for an unreadable, non-UTF-8 or oversized file, both options, or a built-in name
    that is not offered."""
    path, spec = getattr(args, "chat_template_file", None), getattr(args, "chat_template", None)
    if path and spec:
        raise ValueError("give --chat-template-file or --chat-template, not both")
    if spec:
        from sim_backend.compose import builtin_chat_template

        return builtin_chat_template(spec), f"--chat-template {spec[:40]}"
    if not path:
        return None, ""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_TEMPLATE_FILE_BYTES + 1)
    except OSError as e:
        raise ValueError(f"--chat-template-file {path}: {e.strerror or e}") from None
    if len(data) > MAX_TEMPLATE_FILE_BYTES:
        raise ValueError(f"--chat-template-file {path}: longer than {MAX_TEMPLATE_FILE_BYTES >> 20} MiB")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise ValueError(f"--chat-template-file {path}: not UTF-8 text (byte {e.start})") from None
    if path.endswith(".json"):  # a tokenizer_config.json: its chat_template, as transformers reads it
        import json

        try:
            obj = json.loads(text)
        except ValueError as e:
            raise ValueError(f"--chat-template-file {path}: not valid JSON: {e}") from None
        tmpl = obj.get("chat_template") if isinstance(obj, dict) else None
        if isinstance(tmpl, list):  # named templates: the default one
            tmpl = next((t.get("template") for t in tmpl if isinstance(t, dict) and t.get("name") == "default"), None)
        if not isinstance(tmpl, str):
            raise ValueError(f"--chat-template-file {path}: no 'chat_template' string in this JSON file")
        text = tmpl
    return text, path


def template_kwargs_of(spec: str | None) -> dict[str, Any] | None:
    """``--chat-template-kwargs`` JSON -> dict (ValueError, one line, for anything but a JSON object)."""
    if spec is None:
        return None
    import json

    try:
        obj = json.loads(spec)
    except ValueError as e:
        raise ValueError(f"--chat-template-kwargs must be a JSON object: {e}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"--chat-template-kwargs must be a JSON object, got {type(obj).__name__}")
    if "enable_thinking" in obj and not isinstance(obj["enable_thinking"], bool):
        raise ValueError("--chat-template-kwargs: enable_thinking must be true or false")
    return obj


def _context_kw(args: argparse.Namespace) -> dict[str, Any]:
    """The engine's context options: with ``--context-shift`` the engine runs at ``--ctx-size`` (it shifts there;
    the face's cut of the generation limit to the context left would stop it instead); without, nothing (the
    face keeps enforcing ``--ctx-size``)."""
    if not getattr(args, "context_shift", False):
        return {}
    return {"context_shift": True, "n_ctx": getattr(args, "ctx_size", None)}


class _StampFormatter(logging.Formatter):
    """``%(asctime)s`` as logging writes it (``2026-01-02 03:04:05,678``), its date and time formatted once per
    second: the access log writes a line for every request."""

    _second = -1
    _stamp = ""

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:  # noqa: N802 - logging's
        if datefmt is not None:
            return super().formatTime(record, datefmt)
        s = int(record.created)
        if s != self._second:
            self._second, self._stamp = s, time.strftime("%Y-%m-%d %H:%M:%S", self.converter(s))
        return f"{self._stamp},{int(record.msecs):03d}"


def log_to_stderr() -> None:
    """The serve process's log: INFO and up on stderr, ``time name message``. Records skip the process and
    thread fields (logging's own advice for speed: this format shows neither)."""
    logging.logProcesses = logging.logThreads = logging.logMultiprocessing = False
    if hasattr(logging, "logAsyncioTasks"):  # 3.12+: the task's name, looked up for every record
        logging.logAsyncioTasks = False
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_StampFormatter("%(asctime)s %(name)s %(message)s"))
    logging.basicConfig(level=logging.INFO, handlers=[handler])


#: ``--reasoning`` values as llama-server reads them (``common_arg_utils::is_truthy`` / ``is_falsey`` /
#: ``is_autoy`` in llama.cpp's common/arg.cpp: exact, lower-case spellings)
REASONING_VALUES: dict[str, bool | None] = {"on": True, "enabled": True, "true": True, "1": True,
                                            "off": False, "disabled": False, "false": False, "0": False,
                                            "auto": None, "-1": None}


def reasoning_of(value: str | None) -> bool | None:
    """``--reasoning`` -> the default ``enable_thinking`` (True / False), or None for auto (and no option).
    ValueError (one line) for a value llama-server does not accept."""
    if value is None:
        return None
    if value not in REASONING_VALUES:
        raise ValueError(f"--reasoning must be on, off or auto (or llama-server's enabled/true/1, "
                         f"disabled/false/0, -1), got {value!r}")
    return REASONING_VALUES[value]


def server_template_kwargs(args: argparse.Namespace) -> dict[str, Any] | None:
    """The template variables every request gets: ``--chat-template-kwargs`` with ``--reasoning``'s
    ``enable_thinking`` over its own (llama-server writes both into the same defaults). ValueError."""
    kwargs = template_kwargs_of(getattr(args, "chat_template_kwargs", None))
    think = reasoning_of(getattr(args, "reasoning", None))
    if think is not None:
        kwargs = {**(kwargs or {}), "enable_thinking": think}
    return kwargs


def serve_config(args: argparse.Namespace, model_alias: str) -> ServeConfig:
    """The checked ``ServeConfig`` of the options (no device needed: ``model_alias`` is the bundle's name
    when ``--alias`` is not given); ValueError / KeySourceError with a one-line reason."""
    from sim_backend.planes import seed_or_random

    from ..server.face import ServeConfig

    api, admin = load_serving_keys(args)
    cfg = ServeConfig(host=args.host, port=args.port, api_keys=api, admin_keys=admin,
                      slots_endpoint=not getattr(args, "no_slots_endpoint", False),
                      metrics_endpoint=not getattr(args, "no_metrics", False),
                      max_streams=getattr(args, "max_streams", 16), max_body_bytes=getattr(args, "max_body_bytes",
                                                                                           1 << 20),
                      request_timeout_s=getattr(args, "request_timeout", 600.0),
                      send_timeout_s=getattr(args, "send_timeout", 30.0), lease_ttl_s=getattr(args, "lease_ttl", 30.0),
                      n_predict=getattr(args, "n_predict", -1),
                      model_alias=getattr(args, "alias", None) or model_alias,
                      model_tags=_list(getattr(args, "tags", "")), n_ctx=getattr(args, "ctx_size", None),
                      seed=seed_or_random(getattr(args, "seed", None)),
                      cors_origins=_list(getattr(args, "cors_origins", None)) or None,
                      slot_save_path=getattr(args, "slot_save_path", None),
                      chat_template_kwargs=server_template_kwargs(args),
                      n_batch=getattr(args, "batch_size", 2048), spm_infill=getattr(args, "spm_infill", False),
                      http=getattr(args, "http", "h11"))
    cfg.check()
    return cfg


def build_face(args: argparse.Namespace, system: System) -> tuple[ServeConfig, ServingFace]:
    """(ServeConfig, ServingFace) from the options; ValueError / KeySourceError with a one-line reason."""
    from ..server.face import ServingFace

    cfg = serve_config(args, system.bundle.name)
    audit = system.maintenance.audit if system.maintenance is not None else None
    face = ServingFace(system.inference, system.observation, system.maintenance, cfg, audit=audit)
    return cfg, face


def bind_all(args: argparse.Namespace) -> list[socket.socket]:
    """A listening socket per ``--host`` address on ``--port``; OSError (the others closed) if one cannot bind."""
    from ..server.run import bind_socket

    socks = []
    try:
        for h in hosts_of(args.host):
            socks.append(bind_socket(h, args.port))
    except OSError:
        for sk in socks:
            sk.close()
        raise
    return socks


def run(args: argparse.Namespace) -> int:
    from sim_backend.planes import CalError

    from ..server.keys import KeySourceError
    from ..server.run import serve_foreground

    if getattr(args, "boards", None) is not None:
        from ..fleet.launcher import launch

        try:  # refused once here, not by every board
            reasoning_of(getattr(args, "reasoning", None))
        except ValueError as e:
            return fail(str(e))
        return launch(args)
    log_to_stderr()
    # every option, the keys and the bind before the simulator is built (a first start compiles the
    # kernels for minutes): a refused start costs nothing. Bound here, the sockets take connections
    # into their backlog while the device starts; uvicorn answers them once it is up.
    try:
        if not 1 <= args.queue_limit <= 1024:
            raise ValueError(f"--queue-limit must be in 1..1024, got {args.queue_limit}")
        serve_config(args, "?")
        slo = parse_slo(args.slo) if getattr(args, "slo", None) is not None else None
        template, template_name = chat_template_of(args)
        socks = bind_all(args)
    except (KeySourceError, ValueError) as e:
        return fail(str(e))
    except OSError as e:
        return fail(f"cannot listen on {args.host}:{args.port}: {e.strerror or e}")
    try:
        try:
            # numerics in a worker process, as in the console: the event loop and the model would share one GIL
            system = build_from_args(args, maintenance=args.admin_key_file is not None or _env_admin(),
                                     queue_limit=args.queue_limit, numerics_process=not args.timing_only, slo=slo,
                                     chat_template=template, chat_template_name=template_name,
                                     **_context_kw(args),
                                     numerics_progress=lambda line: print(f"calconsole serve: {line}",
                                                                          file=sys.stderr, flush=True))
        except (CalError, ValueError) as e:
            return fail(str(e))
        try:
            try:
                cfg, face = build_face(args, system)
                if face.audit is not None:  # there from the start (``--audit-log`` help), proved by its probe
                    face.audit.create()
            except (KeySourceError, ValueError, CalError) as e:
                return fail(str(e))
            where = ", ".join("http://" + (f"[{h}]:{p}" if ":" in h else f"{h}:{p}")
                              for h, p in (s.getsockname()[:2] for s in socks))

            def announce() -> None:
                # printed once uvicorn is up with its signal handlers: a stop after this line is a clean stop
                mode = "timing-only" if args.timing_only else "numerics"
                print(f"calconsole serve: listening on {where} ({args.pacing} pacing, "
                      f"{mode}; API key {'required' if cfg.api_keys else 'off'}; "
                      f"maintenance routes {'on' if face.maintenance is not None else 'off'}); Ctrl-C stops",
                      file=sys.stderr, flush=True)

            serve_foreground(face, socks, on_started=announce)
            print("calconsole serve: stopped", file=sys.stderr, flush=True)
        finally:
            system.close()
    finally:
        for sk in socks:  # uvicorn closes what it served; closing again is harmless
            sk.close()
    return 0


def _env_admin() -> bool:
    import os

    from ..server.keys import ENV_ADMIN_KEY

    return bool(os.environ.get(ENV_ADMIN_KEY))
