"""Whether the services a pipeline command talks to answer, asked once before anything starts: the Prefect
API (when PREFECT_API_URL names one), an MLflow tracking server (an http(s) tracking URI) and a Ray cluster
(data.runner=ray with an address).

Left to themselves, their clients retry a silent address for minutes (Ray's driver 20 times, ~40 s a try), so
each is asked here within a bounded time from params: a TCP connect, then one request in the service's own
protocol (an HTTP GET, or a gRPC handshake for Ray), because a port can accept connections and still not be
the service. When the service is there this costs a connect and a round trip. The failure is one line naming
the address, the param that bounds the wait and what to check.
"""

from __future__ import annotations

import os
import socket
import time
import urllib.error
import urllib.request
from urllib.parse import urlsplit

from params import PipelineParams
from params.schema import DataParams


class UnreachableService(ConnectionError):
    """A service the run needs does not answer at its address; the message says which and what to check."""


def check_services(params: PipelineParams) -> None:
    """Raise UnreachableService for the first of the Prefect API, the MLflow server or the Ray cluster that
    does not answer within its timeout; nothing is contacted that the run would not contact itself."""
    check_prefect_api(params.tracking.connect_timeout_s)
    check_tracking_server(params)
    check_ray_cluster(params.data)


def check_prefect_api(timeout_s: float) -> None:
    """The Prefect API of PREFECT_API_URL (environment or profile); without one each flow run starts a
    temporary local API, and there is nothing to ask."""
    from prefect.settings import PREFECT_API_URL

    url = PREFECT_API_URL.value()
    if not url:
        return
    problem = _http_problem(f"{url.rstrip('/')}/health", timeout_s)
    if problem:
        raise UnreachableService(
            f"PREFECT_API_URL={url}: the Prefect API does not answer ({problem}, tracking.connect_timeout_s="
            f"{timeout_s:g}); start it (prefect server start) or check the URL, or unset PREFECT_API_URL so each "
            f"run starts a temporary local one"
        )


def check_tracking_server(params: PipelineParams) -> None:
    """An http(s) MLflow tracking URI must answer; a local store (sqlite, a directory) needs no server."""
    from tasks.tracking import tracking_uri

    uri = tracking_uri(params)
    if urlsplit(uri).scheme not in ("http", "https"):
        return
    timeout_s = params.tracking.connect_timeout_s
    problem = _http_problem(f"{uri.rstrip('/')}/health", timeout_s)
    if problem:
        source = "MLFLOW_TRACKING_URI" if os.environ.get("MLFLOW_TRACKING_URI") else "tracking.uri"
        raise UnreachableService(
            f"{source}={uri}: no MLflow tracking server answers ({problem}, tracking.connect_timeout_s="
            f"{timeout_s:g}); start it (mlflow server --host HOST --port PORT) or check the host and port"
        )


def check_ray_cluster(data: DataParams) -> None:
    """data.ray_address, when runner=ray names a cluster: its GCS (`host:port`) or Ray Client server
    (`ray://host:port`) must complete a gRPC handshake. `auto` is resolved the way Ray resolves it
    (RAY_ADDRESS, else the cluster `ray start` last started here); null starts a new local Ray."""
    if data.runner != "ray" or data.ray_address is None:
        return
    address = _ray_target(data.ray_address)
    if address is None:
        return  # "auto" found no cluster: ray.init says so itself, at once
    host, _, port = address.rpartition(":")
    timeout_s, started = data.ray_connect_timeout_s, time.monotonic()
    problem = _tcp_problem(host, int(port), timeout_s) or _grpc_problem(
        address, timeout_s, max(0.1, timeout_s - (time.monotonic() - started))
    )
    if problem:
        raise UnreachableService(
            f"data.ray_address={data.ray_address!r}: no Ray cluster answers at {address} ({problem}, "
            f"data.ray_connect_timeout_s={data.ray_connect_timeout_s:g}); check that the head node is running "
            f"(`ray status` on it), that the port is its GCS port (`ray start --head --port`, 6379 by default) or, "
            f"for ray://, its client server port (10001 by default), and that this machine can reach it"
        )


def _ray_target(address: str) -> str | None:
    """host:port to ask for a data.ray_address."""
    if address.startswith("ray://"):
        return address.removeprefix("ray://")
    if address != "auto":
        return address
    from ray._private.services import canonicalize_bootstrap_address  # how ray.init itself resolves "auto"

    try:
        return canonicalize_bootstrap_address("auto")
    except ConnectionError:
        return None


def _tcp_problem(host: str, port: int, timeout_s: float) -> str | None:
    """Why host:port takes no TCP connection within `timeout_s`, or None when it does."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            pass
    except socket.gaierror:
        return f"{host} is not a known host name"
    except ConnectionRefusedError:
        return "connection refused: nothing listens on that port"
    except TimeoutError:
        return f"no connection within {timeout_s:g} s"
    except OSError as error:
        return error.strerror or str(error)
    return None


def _grpc_problem(address: str, timeout_s: float, left_s: float) -> str | None:
    """Why no gRPC server at `address` completes a handshake within `left_s` (of `timeout_s`), or None."""
    import grpc  # Ray's own dependency

    channel = grpc.insecure_channel(address)
    try:
        grpc.channel_ready_future(channel).result(timeout=left_s)
    except grpc.FutureTimeoutError:
        return f"the port accepts connections but no gRPC server answered within {timeout_s:g} s"
    finally:
        channel.close()
    return None


def _http_problem(url: str, timeout_s: float) -> str | None:
    """Why `url` gets no HTTP answer within `timeout_s`, or None when it gets any (an error status is an
    answer: the server is there)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s):
            return None
    except urllib.error.HTTPError:
        return None
    except urllib.error.URLError as error:
        reason = error.reason
    except OSError as error:  # a timeout while reading the answer
        reason = error
    if isinstance(reason, ConnectionRefusedError):
        return "connection refused: nothing listens on that port"
    if isinstance(reason, socket.gaierror):
        return f"{urlsplit(url).hostname} is not a known host name"
    if isinstance(reason, TimeoutError):
        return f"no answer within {timeout_s:g} s"
    return str(getattr(reason, "strerror", None) or reason)
