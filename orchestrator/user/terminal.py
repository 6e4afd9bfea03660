"""Plain text that fits the terminal: every line at most `width` columns, nothing cut mid-word.

The commands (`status`, `list`, `plan`, the progress line) lay their lines out here for the
console's width (80 columns is what most terminals open with). Nothing is ever truncated
with an ellipsis: fields that do not fit go to the next line, and a table drops its least
needed columns first. Job ids in a table are the shortest prefix that names one job, which
every command accepts as JOB.
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence

GAP = "  "


def fit_fields(fields: Sequence[str], width: int, *, indent: str = "", sep: str = GAP) -> list[str]:
    """`fields` joined by `sep` on as few lines as fit `width`, each line starting with `indent`.

    A field is never split across lines unless it alone is wider than the line; then it is
    wrapped at spaces.
    """
    lines: list[str] = []
    line = ""
    room = max(10, width - len(indent))
    for f in (f for f in fields if f):
        if len(f) > room:
            if line:
                lines.append(line)
                line = ""
            lines.extend(textwrap.wrap(f, room, break_on_hyphens=False) or [""])
            continue
        if not line:
            line = f
        elif len(line) + len(sep) + len(f) <= room:
            line += sep + f
        else:
            lines.append(line)
            line = f
    if line:
        lines.append(line)
    return [indent + x for x in lines]


def wrap(text: str, width: int, *, indent: str = "", hanging: str | None = None) -> list[str]:
    """`text` wrapped at spaces to `width`, the first line after `indent`, the others after `hanging`."""
    hanging = indent if hanging is None else hanging
    return textwrap.wrap(text, width, initial_indent=indent, subsequent_indent=hanging, break_on_hyphens=False,
                         break_long_words=True) or [indent.rstrip()]


def unique_prefixes(ids: Sequence[str], *, minimum: int = 6) -> dict[str, str]:
    """Each id's shortest prefix (at least `minimum` characters, never less than a whole id) that no
    other id starts with; an id that is a prefix of another stays whole."""
    out = {}
    for i in ids:
        n = min(len(i), minimum)
        while n < len(i) and any(o != i and o.startswith(i[:n]) for o in ids):
            n += 1
        out[i] = i[:n]
    return out


def table(headers: Sequence[str], rows: Sequence[Sequence[str]], width: int, *,
          right: Sequence[int] = (), drop_order: Sequence[int] = ()) -> list[str]:
    """A plain table (a header line, then one line per row) no wider than `width`.

    Columns are as wide as their widest cell; while the table is too wide, the columns in
    `drop_order` are left out, one at a time. `right`: the columns aligned right.
    """
    keep = list(range(len(headers)))
    for drop in [None, *drop_order]:
        if drop is not None:
            keep.remove(drop)
        widths = {c: max([len(headers[c])] + [len(r[c]) for r in rows]) for c in keep}
        if sum(widths.values()) + len(GAP) * (len(keep) - 1) <= width:
            break

    def line(cells: Sequence[str]) -> str:
        parts = [cells[c].rjust(widths[c]) if c in right else cells[c].ljust(widths[c]) for c in keep]
        return GAP.join(parts).rstrip()

    return [line(headers), *(line(r) for r in rows)]
