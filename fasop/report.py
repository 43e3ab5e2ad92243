"""One self-contained HTML page of a result: the plans file of `fasop search --output plans.json`, or the front
file of `fasop pareto --output front.csv` (`fasop report`, fasop.report).

The page holds the ranked table (sorted by a click on a column's header), the Pareto front (a front file), the
best plan's stages and schedule (a plans file), and what the figures rest on: model, cluster, global batch,
profiles, and what the step time covers. It needs no network: the style and the sorting script are inline, the
charts are images inside the page as data URLs (SVG, each keeping its own ids; PNG for the timeline). Every
text read from the result is escaped; the same result gives the same bytes. The script also records on the page
how many charts loaded and any script error (data-images-loaded, data-errors and the #errors list on <body>),
which the tests read back.
"""

from __future__ import annotations

import base64
import html
import os
from collections.abc import Sequence
from pathlib import Path

from fasop.errors import ArgumentError, InputError
from fasop.files import check_outputs, write_atomically
from fasop.plans import Plan, compress_placement, load_plans

STYLE = """body{font:14px/1.45 system-ui,sans-serif;margin:2em auto;max-width:1200px;padding:0 1em;color:#222}
h1{font-size:1.5em}h2{font-size:1.2em;margin-top:2em}dt{font-weight:600}dd{margin:0 0 .4em 1.5em}
table{border-collapse:collapse;font-size:12px;font-variant-numeric:tabular-nums}
th,td{border-bottom:1px solid #ddd;padding:3px 8px;text-align:right;white-space:nowrap}
th{cursor:pointer;background:#f4f4f4;position:sticky;top:0;user-select:none}
th[aria-sort=ascending]::after{content:" \\25b2"}th[aria-sort=descending]::after{content:" \\25bc"}
td.text{text-align:left}tr.front td{background:#eef6ee}.scroll{max-height:32em;overflow:auto}
img{max-width:100%;height:auto;display:block;margin:1em 0}.note{color:#555}#errors{color:#b00000}"""

# Sorting: a click on a header sorts its table's rows by that column (numbers as numbers), a second click the
# other way. '#sort=3,3' in the address clicks header 3 twice once the page is loaded.
SCRIPT = """window.onerror=function(message){var list=document.getElementById("errors");var item=document.createElement("li");
item.textContent=String(message);list.appendChild(item);document.body.dataset.errors=list.children.length;};
function sortTable(table,column,header){var body=table.tBodies[0];var rows=Array.prototype.slice.call(body.rows);
var up=header.getAttribute("aria-sort")!=="ascending";rows.sort(function(a,b){var x=a.cells[column].dataset.sort,
y=b.cells[column].dataset.sort,nx=parseFloat(x),ny=parseFloat(y);var d=(!isNaN(nx)&&!isNaN(ny))?nx-ny:x.localeCompare(y);
return up?d:-d;});table.querySelectorAll("th").forEach(function(th){th.removeAttribute("aria-sort");});
header.setAttribute("aria-sort",up?"ascending":"descending");rows.forEach(function(row){body.appendChild(row);});}
document.querySelectorAll("table.sortable").forEach(function(table){table.querySelectorAll("th").forEach(
function(th,column){th.addEventListener("click",function(){sortTable(table,column,th);});});});
window.addEventListener("load",function(){var loaded=Array.prototype.filter.call(document.images,function(image){
return image.complete&&image.naturalWidth>0;});document.body.dataset.imagesLoaded=loaded.length;
var asked=/^#sort=([0-9,]+)$/.exec(location.hash);if(asked){var headers=document.querySelectorAll("table.sortable th");
asked[1].split(",").forEach(function(i){headers[Number(i)].click();});}});"""

# (header, field, decimals) of each column of a plans table; decimals None: text
PLAN_COLUMNS = (("rank", "rank", 0), ("kind", "kind", None), ("mbs", "mbs", 0), ("tp", "tp", 0), ("dp", "dp", 0),
                ("pp", "pp", 0), ("vp", "virtual_stages", 0), ("recompute", "recompute", None),
                ("sp", "sequence_parallel", None), ("placement", "placement", None),
                ("layers/stage", "layers_per_stage", None), ("step s", "step_time_s", 4),
                ("samples/s", "throughput_samples_per_s", 1), ("tokens/s", "tokens_per_s", 0),
                ("peak GiB", "peak_memory_gib", 1), ("capacity GiB", "memory_capacity_gib", 1),
                ("$/step", "cost_per_step_usd", 5), ("run h", "train_hours", 2), ("run $", "train_cost_usd", 0))
FRONT_COLUMNS = (("gpus", "gpus", 0), ("mbs", "mbs", 0), ("tp", "tp", 0), ("dp", "dp", 0), ("pp", "pp", 0),
                 ("placement", "placement", None), ("step s", "step_time_s", 4),
                 ("samples/s", "throughput_samples_per_s", 1), ("$/hour", "cost_per_hour_usd", 2),
                 ("run h", "train_hours", 2), ("run $", "train_cost_usd", 0), ("front", "on_front", None),
                 ("note", "note", None))


