"""Sections: benchmarking_script, nsys_profile, mixed_precision_accumulation, memory_profiling, and
torch_compile (the model suite compiled)."""

from __future__ import annotations

import pandas as pd

from cs336_systems.config import ModelConfig
from cs336_systems.report.document import Document, Figure, Heading, Paragraph, Table
from cs336_systems.report.sections.common import (
    Results,
    col,
    eager_reference_rows,
    environment,
    latest,
    ours_vs_baseline,
    shared_value,
)

MEMORY_CONTEXTS = (128, 2048)  # memory_profiling's contexts (the handout's)
TOP_OPS = 5  # memory_profiling (f): how many ops of the block's saved tensors to list


def benchmarking_script(doc: Document, r: Results) -> None:
    doc.add(Heading("benchmarking_script: forward, backward and training-step timings"))
    model = eager_reference_rows(r.frame("model"))
    eager = model[(col(model, "compile") == False) & (col(model, "dtype") == "fp32")]  # noqa: E712
    if eager.empty:
        return r.note_missing(doc, "benchmarking_script", "eager fp32 model-suite rows (GPU)")
    table = ours_vs_baseline(eager, ["preset", "mode"])
    order = {p: i for i, p in enumerate(["small", "medium", "large", "xl", "10B"])}
    table = table.sort_values(["preset", "mode"], key=lambda s: s.map(order) if s.name == "preset" else s)
    shown = latest(eager, ["preset", "mode", "provider"])
    steps = ", ".join(sorted({f"{int(w)} warm-up and {int(n)} timed steps"
                              for w, n in zip(shown["warmup"], shown["n"])}))
    batches = ", ".join(sorted({f"batch {int(b)}, context {int(c)}" for b, c in zip(shown["batch"], shown["context"])}))
    doc.add(Paragraph("`cs336-bench model --preset small,medium,large,xl --dtype fp32 --provider ours,baseline` "
                      f"({batches}, {steps}; `ours` is the cs336_basics model with the staff-equivalent attention "
                      "and AdamW, `baseline` the PyTorch-native LM with SDPA and fused AdamW). " + environment(eager)))
    doc.add(Table(table, "median ± standard deviation over the timed steps, ms"))
    phases = r.frame("model")
    phases = phases[(phases["metric"] == "phase_time") & (phases["mode"] == "train-step")]
    keys = [k for k in ("run_id", "preset", "provider", "dtype", "context", "batch", "compile", "attention",
                        "checkpoint", "fused", "optimizer") if k in phases.columns and k in shown.columns]
    phases = phases.merge(shown[shown["mode"] == "train-step"][keys].drop_duplicates(), on=keys)  # the timed rows'
    if not phases.empty:
        wide = latest(phases, ["preset", "provider", "phase"]).pivot_table(
            index=["preset", "provider"], columns="phase", values="median").reset_index()
        wide = wide.sort_values("preset", key=lambda s: s.map(order))
        doc.add(Table(wide.round(1), "the training step by phase, mean ms per step over the same timed steps "
                                     "(forward, loss, backward alone, optimizer)"))
    first = latest(eager[eager["provider"] == "ours"], ["preset", "mode"])
    calls = r.frame("model")
    calls = calls[(calls["metric"] == "first_call_time") & calls["run_id"].isin(first["run_id"])]
    calls = latest(calls[(calls["provider"] == "ours")], ["preset", "mode", "dtype", "compile", "context"])
    calls = calls[calls["dtype"] == "fp32"]
    if not calls.empty:
        joined = first.merge(calls[["preset", "mode", "median"]], on=["preset", "mode"], suffixes=("", "_first"))
        worst = joined.assign(ratio=joined["median_first"] / joined["median"]).sort_values("ratio").iloc[-1]
        doc.add(Paragraph(f"Warm-up matters: the first call is timed apart (it carries CUDA context, cuBLAS "
                          f"heuristics and allocator growth). The largest first-call/steady ratio in these rows is "
                          f"{worst['ratio']:.1f}x ({worst['preset']} {worst['mode']}: {worst['median_first']:.0f} vs "
                          f"{worst['median']:.1f} ms); without warm-up the mean would be inflated and its spread "
                          f"large."))
    ratios = table["ours / baseline"].dropna() if "ours / baseline" in table else table.iloc[0:0]
    if len(ratios):
        doc.add(Paragraph(f"Our step is {ratios.min():.2f}x to {ratios.max():.2f}x the baseline's time in fp32; "
                          "the gap is the unfused model path (RMSNorm, RoPE and softmax as separate kernels, a "
                          "materialised (seq, seq) score matrix, a per-parameter AdamW loop)."))


