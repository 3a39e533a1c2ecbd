"""A report as a list of blocks (headings, paragraphs, tables, figures, code), rendered to Markdown
and to an HTML page with the same content. Tables are pandas frames; figures are PNG paths
relative to the report's folder."""

from __future__ import annotations

import html
import re
from dataclasses import dataclass, field

import pandas as pd


def anchor(text: str, taken: set[str]) -> str:
    """GitHub's heading anchor (lower case; letters, digits, '-' and '_' kept; spaces to '-'), made unique with
    -1, -2, ... as GitHub does: the Markdown's links and the HTML's ids agree."""
    base = re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")
    slug, n = base, 0
    while slug in taken:
        n += 1
        slug = f"{base}-{n}"
    taken.add(slug)
    return slug


def for_display(frame: pd.DataFrame) -> pd.DataFrame:
    """A table as a reader wants it: no name over the columns (pivot tables carry one), integral float columns as
    integers (contexts are 2048, not 2048.0), missing values blank rather than NaN."""
    frame = frame.copy()
    frame.columns.name = None
    for column in frame.columns:
        values = frame[column]
        if pd.api.types.is_float_dtype(values) and values.notna().any() and (values.dropna() % 1 == 0).all():
            frame[column] = values.astype("Int64")
    shown = frame.astype(object)
    return shown.where(frame.notna(), "")


def _inline_html(text: str) -> str:
    """Escaped text with `code` spans as <code>."""
    return re.sub(r"`([^`]+)`", r"<code>\1</code>", html.escape(text))


@dataclass
class Heading:
    text: str
    level: int = 2


@dataclass
class Paragraph:
    text: str


@dataclass
class Table:
    frame: pd.DataFrame
    caption: str = ""


@dataclass
class Figure:
    path: str
    caption: str


@dataclass
class Code:
    text: str


@dataclass
class Document:
    title: str
    blocks: list = field(default_factory=list)

    def add(self, *blocks) -> None:
        self.blocks.extend(blocks)

    def contents(self) -> list[tuple[Heading, str]]:
        """(heading, anchor) of every heading, in order."""
        taken: set[str] = set()
        return [(block, anchor(block.text, taken)) for block in self.blocks if isinstance(block, Heading)]

    def markdown(self) -> str:
        out = [f"# {self.title}", "", "Contents:", ""]
        out += [f"{'  ' * (heading.level - 2)}- [{heading.text}](#{slug})" for heading, slug in self.contents()]
        out.append("")
        for block in self.blocks:
            if isinstance(block, Heading):
                out += ["#" * block.level + " " + block.text, ""]
            elif isinstance(block, Paragraph):
                out += [block.text, ""]
            elif isinstance(block, Table):
                if block.caption:
                    out += [f"*{block.caption}*", ""]
                out += [for_display(block.frame).to_markdown(index=False), ""]
            elif isinstance(block, Figure):
                out += [f"![{block.caption}]({block.path})", "", f"*{block.caption}*", ""]
            elif isinstance(block, Code):
                out += ["```", block.text.rstrip(), "```", ""]
        return "\n".join(out)

    def html(self) -> str:
        contents = self.contents()
        slugs = {id(heading): slug for heading, slug in contents}
        body = [f"<h1>{html.escape(self.title)}</h1>", "<nav><p>Contents:</p><ul>"]
        body += [f'<li style="margin-left:{heading.level - 2}em"><a href="#{slug}">{_inline_html(heading.text)}'
                 "</a></li>" for heading, slug in contents]
        body.append("</ul></nav>")
        for block in self.blocks:
            if isinstance(block, Heading):
                body.append(f'<h{block.level} id="{slugs[id(block)]}">{_inline_html(block.text)}</h{block.level}>')
            elif isinstance(block, Paragraph):
                body.append(f"<p>{_inline_html(block.text)}</p>")
            elif isinstance(block, Table):
                caption = f"<p><em>{_inline_html(block.caption)}</em></p>" if block.caption else ""
                body.append(caption + for_display(block.frame).to_html(index=False, border=0, classes="data"))
            elif isinstance(block, Figure):
                body.append(f'<figure><img src="{html.escape(block.path)}" alt="{html.escape(block.caption)}">'
                            f"<figcaption>{_inline_html(block.caption)}</figcaption></figure>")
            elif isinstance(block, Code):
                body.append(f"<pre>{html.escape(block.text)}</pre>")
        style = ("body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;"
                 "line-height:1.45}"
                 "table.data{border-collapse:collapse;font-size:0.85em;margin:0.5em 0 1em}"
                 "table.data td,table.data th{padding:2px 8px;border-bottom:1px solid #ddd;text-align:right}"
                 "img{max-width:100%}pre{background:#f5f5f5;padding:0.6em;overflow-x:auto}"
                 "code{background:#f5f5f5;padding:0 0.2em}nav ul{list-style:none;padding-left:0}")
        return (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(self.title)}</title>"
                f"<style>{style}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n")
