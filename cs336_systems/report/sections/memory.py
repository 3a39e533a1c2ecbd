"""Section: gradient_checkpointing and the memory model's predicted peaks against the measured ones."""

from __future__ import annotations

import pandas as pd

from cs336_systems.memory.policy import CheckpointPolicy
from cs336_systems.report.document import Code, Document, Heading, Paragraph, Table
from cs336_systems.report.sections.common import Results, environment, latest


def _policy_order(text: str) -> tuple:
    """The table's order: none, every block, every k by k, then the rest (nested)."""
    policy = CheckpointPolicy.parse(text)
    return ({"none": 0, "every-block": 1, "every-k": 2}.get(policy.scheme, 3), policy.size or 0, text)

def _nested_sentence(table: list[dict]) -> str:
    nested = [t for t in table if t["policy"] == "nested" and t["error"] != "-"]
    if not nested:
        return ""
    error = float(nested[0]["error"].split()[0])
    return (f" The nested policy is not walked: its prediction is the sum of the parts at their largest, "
            f"{abs(error):.1f} % {'above' if error > 0 else 'below'} the measured peak, so it is an estimate, "
            "not a bound.")


def checkpointing_and_memory_model(doc: Document, r: Results) -> None:
    from cs336_systems.config import ModelConfig
    from cs336_systems.memory.model import predict

    doc.add(Heading("gradient_checkpointing: activation checkpointing and the memory model"))
    doc.add(Paragraph("(a) Memory-optimal, compute aside: nest the checkpoints by recursive halving (our "
                      "`--checkpoint nested`, `memory/checkpointing.py`). Checkpoint the first half of the blocks and "
                      "recurse into the second; recomputing a checkpointed half applies the same scheme inside it. "
                      "Alive at any time are the inputs of the halves on the current path, one per level, and one "
                      "block's residuals: peak activation memory O(log N) blocks, for O(N log N) block forwards "
                      "(each level recomputes the forward once). One level of groups of k blocks keeps N/k "
                      "boundaries plus k blocks' residuals, O(sqrt N) at k = sqrt N, for one extra forward."))
    doc.add(Code("def nested(blocks, x):\n"
                 "    if len(blocks) <= 1:\n"
                 "        return blocks[0](x) if blocks else x\n"
                 "    mid = len(blocks) // 2\n"
                 "    x = checkpoint(nested, blocks[:mid], x, use_reentrant=False)\n"
                 "    return nested(blocks[mid:], x)"))
    doc.add(Paragraph("(b) One level of recomputation, measured below: the peaks of every group size k tried, the "
                      "memory model's prediction beside each."))
    mem = r.frame("memory")
    peaks = mem[(mem["metric"] == "peak_memory") & mem["policy"].notna()] if not mem.empty else mem
    peaks = peaks[peaks["device_name"].str.contains("H", na=False)] if not peaks.empty else peaks
    if peaks.empty:
        return r.note_missing(doc, "memory", "`cs336-bench memory search` rows (GPU)")
    peaks = latest(peaks, ["preset", "context", "batch", "dtype", "policy"])
    times = latest(mem[mem["metric"] == "step_time"], ["preset", "context", "batch", "dtype", "policy"])
    stored = latest(mem[mem["metric"] == "predicted_peak_memory"], ["preset", "context", "batch", "dtype", "policy"])
    table = []
    for _, row in peaks.iterrows():
        cfg = ModelConfig.from_name(row["preset"], context_length=int(row["context"]))
        predicted = predict(cfg, int(row["batch"]), int(row["context"]), policy=row["policy"]).peak / 2**30
        t = times[(times["policy"] == row["policy"]) & (times["context"] == row["context"])]
        measured = row["median"] if row["status"] == "ok" else None
        then = stored[(stored["policy"] == row["policy"]) & (stored["context"] == row["context"])]
        table.append({"context": int(row["context"]), "policy": row["policy"],
                      "measured peak GiB": round(measured, 2) if measured else row["status"],
                      "predicted at the run GiB": round(then["median"].iloc[0], 2) if len(then) else "",
                      "predicted GiB": round(predicted, 2),
                      "error": f"{100 * (predicted / measured - 1):+.1f} %" if measured else "-",
                      "step ms": round(t["median"].iloc[0]) if len(t) else "-"})
    table.sort(key=lambda t: (t["context"], _policy_order(t["policy"])))
    search_context = max(t["context"] for t in table)
    others = ", ".join(str(c) for c in sorted({t["context"] for t in table} - {search_context}))
    doc.add(Paragraph(f"`cs336-bench memory search --preset xl --context {search_context} --batch 4` (fp32, "
                      "reference attention, one checkpointing level over group sizes k) and none/every-block at "
                      f"context {others}; "
                      "\"predicted GiB\" is the analytic memory model of this commit (`cs336_systems.memory.model."
                      "predict`), walking the backward pass; \"predicted at the run\" is the one the run stored. " +
                      environment(peaks)))
    doc.add(Table(pd.DataFrame(table)))
    revised = [(t["predicted at the run GiB"] / t["measured peak GiB"] - 1) * 100 for t in table
               if t["predicted at the run GiB"] != "" and isinstance(t["measured peak GiB"], float)
               and t["predicted at the run GiB"] != t["predicted GiB"]]
    if revised:
        doc.add(Paragraph(f"The model has changed since these runs: the predictions they stored were off by "
                          f"{min(revised):+.1f} % to {max(revised):+.1f} % of the measured peaks, so the error "
                          "column, today's model against the same measurements, is not an out-of-sample test."))
    ok = [t for t in table if t["error"] != "-" and not t["policy"].startswith("nested")]
    if ok:
        worst = max(abs(float(t["error"].split()[0])) for t in ok)
        best = min((t for t in ok if t["context"] == search_context), key=lambda t: t["measured peak GiB"],
                   default=None)
        doc.add(Paragraph(f"The model is within {worst:.1f} % of every measured single-level peak. "
                          + (f"The lowest single-level peak at context {search_context} is {best['policy']} "
                             f"({best['measured peak GiB']} GiB, {best['step ms']} ms/step): more groups keep more "
                             "boundaries, bigger groups keep more activations live during recompute; no "
                             "checkpointing does not fit." if best else "")
                          + _nested_sentence(table)))
