"""Sections: our stack in the model path (Triton attention, fused RMSNorm/SwiGLU/RoPE, fused AdamW) against the
PyTorch-native LM at every size, and the fused LM-head cross-entropy against the plain and chunked losses."""

from __future__ import annotations

import pandas as pd

from cs336_systems.report.document import Document, Figure, Heading, Paragraph, Table
from cs336_systems.report.sections.common import Results, col, environment, latest, rows_of, shared_value

MODE_NAMES = {"default": "compiled", "reduce-overhead": "CUDA graphs"}  # compile_mode -> the table's words
PRESET_ORDER = ("small", "medium", "large", "xl")


def _size_rank(preset: str) -> tuple[int, str]:
    """Table-1 presets by size, any other after them by name."""
    return (PRESET_ORDER.index(preset) if preset in PRESET_ORDER else len(PRESET_ORDER), preset)
BEST_MODE_TARGET = 0.9  # issue 32: our best mode at most this fraction of the baseline's best
TARGET_CARD = "H200"  # issue 32's targets are measured on it


def _cards(rows: pd.DataFrame) -> list[pd.DataFrame]:
    """The rows split by card, the target card's first, then the others newest first: each card gets a table of its
    own (a table mixing cards would set a run on one beside a run on another)."""
    names = col(rows, "device_name", "").fillna("").astype(str)
    newest_first = rows.assign(card=names).groupby("card")["timestamp"].max().sort_values(ascending=False).index
    return [rows[names == card] for card in sorted(newest_first, key=lambda card: TARGET_CARD not in card)]


def _execution_mode(rows: pd.DataFrame) -> pd.Series:
    """eager, compiled (torch.compile) or CUDA graphs (torch.compile's reduce-overhead) of each row; "step graph"
    after eager or compiled where the whole step was captured as CUDA graphs (`--step-graph on`)."""
    mode = col(rows, "compile_mode", "default").fillna("default").map(lambda m: MODE_NAMES.get(m, m))
    mode = mode.where(col(rows, "compile", False).fillna(False).astype(bool), "eager")
    graphed = col(rows, "step_graph", False).astype(object).eq(True)
    return mode.where(~graphed, mode + ", step graph")


def fused_model_path(doc: Document, r: Results) -> None:
    """Issue 32: our stack (Triton attention, fused RMSNorm/SwiGLU/RoPE, fused AdamW) against the PyTorch-native
    LM at every size and context, eager, compiled and replayed as CUDA graphs, ratios from one run each."""
    doc.add(Heading("Our stack against PyTorch at every model size"))
    model = r.frame("model")
    step = model[(col(model, "metric") == "time") & (col(model, "mode") == "train-step")
                 & (col(model, "dtype") == "bf16")]
    if step.empty:
        return r.note_missing(doc, "fused model path", "model-suite rows with --fused (GPU)")
    shown = 0
    for number, card_rows in enumerate(_cards(step)):
        shown += _size_table(doc, r, card_rows, "stack_by_size.png" if number == 0 else f"stack_by_size_{number}.png")
    if not shown:
        return r.note_missing(doc, "fused model path", "ours and the baseline measured in one run (GPU)")


