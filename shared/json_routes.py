"""JSON answers the metrics server gives beside ``/metrics``, by path.

Why on the metrics port: KEDA's metrics-api scaler reads a number from a JSON document
over HTTP (https://keda.sh/docs/latest/scalers/metrics-api/); serving it where the run's
figures are served already asks for no other port, Service or NetworkPolicy rule, and
no Prometheus between the run and the autoscaler. A route's answer is a function of the
query string returning (HTTP status, a JSON-able body); one that raises answers 500
with the error, never a traceback.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any
from urllib.parse import parse_qs

import orjson

log = logging.getLogger(__name__)

Answer = Callable[[Mapping[str, list[str]]], tuple[int, Any]]
_routes: dict[str, Answer] = {}
_REASONS = {200: "OK", 400: "Bad Request", 500: "Internal Server Error", 503: "Service Unavailable"}


def route(path: str, answer: Answer) -> Callable[[], None]:
    """Serve ``answer`` at ``path`` on this process's metrics server; returns what
    removes it."""
    _routes[path] = answer

    def remove() -> None:
        _routes.pop(path, None)

    return remove


def routed(metrics_app: Callable[..., Iterable[bytes]]) -> Callable[..., Iterable[bytes]]:
    """A WSGI app that answers the routes, and everything else with ``metrics_app``."""

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        answer = _routes.get(environ.get("PATH_INFO", ""))
        if answer is None:
            return metrics_app(environ, start_response)
        try:
            status, body = answer(parse_qs(environ.get("QUERY_STRING", "")))
        except Exception as exc:  # a route's bug is its answer's error, not the server's
            log.warning("metrics: %s failed: %s", environ.get("PATH_INFO"), exc)
            status, body = 500, {"error": f"{type(exc).__name__}: {exc}"}
        data = orjson.dumps(body)
        start_response(
            f"{status} {_REASONS.get(status, 'Error')}",
            [("Content-Type", "application/json"), ("Content-Length", str(len(data)))],
        )
        return [data]

    return app