def nsys_profile(doc: Document, r: Results) -> None:
    doc.add(Heading("nsys_profile: where the time goes"))
    model = r.frame("model")
    prof = model[model["metric"] == "profile_kernel_time"] if not model.empty else model
    if prof.empty:
        return r.note_missing(doc, "nsys_profile", "a --profile run (GPU)")
    # Every row of the newest profiled run: kernels are told apart by their rows (older runs stored names cut at
    # 120 characters, so a dedup on the name would merge different kernels).
    newest = prof.sort_values("timestamp")["run_id"].iloc[-1]
    prof = prof[prof["run_id"] == newest]
    doc.add(Paragraph("`cs336-bench model --preset xl --mode train-step --dtype bf16 --profile` (torch.profiler "
                      "over the timed steps, CUDA kernels grouped by our NVTX/record ranges; the Nsight Systems "
                      "command lines are in the README, Nsight itself is not on the lent machine). "
                      + environment(prof)))
    top = prof.sort_values("median", ascending=False).head(12)
    doc.add(Table(pd.DataFrame({"range": top["range"], "kernel": top["kernel"].str.slice(0, 70),
                                "ms per step": top["median"].round(2), "calls per step": top["calls_per_step"],
                                "share": (100 * top["share"]).round(1).astype(str) + " %"}),
                  "top CUDA kernels by total time per step"))
    by_range = prof.groupby("range")["median"].sum().sort_values(ascending=False)
    doc.add(Paragraph("Time per step by range (ms): " + ", ".join(f"{k} {v:.1f}" for k, v in by_range.items())
                      + ". Matrix multiplies (cutlass/cuBLAS GEMM kernels) lead the forward and backward; the "
                      "attention softmax's elementwise kernels take a share far above their FLOPs, which is the "
                      "case for FlashAttention."))
    r.missing.append(("nsys_profile", "an Nsight Systems report (nsys is not on the lent machine)"))


def mixed_precision_accumulation(doc: Document, r: Results) -> None:
    doc.add(Heading("mixed_precision_accumulation and benchmarking_mixed_precision"))
    prec = r.frame("precision")
    if prec.empty:
        return r.note_missing(doc, "mixed_precision_accumulation", "`cs336-bench precision` rows")
    loops = latest(prec[prec["metric"] == "sum"], ["loop"])
    doc.add(Paragraph("`cs336-bench precision`: 1000 additions of 0.01 (exact sum 10). " + environment(loops)))
    doc.add(Table(pd.DataFrame({"loop": loops["loop"], "sum": loops["median"].round(6),
                                "error": (loops["median"] - 10).abs().map(lambda v: f"{v:.2e}")})))
    doc.add(Paragraph("An fp16 accumulator loses the small addends once the sum grows (its spacing near 10 is "
                      "2^-7); accumulating in fp32 keeps the error at the fp16 rounding of 0.01 itself, whether "
                      "the addend is converted explicitly or implicitly."))
    dtypes = latest(prec[prec["metric"] == "dtype"], ["tensor", "autocast"])
    if not dtypes.empty:
        device = ", ".join(sorted(set(dtypes["device"])))
        doc.add(Table(pd.DataFrame({"tensor": dtypes["tensor"], "dtype under autocast": dtypes["message"]}),
                      f"toy model under bf16 autocast on {device}"))
        if "cuda" not in device:
            doc.add(Paragraph("These dtypes were read on CPU autocast, whose op lists differ from CUDA's: there "
                              "layer norm runs in fp32 under autocast (it is on CUDA's fp32 list) while CPU "
                              "autocast runs it in bf16."))
            r.missing.append(("benchmarking_mixed_precision", "the autocast dtypes read on CUDA"))
    model = eager_reference_rows(r.frame("model"))
    step = model[(model["compile"] == False) & (model["mode"] == "train-step")]  # noqa: E712
    if not step.empty:
        wide = latest(step, ["preset", "dtype", "provider"]).pivot_table(
            index=["preset", "provider"], columns="dtype", values="median").reset_index()
        if {"fp32", "bf16"} <= set(wide.columns):
            wide["fp32 / bf16"] = (wide["fp32"] / wide["bf16"]).round(2)
            doc.add(Table(wide.round(1), "eager train-step ms, fp32 vs bf16 autocast. " + environment(step)))


