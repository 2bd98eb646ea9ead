"""The ``epkit`` command: ``verify``, ``bench``, ``simulate``, ``kernels``, ``version``.

Each subcommand lives in its own module and takes its own arguments; this file only routes
(and holds :class:`HelpFormatter`, the help format of the subcommands: defaults shown).
"""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> (module with main(argv) -> int, one-line help)
COMMANDS = {
    "verify": ("epkit.verify.cli", "prove an implementation against the reference on a real process group"),
    "bench": ("epkit.tools.bench", "time epkit against the plain-torch dispatcher and the bare exchange"),
    "simulate": ("epkit.tools.simulate", "plan traffic for a large group with the reference (no process group)"),
    "kernels": ("epkit.tools.kernels", "list epkit's Triton kernels; --compile sm_90,gfx942 checks their compiled code"),
    "version": (None, "print the versions of epkit and torch, the extension's build and whether it loads"),
}
# the defaults the one-line usage quotes (each command's --help lists all of them)
DEFAULTS_OF = {"bench": "epkit.tools.bench", "simulate": "epkit.tools.simulate"}
QUOTED = ("world_size", "ranks", "tokens", "hidden", "topk", "experts", "dtype", "routing")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """``(default: ...)`` after every option's help, except flags (off by default), options
    whose default is None (their help says what happens), and helps that already name it."""

    def _get_help_string(self, action):
        help_text = action.help or ""
        if ("(default" in help_text or "default:" in help_text or any(action.default is v for v in (None, False, argparse.SUPPRESS))
                or not action.option_strings):
            return help_text
        return help_text + " (default: %(default)s)"


def _defaults_line(cmd: str) -> str:
    try:
        ap = importlib.import_module(DEFAULTS_OF[cmd]).build_parser()
    except Exception:  # noqa: BLE001 - the usage must print whatever breaks
        return ""
    quoted = [f"--{a.dest.replace('_', '-')} {a.default}" for a in ap._actions
              if a.dest in QUOTED and a.default is not None]
    return " ".join(quoted)


def _usage() -> str:
    lines = ["usage: epkit <command> [options]", "", "commands:"]
    for name, (_, doc) in COMMANDS.items():
        lines.append(f"  {name:<10} {doc}")
        if name in DEFAULTS_OF and (defaults := _defaults_line(name)):
            lines.append(f"  {'':<10}   defaults: {defaults}")
    lines += ["", "Run 'epkit <command> --help' for a command's options and their defaults."]
    return "\n".join(lines)


def _version() -> int:
    """epkit, torch (and its CUDA), the C++ extension (where, flags, whether it loaded, building
    it first where the cache is stale), then which kernels serve each device."""
    from epkit import _version as version_module

    print(f"epkit {version_module.__version__}")
    try:
        import torch
    except ImportError:
        print("torch: not installed (epkit.reference alone works without it)")
        return 1
    cuda = torch.version.cuda or "none"
    gpu = f", {torch.cuda.device_count()} GPU(s) visible" if torch.version.cuda else ""
    print(f"torch {torch.__version__} (CUDA {cuda}{gpu})")
    from epkit import _build

    try:
        info = _build.build_info()
    except Exception as exc:  # noqa: BLE001 - a broken set-up is what this command reports
        print(f"extension: cannot tell ({type(exc).__name__}: {exc})")
        return 1
    print(f"extension {info['name']}: {info['kind']} build, {info['sources']} sources, in "
          f"{info['directory']}" + (f" (built {info['built_at']})" if info.get("built_at") else ""))
    print(f"  cflags: {' '.join(info['cflags'])}")
    if not info["loaded"]:
        print(f"  loaded: NO: {info['error']}")
        return 1
    print("  loaded: yes")
    kernels = info["kernels"]
    cpu = ("Triton (interpreted: TRITON_INTERPRET=1)" if kernels["CPU"] == "triton"
           and info["triton_interpreted"] else "Triton" if kernels["CPU"] == "triton" else "C++")
    cuda_k = ("Triton" if kernels["CUDA"] else
              "none (no GPU)" if not torch.cuda.is_available() else "none (Triton not importable)")
    print(f"kernels: CPU {cpu}; CUDA {cuda_k} (EPKIT_KERNELS=triton puts the Triton kernels on CPU)")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd in ("--version", "version"):
        if rest and rest[0] in ("-h", "--help"):
            print(f"usage: epkit version\n\n{COMMANDS['version'][1]} (exit status 1 if it does not load)")
            return 0
        return _version()
    if cmd not in COMMANDS:
        print(f"epkit: unknown command {cmd!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[cmd][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