def _size_table(doc: Document, r: Results, step: pd.DataFrame, figure: str) -> int:
    """One card's table (and plot, and best-mode summary) of `fused_model_path`; returns its number of rows."""
    # Only runs that timed the baseline too: a ratio is taken within one run.
    step = step[step["run_id"].isin(set(step.loc[step["provider"] == "baseline", "run_id"]))]
    fused = col(step, "fused", False).fillna(False).astype(bool)
    # Ours: the whole stack; and, compiled, the same without our pointwise operators (inductor generates RMSNorm,
    # the SwiGLU gate and RoPE itself), where a run measured it.
    # (ours as it runs by default: an A/B run's rows without the weight copies, `--weight-copies off`, without the
    # fused loss, `--fused-loss off`, without the fused residual add, `--residual-norm off`, timed without dynamo's
    # guards, `--skip-guards`, or with 16-bit weight gradients, CS336_FP32_WEIGHT_GRADIENTS=0, stay out)
    not_default = (col(step, "weight_copies", None).astype(object).eq(False)
                   | col(step, "fused_loss", None).astype(object).eq(False)
                   | col(step, "residual_norm", None).astype(object).eq(False)
                   | col(step, "skip_guards", None).astype(object).eq(True)
                   | col(step, "weight_gradients", None).notna())
    ours = step[(step["provider"] == "ours") & fused & ~not_default]
    inductor = step[(step["provider"] == "ours") & ~fused & (col(step, "attention") == "triton")
                    & (col(step, "optimizer") == "fused") & col(step, "compile", False).fillna(False).astype(bool)]
    if ours.empty:
        return 0
    base = step[step["run_id"].isin(set(ours["run_id"]) | set(inductor["run_id"])) & (step["provider"] == "baseline")]
    rows = pd.concat([ours, inductor, base])
    rows = rows[rows["status"] == "ok"]
    rows = rows.assign(base_execution=_execution_mode(rows))
    pointwise_by_inductor = (rows["provider"] == "ours") & ~col(rows, "fused", False).fillna(False).astype(bool)
    triton_ops = (rows["provider"] == "ours") & (col(rows, "operators", "custom_op").fillna("custom_op") == "triton_op")
    rows = rows.assign(execution=rows["base_execution"].where(~pointwise_by_inductor,
                                                              rows["base_execution"] + ", inductor pointwise")
                       .where(~triton_ops, rows["base_execution"] + ", triton_op"))
    # Each of our newest rows beside the baseline of its own run, in the same execution mode.
    ours_rows = latest(rows[rows["provider"] == "ours"], ["preset", "context", "execution"])
    base_rows = latest(rows[rows["provider"] == "baseline"], ["run_id", "preset", "context", "base_execution"])
    keys = ["run_id", "preset", "context", "base_execution"]
    wide = ours_rows[keys + ["execution", "median", "std"]].rename(columns={"median": "ours", "std": "ours_std"}).merge(
        base_rows[keys + ["median", "std"]].rename(columns={"median": "baseline", "std": "baseline_std"}), on=keys)
    rows = pd.concat([ours_rows, base_rows])
    rows = rows[rows["run_id"].isin(set(wide["run_id"]))]  # the rows the table shows: its environment line's
    if wide.empty:
        return 0
    # The run's spread beside its medians: a ratio inside the steps' noise is no evidence either way.
    def percent(std: pd.Series, median: pd.Series) -> pd.Series:
        return (100 * std / median).round().astype("Int64").astype(str)

    spread = percent(wide["ours_std"], wide["ours"]) + " / " + percent(wide["baseline_std"], wide["baseline"])
    wide = wide[["preset", "context", "execution", "baseline", "ours"]].assign(**{"std % (ours / baseline)": spread})
    wide["ours / baseline"] = (wide["ours"] / wide["baseline"]).round(2)
    wide["preset"] = pd.Categorical(wide["preset"], sorted(set(wide["preset"]), key=_size_rank), ordered=True)
    wide = wide.sort_values(["preset", "context", "execution"])
    doc.add(Paragraph("`cs336-bench model --preset small,medium,large,xl --context 128,512,2048 --dtype bf16 "
                      "--attention triton --fused --optimizer fused --mode train-step --provider ours,baseline "
                      "--compile off` (eager), then `--compile on,reduce-overhead --compile-scope block` (each block "
                      "compiled; reduce-overhead replays the compiled graphs as CUDA graphs), and `--step-graph on` "
                      "with `--compile off,on` (the whole step captured as CUDA graphs, both providers, the "
                      "optimizers in their capturable forms: `cs336_systems/step_graph.py`): median train step, "
                      f"batch {shared_value(rows['batch'])}, bf16 autocast; ours and the baseline in the same run. "
                      + environment(rows)))
    doc.add(Table(wide.round({"ours": 1, "baseline": 1}).rename(columns={"ours": "ours ms", "baseline": "baseline ms"}),
                  "train-step median ms; ours / baseline < 1 means ours is faster; std %: the timed steps' "
                  "standard deviation over their median (a ratio within it is noise)"))
    from cs336_systems.plots import plot_ratio_by_size

    current = _current_forms(wide)
    # The plot shows our current forms only (the table keeps the superseded custom-operator rows beside them).
    plot_ratio_by_size(current.assign(execution=current["mode"]), r.figures_dir / figure)
    doc.add(Figure(f"figures/{figure}", "ours / baseline train-step time by size in our current forms, one line "
                   "per execution mode, one panel per context; below the dashed line ours is faster"))
    best = current.groupby(["preset", "context"], observed=True).agg(ours=("ours", "min"),
                                                                       baseline=("baseline", "min"))
    best_ratio = best["ours"] / best["baseline"]
    doc.add(Paragraph(
        f"In its current forms (compiled: our pointwise operators as triton_ops, the default; the table keeps the "
        f"earlier custom-operator rows too) ours is at or ahead of the baseline in "
        f"{int((current['ours / baseline'] <= 1.0).sum())} of {len(current)} (size, context, mode) cases. Comparing "
        f"each side's best mode, ours / baseline ranges {best_ratio.min():.2f}-{best_ratio.max():.2f} (target: at "
        f"most {BEST_MODE_TARGET}); the eager ratios range "
        + _range(current[current["mode"] == "eager"]["ours / baseline"]) + ", the compiled ones "
        + _range(current[current["mode"] == "compiled"]["ours / baseline"]) + ", the CUDA-graph ones "
        + _range(current[current["mode"] == "CUDA graphs"]["ours / baseline"]) + " and those of the whole step "
        "captured (step graph, eager or compiled) "
        + _range(current[current["mode"].str.endswith("step graph")]["ours / baseline"]) + "."))
    return len(wide)


