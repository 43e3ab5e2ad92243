"""`fasop report`: one self-contained HTML page of a search or pareto result."""

from __future__ import annotations

from pathlib import Path

import click

from fasop.cli import common
from fasop.errors import InputError


@click.command()
@click.argument("result", type=click.Path(dir_okay=False, path_type=Path), metavar="RESULT")
@click.option("-o", "--output", "out_path", type=click.Path(dir_okay=False, path_type=Path), required=True,
              help="report.html: the page, with its charts and script inside (it opens without a network).")
@common.force_option
@common.reports_input_errors
def report(result, out_path, force):
    """Write one HTML page of RESULT, a plans.json of fasop search --output or a front.csv of fasop pareto
    --output: the ranked table (click a header to sort), the Pareto front, the best plan's stages and
    schedule, and the inputs and assumptions behind them."""
    from fasop.report import write_report

    if result.suffix.lower() not in (".json", ".csv"):
        raise InputError(str(result), "expected the plans.json of fasop search --output or the front.csv of "
                                      "fasop pareto --output")
    common.check_outputs([(out_path, "--output")], [result], force)
    what = write_report(result, out_path)
    click.echo(f"report of {what} written to {out_path}")
