"""The HTTP app: the server's own routes (health, metrics, control, rollouts) and each route module's."""
from __future__ import annotations

from aiohttp import web

from . import lifecycle, routes_chat, routes_native, routes_openai, routes_rl
from .app import (SERVER_KEY, Server, auth_middleware, errors_middleware, get_control, health, metrics,
                  put_control, rollout_finish, rollouts)


def build_app(server: Server) -> web.Application:
    """The server's route table: the app's own routes, then each route module's."""
    # client_max_size bounds what request.read() accepts; read_json turns the overflow into a 413.
    app = web.Application(middlewares=[errors_middleware, auth_middleware], client_max_size=server.settings.max_body_bytes)
    app[SERVER_KEY] = server
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/control", get_control)
    app.router.add_put("/control", put_control)
    app.router.add_post("/rollout/finish", rollout_finish)
    app.router.add_get("/rollouts", rollouts)
    routes_native.add_routes(app)
    routes_openai.add_routes(app)
    routes_rl.add_routes(app)
    routes_chat.add_routes(app)
    lifecycle.add_routes(app)
    return app


def build_metrics_app(server: Server) -> web.Application:
    """`--metrics-port`'s listener: GET /metrics only, so a NetworkPolicy can admit scrapers to this
    port and nothing else (a policy cannot tell paths apart)."""
    app = web.Application(middlewares=[errors_middleware])
    app[SERVER_KEY] = server
    app.router.add_get("/metrics", metrics)
    return app
