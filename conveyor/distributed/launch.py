"""``conveyor serve --data-parallel-size N``: a local Ray (or ``--ray-address``), N engine replicas on Ray Serve,
and conveyor's own OpenAI app and uvicorn in this process as the one ingress, on the same port.

Ray's footprint is kept small, since it shares the machine with the engines: no dashboard, no Serve HTTP proxy
(conveyor's uvicorn is the ingress), a local Ray sized to the replicas' CPUs.
"""

from __future__ import annotations

import argparse
import json
import logging

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentHandle

from conveyor.distributed import parse_disaggregate
from conveyor.distributed.disagg_pool import DisaggPool
from conveyor.distributed.disagg_replicas import DecodeReplica, PrefillReplica
from conveyor.distributed.pool import ReplicaPool
from conveyor.distributed.replica import EngineReplica, ReplicaBoard
from conveyor.distributed.routers import ROUTERS
from conveyor.engine.args import EngineArgs

logger = logging.getLogger("conveyor.distributed")

APP_NAME = "conveyor"
DEPLOYMENT_NAME = "engine"
PREFILL_DEPLOYMENT, DECODE_DEPLOYMENT = "prefill", "decode"  # --disaggregate's two deployments
HEALTH_CHECK_PERIOD_S = 2.0
# A replica whose engine cannot be built (a bad flag, a missing model) fails the same way every time: give up
# soon instead of Ray Serve's default of many retries, each loading the model again.
CONSTRUCTOR_RETRIES = 2


def deploy_disaggregated(args: EngineArgs, model_name: str | None, num_prefill: int, num_decode: int,
                         router: str = "prefix", cpus_per_replica: float = 1.0, router_kwargs: dict | None = None,
                         max_ongoing_requests: int = 1024, pin_cpus: bool = False) -> DisaggPool:
    """Deploy ``num_prefill`` prefill and ``num_decode`` decode replicas as one Serve application and return the
    pool that fronts them (``disagg_pool``). ``router`` routes among the prefill replicas (the prefix router
    keeps a prompt's head where it is cached); decode replicas are picked by power of two choices (their KV
    arrives with the request, so no cache to aim for)."""
    board = ReplicaBoard.remote()
    kwargs = dict(router_kwargs or {})
    if router == "prefix":
        kwargs.setdefault("block_size", args.block_size)
    router_class = ROUTERS[router]
    router_config = (RequestRouterConfig(request_router_class=router_class, request_router_kwargs=kwargs)
                     if router_class else RequestRouterConfig())
    common = dict(ray_actor_options={"num_cpus": cpus_per_replica}, max_ongoing_requests=max_ongoing_requests,
                  health_check_period_s=HEALTH_CHECK_PERIOD_S, max_constructor_retry_count=CONSTRUCTOR_RETRIES,
                  logging_config={"log_level": "WARNING", "enable_access_log": False})
    prefill = serve.deployment(PrefillReplica).options(name=PREFILL_DEPLOYMENT, num_replicas=num_prefill,
                                                       request_router_config=router_config, **common)
    decode = serve.deployment(DecodeReplica).options(name=DECODE_DEPLOYMENT, num_replicas=num_decode, **common)
    threads = max(1, int(cpus_per_replica))
    engine = (args, model_name, threads, board)
    serve.run(decode.bind(*engine, prefill=prefill.bind(*engine, pin_cpus=pin_cpus), pin_cpus=pin_cpus),
              name=APP_NAME, route_prefix=None)
    prefill_handle = DeploymentHandle(PREFILL_DEPLOYMENT, APP_NAME)
    decode_handle = DeploymentHandle(DECODE_DEPLOYMENT, APP_NAME)
    info = decode_handle.info.remote().result().loaded()
    return DisaggPool(prefill_handle, decode_handle, info, board, APP_NAME, PREFILL_DEPLOYMENT, DECODE_DEPLOYMENT)


def deploy(args: EngineArgs, model_name: str, num_replicas: int, router: str, cpus_per_replica: float = 1.0,
           autoscaling_config: dict | None = None, router_kwargs: dict | None = None,
           max_ongoing_requests: int = 1024, pin_cpus: bool = False) -> ReplicaPool:
    """Deploy the engine replicas on the connected Ray and return the pool that fronts them (start it on the
    event loop that serves). ``max_ongoing_requests`` is high on purpose: queueing and its 503 belong to each
    engine's own bounded queue, not to Ray Serve's router."""
    board = ReplicaBoard.remote()
    kwargs = dict(router_kwargs or {})
    if router == "prefix":
        kwargs.setdefault("block_size", args.block_size)
    replicas = {"autoscaling_config": autoscaling_config} if autoscaling_config else {"num_replicas": num_replicas}
    router_class = ROUTERS[router]
    router_config = (RequestRouterConfig(request_router_class=router_class, request_router_kwargs=kwargs)
                     if router_class else RequestRouterConfig())
    deployment = serve.deployment(EngineReplica).options(
        name=DEPLOYMENT_NAME, **replicas, ray_actor_options={"num_cpus": cpus_per_replica},
        max_ongoing_requests=max_ongoing_requests, health_check_period_s=HEALTH_CHECK_PERIOD_S,
        request_router_config=router_config,
        logging_config={"log_level": "WARNING", "enable_access_log": False},  # per-request lines are uvicorn's
        max_constructor_retry_count=CONSTRUCTOR_RETRIES,
    )
    threads = max(1, int(cpus_per_replica))
    serve.run(deployment.bind(args, model_name, threads, board, pin_cpus=pin_cpus), name=APP_NAME,
              route_prefix=None)
    # Not serve.run's return value: that is this process's cached handle for the deployment, whose request router
    # was fixed when it first routed, so a second deploy in one process with another router would keep the first.
    handle = DeploymentHandle(DEPLOYMENT_NAME, APP_NAME)
    info = handle.info.remote().result().loaded()  # a replica's facts, with a tokenizer loaded here
    return ReplicaPool(handle, info, board, APP_NAME, DEPLOYMENT_NAME)