def write_report(result_path: str | os.PathLike, out_path: str | os.PathLike) -> str:
    """Write the page of `result_path` (plans.json or front.csv) to `out_path` (.html), whole or not at all and
    never over the result; returns a line that says what the page shows."""
    path, result = Path(out_path), Path(result_path)
    if path.suffix.lower() not in (".html", ".htm"):
        raise ArgumentError("out_path", "expected a file name ending in .html", out_path)
    try:
        check_outputs([(path, "out_path")], [result])
    except InputError as err:
        raise ArgumentError("out_path", err.problem, out_path) from None
    page, what = report_html(result)
    write_atomically(path, page, str(path))
    return what


def report_html(result_path: str | os.PathLike) -> tuple[str, str]:
    """The page of a plans file (.json) or a front file (.csv), and a line that says what it shows."""
    result = Path(result_path)
    if result.suffix.lower() == ".json":
        plans = load_plans(result)
        title, sections = _plans_page(plans, result)
        what = f"{len(plans)} plans of {result.name}"
    elif result.suffix.lower() == ".csv":
        from fasop.market.frontfile import read_front_csv

        records = read_front_csv(result)
        title, sections = _front_page(records, result)
        what = f"{len(records)} compositions of {result.name}"
    else:
        raise ArgumentError("result_path", "expected a plans file (.json) of fasop search or a front file (.csv) "
                                           "of fasop pareto", result_path)
    body = "\n".join(sections)
    page = (f'<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n<title>{_e(title)}</title>\n'
            f"<style>\n{STYLE}\n</style>\n</head>\n"
            f'<body data-errors="0" data-images-loaded="0">\n<h1>{_e(title)}</h1>\n<ul id="errors"></ul>\n{body}\n'
            f"<script>\n{SCRIPT}\n</script>\n</body>\n</html>\n")
    return page, what


def _e(value: object) -> str:
    return html.escape(str(value), quote=True)


def _cell(value: object, decimals: int | None) -> str:
    """A table cell: its text, and the value it sorts by."""
    if value is None or value == "":
        return '<td data-sort=""></td>'
    if isinstance(value, bool):
        text = "yes" if value else ""
        return f'<td class="text" data-sort="{_e(text)}">{_e(text)}</td>'
    if decimals is None or not isinstance(value, (int, float)):
        text = " ".join(map(str, value)) if isinstance(value, list) else str(value)
        return f'<td class="text" data-sort="{_e(text)}">{_e(text)}</td>'
    return f'<td data-sort="{value!r}">{value:,.{decimals}f}</td>'


def _table(columns: tuple, rows: list[dict], front: list[bool] | None = None) -> str:
    head = "".join(f'<th scope="col">{_e(header)}</th>' for header, _, _ in columns)
    lines = []
    for index, row in enumerate(rows):
        marked = ' class="front"' if front and front[index] else ""
        lines.append(f"<tr{marked}>" + "".join(_cell(row.get(field), decimals) for _, field, decimals in columns)
                     + "</tr>")
    body = "\n".join(lines)
    return (f'<div class="scroll"><table class="sortable">\n<thead><tr>{head}</tr></thead>\n<tbody>\n{body}\n'
            "</tbody>\n</table></div>")


def _image(fig, alt: str, suffix: str = ".svg") -> str:
    """The chart as an image inside the page: SVG, or PNG for a chart of thousands of shapes (a timeline's bars
    make megabytes of SVG)."""
    from fasop.chart import figure_bytes

    data = base64.b64encode(figure_bytes(fig, suffix)).decode("ascii")
    kind = "svg+xml" if suffix == ".svg" else "png"
    return f'<img alt="{_e(alt)}" src="data:image/{kind};base64,{data}">'


def _facts(pairs: Sequence[tuple[str, object]]) -> str:
    return "<dl>\n" + "\n".join(f"<dt>{_e(k)}</dt><dd>{_e(v)}</dd>" for k, v in pairs if v not in (None, "")) + "\n</dl>"


def _plan_rows(plans: list[Plan]) -> list[dict]:
    rows = []
    for plan in plans:
        row = plan.record()
        row["placement"] = compress_placement(plan.placement)
        rows.append(row)
    return rows


def _step_covers(plan: Plan) -> str:
    """What the best plan's step time is made of, from the figures its plan file holds."""
    if plan.step_time_s is None:
        return ""
    parts = [(f"the pipeline {plan.pipeline_time_s:.4g} s ("
              + ("Megatron-LM's 1F1B schedule timed exactly" if plan.timing == "exact-schedule" else "closed form")
              + ")") if plan.pipeline_time_s is not None else "",
             f"data-parallel traffic left exposed {plan.dp_exposed_s:.4g} s" if plan.dp_exposed_s else "",
             f"the embedding all-reduce {plan.embedding_allreduce_s:.4g} s" if plan.embedding_allreduce_s else "",
             f"the optimizer step {plan.optimizer_s:.4g} s" if plan.optimizer_s else ""]
    shown = [part for part in parts if part]
    return (f"{plan.step_time_s:.4g} s per step of {plan.gbs} samples" + (": " + ", ".join(shown) if shown else "")
            + " (docs/cost-model.md)")


