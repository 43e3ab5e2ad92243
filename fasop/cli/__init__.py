"""The `fasop` command line: thin click commands over the Python API, one module per command group."""

from __future__ import annotations

import click

from fasop.cli import calibration, compare, emit, pareto, profile, search


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="fasop")
def main():
    """Plan data, tensor and pipeline parallelism for Megatron-LM on heterogeneous GPU clusters."""


for command in (search.search, search.estimate, emit.emit, compare.compare, profile.profile, calibration.validate,
                calibration.calibrate, pareto.pareto, pareto.plot):
    main.add_command(command)
