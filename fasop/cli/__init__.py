"""The `fasop` command line: thin click commands over the Python API, one module per command group."""

from __future__ import annotations

import gc
import importlib
from collections.abc import MutableMapping

import click

# The module (in fasop.cli) of each command, a function of the command's name. A command's module is imported when
# the command runs or is listed, so that `fasop search` does not load the launch, calibration and charting code.
COMMAND_MODULES = {"search": "search", "estimate": "estimate", "emit": "emit", "compare": "compare", "profile": "profile",
                   "validate": "calibration", "calibrate": "calibration", "pareto": "pareto", "plot": "pareto",
                   "report": "report"}


class _OneLineError(click.ClickException):
    """A usage error, said in one line like every input error, with the same exit code (2)."""

    exit_code = 2


class _Group(click.Group):
    """The top-level group: commands imported on first use; `commands` imports and holds them all."""

    @property
    def commands(self) -> MutableMapping[str, click.Command]:
        for name in COMMAND_MODULES:
            self._command(name)
        return self._loaded

    @commands.setter
    def commands(self, commands: MutableMapping[str, click.Command]) -> None:
        self._loaded = dict(commands)

    def _command(self, name: str) -> click.Command:
        if name not in self._loaded:
            self._loaded[name] = getattr(importlib.import_module(f"fasop.cli.{COMMAND_MODULES[name]}"), name)
        return self._loaded[name]

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        return self._command(cmd_name) if cmd_name in COMMAND_MODULES else None

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMAND_MODULES)

    def invoke(self, ctx: click.Context):
        # click prints a usage error (a bad or missing option value, an unknown option, an extra argument) under
        # the usage line and a hint: four lines, not one
        try:
            return super().invoke(ctx)
        except click.UsageError as err:
            raise _OneLineError(err.format_message()) from None


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="fasop")
def main():
    """Plan data, tensor and pipeline parallelism for Megatron-LM on heterogeneous GPU clusters."""


def run() -> None:
    """The `fasop` program: `main`, then the interpreter's exit without its last cyclic collection, which would walk
    every object the command made only to free them all anyway (about 50 ms after a search). Tests call `main`."""
    gc.freeze()  # what importing made lives to the end: the collections the command triggers need not rescan it
    try:
        main()
    finally:
        gc.freeze()
