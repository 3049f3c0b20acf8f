"""A self-contained HTML page of figures and tables: the study report (``adls_lightning.reports.study``) and the
sweep report (``adls_lightning.reports.sweep``) are written with it.

Figures are plotly figures (Optuna draws its own with plotly); plotly.js is embedded once, so the page opens from
a file with no network. Tables sort by any column on a click on its header.
"""

from __future__ import annotations

import html
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from adls_lightning.files.atomic import atomic_write_bytes

#: the file a page is written to, in its report's folder
PAGE_FILE = "index.html"
#: how a page names the command that wrote it (first in its head), so a redraw tells its own earlier page from
#: another report's
GENERATOR = re.compile(r"<meta name='generator' content='([\w.]+)'>")

STYLE = """
body { font-family: system-ui, sans-serif; margin: 1.5em; color: #222; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; margin-top: 1.5em; }
table { border-collapse: collapse; font-size: 0.85em; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.5em; text-align: left; vertical-align: top; }
th { background: #f0f0f0; cursor: pointer; user-select: none; }
th.sorted-asc::after { content: " \\25B2"; } th.sorted-desc::after { content: " \\25BC"; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
code, pre { background: #f6f6f6; padding: 0.2em 0.4em; white-space: pre-wrap; word-break: break-all; }
.figure { margin: 1em 0; }
"""

# Click a header: sort by that column (numbers as numbers, empty cells last), click again: the other way.
SORT_SCRIPT = """
document.querySelectorAll("table.sortable").forEach(function (table) {
  table.querySelectorAll("th").forEach(function (th, col) {
    th.addEventListener("click", function () {
      var asc = !th.classList.contains("sorted-asc");
      table.querySelectorAll("th").forEach(function (h) { h.classList.remove("sorted-asc", "sorted-desc"); });
      th.classList.add(asc ? "sorted-asc" : "sorted-desc");
      var body = table.tBodies[0], rows = Array.from(body.rows);
      function key(row) {
        var text = row.cells[col].textContent.trim(), num = Number(text);
        return text === "" ? null : (isNaN(num) ? text : num);
      }
      rows.sort(function (a, b) {
        var x = key(a), y = key(b);
        if (x === null) return 1; if (y === null) return -1;
        var c = (typeof x === "number" && typeof y === "number") ? x - y : String(x).localeCompare(String(y));
        return asc ? c : -c;
      });
      rows.forEach(function (row) { body.appendChild(row); });
    });
  });
});
"""


def format_cell(value: Any) -> tuple[str, bool]:
    """(text, is a number) of a table cell: floats to 6 significant digits, lists and dicts as JSON."""
    if value is None:
        return "", False
    if isinstance(value, bool):
        return str(value).lower(), False
    if isinstance(value, float):
        return f"{value:.6g}", True
    if isinstance(value, int):
        return str(value), True
    if isinstance(value, (list, tuple, dict)):
        return json.dumps(value), False
    return str(value), False


@dataclass
class Page:
    """The sections of one report page, in order."""

    title: str
    #: the command that writes it (``adls_lightning.reports.sweep``): named in the page's head
    generator: str
    sections: list[str] = field(default_factory=list)
    figures: int = 0

    def heading(self, text: str) -> None:
        self.sections.append(f"<h2>{html.escape(text)}</h2>")

    def paragraph(self, text: str) -> None:
        self.sections.append(f"<p>{html.escape(text)}</p>")

    def code(self, text: str) -> None:
        self.sections.append(f"<pre><code>{html.escape(text)}</code></pre>")

    def facts(self, rows: Mapping[str, Any]) -> None:
        """A two-column table of names and values (not sortable)."""
        cells = "".join(
            f"<tr><th>{html.escape(str(k))}</th><td>{html.escape(format_cell(v)[0])}</td></tr>"
            for k, v in rows.items()
        )
        self.sections.append(f"<table class='facts'>{cells}</table>")

    def figure(self, figure: Any) -> None:
        """A plotly figure (drawn by the embedded plotly.js when the page opens)."""
        self.figures += 1
        div = figure.to_html(full_html=False, include_plotlyjs=False, div_id=f"figure-{self.figures}")
        self.sections.append(f"<div class='figure'>{div}</div>")

    def table(self, columns: Sequence[str], rows: Sequence[Sequence[Any]], table_id: str) -> None:
        """A sortable table; ``rows`` hold values (formatted by :func:`format_cell`)."""
        head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
        body = []
        for row in rows:
            cells = []
            for value in row:
                text, number = format_cell(value)
                cells.append(f"<td{' class=num' if number else ''}>{html.escape(text)}</td>")
            body.append(f"<tr>{''.join(cells)}</tr>")
        self.sections.append(
            f"<table class='sortable' id='{table_id}'><thead><tr>{head}</tr></thead>"
            f"<tbody>{''.join(body)}</tbody></table>"
        )

    def html(self) -> str:
        from plotly.offline import get_plotlyjs

        plotly_js = f"<script>{get_plotlyjs()}</script>" if self.figures else ""
        return (
            "<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'>"
            f"<meta name='generator' content='{html.escape(self.generator)}'>"
            f"<title>{html.escape(self.title)}</title><style>{STYLE}</style>{plotly_js}</head>"
            f"<body><h1>{html.escape(self.title)}</h1>{''.join(self.sections)}"
            f"<script>{SORT_SCRIPT}</script></body></html>\n"
        )

    def write(self, out_dir: Path) -> Path:
        """Write ``out_dir/index.html`` (the folder is created; the file is replaced whole, never half-written)."""
        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / PAGE_FILE
        atomic_write_bytes(path, self.html().encode())
        return path


def page_generator(folder: Path) -> str | None:
    """The command that wrote ``folder``'s page (its head's generator), or None: no page, or not one of these."""
    try:
        with (folder / PAGE_FILE).open("rb") as page:
            head = page.read(512).decode("utf-8", "replace")
    except OSError:
        return None
    found = GENERATOR.search(head)
    return found.group(1) if found else None


def check_page_folder(out: Path, command: str) -> None:
    """Refuse a page's ``out=`` unless new, empty, or ``command``'s own earlier page (redrawn in place).

    Raises:
        ConfigError: naming ``out=`` and what it holds.
    """
    from adls_lightning.reports.output import check_report_folder

    check_report_folder(out, command, (PAGE_FILE,), lambda folder: page_generator(folder) == command)
