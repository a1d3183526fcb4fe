"""Start the service: run directory, backend, incumbent, HTTP server and the candidate loop, in
one task group; SIGINT or SIGTERM stops it (what is published is already on disk)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable

from headrace.core import logs
from headrace.core.errors import ConfigError
from headrace.net.addresses import is_loopback
from headrace.net.http import HttpServer
from headrace.run.backends import make_backend
from headrace.run.config import RunConfig
from headrace.run.defaults import apply_model_defaults
from headrace.run.interrupt import stop_on_signals
from headrace.run.rundir import RunDir
from headrace.run.stalls import warn_when_blocked

from .chain import VersionChain
from .config import serve_options
from .lanes import Serving, check_per_scenario
from .routes import Routes
from .service import Service

log = logs.get_logger()


def api_token(config: RunConfig) -> str | None:
    """The bearer token from ``serve.token_env``; None only with ``serve.no_auth`` on loopback."""
    cfg = serve_options(config)
    token = os.environ.get(cfg.token_env, "").strip()
    if cfg.no_auth:
        if not is_loopback(cfg.host):
            raise ConfigError(
                f"--no-auth serves without a token, which is allowed on a loopback address only, and --host is "
                f"'{cfg.host}'. Set a token in ${cfg.token_env} (or the variable --token-env names), or bind to "
                "127.0.0.1."
            )
        return None
    if not token:
        raise ConfigError(
            f"no API token: the environment variable {cfg.token_env} is unset or empty, and the server refuses "
            f"to start without one. Set it (export {cfg.token_env}=$(openssl rand -hex 16)) and send it as "
            "'Authorization: Bearer <token>', name another variable with --token-env, or pass --no-auth to "
            "serve on loopback without a token."
        )
    return token


async def serve(config: RunConfig, token: str | None, ready: Callable[[str], None] = print) -> None:
    config = apply_model_defaults(config)
    check_per_scenario(config)  # before the backend starts: a refusal costs nothing
    with RunDir.open(config) as run_dir:  # locked while it serves; --resume / --overwrite as for runs
        config = config.model_copy(update={"run_dir": str(run_dir.path)})
        with logs.run_log(run_dir.path / "log.jsonl"):
            current = VersionChain(run_dir.path).incumbent() if config.resume else None
            restore = (current.version, current.checkpoint) if current else None
            async with make_backend(config, resume_checkpoint=restore) as backend:
                service = Service(config, backend, run_dir.path, say=ready)
                try:
                    serving = await service.start()
                    run_dir.began = True  # set up: a refusal before this leaves the directory as it was
                    await _serve(config, service, serving, token, ready)
                finally:
                    service.close()
            if service.serving is not None:
                ready(
                    f"headrace serve: stopped; version {service.serving.version} is saved in {run_dir.path} "
                    f"(`headrace serve --resume --run-dir {run_dir.path}` serves it again)"
                )


async def _serve(
    config: RunConfig, service: Service, serving: Serving, token: str | None, ready: Callable[[str], None]
) -> None:
    cfg = serve_options(config)
    routes = Routes(service, token)
    server = HttpServer(routes, cfg.host, cfg.port, limits=cfg, name="headrace serve", admit=routes.admit)
    routes.http_stats = lambda: server.stats
    stop = asyncio.Event()
    # what is published is on disk already: a second signal exits at once, as kill -9 would
    gate_env = f"'{cfg.gate_env}' (the gate's)" if cfg.gate == "env" else None
    with stop_on_signals(stop.set, stopping="closing the server"), warn_when_blocked(gate_env):
        async with asyncio.TaskGroup() as tasks:
            await server.start(tasks)
            trainer = tasks.create_task(service.train_candidates(), name="serve-candidates")
            url = f"http://{cfg.host}:{server.port}/v1"
            log.info(
                "serve_start", url=url, version=serving.version, run_dir=config.run_dir, **service.backend.describe()
            )
            ready(
                f"headrace serve: serving '{service.model_name}' version {serving.version} at {url} "
                f"(run dir {config.run_dir}; {'token from $' + cfg.token_env if token else 'no auth'})"
            )
            try:
                await stop.wait()
            finally:
                trainer.cancel()
                await server.close()
