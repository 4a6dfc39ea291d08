"""``conveyor serve``: an OpenAI-compatible server, flags named as in ``vllm serve``.

This module sits above ``server/`` and ``distributed/``: it picks the layout (the engine in its own process, in a
thread of this one, or ``--data-parallel-size`` replicas on Ray Serve) and builds it from those packages, so that
``server/`` never imports ``distributed/`` (which builds on ``server/``'s app).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os

logger = logging.getLogger("conveyor.server")  # its lines are the server's start-up


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def add_serve_parser(sub) -> None:
    from conveyor.engine.args import EngineArgs
    from conveyor.server.cors import add_cors_args
    from conveyor.server.limits import (
        DEFAULT_MAX_REQUEST_BODY_BYTES, DEFAULT_MAX_SEQS_PER_REQUEST, DEFAULT_TIMEOUT_KEEP_ALIVE_S,
    )

    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    p.add_argument("model_tag", nargs="?", default=None, help="model name, GGUF file or directory (same as --model)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None, help="the name clients pass as `model` (default: the "
                   "model's name, e.g. SmolLM2-135M-Instruct, or the GGUF file's / directory's name)")
    env_keys = [k for k in os.environ.get("CONVEYOR_API_KEY", "").split(",") if k]
    p.add_argument("--api-key", nargs="+", default=env_keys or None, metavar="KEY",
                   help="require one of these keys ('Authorization: Bearer KEY' or 'x-api-key: KEY') on every route "
                   "but /health and /metrics; each key sees only the responses it stored (default: "
                   "$CONVEYOR_API_KEY, comma-separated)")
    p.add_argument("--log-stats-interval", type=float, default=5.0, help="seconds between status log lines")
    p.add_argument("--disable-log-stats", action="store_true")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGINT/SIGTERM, seconds in-flight requests may take to finish before they are aborted")
    p.add_argument("--max-n", type=int, default=128,
                   help="the largest n (and best_of) one request may ask for (OpenAI's limit is 128); larger is 400")
    p.add_argument("--max-seqs-per-request", type=_positive_int, default=DEFAULT_MAX_SEQS_PER_REQUEST,
                   help="the most sequences (prompts x n) one request may ask for; more is 400 (default: the "
                   "default --max-num-seqs, one full batch)")
    p.add_argument("--max-request-body-bytes", type=_positive_int, default=DEFAULT_MAX_REQUEST_BODY_BYTES,
                   help="the largest request body the server reads; larger is 413, before the rest is read (default "
                   "4 MiB: a 128K-token prompt is under 1 MB)")
    p.add_argument("--timeout-keep-alive", type=float, default=DEFAULT_TIMEOUT_KEEP_ALIVE_S,
                   help="seconds an idle keep-alive connection stays open after a response (uvicorn's; default "
                   "65, above common clients' 5 s reuse window)")
    p.add_argument("--timeout-headers", type=float, default=10.0,
                   help="seconds a client has to send a request's headers once connected (or from the first byte "
                   "of a later request); slower or silent connections are closed")
    p.add_argument("--engine-in-process", action="store_true",
                   help="step the engine in a thread of the server's process instead of a process of its own "
                   "(then the engine and the event loop share one GIL)")
    p.add_argument("--frontend-cpus", type=int, default=0,
                   help="keep this many of the allowed CPUs for the API server and run the engine process on the "
                   "rest (one pinned torch thread each; --num-threads, if given, at most that many), as vLLM's CPU backend "
                   "keeps one for its frontend (0: share all; needs the engine in its own process)")
    p.add_argument("--uvicorn-log-level", default="info")
    p.add_argument("--uvicorn-loop", choices=("auto", "uvloop", "asyncio"), default="auto",
                   help="the server's event loop: auto takes uvloop when it is installed (uvicorn's rule)")
    from conveyor.server.tools import PARSERS

    p.add_argument("--tool-call-parser", choices=PARSERS, default=None,
                   help="the tool-call syntax of the model for tool_choice auto (default: read from the chat "
                   "template; generic, a constrained JSON reply, when it has none)")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="accepted for vLLM's command lines: tool_choice auto is always served")
    from conveyor.engine.cpu_priority import CPU_PRIORITIES
    from conveyor.server.reasoning import REASONING_PARSERS

    p.add_argument("--embedding-model", default=None, metavar="MODEL",
                   help="also serve this embedding or reranking model (a name, GGUF file or directory), in an engine "
                        "of its own behind the same server: /v1/embeddings, /v1/rerank and /v1/score go to it, or "
                        "requests naming it; --pooler-config applies to it")
    p.add_argument("--embedding-served-model-name", default=None,
                   help="the name clients pass as `model` for --embedding-model (default: its own name)")
    p.add_argument("--embedding-cpu-priority", choices=("auto", *CPU_PRIORITIES), default="auto",
                   help="the CPU priority of --embedding-model's engine process: low (nice 19: the chat engine's "
                   "threads take the cores first, so embeddings barely slow the chat's decode), idle (SCHED_IDLE: "
                   "only the cycles everything else leaves), normal (an equal share); auto: low, normal with "
                   "--engine-in-process (one process, one priority)")
    p.add_argument("--reasoning-parser", choices=REASONING_PARSERS, default=None,
                   help="the model's reasoning syntax, split off the answer as reasoning_content / thinking "
                   "(default: read from the chat template: <think> or [THINK]; none: never split)")

    from conveyor.structured.checker import CHECK_TIMEOUT_S

    p.add_argument("--grammar-check-timeout", type=float, default=CHECK_TIMEOUT_S,
                   help="seconds a new constraint (response_format, guided_*, tools) may take to compile and to "
                   "compute its first masks in the check before it runs (a worker process); slower is 400")
    add_cors_args(p)
    from conveyor.server.admission import add_admission_args
    from conveyor.server.batches.setup import add_batch_args
    from conveyor.server.responses.store import add_store_args

    add_store_args(p)
    add_batch_args(p)
    add_admission_args(p)
    _add_scale_out_args(p)
    _add_models_args(p)
    EngineArgs.add_cli_args(p, skip=("model",))
    p.set_defaults(func=run_serve)


class _ModelFlag(argparse.Action):
    """``--model PATH`` (once: the model, as ever) or ``--model NAME=PATH`` (repeatable: one more model served as
    NAME, loaded on demand)."""

    def __call__(self, parser, ns, value, option_string=None) -> None:
        from conveyor.server.model_catalog import split_named_model

        named = split_named_model(value)
        if named is None:
            ns.model = value
        else:
            ns.named_models = [*(ns.named_models or []), named]


def _add_models_args(p) -> None:
    from conveyor.engine.args import EngineArgs
    from conveyor.server.model_pool import DEFAULT_KEEP_ALIVE_S

    g = p.add_argument_group("many models, loaded on demand (docs/server.md)")
    g.add_argument("--model", action=_ModelFlag, default=None, dest="model",
                   help=EngineArgs.__dataclass_fields__["model"].metadata["help"] + "; NAME=PATH (repeatable) "
                   "serves PATH as NAME among models loaded on demand")
    p.set_defaults(named_models=None)
    g.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                   help="with --enable-lora: serve the PEFT LoRA adapter directory PATH as model NAME (vLLM's "
                   'spelling; also its JSON form {"name": ..., "path": ...}); more through /v1/load_lora_adapter '
                   "(docs/lora.md)")
    g.add_argument("--models-dir", default=None, metavar="DIR",
                   help="serve every model in DIR (each GGUF file or model directory, named by its file / directory "
                   "name), each loaded in an engine process of its own when a request first names it")
    g.add_argument("--keep-alive", type=float, default=DEFAULT_KEEP_ALIVE_S, metavar="SECONDS",
                   help="with models on demand: how long an idle model stays loaded (negative: until the server "
                   "stops); Ollama's per-request keep_alive overrides it")
    g.add_argument("--max-loaded-models", type=_positive_int, default=None, metavar="N",
                   help="with models on demand: the most models loaded at once; loading one more unloads the least "
                   "recently used idle model (requests wait while every loaded model is in use)")
    g.add_argument("--max-loaded-memory", type=float, default=None, metavar="GIB",
                   help="with models on demand: the most memory the loaded models' engine processes may hold "
                   "(measured once each is ready; before its first load a model counts its weight files); loading "
                   "one more unloads least recently used idle models until it fits; a model larger than this "
                   "loads alone")
    g.add_argument("--model-load-timeout", type=float, default=600.0, metavar="SECONDS",
                   help="with models on demand: how long a request waits for its model to load (then 503)")


# How long torch's OpenMP workers (libgomp) spin at the end of a parallel region before they sleep. A server shares
# its cores with its event loop and its clients, so workers that spin for long (libgomp's default, 300,000 spins)
# take the CPU the thread they wait for needs: at a load of 8-12 on 2 cores a step took a second. Workers that never
# spin (OMP_WAIT_POLICY=PASSIVE) pay a futex sleep and wake-up at every region, hundreds per decode step, which cut
# batch-1 decode over HTTP to a quarter. A short spin keeps consecutive regions of a step on awake workers and lets
# them sleep between steps. The numbers are in docs/serving-latency.md. libgomp reads these when torch loads it, so
# they are set before anything imports torch, and only when the user chose no wait policy of their own.
OMP_WAIT_ENV = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
# 10,000 spins is the middle of the measured range: 3,000-30,000 all gave batch-1 decode 3-4x passive's; 30,000 had
# a second-long outlier on an oversubscribed machine. A user on a crowded machine sets OMP_WAIT_POLICY=PASSIVE.
OMP_DEFAULTS = {"GOMP_SPINCOUNT": "10000"}

def set_omp_defaults(environ=os.environ) -> None:
    """Set OpenMP's wait for this process and the engine process it starts, unless ``environ`` already names a
    wait policy or spin count."""
    if not any(name in environ for name in OMP_WAIT_ENV):
        environ.update(OMP_DEFAULTS)


def _add_scale_out_args(p) -> None:
    from conveyor.distributed import ROUTER_NAMES

    g = p.add_argument_group("scale-out on Ray Serve (needs the extra: pip install 'conveyor[ray]')")
    g.add_argument("--data-parallel-size", type=int, default=1,
                   help="engine replicas behind this one endpoint, each a Ray Serve replica (1: no Ray)")
    g.add_argument("--ray-address", default=None,
                   help="join this Ray cluster (its GCS host:port, or auto: the one `ray start` last started on this "
                   "machine) instead of starting a local one")
    g.add_argument("--router", choices=ROUTER_NAMES, default="prefix",
                   help="how requests pick a replica: prefix (the replica caching the prompt's head while queues "
                   "are balanced, else power of two choices), pow2, round-robin")
    g.add_argument("--router-imbalance-threshold", type=int, default=8,
                   help="prefix router: while replicas' queues differ by at most this many requests, the prefix "
                   "decides; beyond it, power of two choices")
    g.add_argument("--disaggregate", default=None, metavar="xPyD",
                   help="disaggregated prefill/decode: x prefill and y decode replicas (e.g. 1P1D), the prompt's KV "
                   "handed over through Ray's object store (docs/disaggregation.md); replaces --data-parallel-size")
    g.add_argument("--cpus-per-replica", type=float, default=1.0, help="Ray CPUs (and torch threads) per replica")
    g.add_argument("--pin-replica-cpus", action="store_true",
                   help="pin each replica to --cpus-per-replica CPUs of its own (Ray counts CPUs but does not place "
                   "them: without it, replicas on one machine may share cores)")
    g.add_argument("--autoscaling-config", default=None,
                   help="Ray Serve autoscaling_config as JSON (e.g. '{\"min_replicas\": 1, \"max_replicas\": 4}'); "
                   "replaces --data-parallel-size")


def split_cpus(ns: argparse.Namespace, args) -> tuple[list[int], str]:
    """``--frontend-cpus N``: (the first N allowed CPUs for this process, the rest as the engine's ``cpu_ids``)."""
    cpus = sorted(os.sched_getaffinity(0))
    if ns.engine_in_process or args.cpu_ids:
        raise SystemExit("--frontend-cpus needs the engine in its own process and no --cpu-ids")
    if not 0 < ns.frontend_cpus < len(cpus):
        raise SystemExit(f"--frontend-cpus {ns.frontend_cpus}: this process may use {len(cpus)} CPUs {cpus}; "
                         "keep at least one for the engine")
    engine_cpus = len(cpus) - ns.frontend_cpus
    if args.num_threads and args.num_threads > engine_cpus:  # threads sharing a CPU wait on each other's barriers
        raise SystemExit(f"--num-threads {args.num_threads} with --frontend-cpus {ns.frontend_cpus}: the engine has "
                         f"{engine_cpus} CPU(s) left; give it at most {engine_cpus} thread(s) (or leave "
                         "--num-threads out: one per CPU)")
    return cpus[:ns.frontend_cpus], ",".join(map(str, cpus[ns.frontend_cpus:]))


def run_serve(ns: argparse.Namespace) -> int:
    set_omp_defaults()  # the engine process inherits it
    from conveyor.engine.args import EngineArgs

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    if ns.model_tag and not ns.model:
        ns.model = ns.model_tag
    args = EngineArgs.from_cli_args(ns)
    if ns.models_dir or ns.named_models:
        return run_serve_models(ns, args)
    from conveyor.server.admission import ServiceClasses

    try:
        service_classes = ServiceClasses.from_namespace(ns)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    if ns.data_parallel_size > 1 or ns.ray_address or ns.autoscaling_config or ns.disaggregate:
        if service_classes is not None:
            raise SystemExit("--service-class needs one engine (SLO-aware admission reads its queue); not with "
                             "--data-parallel-size, --disaggregate or Ray")
        if args.cpu_ids or ns.frontend_cpus:  # each replica would pin itself to the same CPUs
            raise SystemExit("--cpu-ids and --frontend-cpus place one engine; with --data-parallel-size, Ray places "
                             "the replicas (--cpus-per-replica CPUs each)")
        from conveyor.distributed import parse_disaggregate, require_ray

        if ns.disaggregate:
            if ns.autoscaling_config or ns.data_parallel_size > 1:
                raise SystemExit("--disaggregate xPyD sets the replicas; drop --data-parallel-size and "
                                 "--autoscaling-config")
            try:
                parse_disaggregate(ns.disaggregate)
            except ValueError as exc:
                raise SystemExit(str(exc)) from None
        require_ray()
        from conveyor.distributed.launch import run_serve_data_parallel

        return run_serve_data_parallel(ns, args)
    frontend_cpus = split_cpus(ns, args) if ns.frontend_cpus else None
    if frontend_cpus is not None:
        args = dataclasses.replace(args, cpu_ids=frontend_cpus[1])
    second_args = None
    if ns.embedding_model:  # its own engine, with the same knobs but its own context length
        from conveyor.engine.cpu_priority import embedding_cpu_priority

        try:
            priority = embedding_cpu_priority(ns.embedding_cpu_priority, args.cpu_priority, ns.engine_in_process)
        except ValueError as exc:
            raise SystemExit(str(exc)) from None
        second_args = dataclasses.replace(args, model=ns.embedding_model, max_model_len=None, speculative_config=None,
                                          cpu_priority=priority)
        args = dataclasses.replace(args, pooler_config=None, convert="auto")
    engine = second = None
    if not ns.engine_in_process:
        from conveyor.engine.core_client import EngineCoreClient

        engine = EngineCoreClient(args)  # the engine process starts loading the model now ...
        second = EngineCoreClient(second_args) if second_args is not None else None
    try:
        app = _start_app(ns, args, second_args, service_classes, frontend_cpus, engine, second)
    except BaseException:
        # Whatever ends the start (a refused flag, a data directory that cannot be made, Ctrl-C while loading)
        # stops the engine processes first: left running, they keep this process from exiting.
        _stop_engines(engine, second)
        raise
    from conveyor.server.launcher import make_server

    server = make_server(app, ns.host, ns.port, ns.uvicorn_log_level, ns.timeout_keep_alive, ns.timeout_headers,
                         loop=ns.uvicorn_loop)
    try:
        server.run()
    except KeyboardInterrupt:
        # uvicorn re-raises the SIGINT it handled once its graceful shutdown is over; the drain already ran, so
        # Ctrl-C ends the server like SIGTERM does, not with a traceback.
        pass
    return 1 if server.engine_died else 0  # non-zero: a supervisor restarts a server whose engine died


def _start_app(ns: argparse.Namespace, args, second_args, service_classes, frontend_cpus, engine, second):
    """Wait for the engine(s) (or build them in this process) and build the app; what cannot start raises."""
    if frontend_cpus is not None:
        os.sched_setaffinity(0, frontend_cpus[0])  # after the spawn: the engine process set its own CPUs
        logger.info("API server on CPUs %s, engine on CPUs %s", frontend_cpus[0], frontend_cpus[1])
    from conveyor.server.app import build_app  # ... while this process imports the server
    from conveyor.server.batches.setup import BatchAPIConfig
    from conveyor.server.cors import CORSConfig
    from conveyor.server.lora_adapters import parse_lora_modules
    from conveyor.server.responses.store import ResponseStore

    if ns.engine_in_process:
        from conveyor.engine.llm_engine import LLMEngine

        engine = LLMEngine(args)
        second = LLMEngine(second_args) if second_args is not None else None
    also_serve = [(second, ns.embedding_served_model_name)] if second is not None else []
    lora_modules = parse_lora_modules(ns.lora_modules)
    info = engine.info  # (the engine process: waits until it is ready)
    model = info.model_info
    if info.random_weights:
        logger.warning("serving %s: RANDOM weights, its output is noise (it exists for benchmarks)", model.name)
    logger.info("loaded %s (%.0fM parameters, %s) in %.2f s; engine ready in %.2f s: %d KV blocks of %d tokens, "
                "max_model_len %d, policy %s, engine %s", model.name, model.num_params / 1e6, model.dtype,
                info.load_time_s, info.init_time_s, info.num_kv_blocks, args.block_size, info.max_model_len,
                args.policy, "in this process" if ns.engine_in_process else f"in process {info.pid}")
    return build_app(engine, ns.served_model_name or model.name, ns.api_key,
                    0.0 if ns.disable_log_stats else ns.log_stats_interval, ns.shutdown_timeout, ns.max_n,
                    max_request_body_bytes=ns.max_request_body_bytes, max_seqs_per_request=ns.max_seqs_per_request,
                    tool_call_parser=ns.tool_call_parser, reasoning_parser=ns.reasoning_parser,
                    cors=CORSConfig.from_namespace(ns), responses_store=ResponseStore.from_namespace(ns),
                    also_serve=also_serve, grammar_check_timeout_s=ns.grammar_check_timeout,
                    batches=BatchAPIConfig.from_namespace(ns, args), service_classes=service_classes,
                    lora_modules=lora_modules)


def _stop_engines(*engines) -> None:
    """Stop engine processes that were started but will not serve (their start, or the app's, failed)."""
    from conveyor.engine.core_client import EngineCoreClient

    for engine in engines:
        if isinstance(engine, EngineCoreClient):
            try:
                asyncio.run(engine.shutdown())
            except Exception as exc:  # one that never became ready was already reaped by its wait
                logger.debug("stopping an engine that did not start: %s", exc)


def run_serve_models(ns: argparse.Namespace, args) -> int:
    """``--models-dir`` / ``--model NAME=PATH``: one API process, each model loaded on demand in an engine process
    of its own (``server/model_pool.py``); a plain ``--model`` joins them under its served name."""
    refused = [flag for flag, on in (("--engine-in-process", ns.engine_in_process),
                                     ("--embedding-model", ns.embedding_model),
                                     ("--lora-modules", ns.lora_modules), ("--enable-lora", args.enable_lora),
                                     ("--frontend-cpus", ns.frontend_cpus), ("--cpu-ids", args.cpu_ids),
                                     ("--service-class", ns.service_class),
                                     ("--data-parallel-size", ns.data_parallel_size > 1),
                                     ("--disaggregate", ns.disaggregate)) if on]
    if refused:
        raise SystemExit(f"{', '.join(refused)}: not with --models-dir / --model NAME=PATH (each model there is "
                         "one engine process of its own, loaded on demand)")
    from conveyor.engine.core_client import EngineCoreClient
    from conveyor.server.limits import max_token_chars
    from conveyor.server.serving_common import ServingContext
    from conveyor.server.cors import CORSConfig
    from conveyor.server.launcher import make_server
    from conveyor.server.model_catalog import ModelCatalog
    from conveyor.server.model_memory import GIB, MemoryBudget
    from conveyor.server.model_pool import ModelPool
    from conveyor.server.responses.store import ResponseStore
    from conveyor.server.router_app import build_router_app

    named = list(ns.named_models or [])
    if ns.model:  # the one plain --model is served too, first (the default for requests naming no model)
        named.insert(0, (ns.served_model_name or os.path.basename(ns.model.rstrip("/")).removesuffix(".gguf"),
                         ns.model))
    try:
        catalog = ModelCatalog(named, ns.models_dir)
    except (OSError, ValueError) as exc:
        raise SystemExit(str(exc)) from None

    def start_engine(name: str, path: str):
        engine = EngineCoreClient(dataclasses.replace(args, model=path), startup_timeout_s=ns.model_load_timeout)
        return engine.wait_ready()

    def make_context(engine, name: str):
        return ServingContext(engine, name, ns.max_n, ns.max_seqs_per_request, max_token_chars(engine.info.tokenizer),
                              ns.tool_call_parser, ns.reasoning_parser)

    try:
        memory = MemoryBudget(int(ns.max_loaded_memory * GIB)) if ns.max_loaded_memory is not None else None
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    pool = ModelPool(catalog, start_engine, make_context, ns.keep_alive, ns.max_loaded_models, ns.model_load_timeout,
                     memory)
    logger.info("serving %d models on demand (%s); idle ones unload after %s s%s%s", len(catalog.names),
                ", ".join(catalog.names), ns.keep_alive,
                f", at most {ns.max_loaded_models} loaded" if ns.max_loaded_models else "",
                f", at most {ns.max_loaded_memory:g} GiB loaded" if memory is not None else "")
    app = build_router_app(pool, ns.api_key, ns.shutdown_timeout, ns.max_request_body_bytes,
                           CORSConfig.from_namespace(ns), ResponseStore.from_namespace(ns))
    server = make_server(app, ns.host, ns.port, ns.uvicorn_log_level, ns.timeout_keep_alive, ns.timeout_headers,
                         exit_on_engine_death=False, loop=ns.uvicorn_loop)
    try:
        server.run()
    except KeyboardInterrupt:
        pass
    return 0
