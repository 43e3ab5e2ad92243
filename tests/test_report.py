"""`fasop report`: one self-contained HTML page of a plans file or a front file, the same bytes for the same
result, every text from the result escaped, bad input refused in one line; and the page as headless Chromium
loads it: no console error, the charts loaded, the table sorted by a click on a header."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest
from click.testing import CliRunner

from fasop.cli import main
from fasop.errors import InputError
from fasop.report import PLAN_COLUMNS, write_report

FRONT = Path(__file__).parent / "data" / "front-gpt2-xl-fasop-pareto.csv"  # the README's pareto example


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.fixture(scope="module")
def plans(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("report") / "plans.json"
    result = run("search", "--model", "gpt2-xl", "--cluster", "fasop-1xA100-3xA10", "--output", path)
    assert result.exit_code == 0, result.output
    return path


class Page(HTMLParser):
    """What a test reads of a page: <body>'s attributes, the images, each table row's sort values, the headers."""

    def __init__(self, text: str):
        super().__init__()
        self.body: dict[str, str | None] = {}
        self.images: list[str] = []
        self.rows: list[list[str]] = []
        self.front_rows = 0
        self.headers: list[str] = []
        self._in_header = False
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        found = dict(attrs)
        if tag == "body":
            self.body = found
        elif tag == "img":
            self.images.append(found["src"] or "")
        elif tag == "tr" and self._in_tbody:
            self.rows.append([])
            self.front_rows += found.get("class") == "front"
        elif tag == "td" and self.rows:
            self.rows[-1].append(found.get("data-sort") or "")
        elif tag == "th":
            self._in_header = True
            self.headers.append("")
        self._in_tbody = tag == "tbody" or getattr(self, "_in_tbody", False)

    def handle_endtag(self, tag):
        self._in_tbody = self._in_tbody and tag != "tbody"
        self._in_header = self._in_header and tag != "th"

    def handle_data(self, data):
        if self._in_header:
            self.headers[-1] += data


def test_a_plans_report_holds_the_table_the_charts_and_the_inputs(plans, tmp_path):
    out = tmp_path / "report.html"
    what = write_report(plans, out)
    count = len(json.loads(plans.read_text()))
    assert what == f"{count} plans of plans.json"
    text = out.read_text()
    page = Page(text)
    assert page.headers == [header for header, _, _ in PLAN_COLUMNS]
    assert [row[0] for row in page.rows] == [str(rank) for rank in range(1, count + 1)]  # ranked
    assert [src[:26] for src in page.images] == ["data:image/svg+xml;base64,", "data:image/png;base64,iVBO"]
    for fact in ("model</dt><dd>gpt2-xl", "cluster</dt><dd>fasop-1xA100-3xA10", "global batch</dt><dd>",
                 "profiles</dt><dd>the bundled profiles of gpt2-xl", "step time of the best plan</dt><dd>"):
        assert fact in text
    assert "http://" not in text.replace("http://www.w3.org", "") and "https://" not in text  # nothing fetched
    again = tmp_path / "again.html"
    write_report(plans, again)
    assert again.read_bytes() == out.read_bytes()


def test_a_front_report_holds_the_front_and_every_composition(tmp_path):
    out = tmp_path / "front.html"
    assert write_report(FRONT, out) == "80 compositions of front-gpt2-xl-fasop-pareto.csv"
    page = Page(out.read_text())
    assert len(page.rows) == 80 and page.front_rows == 5
    assert len(page.images) == 1 and page.images[0].startswith("data:image/svg+xml;base64,")


def test_every_text_from_the_result_is_escaped(plans, tmp_path):
    hostile = tmp_path / "hostile.json"
    records = json.loads(plans.read_text())
    for record in records:  # names follow the name rule; a file's path is free text
        record["model_file"] = '<img src=x onerror="alert(1)">&'
    hostile.write_text(json.dumps(records))
    out = tmp_path / "hostile.html"
    write_report(hostile, out)
    text = out.read_text()
    assert '<img src=x' not in text and "&lt;img src=x onerror=&quot;alert(1)&quot;&gt;&amp;" in text


def test_bad_results_and_outputs_are_refused_and_nothing_is_written(plans, tmp_path):
    with pytest.raises(InputError, match="^out_path=.*report.txt: expected a file name ending in .html"):
        write_report(plans, tmp_path / "report.txt")
    link = tmp_path / "link.html"  # the result under another name
    link.symlink_to(plans)
    with pytest.raises(InputError, match="is an input of this run"):
        write_report(plans, link)
    link.unlink()
    not_plans = tmp_path / "list.json"
    not_plans.write_text("[1, 2]")
    with pytest.raises(InputError, match="list.json: entry 0: not a fasop plan"):
        write_report(not_plans, tmp_path / "r.html")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["list.json"]


def test_the_report_command(plans, tmp_path):
    help_text = run("report", "--help").output
    assert "RESULT" in help_text and "--output" in help_text and "--force" in help_text
    assert "report" in run("--help").output
    out = tmp_path / "page.html"
    result = run("report", plans, "-o", out)
    assert result.exit_code == 0, result.output
    assert result.output == f"report of {len(json.loads(plans.read_text()))} plans of plans.json written to {out}\n"
    before = out.read_bytes()
    refused = run("report", plans, "--output", out)
    assert refused.exit_code == 2 and refused.output.strip().endswith("already exists (pass --force to overwrite it)")
    assert run("report", plans, "--output", out, "--force").exit_code == 0 and out.read_bytes() == before
    for args, words in ((["notes.txt", "-o", tmp_path / "x.html"], "notes.txt: expected the plans.json"),
                        ([plans, "-o", tmp_path / "x.pdf"], "--output "),
                        ([plans, "-o", plans], "is an input of this run"),
                        ([tmp_path / "missing.csv", "-o", tmp_path / "x.html"], "missing.csv")):
        result = run("report", *args)
        lines = [line for line in result.output.splitlines() if line.strip()]
        assert result.exit_code == 2 and len(lines) == 1 and lines[0].startswith("Error: ") and words in lines[0], \
            result.output
    assert not (tmp_path / "x.html").exists() and not (tmp_path / "x.pdf").exists()


# -- in a real browser ---------------------------------------------------------------------------------------

CHROMIUM = shutil.which("chromium")


def in_chromium(page: Path, fragment: str, profile: Path) -> tuple[str, str]:
    """The DOM of `page` once loaded and its script has run (--virtual-time-budget), and what the browser logged
    (console messages are lines with CONSOLE)."""
    done = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={profile}",
                           "--enable-logging=stderr", "--v=0", "--virtual-time-budget=3000", "--dump-dom",
                           page.as_uri() + fragment], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout, done.stderr


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (bash scripts/install_browser.sh)")
def test_the_page_loads_in_chromium_and_sorts_on_a_click(plans, tmp_path):
    out = tmp_path / "report.html"
    write_report(plans, out)
    column = [header for header, _, _ in PLAN_COLUMNS].index("step s")
    dom, log = in_chromium(out, f"#sort={column},{column}", tmp_path / "profile")  # two clicks: descending
    assert not [line for line in log.splitlines() if "CONSOLE" in line], log
    page = Page(dom)
    assert page.body["data-errors"] == "0" and page.body["data-images-loaded"] == "2"
    assert re.search(r'<ul id="errors"></ul>', dom)
    steps = [float(row[column]) for row in page.rows]
    assert len(steps) == len(json.loads(plans.read_text())) and steps == sorted(steps, reverse=True)
    assert steps != [float(row[column]) for row in Page(out.read_text()).rows]  # the click changed the order

    front = tmp_path / "front.html"
    write_report(FRONT, front)
    dom, log = in_chromium(front, "", tmp_path / "profile")
    assert not [line for line in log.splitlines() if "CONSOLE" in line], log
    page = Page(dom)
    assert page.body["data-errors"] == "0" and page.body["data-images-loaded"] == "1" and len(page.rows) == 80