def weight_copies(doc: Document, r: Results) -> None:
    """Issue 32: our stack with and without the weights' bf16 copies (`--weight-copies on,off`), beside the baseline,
    each row from one run; with 16-bit weight gradients too where a run was made with CS336_FP32_WEIGHT_GRADIENTS=0."""
    doc.add(Heading("The weights' bf16 copies, with and without"))
    model = r.frame("model")
    step = model[(col(model, "metric") == "time") & (col(model, "mode") == "train-step")
                 & (col(model, "status") == "ok")]
    # The runs that timed ours with and without the copies, and the baseline.
    rows = step.iloc[:0]
    if not step.empty:
        copies = col(step, "weight_copies", None).astype(object)
        step = step.assign(side=step["provider"].where(step["provider"] == "baseline",
                                                       copies.map({True: "with copies", False: "without"})))
        complete = step.groupby("run_id")["side"].agg(lambda v: {"with copies", "without", "baseline"} <= set(v))
        rows = step[step["run_id"].isin(complete[complete].index)]
    if rows.empty:
        return r.note_missing(doc, "weight copies", "model-suite rows with --weight-copies on,off (GPU)")
    rows = rows.assign(execution=_execution_mode(rows),
                       gradients=col(rows, "weight_gradients", None).astype(object).fillna("fp32 from the product"))
    keys = ["run_id", "device_name", "preset", "context", "execution"]
    wide = rows.pivot_table(index=keys, columns="side", values="median", aggfunc="last").reset_index()
    gradients = rows[rows["provider"] == "ours"].groupby(keys)["gradients"].last().reset_index()
    wide = wide.merge(gradients, on=keys).dropna(subset=["baseline", "with copies", "without"])
    wide["with / without"] = (wide["with copies"] / wide["without"]).round(3)
    wide["with / baseline"] = (wide["with copies"] / wide["baseline"]).round(3)
    wide = wide.assign(card=wide["device_name"].str.replace("NVIDIA ", "", regex=False))
    wide = wide.sort_values(["card", "preset", "context", "execution", "run_id"])
    doc.add(Paragraph(
        "`cs336-bench model --fused --optimizer fused --dtype bf16 --weight-copies on,off --provider ours,baseline` "
        "(the weight copies: `cs336_systems/weight_copies.py`): train-step median ms of ours with and without them "
        "and of the baseline, each line one run; `weight gradients` says how the weight gradients left the product "
        "(fp32 by `mm` with out_dtype, the default, or a bf16 product and a cast). " + environment(rows)))
    doc.add(Table(wide[["card", "preset", "context", "execution", "gradients", "baseline", "without", "with copies",
                        "with / without", "with / baseline"]].rename(columns={"gradients": "weight gradients"})
                  .round({"baseline": 1, "without": 1, "with copies": 1}),
                  "train-step median ms; with / without below 1 means the copies made ours faster in that run"))


