"""The `batonlm` command: `batonlm serve [MODEL] ...`, `batonlm bench ...`."""

from __future__ import annotations

import argparse
import sys

from batonlm.config import ServerArgs
from batonlm.settings import GROUPS, ConfigError, Declared, declared
from batonlm.version import __version__


def _flag_help(d: Declared) -> str:
    return f"{d.setting.help} (default: {d.shown_default()})"


def _metavar(d: Declared) -> str:
    if d.kind is int:
        return "N"
    if d.kind is float:
        return "SECONDS" if d.setting.unit == "seconds" else "X"
    return d.name.rsplit("_", 1)[-1].upper()


def _add_serve_arguments(p: argparse.ArgumentParser) -> None:
    """Every ServerArgs setting as a flag, grouped by concern, with its default."""
    p.add_argument("--config", default=None, metavar="FILE",
                   help="a YAML preset of server arguments (see configs/); flags given here override it")
    groups = {name: p.add_argument_group(name, about) for name, about in GROUPS.items()}
    defaults = ServerArgs()  # the environment's defaults included
    for d in declared(ServerArgs):
        group, default = groups[d.setting.group], getattr(defaults, d.name)
        if d.setting.positional:
            group.add_argument(d.name, nargs="?", default=default, metavar=d.name.upper(), help=_flag_help(d))
            continue
        kwargs: dict = {"dest": d.name, "default": default, "help": _flag_help(d)}
        if d.kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = d.kind
            if d.setting.choices:
                kwargs["choices"] = d.setting.choices
            else:
                kwargs["metavar"] = d.setting.metavar or _metavar(d)
        group.add_argument(*d.setting.flags, d.flag, **kwargs)  # a short name first (--tp)


def serve_args_from_namespace(ns: argparse.Namespace) -> ServerArgs:
    return ServerArgs.from_kwargs(**{k: v for k, v in vars(ns).items() if k not in ("command", "func", "config")})


def parse_serve_args(argv: list[str]) -> ServerArgs:
    """`serve` arguments: defaults, then the --config file, then the flags given."""
    parser = argparse.ArgumentParser(prog="batonlm serve")
    _add_serve_arguments(parser)
    ns = parser.parse_args(argv)
    if ns.config:
        from batonlm.config_file import load_config_file

        parser.set_defaults(**load_config_file(ns.config))
        ns = parser.parse_args(argv)
    return serve_args_from_namespace(ns)


def _serve(ns: argparse.Namespace) -> int:
    from batonlm.server.serve import serve

    try:
        args = parse_serve_args(ns.argv)
    except ConfigError as e:
        print(f"batonlm serve: error: {e}", file=sys.stderr)
        return 2
    return serve(args)


def serving_port(pid: int = 1) -> tuple[str, int]:
    """Where the `batonlm serve` running as process `pid` (a container's entrypoint) listens:
    its own flags (a --port given at `docker run` included), else the environment's defaults."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = [a.decode() for a in f.read().split(b"\0") if a]
        args = parse_serve_args(argv[argv.index("serve") + 1 :])
    except (OSError, ValueError, ConfigError, SystemExit):  # not a batonlm serve: the defaults
        args = ServerArgs()
    host = "127.0.0.1" if args.host in ("0.0.0.0", "::", "") else args.host
    return host, args.port


def _healthcheck(ns: argparse.Namespace) -> int:
    """Exit 0 when the server answers /health with 200 (the Docker image's HEALTHCHECK)."""
    import urllib.request

    host, port = serving_port(ns.pid)
    if ns.port is not None:
        port = ns.port
    shown = f"[{host}]" if ":" in host else host
    try:
        with urllib.request.urlopen(f"http://{shown}:{port}/health", timeout=ns.timeout) as r:
            return 0 if r.status == 200 else 1
    except OSError as e:
        print(f"batonlm healthcheck: http://{shown}:{port}/health: {e}", file=sys.stderr)
        return 1


def _bench(ns: argparse.Namespace) -> int:
    from batonlm.bench.cli import run_bench

    return run_bench(ns)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="batonlm", description="batonlm: an LLM serving engine with an overlap loop")
    parser.add_argument("--version", action="version", version=f"batonlm {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API",
                           description="Serve a model over an OpenAI-compatible HTTP API. Every flag is also a key "
                                       "of a --config preset (docs/flags.md lists them).")
    _add_serve_arguments(serve)
    serve.set_defaults(func=_serve)
    health = sub.add_parser("healthcheck", help="exit 0 when the server in this container (process 1) is healthy")
    health.add_argument("--pid", type=int, default=1, help="the batonlm serve process whose port is probed")
    health.add_argument("--port", type=int, default=None, help="probe this port instead")
    health.add_argument("--timeout", type=float, default=5.0)
    health.set_defaults(func=_healthcheck)
    try:
        from batonlm.bench.cli import add_bench_arguments
    except ImportError:
        pass
    else:
        bench = sub.add_parser("bench", help="load-test an OpenAI-compatible server")
        add_bench_arguments(bench)
        bench.set_defaults(func=_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        ns = build_parser().parse_args(argv)
    except ConfigError as e:  # a default from the environment that is not valid
        print(f"batonlm: error: {e}", file=sys.stderr)
        return 2
    ns.argv = argv[1:]  # what follows the subcommand, re-parsed with any --config preset
    return ns.func(ns)


if __name__ == "__main__":
    sys.exit(main())