class RayJoinError(RuntimeError):
    """``--ray-address`` could not be joined; the message says what to check."""

    def __init__(self, address: str, cause: BaseException) -> None:
        super().__init__(
            f"could not join the Ray cluster at {address} ({cause}). Check the address (the GCS port `ray start "
            f"--head` printed, 6379 by default). A cluster started while a token existed (~/.ray/auth_token) "
            f"requires it: set RAY_AUTH_MODE=token (Ray sends the token only when told to for an explicit "
            f"address), or pass --ray-address auto to join the cluster `ray start` last started on this machine.")


def start_ray(address: str | None, num_cpus: float) -> None:
    """Join ``address``, or start a local Ray with ``num_cpus`` CPUs, no dashboard, quiet logs.

    The local Ray is started with ``address="local"``: without it, ``ray.init`` joins whatever cluster a
    ``ray start`` on this machine last recorded in ``/tmp/ray/ray_current_cluster`` (someone else's, or a dead
    one whose file stayed behind), and refuses ``num_cpus`` there. Raises ``RayJoinError`` when ``address``
    cannot be joined."""
    if address:
        try:
            ray.init(address=address, include_dashboard=False, logging_level=logging.WARNING)
        except ConnectionError as exc:
            raise RayJoinError(address, exc) from exc
    else:
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, logging_level=logging.WARNING)
    # No Serve HTTP proxy (conveyor's uvicorn is the ingress); Ray's own INFO lines stay in Ray's log files.
    serve.start(proxy_location="Disabled", logging_config={"log_level": "WARNING"})


def run_serve_data_parallel(ns: argparse.Namespace, args: EngineArgs) -> int:
    """The body of ``conveyor serve`` when ``--data-parallel-size`` > 1 or ``--ray-address`` is given."""
    from conveyor.distributed.metrics import PoolMetrics
    from conveyor.server.app import build_app
    from conveyor.server.batches.setup import BatchAPIConfig
    from conveyor.server.cors import CORSConfig
    from conveyor.server.launcher import make_server
    from conveyor.server.responses.store import ResponseStore

    autoscaling = json.loads(ns.autoscaling_config) if ns.autoscaling_config else None
    split = parse_disaggregate(ns.disaggregate) if getattr(ns, "disaggregate", None) else None
    num_cpus = (sum(split) if split else ns.data_parallel_size) * ns.cpus_per_replica
    if autoscaling:
        num_cpus = autoscaling.get("max_replicas", ns.data_parallel_size) * ns.cpus_per_replica
    try:
        start_ray(ns.ray_address, num_cpus)
    except RayJoinError as exc:
        logger.critical("%s", exc)
        return 1
    model_name = ns.served_model_name or args.model or None
    try:
        router_kwargs = {"imbalance_threshold": ns.router_imbalance_threshold} if ns.router == "prefix" else {}
        try:
            if split:
                pool = deploy_disaggregated(args, model_name, *split, ns.router, ns.cpus_per_replica, router_kwargs,
                                            pin_cpus=ns.pin_replica_cpus)
            else:
                pool = deploy(args, model_name, ns.data_parallel_size, ns.router, ns.cpus_per_replica, autoscaling,
                              router_kwargs, pin_cpus=ns.pin_replica_cpus)
        except RuntimeError as exc:  # the replicas' own errors are in the log above, as Ray printed them
            logger.critical("the engine replicas could not start: %s", exc)
            return 1
        model_name = model_name or pool.info.model_info.name
        if split:
            logger.info("%d prefill + %d decode replica(s) of %s on Ray Serve, prefill router %s", *split, model_name,
                        ns.router)
        else:
            logger.info("%d replica(s) of %s on Ray Serve, router %s", ns.data_parallel_size, model_name, ns.router)
        app = build_app(pool, model_name, ns.api_key, 0.0 if ns.disable_log_stats else ns.log_stats_interval,
                        ns.shutdown_timeout, ns.max_n, metrics=PoolMetrics(pool),
                        health_detail=pool.health, max_request_body_bytes=ns.max_request_body_bytes,
                        max_seqs_per_request=ns.max_seqs_per_request, tool_call_parser=ns.tool_call_parser,
                        reasoning_parser=ns.reasoning_parser, cors=CORSConfig.from_namespace(ns),
                        responses_store=ResponseStore.from_namespace(ns),
                        grammar_check_timeout_s=ns.grammar_check_timeout,
                        batches=BatchAPIConfig.from_namespace(ns, args))
        server = make_server(app, ns.host, ns.port, ns.uvicorn_log_level, ns.timeout_keep_alive, ns.timeout_headers,
                             loop=ns.uvicorn_loop)
        server.run()
    finally:
        stop_ray(joined=bool(ns.ray_address))
    return 0


def stop_ray(joined: bool) -> None:
    """Leave a joined cluster as it was (only this app is deleted); a local Ray is stopped whole, which stops
    its Serve actors with it (``serve.shutdown`` would wait for a graceful controller shutdown first)."""
    if joined:
        serve.delete(APP_NAME)
    ray.shutdown()