def _current_forms(wide: pd.DataFrame) -> pd.DataFrame:
    """The table's rows of our current forms, with their execution mode less ", triton_op" as `mode`: where a
    (size, context, mode) has a triton_op row (the compiled default), not its earlier custom-operator row."""
    rows = wide.assign(mode=wide["execution"].str.replace(", triton_op", "", regex=False),
                       triton_op=wide["execution"].str.endswith(", triton_op"))
    has_triton_op = rows.groupby(["preset", "context", "mode"], observed=True)["triton_op"].transform("any")
    return rows[rows["triton_op"] | ~has_triton_op]


PHASE_OF_RANGE = {"attention/scores": "forward", "attention/softmax": "forward", "attention/matmul": "forward"}


def stack_profile(doc: Document, r: Results) -> None:
    """Issue 32: where our step's time goes against the baseline's, per profiled configuration from its latest run of
    both providers: per phase the time the timed steps spent (phase_time) beside the kernels' own time in it
    (profile_category_time; the gap is the device waiting on the host), and per kind of work the kernel time of
    each."""
    doc.add(Heading("Where our step's time goes, against the baseline's"))
    model = r.frame("model")
    cats = model[(col(model, "metric") == "profile_category_time") & (col(model, "device") == "cuda")]
    both = (cats.groupby("run_id")["provider"].agg(lambda p: {"ours", "baseline"} <= set(p)) if not cats.empty
            else pd.Series(dtype=bool))
    both = list(both[both].index)  # the runs that profiled both providers
    if not both:
        return r.note_missing(doc, "stack profile", "a profile of ours and the baseline in one run (`bash "
                              "scripts/device_run.sh model-sizes-profile`, GPU)")
    cats = cats[cats["run_id"].isin(both)]
    groups = sorted(cats.groupby(["preset", "context", "compile"]),
                    key=lambda item: (_size_rank(item[0][0]), *item[0][1:]))
    for (preset, context, compiled), configuration in groups:
        run = configuration.sort_values("timestamp")["run_id"].iloc[-1]  # each configuration's latest profile
        part = configuration[configuration["run_id"] == run]
        phases = rows_of(model, metric="phase_time", run_id=run, preset=preset, context=context, compile=compiled)
        by_phase = part.assign(phase=part["range"].map(lambda n: PHASE_OF_RANGE.get(n, n)))
        kernel = by_phase.groupby(["phase", "provider"])["median"].sum().unstack("provider")
        launches = (by_phase.assign(calls=col(by_phase, "calls_per_step")).groupby(["phase", "provider"])["calls"]
                    .sum(min_count=1).unstack("provider").round())
        wall = latest(phases, ["provider", "phase"]).pivot_table(index="phase", columns="provider", values="median")
        table = pd.DataFrame({"ours: phase ms": wall.get("ours"), "ours: kernels ms": kernel.get("ours"),
                              "ours: launches": launches.get("ours"), "baseline: phase ms": wall.get("baseline"),
                              "baseline: kernels ms": kernel.get("baseline"),
                              "baseline: launches": launches.get("baseline")}).round(2)
        mode = "compiled" if compiled else "eager"
        ours_rows = part[part["provider"] == "ours"]
        doc.add(Paragraph(f"`cs336-bench model --preset {preset} --context {int(context)} --provider ours,baseline "
                          f"--profile` ({mode}; ours: attention {shared_value(col(ours_rows, 'attention'))}, fused "
                          f"kernels {shared_value(col(ours_rows, 'fused'))}, optimizer "
                          f"{shared_value(col(ours_rows, 'optimizer'))}): per phase, "
                          "the mean time of the timed steps, the kernels' own time in it and the kernels launched "
                          "(torch.profiler, the profiled steps, per step); where the first exceeds the second the "
                          "device waited on the host. "
                          + environment(part)))
        doc.add(Table(table.reset_index().fillna(""), f"{preset}, context {int(context)}, {mode}: ms per step"))
        kinds = part.groupby(["category", "provider"])["median"].sum().unstack("provider").fillna(0.0)
        if {"ours", "baseline"} <= set(kinds.columns):
            kinds["ours - baseline"] = kinds["ours"] - kinds["baseline"]
            kinds = kinds.sort_values("ours - baseline", ascending=False).round(2) + 0.0  # (no "-0")
            doc.add(Table(kinds.reset_index(), f"{preset}, context {int(context)}, {mode}: kernel ms per step by "
                                               "kind of work, the largest excess of ours first"))


