"""`kvtune serve --model DIR [engine flags with vLLM's names] --host H --port P`.

`kvtune serve --simulate PROFILE` (a test and demo mode, never the default) serves the same API,
metrics and admin API with no model: the real engine and scheduler over a runner that sleeps each
step's cost from a `kvtune sim` profile (``sim.realtime_runner``)."""
from __future__ import annotations

import logging
import os
import socket
import sys
from typing import Any

import click

from ..config import ConfigError, EngineConfig
from ..flags import device_engine_options

DEFAULT_PORT = 8000
#: Where a kubelet looks first for a container's termination message (the default
#: terminationMessagePath); written only where it exists, i.e. inside a pod.
TERMINATION_LOG = "/dev/termination-log"


class StartupError(click.ClickException):
    """The engine cannot run with these flags: one line, ``kvtune serve: ...``, as the last line on
    stderr and in the termination-message file, so that it becomes the pod's termination message
    (with FallbackToLogsOnError the kubelet falls back to the log's last lines), exit status 1."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))  # one line, whatever the cause printed

    def show(self, file: Any = None) -> None:
        line = f"kvtune serve: {self.format_message()}"
        if os.path.exists(TERMINATION_LOG):
            try:
                with open(TERMINATION_LOG, "w") as f:
                    f.write(line + "\n")
            except OSError:
                pass
        sys.stdout.flush()
        click.echo(line, err=True)


def _port(port: int | None, var: str = "KVTUNE_PORT", default: int | None = DEFAULT_PORT) -> int | None:
    """The flag, else ``$var``, else ``default``."""
    if port is not None:
        return port
    env = os.environ.get(var)
    if env:
        try:
            p = int(env)
        except ValueError:
            raise click.UsageError(f"{var}={env!r} is not a port number") from None
        if not 0 <= p <= 65535:
            raise click.UsageError(f"{var}={p} is outside 0..65535")
        return p
    return default


def _listen(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise StartupError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def _simulated_engine(name: str, cfg: EngineConfig, served_model_name: str | None) -> Any:
    from ..sim.profile import ProfileError
    from ..sim.profiles import load_profile
    from ..sim.realtime_runner import build_simulated_engine
    try:
        profile = load_profile(name)
    except ProfileError as e:
        raise click.UsageError(str(e)) from None
    try:
        return build_simulated_engine(profile, cfg, served_model_name=served_model_name)
    except ConfigError as e:  # the flags do not fit the profile's device (sizing)
        raise StartupError(str(e)) from None


def _model_engine(model_dir: str, cfg: EngineConfig, device: str, dtype: str, served_model_name: str | None,
                  device_memory: float | None) -> Any:
    from ..builder import build_engine
    try:
        return build_engine(model_dir, cfg, device=device, dtype=dtype,
                            served_model_name=served_model_name, device_memory_gib=device_memory)
    except ConfigError as e:  # the flags do not fit this model and device (sizing)
        raise StartupError(str(e)) from None
    except (ValueError, FileNotFoundError, OSError) as e:
        raise StartupError(f"cannot start the engine: {e}") from None
    except RuntimeError as e:  # torch: no CUDA, out of memory, ...
        raise StartupError(f"cannot start the engine on {device}: {e}") from None


@click.command("serve")
@click.option("--model", "model_dir", default=None, type=click.Path(), help="Local model directory.")
@click.option("--simulate", "simulate", default=None, metavar="PROFILE",
              help="No model: run the real engine with this simulator profile's step costs in wall-clock time "
                   "(a profile name or JSON file, as `kvtune sim --profile`), tokens from a byte tokenizer. "
                   "A test and demo mode; the state API says `simulated: PROFILE`.")
@device_engine_options
@click.option("--served-model-name", default=None, help="Model name in the API (default: the directory name).")
@click.option("--device", default="cpu", show_default=True, help="cpu or cuda (cuda:N).")
@click.option("--dtype", default="auto", show_default=True, help="auto, float32, bfloat16 or float16.")
@click.option("--device-memory", type=click.FloatRange(min=0, min_open=True), default=None, metavar="GIB",
              help="CPU only: stand in for a device of this many GiB, so that --gpu-memory-utilization "
                   "sizes the KV cache as on a GPU (demos, tests of memory tuning).")
@click.option("--host", default="0.0.0.0", show_default=True)
@click.option("--port", type=click.IntRange(0, 65535), default=None,
              help=f"Port (default: $KVTUNE_PORT, else {DEFAULT_PORT}).")
@click.option("--admin-port", type=click.IntRange(1, 65535), default=None,
              help="Serve /metrics and the admin API /kvtune/v1/* on this port only, and the API on --port only "
                   "(/health on both), for network policies that admit API clients to one port and only "
                   "monitoring and the operator to the other (default: $KVTUNE_ADMIN_PORT, else one port for all).")
@click.option("--api-key", default=None,
              help="Require this bearer key on /v1 (default: $KVTUNE_API_KEY or $VLLM_API_KEY).")
@click.option("--admin-key", default=None,
              help="Require this bearer key on the admin API /kvtune/v1/* (default: $KVTUNE_ADMIN_KEY); "
                   "without one the admin API answers only on loopback. The --api-key never opens it.")
@click.option("--max-body-mib", type=click.FloatRange(min=0, min_open=True), default=4.0, show_default=True,
              help="Largest request body, MiB; a larger one is refused with 413 before it is parsed.")
@click.option("--enable-prompt-tokens-details/--no-enable-prompt-tokens-details", default=False,
              show_default=True,
              help="Return usage.prompt_tokens_details.cached_tokens (it tells a client how much of its prompt "
                   "was cached, so it is off by default: shared caches leak prefixes between users).")
@click.option("--config-file", type=click.Path(), default=None,
              help="YAML of engine knobs, watched: live knobs apply on change (a mounted ConfigMap).")
@click.option("--max-waiting", type=click.IntRange(min=1), default=None,
              help="Bound of the waiting queue; beyond it requests get 503 with Retry-After.")
@click.option("--shutdown-timeout", type=click.FloatRange(min=0), default=5.0, show_default=True, metavar="SECONDS",
              help="On SIGTERM the server takes no new request and lets those in flight (queued ones too) "
                   "finish for at most this long, then cancels them (a pod's grace period minus its preStop).")
@click.option("--keep-alive-timeout", type=click.FloatRange(min=0, min_open=True), default=120.0, show_default=True,
              metavar="SECONDS",
              help="Close a keep-alive connection idle this long: longer than client pools' idle timeouts (aiohttp "
                   "15 s, Go 90 s), so that the client closes an idle pooled connection, never the server under it.")
@click.option("--header-timeout", type=click.FloatRange(min=0, min_open=True), default=30.0, show_default=True,
              metavar="SECONDS",
              help="A request head not complete this long after its first byte gets 408 and the connection closes.")
@click.option("--max-connections", type=click.IntRange(min=1), default=4096, show_default=True,
              help="Open connections at most; over it the longest-idle one is closed, or the new request gets 503.")
@click.option("--log-level", default="info", show_default=True,
              type=click.Choice(["debug", "info", "warning", "error"], case_sensitive=False))
def serve(model_dir: str | None, simulate: str | None, served_model_name: str | None, device: str, dtype: str, device_memory: float | None,
          host: str, port: int | None, admin_port: int | None,
          api_key: str | None, admin_key: str | None, max_body_mib: float, enable_prompt_tokens_details: bool,
          config_file: str | None, max_waiting: int | None, shutdown_timeout: float, keep_alive_timeout: float,
          header_timeout: float, max_connections: int, log_level: str, **flags: Any) -> None:
    """Serve a model: OpenAI-compatible API, /metrics, and the admin API under /kvtune/v1/."""
    # OpenMP threads that spin at barriers hold the cores their partners need whenever anything else
    # runs (other pods, the server's own threads): small ops then wait out whole time slices. Must be
    # set before torch loads (it is imported lazily, below).
    os.environ.setdefault("GOMP_SPINCOUNT", "0")
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("kvtune.serve")
    if (model_dir is None) == (simulate is None):
        raise click.UsageError("give --model DIR, or --simulate PROFILE for a simulated engine (not both)")
    port = _port(port)
    admin_port = _port(admin_port, "KVTUNE_ADMIN_PORT", None)
    if admin_port is not None and admin_port == port:
        raise click.UsageError(f"--admin-port {admin_port} is the API port too: give it a port of its own")
    values = {k: v for k, v in flags.items() if v is not None}
    try:
        EngineConfig.build(**values)  # flags alone must be valid
    except ConfigError as e:
        raise click.UsageError(f"invalid engine flags: {e}") from None

    watcher = None
    if config_file:
        from .config_watch import ConfigFileError, ConfigFileWatcher, read_config_file, split_known
        try:
            file_values = read_config_file(config_file)
        except ConfigFileError as e:
            raise click.UsageError(str(e)) from None
        known, unknown = split_known(file_values)
        if unknown:
            log.warning("config file %s: unknown keys %s ignored", config_file, unknown)
        over = {k: (values[k], v) for k, v in known.items() if k in values and values[k] != v}
        if over:
            log.warning("config file %s overrides flags: %s", config_file,
                        ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in over.items()))
        values.update(known)
        watcher = ConfigFileWatcher(config_file)
        watcher.prime(ConfigFileWatcher.digest(config_file))
    try:
        cfg = EngineConfig.build(**values)
    except ConfigError as e:
        raise click.UsageError(f"invalid engine config (flags + {config_file}): {e}") from None

    if device_memory is not None and (device != "cpu" or cfg.kv_cache_memory is not None):
        raise click.UsageError("--device-memory applies to --device cpu without --kv-cache-memory")
    api_key = api_key or os.environ.get("KVTUNE_API_KEY") or os.environ.get("VLLM_API_KEY") or None
    admin_key = admin_key or os.environ.get("KVTUNE_ADMIN_KEY") or None

    if simulate is not None:
        if device_memory is not None or device != "cpu" or dtype != "auto":
            raise click.UsageError("--device, --dtype and --device-memory do not apply to --simulate "
                                   "(the profile is the device)")
        engine = _simulated_engine(simulate, cfg, served_model_name)
        device = engine.device
    else:
        engine = _model_engine(model_dir, cfg, device, dtype, served_model_name, device_memory)

    import uvicorn

    from .app import ServerSettings, create_app
    from .http_connection import ConnectionLimits, protocol_class
    server: uvicorn.Server | None = None

    def on_fatal(e: BaseException) -> None:  # the engine thread died: stop serving, exit non-zero
        if server is not None:
            server.should_exit = True

    app = create_app(engine, ServerSettings(served_model_names=[engine.model_name], api_key=api_key,
                                            admin_key=admin_key, max_waiting=max_waiting, model_dir=model_dir,
                                            max_body_bytes=int(max_body_mib * 2**20),
                                            enable_prompt_tokens_details=enable_prompt_tokens_details,
                                            admin_port=admin_port),
                     config_watcher=watcher, on_fatal=on_fatal)
    snap = engine.snapshot()
    log.info("serving %s on http://%s:%d (device %s, dtype %s, %d KV blocks of %d tokens, %d swap blocks, "
             "max_model_len %d)", engine.model_name, host, port, device, engine.kv_cache_dtype,
             snap["blocks"]["total"], engine.config.block_size, snap["swap"]["total"], engine.config.max_model_len)
    if not admin_key:
        log.info("no --admin-key: the admin API /kvtune/v1/* answers on loopback only")
    if admin_port is not None:
        log.info("/metrics and the admin API on port %d only", admin_port)
    limits = ConnectionLimits(keep_alive_s=keep_alive_timeout, header_timeout_s=header_timeout,
                              max_connections=max_connections)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level.lower(), access_log=False,
                                           timeout_graceful_shutdown=shutdown_timeout, http=protocol_class(limits),
                                           headers=[("keep-alive", f"timeout={int(keep_alive_timeout)}")]))
    # one server (one lifespan, one engine loop) on one or two listening sockets
    sockets = [_listen(host, p) for p in (port, admin_port) if p is not None]
    try:
        server.run(sockets=sockets)
    finally:
        for sock in sockets:
            sock.close()
    err = app.state.ctx.async_engine.error
    if err is not None:
        click.echo(f"Error: the engine loop failed: {type(err).__name__}: {err}", err=True)
        sys.exit(1)


def main() -> None:  # python -m kvtune_engine.server.cli
    serve(standalone_mode=True)


if __name__ == "__main__":
    sys.exit(main())
