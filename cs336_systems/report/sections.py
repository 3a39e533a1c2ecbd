"""The report's sections, one function per handout problem (or toolkit measurement), in order.

Each reads frames from `Results` (one per result file, config keys as columns), adds tables,
figures and sentences computed from those rows to the document, and records what is missing.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from cs336_systems.analysis import collectives, ddp_overhead, memory, parallelism
from cs336_systems.report.document import Code, Document, Figure, Heading, Paragraph, Table
from cs336_systems.results import load_rows, rows_to_frame


@dataclass
class Results:
    frames: dict[str, pd.DataFrame]
    results_dir: Path
    figures_dir: Path
    missing: list[tuple[str, str]] = field(default_factory=list)

    @classmethod
    def load(cls, results_dir: Path, figures_dir: Path) -> Results:
        frames = {p.stem: rows_to_frame(load_rows(p)) for p in sorted(results_dir.glob("*.jsonl"))}
        figures_dir.mkdir(parents=True, exist_ok=True)
        return cls(frames, results_dir, figures_dir)

    def frame(self, suite: str) -> pd.DataFrame:
        return self.frames.get(suite, pd.DataFrame())

    def copy_figure(self, name: str) -> str | None:
        """Copy a committed PNG into the report's figures; its path relative to the report, or None."""
        source = self.results_dir / name
        if not source.exists():
            return None
        shutil.copy(source, self.figures_dir / name)
        return f"figures/{name}"

    def note_missing(self, doc: Document, section: str, what: str) -> None:
        self.missing.append((section, what))
        doc.add(Paragraph(f"Missing: {what}."))


def environment(frame: pd.DataFrame) -> str:
    """'measured on X (torch a, triton b), commits c, d' for the rows of a table."""
    if frame.empty:
        return "no rows"
    parts = []
    for (device, torch_v, triton_v), rows in frame.groupby(["device_name", "torch", "triton"], dropna=False):
        commits = ", ".join(sorted({str(c)[:10] for c in rows["git_commit"]}))
        parts.append(f"{device} (torch {torch_v}, triton {triton_v}; commit {commits})")
    return "Measured on " + "; ".join(parts) + "."


