"""Sections: our fused kernels in the model path (RMSNorm, SwiGLU, AdamW) and the fused LM-head
cross-entropy against the plain and chunked losses."""

from __future__ import annotations

import pandas as pd

from cs336_systems.report.document import Document, Heading, Paragraph, Table
from cs336_systems.report.sections.common import Results, col, environment, latest, ours_vs_baseline


def fused_model_path(doc: Document, r: Results) -> None:
    doc.add(Heading("Our kernels in the model: Triton attention, fused RMSNorm/SwiGLU, fused AdamW"))
    model = r.frame("model")
    rows = model[(col(model, "metric") == "time") & (col(model, "fused", False).fillna(False) == True)]  # noqa: E712
    if rows.empty:
        return r.note_missing(doc, "fused model path", "model-suite rows with --fused (GPU)")
    base = model[(model["metric"] == "time") & model["run_id"].isin(rows["run_id"]) & (model["provider"] == "baseline")]
    table = ours_vs_baseline(pd.concat([rows, base]), ["preset", "dtype", "mode"])
    doc.add(Paragraph("`cs336-bench model --dtype bf16 --attention triton --fused --optimizer fused --mode "
                      "train-step --provider ours,baseline` (eager, batch 4, context 512). " + environment(rows)))
    doc.add(Table(table))
    doc.add(Paragraph("Our kernels narrow the eager gap (compare the bf16 train-step rows above), but the eager "
                      "model is still slower than the PyTorch-native one: RoPE, the residual adds and the per-layer "
                      "einsum/rearrange copies are still separate kernels, and at context 512 the step is launch-"
                      "bound. At 32k context (leaderboard, below) the same kernels pay."))


def fused_cross_entropy(doc: Document, r: Results) -> None:
    """Issue 7's loss benchmark: our fused LM head + cross-entropy against lm_head + cross_entropy."""
    doc.add(Heading("Fused LM head + cross-entropy"))
    frame = r.frame("cross-entropy")
    rows = frame[col(frame, "device") == "cuda"]
    if rows.empty:
        return r.note_missing(doc, "fused cross-entropy", "`cs336-bench cross-entropy` rows (`bash "
                              "scripts/device_run.sh cross-entropy`, GPU)")
    from cs336_systems.bench.suites.cross_entropy import CASE_KEYS, summary_table

    rows = latest(rows, ["provider", *CASE_KEYS, "metric"])
    times = rows[rows["metric"] == "time"]
    table = summary_table(rows, digits=1)
    doc.add(Paragraph("`cs336-bench cross-entropy`: the loss and its gradients for the hidden states and the head "
                      "weight, one forward and backward, timed by do_bench. fused is ours; plain is "
                      "F.cross_entropy on the whole fp32-upcast logits; chunked is the leaderboard baseline's loss "
                      "(4096-token chunks, each checkpointed). TFLOP/s counts the three GEMMs (logits, dH, dW) "
                      "for every provider; peak is the memory allocated above the inputs. " + environment(times)))
    doc.add(Table(table, "median ms, speed-up (baseline time / ours), peak GiB and TFLOP/s"))