# What the page names once, from the best plan, for every plan of the file.
PLANS_RUN = ("model", "model_file", "cluster", "cluster_file", "gbs", "profiles", "train_steps")


def _plans_page(plans: list[Plan], result: Path) -> tuple[str, list[str]]:
    from fasop.plot import check_one_run, check_plan, check_times, stage_chart, stage_names
    from fasop.timeline import plan_op_times, timeline_chart, timeline_title

    check_one_run([dict(plan) for plan in plans], PLANS_RUN, str(result))
    for plan in plans:  # the table shows every plan's figures: refused as fasop plot refuses them
        check_times(plan, f"{result}: plan {plan.rank}")
    plans = sorted(plans, key=lambda plan: plan.rank or 0)
    best = plans[0]
    profiles = best.profiles or f"the bundled profiles of {best.model or 'the model'}"
    if best.synthesised_profiles:
        profiles += "; synthesised from the roofline for " + ", ".join(best.synthesised_profiles)
    facts = [("result", f"{result.name}: {len(plans)} plans, ranked"), ("model", best.model_file or best.model),
             ("cluster", best.cluster_file or best.cluster), ("global batch", f"{best.gbs} samples"),
             ("GPUs of the best plan", f"{best.tp * best.dp * best.pp} on {len(best.placement)} nodes "
                                       f"({compress_placement(best.placement)})"),
             ("profiles", profiles), ("step time of the best plan", _step_covers(best)),
             ("run", f"{best.train_steps:,} steps" if best.train_steps else "")]
    sections = ["<h2>Inputs and assumptions</h2>", _facts(facts), "<h2>Plans</h2>",
                _table(PLAN_COLUMNS, _plan_rows(plans)), f"<h2>The best plan (rank {_e(best.rank)})</h2>"]
    where = f"{result}: plan {best.rank}"
    try:
        check_plan(best, where)
    except InputError as err:
        sections.append(f'<p class="note">No stage chart: {_e(err)}</p>')
        return f"fasop report: {best.model or 'plans'} on {best.cluster or result.name}", sections
    fig, _ = stage_chart(best)
    sections.append(_image(fig, "time of one step on each pipeline stage"))
    try:
        times = plan_op_times(best, where)
    except InputError as err:
        sections.append(f'<p class="note">No schedule: {_e(err)}</p>')
    else:
        fig, _ = timeline_chart(times, title=timeline_title(best, times), stage_names=stage_names(best))
        sections.append(_image(fig, "the pipeline schedule of one step", ".png"))
    return f"fasop report: {best.model or 'plans'} on {best.cluster or result.name}", sections


def _front_page(records: list[dict], result: Path) -> tuple[str, list[str]]:
    from fasop.market.pareto import composition_label, node_counts
    from fasop.plot import FRONT_RUN, check_one_run, front_chart

    check_one_run(records, FRONT_RUN, str(result))
    first = records[0]
    feasible = [r for r in records if r["feasible"]]
    facts = [("result", f"{result.name}: {len(records)} compositions, {len(feasible)} with a plan that fits, "
                        f"{sum(bool(r['on_front']) for r in records)} on the Pareto front"),
             ("model", first.get("model")), ("cluster", first.get("cluster")),
             ("node types", ", ".join(f"0-{max(node_counts(r)[name] for r in records)} {name}"
                                      for name in node_counts(first))),
             ("global batch", f"{first.get('gbs'):.0f} samples" if first.get("gbs") else ""),
             ("run", f"{first['train_steps']:,.0f} steps" if first.get("train_steps") else ""),
             ("each composition", "its fastest plan, as fasop search finds it on exactly those nodes; the run's cost "
                                  "is its hours times the nodes' price per hour"),
             ("profiles", "as the sweep was run (the front file does not record them)")]
    rows = [{**r, "composition": composition_label(r)} for r in records]
    columns = (("composition", "composition", None), *FRONT_COLUMNS)
    sections = ["<h2>Inputs and assumptions</h2>", _facts(facts)]
    if feasible:
        fig, _ = front_chart(records)
        sections += ["<h2>The Pareto front</h2>", _image(fig, "cost of the run against throughput")]
    sections += ["<h2>Compositions</h2>", _table(columns, rows, [bool(r["on_front"]) for r in records]),
                 '<p class="note">A front file holds no per-stage times: the report of the plans.json that '
                 "fasop search writes for one composition shows its stages and schedule.</p>"]
    return f"fasop report: {first.get('model')} on {first.get('cluster')}", sections
