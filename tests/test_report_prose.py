"""Every number in the report's prose comes from data: a numeral typed into a sentence of a report section (the
literal parts of the strings its paragraphs, captions and prose helpers are built from, outside `code spans`) fails
this test unless it stands in one of a short list of constants (a definition, the handout's own figures, a formula).
Values formatted into the text (`{value:.2f}`) come from rows, the code or a calculator by construction. A second
test checks a claim against the code it describes: which backward runs by default."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import cs336_systems.report.sections as sections_package

SECTIONS = Path(sections_package.__file__).parent
NUMERAL = re.compile(r"(?<![\w.^/])\d+(?:[.,]\d+)*(?:e[+-]?\d+)?(?![\w])")
FORMATTED = "\x00"  # stands for a formatted value in the scanned text

# Phrases whose numerals are constants, each with why it is not a measurement.
ALLOWED = {
    r"FlashAttention-2|ZeRO-1|ZeRO-3|ring all-reduce of 2": "names",
    r"\b1/[NXY]\b|N - 1|N/2|\(N-1\)|N\^2|seq\^2|2\^-7|x 4 bytes|x 4 =|4 bytes each|16 bytes per parameter":
        "definitions: shares of N ranks, powers, bytes per fp32 element and per AdamW parameter",
    r"6 B D F|2 B D F|3 F X \+ 2 B Y <= 6 B F W": "the handout's FLOP formulas",
    r"C = 4\.6e14 FLOP/s, W = 1\.8e11 B/s": "the handout's TPU v5p figures",
    r"\(5 products|\(7 products": "the matmuls per tile of each backward algorithm",
    r"3-D inputs": "a shape's name",
    r"1000 additions of 0\.01|exact sum 10|spacing near 10|rounding of 0\.01": "the handout's accumulation loops",
    r"d_model 16384, d_ff 53248, 126 blocks|X = 16 \(FSDP, M_X = 2\) x Y = 4 \(TP, M_Y = 1\)":
        "the handout's XXL model and its mesh",
    r"1 GB over N devices at W = 450 GB/s|w = 100 GB/s and o = 50 us": "illustrative calculator inputs, said so",
    r"Below 1 ours|ours / baseline < 1|below 1 means": "the ratio's definition",
    r"on 2 GPUs|2 GPUs is missing": "the run the one-GPU machine cannot make",
    r"largest finite value 65504|10-bit mantissa|7-bit mantissa": "fp16's and bf16's formats, by definition",
    r"\(4 d\^2 \+ 3 d d_ff \+ 2 d\)": "a block's parameter count (four d x d projections, three d x d_ff, two norms)",
    r"4 d_head FLOPs per score": "the attention's two products per score (d_head multiply-adds each)",
    r"\(a\)|\(b\)|\(c\)|\(d\)|\(e\)": "the handout's sub-question labels",
}


def _literal_text(node: ast.AST) -> str:
    """The literal characters of a string expression; formatted values become FORMATTED."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else FORMATTED for v in node.values)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _literal_text(node.left) + _literal_text(node.right)
    if isinstance(node, ast.IfExp):
        return _literal_text(node.body) + " " + _literal_text(node.orelse)
    return FORMATTED if isinstance(node, (ast.Name, ast.Call, ast.Attribute, ast.Subscript)) else ""


def _prose_strings(tree: ast.AST):
    """(line, text) of each string that becomes prose: paragraphs, table and figure captions, and the strings
    helper functions return (they are joined into paragraphs)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("Paragraph", "Table", "Figure"):
            args = node.args if node.func.id == "Paragraph" else node.args[1:]
            for arg in args:
                yield node.lineno, _literal_text(arg)
        elif isinstance(node, ast.Return) and node.value is not None and isinstance(
                node.value, (ast.Constant, ast.JoinedStr, ast.BinOp)):
            yield node.lineno, _literal_text(node.value)
    for node in getattr(tree, "body", []):  # module-level prose constants (strings a paragraph formats in)
        if isinstance(node, ast.Assign) and isinstance(node.value, (ast.Constant, ast.BinOp)) \
                and isinstance(_literal_text(node.value), str) and " " in _literal_text(node.value):
            yield node.lineno, _literal_text(node.value)


def hand_typed_numerals() -> list[str]:
    found = []
    for path in sorted(SECTIONS.glob("*.py")):
        for line, text in _prose_strings(ast.parse(path.read_text())):
            prose = re.sub(r"`[^`]*`", "", text)
            for allowed in ALLOWED:
                prose = re.sub(allowed, " ", prose)
            for match in NUMERAL.finditer(prose):
                context = prose[max(0, match.start() - 40):match.end() + 20].replace(FORMATTED, "{...}")
                found.append(f"{path.name}:{line}: {match.group()!r} in ...{context}...")
    return found


def test_no_numeral_in_the_report_prose_is_typed_by_hand():
    found = hand_typed_numerals()
    assert not found, "numerals typed into the report's prose (format them from rows, the code or a calculator):\n" \
        + "\n".join(found)


def test_the_scan_finds_a_typed_numeral(tmp_path, monkeypatch):
    """The scanner itself: a sentence with a typed number is caught, the same number formatted is not."""
    module = tmp_path / "example.py"
    module.write_text('def s(doc, x):\n    doc.add(Paragraph(f"ours takes 12.5 ms against {x:.1f} ms"))\n')
    monkeypatch.setattr(sys.modules[__name__], "SECTIONS", tmp_path)
    assert [f.split(": ", 1)[1].split(" in ")[0] for f in hand_typed_numerals()] == ["'12.5'"]
    module.write_text('WHY = ("the first step pays 3 compiles")\ndef s(doc):\n    doc.add(Paragraph(f"x: {WHY}"))\n')
    assert [f.split(": ", 1)[1].split(" in ")[0] for f in hand_typed_numerals()] == ["'3'"]


def test_the_default_backward_sentence_matches_the_code():
    """The report names the head dims where the one-pass backward is the default from the code itself."""
    from cs336_systems.kernels.flash_attention import hopper_backward

    source = (SECTIONS / "attention.py").read_text()
    assert "ONE_PASS_HEAD_DIMS" in source
    assert hopper_backward.ONE_PASS_HEAD_DIMS  # the sentence formats them; an empty tuple would read oddly