def memory_profiling(doc: Document, r: Results) -> None:
    doc.add(Heading("memory_profiling: peaks, timelines and saved tensors"))
    model = r.frame("model")
    peaks = model[(model["metric"] == "peak_allocated") & model["phase"].notna()] if "phase" in model else model
    peaks = peaks[peaks["preset"] == "xl"] if not peaks.empty else peaks
    peaks = peaks[peaks["context"].isin(MEMORY_CONTEXTS)] if not peaks.empty else peaks
    if peaks.empty:
        r.note_missing(doc, "memory_profiling", "xl --memory runs at context 128/2048 (GPU)")
    else:
        peaks = latest(peaks, ["context", "dtype", "mode", "phase"])
        wide = peaks.pivot_table(index=["context", "dtype", "mode"], columns="phase", values="median").reset_index()
        doc.add(Paragraph("`cs336-bench model --preset xl --context 128,2048 --dtype fp32,bf16 --mode "
                          f"forward,train-step --memory` (batch {shared_value(peaks['batch'])}, reference attention, "
                          "no checkpointing). Peak allocated GiB per phase. " + environment(peaks)))
        doc.add(Table(wide.round(2)))
        doc.add(Paragraph("Each mode is recorded right after its own timed steps, so the forward rows hold the "
                          "parameters (fp32: 4 bytes each) and the forward's activations (plus, under bf16 autocast, "
                          "the bf16 weight copies), no gradients or AdamW state. The train-step peak is at the end "
                          "of backward/optimizer: parameters, gradients and both moments (16 bytes per parameter) "
                          f"dominate at context {min(MEMORY_CONTEXTS)}."))
        long_context = max(MEMORY_CONTEXTS)
        ooms = model[(model["status"] == "oom") & (model["preset"] == "xl") & (model["context"] == long_context)]
        if not ooms.empty:
            from cs336_systems.memory.model import predict

            cases = sorted({f"{d} {m}" for d, m in zip(ooms["dtype"], ooms["mode"])})
            batch = int(ooms["batch"].iloc[0]) if "batch" in ooms else 4
            xl = ModelConfig.from_name("xl", context_length=long_context)
            predicted = predict(xl, batch, long_context, dtype="fp32").peak / 2**30
            doc.add(Paragraph(f"Out of memory on the {shared_value(ooms['device_name'])} at context {long_context}: "
                              + ", ".join(cases) +
                              f" (the memory model, `cs336_systems.memory.model.predict`, puts the fp32 step's peak at "
                              f"{predicted:.2f} GiB: the ({batch}, {xl.num_heads}, {long_context}, {long_context}) "
                              "score tensors, several "
                              "per block, dominate)."))
        for name in sorted(p.name for p in r.results_dir.glob("xl_ctx*_memory.png")):
            path = r.copy_figure(name)
            doc.add(Figure(path, f"active memory timeline: {name.removesuffix('_memory.png')}"))
    saved = r.frame("memory")
    saved = saved[saved["metric"] == "saved_bytes"] if not saved.empty else saved
    if saved.empty:
        r.note_missing(doc, "memory_profiling", "`cs336-bench memory saved` rows")
    else:
        totals = latest(saved[saved["what"] == "total"], ["preset", "context", "part", "compile", "dtype"])
        doc.add(Table(totals[["preset", "context", "batch", "dtype", "part", "compile", "median"]]
                      .rename(columns={"median": "saved GiB"}).round(4),
                      "saved for backward (parameters excluded). " + environment(totals)))
        ops = latest(saved[saved["what"] == "op"], ["preset", "context", "part", "compile", "dtype", "op"])
        block = ops[(ops["part"] == "block") & (ops["compile"] == False)]  # noqa: E712
        for (preset, context, dtype), group in block.groupby(["preset", "context", "dtype"]):
            top = group.sort_values("median", ascending=False).head(TOP_OPS)
            doc.add(Table(pd.DataFrame({"op": top["op"], "tensors": top["tensors"],
                                        "saved GiB": top["median"].round(4),
                                        "share of the block": (100 * top["share"]).round(1).astype(str) + " %"}),
                          f"(f) the {TOP_OPS} ops whose outputs one TransformerBlock saves most of ({preset}, context "
                          f"{int(context)}, {dtype}): {100 * top['share'].sum():.1f} % of the block's saved "
                          "bytes"))
    cfg = ModelConfig.from_name("xl")
    d, short, ctx, batch = cfg.d_model, min(MEMORY_CONTEXTS), max(MEMORY_CONTEXTS), 4
    doc.add(Paragraph(f"One residual-stream activation of xl in fp32 is batch x context x d_model x 4 bytes = "
                      f"{batch} x {ctx} x {d} x 4 = {batch * ctx * d * 4 / 2**20:.0f} MiB at context {ctx} "
                      f"({batch * short * d * 4 / 2**20:.0f} MiB at {short})."))