def latest(frame: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    """The newest row of each configuration (re-runs append; the last one counts)."""
    keys = [k for k in keys if k in frame.columns]
    return frame.sort_values("timestamp").drop_duplicates(keys, keep="last")


def _col(frame: pd.DataFrame, name: str, default=None) -> pd.Series:
    return frame[name] if name in frame.columns else pd.Series(default, index=frame.index)


def _ms(value) -> str:
    return "-" if value is None or (isinstance(value, float) and np.isnan(value)) else f"{value:.1f}"


def _eager_reference_rows(model: pd.DataFrame) -> pd.DataFrame:
    """Rows of the plain model suite: reference attention (or the baseline's SDPA), no checkpointing,
    no fused kernels, cs336 AdamW for ours, batch 4, context 512, whole-step timings."""
    if model.empty:
        return model
    m = model[(model["metric"] == "time") & (model["context"] == 512)]
    m = m[_col(m, "checkpoint", "none").fillna("none") == "none"]
    m = m[_col(m, "fused", False).fillna(False) == False]  # noqa: E712
    m = m[_col(m, "attention").isin(["reference", "sdpa"])]
    return m


def _ours_vs_baseline(rows: pd.DataFrame, index: list[str]) -> pd.DataFrame:
    rows = latest(rows, index + ["provider"])
    wide = rows.pivot_table(index=index, columns="provider", values="median", aggfunc="last").reset_index()
    spread = rows.pivot_table(index=index, columns="provider", values="std", aggfunc="last").reset_index()
    for provider in ("ours", "baseline"):
        if provider in wide:
            wide[f"{provider} ms (mean±std)"] = [
                f"{m:.1f} ± {s:.1f}" if not np.isnan(m) else "-" for m, s in zip(wide[provider], spread[provider])]
    if {"ours", "baseline"} <= set(wide.columns):
        wide["ours / baseline"] = (wide["ours"] / wide["baseline"]).round(2)
    return wide.drop(columns=[c for c in ("ours", "baseline") if c in wide.columns])


def benchmarking_script(doc: Document, r: Results) -> None:
    doc.add(Heading("benchmarking_script: forward, backward and training-step timings"))
    model = _eager_reference_rows(r.frame("model"))
    eager = model[(_col(model, "compile") == False) & (_col(model, "dtype") == "fp32")]  # noqa: E712
    if eager.empty:
        return r.note_missing(doc, "benchmarking_script", "eager fp32 model-suite rows (GPU)")
    table = _ours_vs_baseline(eager, ["preset", "mode"])
    order = {p: i for i, p in enumerate(["small", "medium", "large", "xl", "10B"])}
    table = table.sort_values(["preset", "mode"], key=lambda s: s.map(order) if s.name == "preset" else s)
    doc.add(Paragraph("`cs336-bench model --preset small,medium,large,xl --dtype fp32 --provider ours,baseline` "
                      "(batch 4, context 512, 3 warm-up and 8 timed steps; `ours` is the cs336_basics model with "
                      "the staff-equivalent attention and AdamW, `baseline` the PyTorch-native LM with SDPA and "
                      "fused AdamW). " + environment(eager)))
    doc.add(Table(table, "median ms; mean ± std over the timed steps"))
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
    ratios = table["ours / baseline"].dropna()
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
    prof = latest(prof, ["preset", "dtype", "mode", "range", "kernel"])
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
    model = _eager_reference_rows(r.frame("model"))
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
    peaks = peaks[peaks["context"].isin([128, 2048])] if not peaks.empty else peaks
    if peaks.empty:
        r.note_missing(doc, "memory_profiling", "xl --memory runs at context 128/2048 (GPU)")
    else:
        peaks = latest(peaks, ["context", "dtype", "mode", "phase"])
        wide = peaks.pivot_table(index=["context", "dtype", "mode"], columns="phase", values="median").reset_index()
        doc.add(Paragraph("`cs336-bench model --preset xl --context 128,2048 --dtype fp32,bf16 --mode "
                          "forward,train-step --memory` (batch 4, reference attention, no checkpointing). Peak "
                          "allocated GiB per phase. " + environment(peaks)))
        doc.add(Table(wide.round(2)))
        doc.add(Paragraph("Each mode is recorded right after its own timed steps, so the forward rows hold the "
                          "parameters (fp32: 4 bytes each) and the forward's activations (plus, under bf16 autocast, "
                          "the bf16 weight copies), no gradients or AdamW state. The train-step peak is at the end "
                          "of backward/optimizer: parameters, gradients and both moments (16 bytes per parameter) "
                          "dominate at context 128."))
        ooms = model[(model["status"] == "oom") & (model["preset"] == "xl") & (model["context"] == 2048)]
        if not ooms.empty:
            cases = sorted({f"{d} {m}" for d, m in zip(ooms["dtype"], ooms["mode"])})
            doc.add(Paragraph("Out of memory on the 141 GB card at context 2048: " + ", ".join(cases) +
                              " (the memory model predicts 307 GiB for the fp32 step: the (4, 32, 2048, 2048) "
                              "score tensors, several per block, dominate)."))
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
    d, ctx, batch = 2560, 2048, 4
    doc.add(Paragraph(f"One residual-stream activation of xl in fp32 is batch x context x d_model x 4 bytes = "
                      f"{batch} x {ctx} x {d} x 4 = {batch * ctx * d * 4 / 2**20:.0f} MiB at context {ctx} "
                      f"({batch * 128 * d * 4 / 2**20:.0f} MiB at 128)."))


def _attention_kernel_time(doc: Document, att: pd.DataFrame) -> None:
    """Wall time beside GPU kernel time (`--kernel-time` rows), fwd+bwd at seq >= 8192: where the two differ the
    call is host-bound, and the kernel-time ratio is what the kernels alone achieve."""
    keys = ["provider", "batch", "heads", "seq", "d", "dtype", "pass"]
    # the target cases only (the flash sweep's other head dims record kernel time too, naive's among them)
    both = att[att["metric"].isin(["time", "kernel_time"]) & (att["status"] == "ok") & (att["pass"] == "fwd-bwd")
               & (att["seq"] >= 8192) & (att["heads"] > 0) & att["d"].isin([64, 128]) & (att["dtype"] == "bf16")
               & (att["provider"] != "naive")]
    kernel = latest(both[both["metric"] == "kernel_time"], keys)
    if kernel.empty:
        return
    wall = latest(both[both["metric"] == "time"], keys)
    merged = kernel.merge(wall, on=keys, suffixes=(" kernel", " wall"))
    # one row per shape: provider's wall and kernel ms side by side
    table = merged.pivot_table(index=["batch", "heads", "seq", "d", "dtype"], columns="provider",
                               values=["median wall", "median kernel"])
    table.columns = [f"{provider} {kind.split()[1]}" for kind, provider in table.columns]
    for base in ("sdpa-flash", "sdpa-cudnn"):
        if f"{base} kernel" in table and "triton kernel" in table:
            table[f"kernel-time speed-up vs {base}"] = table[f"{base} kernel"] / table["triton kernel"]
    doc.add(Table(table.reset_index().round(3), "fwd+bwd ms: wall (do_bench) and GPU kernel time (torch.profiler, "
                                                "`cs336-bench attention --kernel-time`)"))


def attention_benchmarks(doc: Document, r: Results) -> None:
    doc.add(Heading("pytorch_attention, torch_compile (a), flash_benchmarking"))
    att = r.frame("attention")
    att = att[att["device"] == "cuda"] if not att.empty else att
    handout = att[(att["batch"] == 8) & (att["heads"] == 0)] if not att.empty else att
    if handout.empty:
        r.note_missing(doc, "pytorch_attention", "the handout sweep (batch 8, d 16..128, seq 256..16384, naive "
                       "eager vs compiled; `cs336-bench attention --sweep handout`, GPU)")
    else:
        _handout_attention(doc, r, handout)
    if att.empty:
        return r.note_missing(doc, "flash_benchmarking", "attention rows (GPU)")
    t = latest(att[(att["metric"] == "time") & (att["heads"] > 0)],
               ["provider", "batch", "heads", "seq", "d", "dtype", "pass"])
    # bf16 only: the targets are bf16, and the table's rows have no dtype column to keep fp32 apart
    big = t[(t["seq"] >= 8192) & (t["status"] == "ok") & (t["dtype"] == "bf16")]
    wide = big.pivot_table(index=["batch", "heads", "seq", "d", "pass"], columns="provider",
                           values="median").reset_index()
    for base in ("sdpa-flash", "sdpa-cudnn"):
        if base in wide and "triton" in wide:
            wide[f"speed-up vs {base}"] = wide[base] / wide["triton"]  # rounded for display only
    # Which commit our row comes from: the single-head shapes were last run with earlier kernels.
    ours_commit = big[big["provider"] == "triton"].set_index(["batch", "heads", "seq", "d", "pass"])["git_commit"]
    wide["triton commit"] = [str(ours_commit.get(key, ""))[:10]
                             for key in zip(wide["batch"], wide["heads"], wide["seq"], wide["d"], wide["pass"])]
    doc.add(Paragraph("`cs336-bench attention --sweep train` and `--sweep flash` (bf16, causal, "
                      "triton.testing.do_bench). Median ms; speed-up = baseline time / our time. "
                      + environment(big)))
    doc.add(Table(wide[wide["pass"] == "fwd-bwd"].round(3), "forward + backward"))
    doc.add(Table(wide[wide["pass"] == "fwd"].round(3), "forward"))
    # (the targets below are checked on unrounded ratios: 0.895 is short of 0.9)
    fb = wide[(wide["pass"] == "fwd-bwd") & wide["d"].isin([64, 128])]
    if "speed-up vs sdpa-flash" in fb and "speed-up vs sdpa-cudnn" in fb:
        for label, group in (("multi-head training shapes", fb[fb["heads"] > 1]),
                             ("single-head sweep shapes", fb[fb["heads"] == 1])):
            if group.empty:
                continue
            ok_flash = (group["speed-up vs sdpa-flash"] >= 1.3).sum()
            ok_cudnn = (group["speed-up vs sdpa-cudnn"] >= 0.9).sum()
            commits = ", ".join(sorted(set(group["triton commit"])))
            doc.add(Paragraph(
                f"Targets (seq >= 8192, d 64/128, fwd+bwd), {label} (ours from commit {commits}): at least 1.3x "
                f"SDPA-flash on {ok_flash} of {len(group)}, at least 0.9x cuDNN on {ok_cudnn} of {len(group)} "
                f"(range {group['speed-up vs sdpa-cudnn'].min():.3f}-{group['speed-up vs sdpa-cudnn'].max():.3f}x)."))
            short = group[(group["speed-up vs sdpa-flash"] < 1.3) | (group["speed-up vs sdpa-cudnn"] < 0.9)]
            if not short.empty:
                cases = ", ".join(f"d {d} seq {n}" for d, n in zip(short["d"], short["seq"]))
                doc.add(Paragraph(f"Short of a target among the {label}: {cases}."))
        doc.add(Paragraph(
            "`triton` is the default backward: on Hopper at d 128 the warp-specialised one-pass kernel "
            "(`hopper_one_pass.py`: each program owns 128 keys and adds its share of dQ into fp32 rows by TMA "
            "reduce-add, so dQ is not bit-reproducible), elsewhere two passes. `triton-two-pass-bwd` is always "
            "the two deterministic passes. Repeat calls replay launch plans: the compiled kernels called "
            "directly, without Triton's per-call argument binding, by default from a C++ autograd node "
            "(`native_launch.py`; `triton-python` replays them from Python, `launch_plan.py`). Without them a "
            "short single-head call was host-bound, its Python costing more than the GPU's work; the table "
            "below puts each call's wall time beside its GPU kernel time (notes/flash_attention.md)."))
        _attention_kernel_time(doc, att)
    # bf16 (the target's dtype); dtype is in the key so a later fp32 run of a shape cannot stand in for it
    tf = latest(att[(att["metric"] == "tflops") & (att["provider"] == "triton") & (att["pass"] == "fwd")
                    & (att["d"] == 128) & (att["dtype"] == "bf16")], ["batch", "heads", "seq", "d", "dtype", "pass"])
    if not tf.empty:
        best = tf.sort_values("median").iloc[-1]
        doc.add(Paragraph(f"Forward peak at d 128, bf16: {best['median']:.0f} TFLOP/s (causal FLOPs) at batch "
                          f"{best['batch']}, {best['heads']} heads, seq {best['seq']}."))
    path = r.copy_figure("attention_tflops.png")
    if path:
        doc.add(Figure(path, "TFLOP/s against sequence length per implementation"))
    mem = latest(att[att["metric"] == "peak_allocated"], ["provider", "batch", "heads", "seq", "d", "dtype", "pass"])
    mem = mem[(mem["pass"] == "fwd-bwd") & (mem["heads"] == 1) & (mem["d"] == 128) & (mem["dtype"] == "bf16")]
    if not mem.empty:
        doc.add(Table(mem.pivot_table(index="seq", columns="provider", values="median").reset_index().round(3),
                      "peak allocated GiB, fwd+bwd, batch 1, d 128, bf16: ours grows linearly with seq, naive "
                      "quadratically"))
    _flash_sweep(doc, r, att)


def _flash_sweep(doc: Document, r: Results, att: pd.DataFrame) -> None:
    """flash_benchmarking: batch 1, one head, causal, seq 128..65536 x d 16..128 x {bf16, fp32}, every
    implementation; the latest row per case across runs (each head dim ran in its own device call)."""
    from cs336_systems.bench.attention_suite import SWEEPS
    from cs336_systems.plots import plot_attention_tflops

    sweep_rows = latest(att[(att["batch"] == 1) & (att["heads"] == 1)],
                        ["provider", "seq", "d", "dtype", "pass", "metric"])
    ours = sweep_rows[(sweep_rows["provider"] == "triton") & (sweep_rows["metric"] == "time")
                      & (sweep_rows["status"] == "ok")]
    seqs = SWEEPS["flash"]["seq"]
    absent = []
    for dtype in ("bf16", "fp32"):
        for d in (16, 32, 64, 128):
            have = set(ours[(ours["d"] == d) & (ours["dtype"] == dtype)]["seq"].astype(int))
            lacking = [n for n in seqs if n not in have]
            if lacking:
                absent.append(f"{dtype} d {d}" + (f" (seq {', '.join(map(str, lacking))})" if have else ""))
    if not ours.empty:
        name = "attention_flash_sweep.png"
        plot_attention_tflops(sweep_rows, r.figures_dir / name)
        doc.add(Figure(f"figures/{name}", "flash_benchmarking sweep: fwd+bwd TFLOP/s (causal FLOPs) against "
                       "sequence length, batch 1, one head, per head dim and dtype. " + environment(ours)))
        small = sweep_rows[(sweep_rows["seq"] <= 512) & (sweep_rows["pass"] == "fwd-bwd")
                           & (sweep_rows["metric"] == "time") & (sweep_rows["status"] == "ok")]
        span = {p: (g["median"].min(), g["median"].max()) for p, g in small.groupby("provider")}
        if "triton" in span and "sdpa-flash" in span:
            doc.add(Paragraph(
                f"At seq <= 512 our fwd+bwd takes {span['triton'][0]:.2f}-{span['triton'][1]:.2f} ms against "
                f"SDPA-flash's {span['sdpa-flash'][0]:.2f}-{span['sdpa-flash'][1]:.2f} ms: there the time is the "
                "host's, four Triton launches behind an autograd Function (`scripts/attention_host_overhead.py` "
                "splits it; notes/flash_attention.md)."))
    _flash_sweep_fp32(doc, sweep_rows)
    if absent:
        r.missing.append(("flash_benchmarking", f"the flash sweep at {', '.join(absent)} (`FLASH_D=... bash "
                          "scripts/device_run.sh attention-flash`, one head dim per call, GPU)"))


def _flash_sweep_fp32(doc: Document, sweep_rows: pd.DataFrame) -> None:
    """fp32 against the one SDPA backend that takes it (efficient), per head dim: our forward and fwd+bwd, with
    IEEE dots (`triton`) and with tf32x3 (`triton-tf32x3`, the efficient backend's own fp32 arithmetic)."""
    times = sweep_rows[(sweep_rows["dtype"] == "fp32") & (sweep_rows["metric"] == "time")
                       & (sweep_rows["status"] == "ok") & (sweep_rows["seq"] >= 2048)]
    wide = times.pivot_table(index=["d", "seq", "pass"], columns="provider", values="median").reset_index()
    if "sdpa-efficient" not in wide.columns:
        return
    sentences = []
    for provider, dots in (("triton", "IEEE fp32 dots (FMA on CUDA cores, our default)"),
                           ("triton-tf32x3", "tf32x3 dots (`fp32_precision=\"tf32x3\"`)")):
        if provider not in wide.columns:
            continue
        ratio = (wide["sdpa-efficient"] / wide[provider]).rename("ratio")
        parts = []
        for d, group in pd.concat([wide[["d", "pass"]], ratio], axis=1).dropna().groupby("d"):
            text = ", ".join(f"{p} {g['ratio'].min():.2f}-{g['ratio'].max():.2f}x" for p, g in group.groupby("pass")
                             if p in ("fwd", "fwd-bwd"))
            parts.append(f"d {d}: {text}")
        commits = ", ".join(sorted(set(times[times["provider"] == provider]["git_commit"].astype(str).str[:10])))
        sentences.append(f"with {dots}, {'; '.join(parts)} (ours from commit {commits})")
    if not sentences:
        return
    doc.add(Paragraph(
        "fp32 (of SDPA's backends only the efficient one takes fp32; on sm_80 and later it runs three TF32 "
        "tensor-core products per dot): SDPA-efficient's time / ours at seq >= 2048, " + "; ".join(sentences)
        + ". Below 1 ours is slower (notes/flash_attention.md, Versions 15-16)."))


def _handout_attention(doc: Document, r: Results, handout: pd.DataFrame) -> None:
    """pytorch_attention / torch_compile (a): 100 forward and 100 backward passes of the naive attention."""
    keys = ["provider", "seq", "d", "pass", "metric"]
    rows = latest(handout[handout["metric"].isin(["time", "memory_before_backward"])], keys)
    table = None
    for provider in ("naive", "naive-compiled"):
        mine = rows[rows["provider"] == provider]
        if mine.empty:
            continue
        cells = {}
        for (seq, d), group in mine.groupby(["seq", "d"]):
            get = {(p, m): (v, st) for p, m, v, st in zip(group["pass"], group["metric"], group["median"],
                                                           group["status"])}
            row = {}
            for label, key in (("fwd ms", ("fwd", "time")), ("bwd ms", ("bwd", "time")),
                               ("GiB before bwd", ("bwd", "memory_before_backward"))):
                value, status = get.get(key, (None, "-"))
                row[f"{provider} {label}"] = f"{value:.2f}" if status == "ok" and value is not None else status
            cells[(seq, d)] = row
        part = pd.DataFrame.from_dict(cells, orient="index")
        part.index = part.index.set_names(["seq", "d"])
        table = part if table is None else table.join(part, how="outer")
    doc.add(Paragraph("`cs336-bench attention --sweep handout`: batch 8, 3-D inputs (no heads), fp32, not causal; "
                      "the time of one pass (median of 100 after 5 warm-up) and the memory in use before the "
                      "backward. " + environment(rows)))
    doc.add(Table(table.reset_index(), "naive attention, eager and compiled"))
    if "naive-compiled" not in set(rows["provider"]):
        r.note_missing(doc, "torch_compile (a)", "the compiled column of the handout sweep (rows measured before "
                       "the recompile-limit fix were dropped; re-run `--sweep handout`, GPU)")
    mem = rows[(rows["provider"] == "naive") & (rows["metric"] == "memory_before_backward")
               & (rows["status"] == "ok")]
    if not mem.empty:
        top = mem.sort_values("median").iloc[-1]
        oom = rows[(rows["provider"] == "naive") & (rows["status"] == "oom")]
        fits = ("none ran out of memory" if oom.empty else
                f"out of memory from seq {int(oom['seq'].min())} ({len(oom)} rows)")
        doc.add(Paragraph(f"Memory before the backward grows with seq^2 (the saved (batch, seq, seq) scores and "
                          f"softmax): {top['median']:.1f} GiB at seq {int(top['seq'])}, d {int(top['d'])}; "
                          f"{fits}."))


def _nested_sentence(table: list[dict]) -> str:
    nested = [t for t in table if t["policy"] == "nested" and t["error"] != "-"]
    if not nested:
        return ""
    error = float(nested[0]["error"].split()[0])
    return (f" The nested policy is not walked: its prediction is the sum of the parts at their largest, "
            f"{abs(error):.1f} % {'above' if error > 0 else 'below'} the measured peak, so it is an estimate, "
            "not a bound.")


def attention_tuning(doc: Document, r: Results) -> None:
    doc.add(Heading("FlashAttention tile configs and the one-pass backward"))
    tune = r.frame("attention-tune")
    if tune.empty:
        return r.note_missing(doc, "attention tuning", "`cs336-bench attention-tune` rows (GPU)")
    shape = ["batch", "heads", "seq", "d"]
    times = latest(tune[tune["metric"] == "time"], ["provider", *shape, "kernel", "block_m", "block_n",
                                                    "num_warps", "num_stages"])
    kernels = times[times["kernel"].isin(["forward", "forward-tma", "forward-gluon", "dkdv", "dkdv-tma", "dkdv-gluon",
                                          "dq", "dq-tma", "dq-gluon", "fused", "fused-atomic", "fused-gluon"])]
    ok = kernels[kernels["status"] == "ok"]
    best = ok.sort_values("median").groupby([*shape, "kernel"], as_index=False).first()
    counts = kernels.groupby([*shape, "kernel"]).agg(timed=("status", lambda x: int((x == "ok").sum())),
                                                      failed=("status", lambda x: int((x != "ok").sum())))
    best = best.merge(counts.reset_index(), on=[*shape, "kernel"])
    best["config (BLOCK_M, BLOCK_N, warps, stages)"] = [
        f"{int(a)}, {int(b)}, {int(c)}, {int(d)}" for a, b, c, d in
        zip(best["block_m"], best["block_n"], best["num_warps"], best["num_stages"])]
    best["best ms"] = best["median"].round(2)
    doc.add(Paragraph("`cs336-bench attention-tune` times every candidate config of each kernel alone (bf16, "
                      "causal; tile sizes x warps {4, 8} x stages {2..5}); the kernels' short autotune lists "
                      "hold these winners. `fused` is the one-pass backward with dQ reduced by TMA "
                      "reduce-add, `fused-atomic` the same with pointer atomics. " + environment(kernels)))
    doc.add(Table(best[[*shape, "kernel", "config (BLOCK_M, BLOCK_N, warps, stages)", "best ms", "timed",
                        "failed"]], "fastest config per kernel"))
    whole = times[times["kernel"].isin(["fwd", "bwd", "preprocess"]) & (times["status"] == "ok")]
    if not whole.empty:
        wide = whole.pivot_table(index=[*shape, "kernel"], columns="provider", values="median").reset_index()
        doc.add(Table(wide.round(2), "whole passes in the same runs, median ms (triton: as shipped, autotuned)"))
    two = best[best["kernel"].isin(["dkdv", "dq"])].groupby(shape)["median"].sum()
    one = best[best["kernel"] == "fused"].set_index(shape)["median"]
    both = pd.concat([two.rename("two"), one.rename("one")], axis=1).dropna()
    if not both.empty:
        parts = [f"{'x'.join(map(str, k))}: {row.one:.1f} ms vs {row.two:.1f} ms" for k, row in both.iterrows()]
        doc.add(Paragraph("One pass (5 products, dQ reduced across key tiles) against two passes (7 products, no "
                          "atomics), best configs each: " + "; ".join(parts) + ". Saving the dQ pass's "
                          "recomputation does not pay in Triton on the H200: the extra dS transpose and the dQ "
                          "tile in shared memory cost the occupancy the two-pass kernels keep, so the "
                          "deterministic two-pass backward stays the default."))


def torch_compile_model(doc: Document, r: Results) -> None:
    doc.add(Heading("torch_compile (b): the compiled model"))
    model = _eager_reference_rows(r.frame("model"))
    if model.empty:
        return r.note_missing(doc, "torch_compile", "model rows (GPU)")
    comp = model[model["compile"] == True]  # noqa: E712
    if comp.empty:
        return r.note_missing(doc, "torch_compile", "compiled model rows (GPU)")
    eager = model[model["compile"] == False]  # noqa: E712
    keys = ["preset", "dtype", "mode", "provider"]
    both = latest(comp, keys).merge(latest(eager, keys)[keys + ["median"]], on=keys, suffixes=("", "_eager"))
    both = both.assign(**{"eager ms": both["median_eager"].round(1), "compiled ms": both["median"].round(1),
                          "speed-up": (both["median_eager"] / both["median"]).round(2)})
    scope = ", ".join(sorted(set(_col(comp, "compile_scope", "model").fillna("model"))))
    doc.add(Paragraph(f"`cs336-bench model --compile on --compile-scope block` (compile scope: {scope}; each "
                      "Transformer block compiled on its own, so large models compile in seconds; ours and the "
                      "baseline compiled the same way). " + environment(comp)))
    order = {p: i for i, p in enumerate(["small", "medium", "large", "xl"])}
    both = both.sort_values(["dtype", "provider", "preset", "mode"],
                            key=lambda s: s.map(order) if s.name == "preset" else s)
    doc.add(Table(both[keys + ["eager ms", "compiled ms", "speed-up"]]))
    step = both[both["mode"] == "train-step"]
    ours = step[step["provider"] == "ours"]
    if not ours.empty:
        bf16 = ours[ours.dtype == "bf16"]["speed-up"]
        doc.add(Paragraph(f"Compiling helps our model most in bf16 (train step {bf16.min():.2f}-{bf16.max():.2f}x): "
                          "inductor fuses RMSNorm, RoPE, "
                          "the softmax chain and the SwiGLU gate; in fp32 the matmuls dominate and the gain is small."))


def fused_model_path(doc: Document, r: Results) -> None:
    doc.add(Heading("Our kernels in the model: Triton attention, fused RMSNorm/SwiGLU, fused AdamW"))
    model = r.frame("model")
    rows = model[(_col(model, "metric") == "time") & (_col(model, "fused", False).fillna(False) == True)]  # noqa: E712
    if rows.empty:
        return r.note_missing(doc, "fused model path", "model-suite rows with --fused (GPU)")
    base = model[(model["metric"] == "time") & model["run_id"].isin(rows["run_id"]) & (model["provider"] == "baseline")]
    table = _ours_vs_baseline(pd.concat([rows, base]), ["preset", "dtype", "mode"])
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
    rows = frame[_col(frame, "device") == "cuda"]
    if rows.empty:
        return r.note_missing(doc, "fused cross-entropy", "`cs336-bench cross-entropy` rows (`bash "
                              "scripts/device_run.sh cross-entropy`, GPU)")
    from cs336_systems.bench.cross_entropy_suite import CASE_KEYS, summary_table

    rows = latest(rows, ["provider", *CASE_KEYS, "metric"])
    times = rows[rows["metric"] == "time"]
    table = summary_table(rows, digits=1)
    doc.add(Paragraph("`cs336-bench cross-entropy`: the loss and its gradients for the hidden states and the head "
                      "weight, one forward and backward, timed by do_bench. fused is ours; plain is "
                      "F.cross_entropy on the whole fp32-upcast logits; chunked is the leaderboard baseline's loss "
                      "(4096-token chunks, each checkpointed). TFLOP/s counts the three GEMMs (logits, dH, dW) "
                      "for every provider; peak is the memory allocated above the inputs. " + environment(times)))
    doc.add(Table(table, "median ms, speed-up (baseline time / ours), peak GiB and TFLOP/s"))


def leaderboard(doc: Document, r: Results) -> None:
    doc.add(Heading("Leaderboard: the 8B training step at 32k context"))
    lb = r.frame("leaderboard")
    steps = lb[(lb["metric"] == "step_time") & (lb["preset"] == "leaderboard-8b")] if not lb.empty else lb
    if steps.empty:
        return r.note_missing(doc, "leaderboard", "an 8B leaderboard run (H200)")
    latest_run = steps.sort_values("timestamp")["run_id"].iloc[-1]
    paired = lb[lb["metric"] == "speedup_vs_baseline"].sort_values("timestamp")["run_id"]
    runs = [latest_run] + ([paired.iloc[-1]] if len(paired) and paired.iloc[-1] != latest_run else [])
    doc.add(Paragraph("`cs336-bench leaderboard` (8.1B model, one sequence of 32,768 tokens, bf16 parameters and "
                      "AdamW state; ours: Triton FlashAttention-2, fused RMSNorm/SwiGLU gate, fused LM-head "
                      "cross-entropy, fused AdamW, the least checkpointing the memory model says fits; baseline: "
                      "PyTorch-native LM with SDPA, every block checkpointed, chunked CE, torch fused AdamW). "
                      "MFU counts model FLOPs (no recompute) against the measured bf16 matmul ceiling. The latest "
                      "run first; where it has no baseline beside it, the latest run that has one after it."))
    for run in runs:
        _leaderboard_run(doc, lb[lb["run_id"] == run])
    _leaderboard_profile(doc, lb)
    verify = lb[lb["metric"].isin(["ours_grad_rel_error", "plain_grad_rel_error"])]
    if not verify.empty:
        v = latest(verify, ["metric", "preset", "context"])
        doc.add(Table(v[["preset", "context", "param_dtype", "metric", "median"]].rename(columns={"median": "value"}),
                      "--verify: gradient error against an fp64 plain step (ours must be within 2x the plain "
                      "bf16 step's)"))
    r.missing.append(("leaderboard", "the 2-GPU run (issue 11: no multi-GPU machine lent)"))


def _leaderboard_run(doc: Document, rows: pd.DataFrame) -> None:
    """One run's table (step, tokens/s, MFU, peak, phases per provider) and its ratio to the baseline."""
    ok = rows[(rows["metric"] == "step_time") & (rows["status"] == "ok")]
    summary = []
    for _, row in ok.iterrows():
        mine = rows[(rows["provider"] == row["provider"]) & (rows["checkpoint"] == row["checkpoint"])]
        values = mine.drop_duplicates("metric", keep="last").set_index("metric")["median"]
        get = values.get
        phases = mine[mine["metric"] == "phase_time"].set_index("phase")["median"] if "phase" in mine \
            else pd.Series(dtype=float)
        summary.append({"provider": row["provider"], "checkpoint": row["checkpoint"],
                        "step s": round(row["median"] / 1e3, 3), "std ms": round(row["std"], 1),
                        "tokens/s": round(get("tokens_per_s") or 0), "MFU %": round(get("mfu") or 0, 1),
                        "peak GiB": round(get("peak_allocated") or 0, 1),
                        **{f"{p} ms": round(v) for p, v in phases.items()}})
    counts = ", ".join(f"{p} {int(n)}" for p, n in zip(ok["provider"], ok["n"])) if "n" in ok else ""
    doc.add(Table(pd.DataFrame(summary), f"run {ok['run_id'].iloc[0]}: " + environment(ok)
                  + (f" Steps timed by do_bench after warm-up: {counts} (the phases: 3 more steps each)."
                     if counts else "")))
    ours = [s for s in summary if s["provider"] == "ours"]
    speed = rows[rows["metric"] == "speedup_vs_baseline"]
    wall = rows[rows["metric"] == "command_wall_time"]
    verdict = "met" if ours and ours[0]["step s"] <= 5.0 else "not met"
    sentence = (f"Ours is {speed['median'].iloc[0]:.3f}x the baseline's speed, measured in the same run"
                if not speed.empty else "No baseline in this run")
    if ours:
        sentence += f"; {ours[0]['step s']} s per step: the target of 5.0 s is {verdict}"
    if not wall.empty:
        sentence += f". The whole command from a cold Triton cache took {wall['median'].iloc[0]:.0f} s"
    ceiling = rows[rows["metric"] == "matmul_ceiling"]
    if not ceiling.empty:
        sentence += (f". MFU's denominator, the bf16 matmul ceiling measured in this run: "
                     f"{ceiling['median'].iloc[0]:.0f} TFLOP/s")
    doc.add(Paragraph(sentence + "."))


def _leaderboard_profile(doc: Document, lb: pd.DataFrame) -> None:
    """Kernel time by phase and kind of work from the latest `leaderboard --profile` run, ours beside the baseline."""
    prof = lb[lb["metric"] == "profile_category_time"] if not lb.empty else lb
    if prof.empty:
        return
    prof = prof[prof["run_id"] == prof.sort_values("timestamp")["run_id"].iloc[-1]]
    for provider, rows in prof.groupby("provider", sort=False):
        table = rows.pivot_table(index="category", columns="range", values="median", aggfunc="sum", fill_value=0.0)
        table["total"] = table.sum(axis=1)
        table = table.sort_values("total", ascending=False).round(1).reset_index()
        doc.add(Table(table, f"kernel ms per step by phase and kind, {provider} ({rows['checkpoint'].iloc[0]}; "
                             f"`cs336-bench leaderboard --profile`, commit {rows['git_commit'].iloc[0]})"))


def checkpointing_and_memory_model(doc: Document, r: Results) -> None:
    from cs336_systems.config import ModelConfig
    from cs336_systems.memory.model import predict

    doc.add(Heading("Activation checkpointing and the memory model"))
    mem = r.frame("memory")
    peaks = mem[(mem["metric"] == "peak_memory") & mem["policy"].notna()] if not mem.empty else mem
    peaks = peaks[peaks["device_name"].str.contains("H", na=False)] if not peaks.empty else peaks
    if peaks.empty:
        return r.note_missing(doc, "memory", "`cs336-bench memory search` rows (GPU)")
    peaks = latest(peaks, ["preset", "context", "batch", "dtype", "policy"])
    times = latest(mem[mem["metric"] == "step_time"], ["preset", "context", "batch", "dtype", "policy"])
    table = []
    for _, row in peaks.iterrows():
        cfg = ModelConfig.from_name(row["preset"], context_length=int(row["context"]))
        predicted = predict(cfg, int(row["batch"]), int(row["context"]), policy=row["policy"]).peak / 2**30
        t = times[(times["policy"] == row["policy"]) & (times["context"] == row["context"])]
        measured = row["median"] if row["status"] == "ok" else None
        table.append({"context": int(row["context"]), "policy": row["policy"],
                      "measured peak GiB": round(measured, 2) if measured else row["status"],
                      "predicted GiB": round(predicted, 2),
                      "error": f"{100 * (predicted / measured - 1):+.1f} %" if measured else "-",
                      "step ms": round(t["median"].iloc[0]) if len(t) else "-"})
    doc.add(Paragraph("`cs336-bench memory search --preset xl --context 2048 --batch 4` (fp32, reference "
                      "attention, one checkpointing level over group sizes k) and none/every-block at context 512; "
                      "the prediction is the analytic memory model of this commit (`cs336_systems.memory.model."
                      "predict`), walking the backward pass. " + environment(peaks)))
    doc.add(Table(pd.DataFrame(table)))
    ok = [t for t in table if t["error"] != "-" and not t["policy"].startswith("nested")]
    if ok:
        worst = max(abs(float(t["error"].split()[0])) for t in ok)
        best = min((t for t in ok if t["context"] == 2048), key=lambda t: t["measured peak GiB"], default=None)
        doc.add(Paragraph(f"The model is within {worst:.1f} % of every measured single-level peak. "
                          + (f"The lowest single-level peak at context 2048 is {best['policy']} "
                             f"({best['measured peak GiB']} GiB, {best['step ms']} ms/step): more groups keep more "
                             "boundaries, bigger groups keep more activations live during recompute; no "
                             "checkpointing does not fit." if best else "")
                          + _nested_sentence(table)))


def distributed_communication(doc: Document, r: Results) -> None:
    doc.add(Heading("distributed_communication_single_node: collectives"))
    coll = r.frame("collectives")
    if coll.empty:
        r.note_missing(doc, "distributed_communication_single_node", "collectives rows")
    else:
        t = latest(coll[coll["metric"] == "time"], ["op", "size_mb", "world_size", "backend", "dtype"])
        wide = t.pivot_table(index=["backend", "op", "size_mb"], columns="world_size", values="median").reset_index()
        doc.add(Paragraph("`cs336-bench collectives` (fp32 tensors, median ms). " + environment(t)))
        doc.add(Table(wide.round(2), "median ms per collective, columns: world size"))
        path = r.copy_figure("collectives_cpu_gloo.png")
        if path:
            doc.add(Figure(path, "time and bus bandwidth against size (gloo on CPU processes)"))
        doc.add(Paragraph("On gloo over 2 CPU cores the small sizes are latency-bound (time nearly flat up to "
                          "~1 MB) and the large ones bandwidth-bound (time linear in size); more ranks than cores "
                          "oversubscribe the machine, so these are not GPU figures."))
    r.missing.append(("distributed_communication_single_node", "NCCL on 2/4/6 GPUs (issue 9: no multi-GPU machine)"))
    doc.add(Paragraph("The bandwidth model (`cs336-analyze collective`), 1 GB over N devices at W = 450 GB/s "
                      "egress (an illustrative NVLink-class figure, not a measurement):"))
    doc.add(Code("\n".join(str(collectives.collective_time(k, 1e9, n, 4.5e11))
                           + f"   (N={n})" for n in (2, 8) for k in collectives.COLLECTIVES)))


def ddp(doc: Document, r: Results) -> None:
    doc.add(Heading("naive_ddp / minimal_ddp_flat / ddp_overlap / ddp_bucketed benchmarking"))
    frame = r.frame("ddp")
    if frame.empty:
        r.note_missing(doc, "ddp", "ddp rows")
    else:
        rows = latest(frame[frame["metric"].isin(["step_time", "exposed_comm_time"])],
                      ["metric", "variant", "bucket_mb", "world_size", "preset", "backend", "provider"])
        wide = rows.pivot_table(index=["backend", "world_size", "preset", "provider", "variant", "bucket_mb"],
                                columns="metric", values="median", dropna=False).reset_index().dropna(
            subset=["step_time"])
        doc.add(Paragraph("`cs336-bench ddp` (ms per step; exposed communication = time after backward spent "
                          "waiting on gradients). " + environment(rows)))
        doc.add(Table(wide.round(2)))
    r.missing.append(("ddp_bucketed_benchmarking", "xl on 2 GPUs with NCCL (issue 10)"))
    s, w, o = 2.0e9 * 4, 1e11, 5e-5
    doc.add(Paragraph("The overhead model (`cs336-analyze bucket`): with n_b equal buckets, the last bucket's "
                      "all-reduce is exposed and every call costs o, so overhead = s/(n_b w) + n_b o, minimised at "
                      "bucket size sqrt(s w o). For xl's fp32 gradients (s = 8 GB) at w = 100 GB/s and o = 50 us "
                      "(illustrative inputs):"))
    doc.add(Code("\n".join(str(c) for c in ddp_overhead.optimal_bucket(s, w, o))))


def sharding_and_fsdp(doc: Document, r: Results) -> None:
    doc.add(Heading("optimizer_state_sharding_accounting and FSDP"))
    shard = r.frame("sharding")
    if not shard.empty:
        rows = latest(shard, ["metric", "optimizer", "world_size", "preset", "backend"])
        wide = rows.pivot_table(index=["backend", "world_size", "preset", "optimizer"], columns="metric",
                                values="median").reset_index()
        doc.add(Paragraph("`cs336-bench sharding` (bytes per rank in MiB, step ms). " + environment(rows)))
        doc.add(Table(wide.round(2)))
    fsdp = r.frame("fsdp")
    if not fsdp.empty:
        rows = latest(fsdp[fsdp["metric"] == "step_time"], ["provider", "provider_kind", "compute_dtype",
                                                            "world_size", "preset"])
        doc.add(Paragraph("`cs336-bench fsdp`: step ms, ours vs torch FSDP2. " + environment(rows)))
        doc.add(Table(rows[["backend", "world_size", "preset", "provider", "provider_kind", "compute_dtype",
                            "median"]].rename(columns={"median": "step ms"}).round(1)))
        wide = rows.pivot_table(index=["world_size", "compute_dtype"], columns="provider_kind", values="median")
        if {"fsdp", "torch-fsdp2"} <= set(wide.columns):
            ratio = (wide["fsdp"] / wide["torch-fsdp2"]).round(2)
            doc.add(Paragraph("Our FSDP step / FSDP2's: " + ", ".join(
                f"{n} ranks {d}: {v}x" for (n, d), v in ratio.items()) + ". `fsdp` gathers and reduce-scatters "
                "one block at a time (like FSDP2's per-block groups); `fsdp-layer`, one collective per weight, "
                "shows what that grouping is worth on gloo."))
    r.missing.append(("optimizer_state_sharding / fsdp", "xl on 2 GPUs (issue 10)"))


def communication_accounting(doc: Document, r: Results) -> None:
    doc.add(Heading("communication_accounting: the XXL model, FSDP x TP"))
    state = memory.training_state(16384, 53248, 126, tokens=1, device_bytes=80e9)
    doc.add(Paragraph("XXL: d_model 16384, d_ff 53248, 126 blocks of two linear layers; fp32 master weights, "
                      "gradients and AdamW state, bf16 activations (per token and block D + F saved inputs). "
                      "(`cs336-analyze memory`)"))
    doc.add(Code("\n".join(str(c) for c in state)))
    by_name = {c.name: c.value for c in state}
    doc.add(Code("\n".join(str(c) for c in memory.fsdp_shards_to_fit(by_name["state_total"], by_name["activations"],
                                                                     95e9))))
    doc.add(Paragraph("Activations scale with the tokens in flight (shown for one token: multiply by the batch x "
                      "context). Forward pass on a v5p mesh, X = 16 (FSDP, M_X = 2) x Y = 4 (TP, M_Y = 1), "
                      "C = 4.6e14 FLOP/s, W = 1.8e11 B/s (`cs336-analyze mesh-batch`):"))
    doc.add(Code("\n".join(str(c) for c in parallelism.compute_bound_batch_fsdp_tp(53248, 4.6e14, 1.8e11, 16, 4, 2,
                                                                                   1))))
    doc.add(Paragraph("One XXL FFN layer, 65,536 tokens on 64 v5p chips, per strategy (`cs336-analyze ffn`):"))
    lines = [str(c) for c in parallelism.ffn_flops(65536, 16384, 53248)]
    for strategy in ("dp", "fsdp", "tp"):
        lines += [f"{strategy}: {c}" for c in parallelism.ffn_costs(strategy, 65536, 16384, 53248, 64, 4.6e14,
                                                                      1.8e11)]
        lines += [str(parallelism.max_devices_before_comm_dominates(strategy, 65536, 16384, 53248, 4.6e14, 1.8e11,
                                                                    overlapped=o)) for o in (True, False)]
    lines += [f"fsdp-tp: {c}" for c in parallelism.ffn_costs("fsdp-tp", 65536, 16384, 53248, 64, 4.6e14, 1.8e11,
                                                            mesh=(16, 4))]
    doc.add(Code("\n".join(lines)))
    doc.add(Paragraph("To train with a smaller global batch: keep FSDP's axis short and add tensor (or sequence) "
                      "parallelism, overlap each layer's all-gather with the previous layer's compute, communicate "
                      "in bf16, and use activation checkpointing so a smaller per-device batch still fits."))


IMPLEMENTATION_PROBLEMS = (
    ("flash_forward", "Tiled PyTorch FlashAttention-2 forward (`kernels/flash_attention/reference.py`) and the Triton "
     "forward (`forward.py`: grid of query tiles x batch-heads, one loop over key tiles, fp32 accumulators, causal "
     "split into an unmasked and a diagonal loop, exp2 with the scale folded in; tiles through tensor "
     "descriptors on Hopper).",
     "tests/test_kernels_flash_attention.py, tests/test_adapters_attention.py"),
    ("flash_backward", "Backward by recomputation with D = rowsum(O * dO): the torch.compile'd PyTorch version "
     "(impl='compile') and the two-pass Triton backward (dK/dV over query tiles, dQ over key tiles, no atomics).",
     "tests/test_kernels_flash_attention.py"),
    ("naive_ddp, minimal_ddp_flat, ddp_overlap_individual_parameters, ddp_overlap_bucketed",
     "`parallel/ddp.py`: one base class, variants differing only in gradient synchronisation; buckets in "
     "`parallel/buckets.py` (a pure function).", "tests/test_parallel_ddp.py, tests/test_adapters_parallel.py"),
    ("optimizer_state_sharding", "`parallel/sharded_optimizer.py`: ZeRO-1 (each rank steps the parameters it owns, "
     "then broadcasts them).", "tests/test_parallel_sharded_optimizer.py"),
    ("fsdp", "`parallel/fsdp.py`: parameters sharded on the original modules, all-gathered one unit ahead, "
     "gradients reduce-scattered.", "tests/test_parallel_fsdp.py"),
)


def implementations(doc: Document, r: Results) -> None:
    doc.add(Heading("Implementation problems: what checks them"))
    doc.add(Paragraph("These problems are code, not measurements; each is pinned by tests (kernels against an "
                      "fp64 reference with error budgets of 2x PyTorch's own low-precision error; distributed code "
                      "against a single process on gloo). Run them with `python -m pytest`."))
    doc.add(Table(pd.DataFrame(IMPLEMENTATION_PROBLEMS, columns=["problem", "implementation", "tests"])))


SECTIONS = (benchmarking_script, nsys_profile, mixed_precision_accumulation, memory_profiling, attention_benchmarks,
            attention_tuning,
            torch_compile_model, checkpointing_and_memory_model, distributed_communication, ddp, sharding_and_fsdp,
            communication_accounting, fused_model_path, fused_cross_entropy, leaderboard, implementations)
