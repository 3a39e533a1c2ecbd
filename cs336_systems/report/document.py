"""A report as a list of blocks (headings, paragraphs, tables, figures, code), rendered to Markdown
and to an HTML page with the same content. Tables are pandas frames; figures are PNG paths
relative to the report's folder."""

from __future__ import annotations

import html
from dataclasses import dataclass, field

import pandas as pd


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

    def markdown(self) -> str:
        out = [f"# {self.title}", ""]
        for block in self.blocks:
            if isinstance(block, Heading):
                out += ["#" * block.level + " " + block.text, ""]
            elif isinstance(block, Paragraph):
                out += [block.text, ""]
            elif isinstance(block, Table):
                if block.caption:
                    out += [f"*{block.caption}*", ""]
                out += [block.frame.to_markdown(index=False), ""]
            elif isinstance(block, Figure):
                out += [f"![{block.caption}]({block.path})", "", f"*{block.caption}*", ""]
            elif isinstance(block, Code):
                out += ["```", block.text.rstrip(), "```", ""]
        return "\n".join(out)

    def html(self) -> str:
        body = [f"<h1>{html.escape(self.title)}</h1>"]
        for block in self.blocks:
            if isinstance(block, Heading):
                anchor = html.escape(block.text.split(" ")[0].strip("`").lower())
                body.append(f'<h{block.level} id="{anchor}">{html.escape(block.text)}</h{block.level}>')
            elif isinstance(block, Paragraph):
                body.append(f"<p>{html.escape(block.text)}</p>")
            elif isinstance(block, Table):
                caption = f"<p><em>{html.escape(block.caption)}</em></p>" if block.caption else ""
                body.append(caption + block.frame.to_html(index=False, border=0, classes="data"))
            elif isinstance(block, Figure):
                body.append(f'<figure><img src="{html.escape(block.path)}" alt="{html.escape(block.caption)}">'
                            f"<figcaption>{html.escape(block.caption)}</figcaption></figure>")
            elif isinstance(block, Code):
                body.append(f"<pre>{html.escape(block.text)}</pre>")
        style = ("body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;"
                 "line-height:1.45}"
                 "table.data{border-collapse:collapse;font-size:0.85em;margin:0.5em 0 1em}"
                 "table.data td,table.data th{padding:2px 8px;border-bottom:1px solid #ddd;text-align:right}"
                 "img{max-width:100%}pre{background:#f5f5f5;padding:0.6em;overflow-x:auto}")
        return (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(self.title)}</title>"
                f"<style>{style}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n")