def torch_compile_model(doc: Document, r: Results) -> None:
    doc.add(Heading("torch_compile (b): the compiled model"))
    model = eager_reference_rows(r.frame("model"))
    if model.empty:
        return r.note_missing(doc, "torch_compile", "model rows (GPU)")
    comp = model[model["compile"] == True]  # noqa: E712
    if comp.empty:
        return r.note_missing(doc, "torch_compile", "compiled model rows (GPU)")
    eager = model[model["compile"] == False]  # noqa: E712
    keys = ["preset", "dtype", "mode", "provider"]
    compiled = latest(comp, keys)
    # Eager from the compiled row's own run where that run measured it; else the latest eager row, marked.
    same = compiled.merge(latest(eager, keys + ["run_id"])[keys + ["run_id", "median"]], on=keys + ["run_id"],
                          suffixes=("", "_eager"))
    apart = compiled[~compiled.set_index(keys).index.isin(same.set_index(keys).index)].merge(
        latest(eager, keys)[keys + ["median"]], on=keys, suffixes=("", "_eager"))
    both = pd.concat([same.assign(eager_run="same"), apart.assign(eager_run="another")], ignore_index=True)
    both = both.assign(**{"eager ms": both["median_eager"].round(1), "compiled ms": both["median"].round(1),
                          "speed-up": (both["median_eager"] / both["median"]).round(2),
                          "eager from": both["eager_run"] + " run"})
    scope = ", ".join(sorted(set(col(comp, "compile_scope", "model").fillna("model"))))
    doc.add(Paragraph(f"`cs336-bench model --compile on --compile-scope block` (compile scope: {scope}; each "
                      "Transformer block compiled on its own, so large models compile in seconds; ours and the "
                      "baseline compiled the same way). Compiled: " + environment(compiled) + " Eager: " +
                      environment(latest(eager, keys))))
    order = {p: i for i, p in enumerate(["small", "medium", "large", "xl"])}
    both = both.sort_values(["dtype", "provider", "preset", "mode"],
                            key=lambda s: s.map(order) if s.name == "preset" else s)
    doc.add(Table(both[keys + ["eager ms", "compiled ms", "speed-up", "eager from"]]))
    step = both[both["mode"] == "train-step"]
    ours = step[step["provider"] == "ours"]
    if not ours.empty:
        bf16 = ours[ours.dtype == "bf16"]["speed-up"]
        doc.add(Paragraph(f"Compiling helps our model most in bf16 (train step {bf16.min():.2f}-{bf16.max():.2f}x): "
                          "inductor fuses RMSNorm, RoPE, "
                          "the softmax chain and the SwiGLU gate; in fp32 the matmuls dominate and the gain is small."))
