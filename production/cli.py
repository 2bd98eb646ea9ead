"""The ``epkit`` command: ``verify``, ``bench``, ``simulate``, ``version``.

Each subcommand lives in its own module and takes its own arguments; this file only routes.
"""

from __future__ import annotations

import importlib
import sys

# subcommand -> (module with main(argv) -> int, one-line help)
COMMANDS = {
    "verify": ("epkit.verify.cli", "prove an implementation against the reference on a real process group"),
    "bench": ("epkit.bench", "time epkit against the plain-torch dispatcher and the bare exchange"),
    "simulate": ("epkit.simulate", "plan traffic for a large group with the reference (no process group)"),
    "version": (None, "print the version of epkit, torch and the extension build"),
}


def _usage() -> str:
    lines = ["usage: epkit <command> [options]", "", "commands:"]
    lines += [f"  {name:<10} {doc}" for name, (_, doc) in COMMANDS.items()]
    lines += ["", "Run 'epkit <command> --help' for a command's options."]
    return "\n".join(lines)


def _version() -> int:
    import epkit

    print(f"epkit {epkit.__version__}")
    try:
        import torch

        print(f"torch {torch.__version__} (cuda {torch.version.cuda or 'none'})")
    except ImportError:
        print("torch: not installed")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd in ("--version", "version"):
        return _version()
    if cmd not in COMMANDS:
        print(f"epkit: unknown command {cmd!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[cmd][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