def _range(ratios: pd.Series) -> str:
    return "(not measured)" if ratios.empty else f"{ratios.min():.2f}-{ratios.max():.2f}"


def _gpu_rows(doc: Document, r: Results, heading: str, suite: str, missing: str) -> pd.DataFrame | None:
    """The heading, then the suite's CUDA rows; None (noted missing) where there are none."""
    doc.add(Heading(heading))
    frame = r.frame(suite)
    rows = frame[col(frame, "device") == "cuda"]
    if rows.empty:
        r.note_missing(doc, heading, missing)
        return None
    return rows


def _memory_against_liger(doc: Document, rows: pd.DataFrame, keys: list[str], ours: str) -> None:
    """Issue 35's memory target: `ours`'s peak above the inputs at most Liger-Kernel's, case by case."""
    peaks = rows[rows["metric"] == "peak_above_inputs"].pivot_table(index=keys, columns="provider", values="median",
                                                                      aggfunc="last")
    if {ours, "liger"} <= set(peaks.columns):
        within = (peaks[ours] <= peaks["liger"] + 1e-3).dropna()
        doc.add(Paragraph(f"{ours}'s extra memory is at most Liger-Kernel's in {int(within.sum())} of {len(within)} "
                          "cases (the target: all of them)."))


def fused_cross_entropy(doc: Document, r: Results) -> None:
    """Issue 7's loss benchmark: our fused LM head + cross-entropy against lm_head + cross_entropy and Liger."""
    rows = _gpu_rows(doc, r, "Fused LM head + cross-entropy", "cross-entropy", "`cs336-bench cross-entropy` rows "
                     "(`bash scripts/device_run.sh cross-entropy`, GPU)")
    if rows is None:
        return
    from cs336_systems.bench.suites.cross_entropy import CASE_KEYS, summary_table

    rows = latest(rows, ["provider", *CASE_KEYS, "metric"])
    times = rows[rows["metric"] == "time"]
    doc.add(Paragraph("`cs336-bench cross-entropy`: the loss and its gradients for the hidden states and the head "
                      "weight, one forward and backward, timed by do_bench. fused is ours (dW accumulated in fp32); "
                      "fused-lean is ours with Liger-Kernel's memory choices (dW in the weight's dtype, Liger's chunk "
                      "size); liger is Liger-Kernel's fused linear cross-entropy; plain is "
                      "F.cross_entropy on the whole fp32-upcast logits; chunked is the leaderboard baseline's loss "
                      f"({shared_value(col(times, 'chunk_tokens'))}-token chunks, each checkpointed). TFLOP/s counts "
                      "the three GEMMs (logits, dH, dW) "
                      "for every provider; peak is the memory allocated above the inputs. " + environment(times)))
    doc.add(Table(summary_table(rows, digits=1), "median ms, speed-up (baseline time / ours), peak GiB and TFLOP/s"))
    _memory_against_liger(doc, rows, CASE_KEYS, "fused-lean")


def fused_ops(doc: Document, r: Results) -> None:
    """Issue 35: our fused RMSNorm and SwiGLU gate against torch and Liger-Kernel, time and memory."""
    rows = _gpu_rows(doc, r, "Fused RMSNorm and SwiGLU gate against torch and Liger-Kernel", "fused-ops",
                     "`cs336-bench fused-ops` rows (`bash scripts/device_run.sh cross-entropy`, GPU, with the "
                     "liger-kernel wheel carried)")
    if rows is None:
        return
    from cs336_systems.bench.suites.fused_ops import CASE_KEYS, summary_table

    rows = latest(rows, ["provider", *CASE_KEYS, "metric"])
    doc.add(Paragraph("`cs336-bench fused-ops`: each op and its backward, timed by do_bench; GiB is the memory "
                      "allocated above the inputs and the incoming gradient at the peak. Our gate (`ours`) writes "
                      "its gradients over its inputs as our fused model runs it; `ours-out-of-place` makes new "
                      "ones. " + environment(rows)))
    doc.add(Table(summary_table(rows), "median ms and GiB above the inputs"))
    _memory_against_liger(doc, rows, CASE_KEYS, "ours")
