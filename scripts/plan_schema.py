"""The JSON schema of a plan (fasop.plans.Plan), written into docs/formats.md between its markers.

    python scripts/plan_schema.py [--check]

With --check, exit code 1 if the page's schema differs from the model's (tests/test_plans.py checks it too).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from fasop.plans import Plan

PAGE = Path(__file__).resolve().parents[1] / "docs" / "formats.md"
BEGIN, END = "<!-- plan schema: scripts/plan_schema.py -->\n```json\n", "```\n<!-- end of plan schema -->"


def schema_text() -> str:
    return json.dumps(Plan.model_json_schema(), indent=1) + "\n"


def page_with_schema(page: str) -> str:
    start, end = page.index(BEGIN) + len(BEGIN), page.index(END)
    return page[:start] + schema_text() + page[end:]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only report whether the page is up to date")
    args = parser.parse_args()
    page = PAGE.read_text()
    fresh = page_with_schema(page)
    if args.check:
        return 0 if fresh == page else 1
    PAGE.write_text(fresh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
