"""Section nsys_profile: where a forward pass's and a training step's kernel time goes, answered per profiled
configuration from the model suite's `--profile` rows (kernel time by range and kind of work)."""

from __future__ import annotations

import pandas as pd

from cs336_systems.config import ModelConfig
from cs336_systems.report.document import Document, Heading, Paragraph, Table
from cs336_systems.report.sections.common import Results, col, environment, rows_of, shared_value, span

# nsys_profile: the ranges a forward pass's kernels run in (the reference attention names its three parts), and
# the FLOPs per attention score the softmax is counted at for (e): max, subtract, exp, sum, divide.
FORWARD_RANGES = ("forward", "attention/scores", "attention/softmax", "attention/matmul")
SOFTMAX_FLOPS_PER_SCORE = 5


def _profiled_configs(model: pd.DataFrame) -> pd.DataFrame:
    """Category rows of the newest profile of each (preset, context, dtype) of our reference model that holds
    both a forward-only profile and a training step's."""
    cats = model[model["metric"] == "profile_category_time"] if "metric" in model else model
    if cats.empty:
        return cats
    cats = cats[(cats["provider"] == "ours") & (col(cats, "attention") == "reference")
                & (col(cats, "compile") == False) & (col(cats, "fused", False).fillna(False) == False)]  # noqa: E712
    runs = cats.groupby("run_id").agg(modes=("mode", lambda m: set(m)), timestamp=("timestamp", "max"))
    complete = runs[runs["modes"].map(lambda m: {"forward", "train-step"} <= m)].index
    cats = cats[cats["run_id"].isin(complete)]
    newest = cats.sort_values("timestamp").groupby(["preset", "context", "dtype"])["run_id"].last()
    return cats[cats["run_id"].isin(set(newest))]


def _profile_answers(model: pd.DataFrame, cats: pd.DataFrame) -> pd.DataFrame:
    """One row per profiled configuration: the figures questions (a)-(e) ask for."""
    kernels = model[(model["metric"] == "profile_kernel_time") & model["run_id"].isin(set(cats["run_id"]))]
    times = model[(model["metric"] == "time") & (model["mode"] == "forward") & (model["provider"] == "ours")]
    answers = []
    for (preset, context, dtype, run), rows in cats.groupby(["preset", "context", "dtype", "run_id"]):
        forward = rows[(rows["mode"] == "forward") & rows["range"].isin(FORWARD_RANGES)]
        step = rows[rows["mode"] == "train-step"]
        # One command profiles several configurations in one run: each row matched on its configuration too.
        config = dict(run_id=run, preset=preset, context=context, dtype=dtype)
        timed, config_kernels = rows_of(times, **config), rows_of(kernels, **config)
        fwd_kernels = config_kernels[(config_kernels["mode"] == "forward")
                                     & config_kernels["range"].isin(FORWARD_RANGES)]
        step_kernels = config_kernels[(config_kernels["mode"] == "train-step")
                                      & config_kernels["range"].isin(FORWARD_RANGES + ("backward",))]
        top_forward = fwd_kernels.groupby("kernel").agg(ms=("median", "sum"), calls=("calls_per_step", "sum"))
        top_step = step_kernels.groupby("kernel")["median"].sum()
        top_name = top_forward["ms"].idxmax() if len(top_forward) else None
        non_matmul = forward[forward["category"] != "matmul"].groupby("category")["median"].sum()
        non_matmul = non_matmul.sort_values(ascending=False)
        softmax = forward[forward["range"] == "attention/softmax"]["median"].sum()
        attention_matmul = forward[forward["range"].isin(("attention/scores", "attention/matmul"))
                                   & (forward["category"] == "matmul")]["median"].sum()
        cfg = ModelConfig.from_name(preset)
        answers.append({
            "preset": preset, "context": int(context), "dtype": dtype,
            "forward kernels ms": forward["median"].sum(),
            "forward timed ms": timed["median"].iloc[-1] if len(timed) else float("nan"),
            "top forward kernel": top_name,
            "its calls per forward": top_forward["calls"].get(top_name, float("nan")) if top_name else float("nan"),
            "same top in fwd+bwd": (top_step.idxmax() == top_name) if len(top_step) and top_name else None,
            "top fwd+bwd kernel": top_step.idxmax() if len(top_step) else None,
            "forward non-matmul": ", ".join(f"{c} {100 * v / forward['median'].sum():.0f} %"
                                            for c, v in non_matmul.head(3).items()),
            "matmul share forward": forward[forward["category"] == "matmul"]["median"].sum()
            / forward["median"].sum(),
            "matmul share step": step[step["category"] == "matmul"]["median"].sum() / step["median"].sum(),
            "softmax ms": softmax, "attention matmul ms": attention_matmul,
            "matmul / softmax FLOPs": 4 * cfg.d_model / (SOFTMAX_FLOPS_PER_SCORE * cfg.num_heads),
            "run_id": run,
        })
    return pd.DataFrame(answers).sort_values(["preset", "context"], key=lambda s: s.map(
        {p: i for i, p in enumerate(["small", "medium", "large", "xl", "10B"])}) if s.name == "preset" else s)


def _newest_kernel_table(doc: Document, model: pd.DataFrame) -> None:
    """The top kernels of the newest profile of any kind, described from its own rows."""
    prof = model[model["metric"] == "profile_kernel_time"] if "metric" in model else model
    if prof.empty:
        return
    # Kernels are told apart by their rows (older runs stored names cut at 120 characters, so a dedup on the name
    # would merge different kernels).
    prof = prof[prof["run_id"] == prof.sort_values("timestamp")["run_id"].iloc[-1]]
    doc.add(Paragraph(f"The newest profile: `cs336-bench model --preset {shared_value(prof['preset'])} --context "
                      f"{shared_value(prof['context'])} --dtype {shared_value(prof['dtype'])} --mode "
                      f"{shared_value(prof['mode'])} --provider {shared_value(prof['provider'])} --attention "
                      f"{shared_value(prof['attention'])} --profile` (torch.profiler, device kernels by the range "
                      "open when they started). " + environment(prof)))
    top = prof.sort_values("median", ascending=False).head(12)
    doc.add(Table(pd.DataFrame({"provider": top["provider"], "range": top["range"],
                                "kernel": top["kernel"].str.slice(0, 70), "ms per step": top["median"].round(2),
                                "calls per step": top["calls_per_step"],
                                "share": (100 * top["share"]).round(1).astype(str) + " %"}),
                  "top device kernels by total time per step"))


def nsys_profile(doc: Document, r: Results) -> None:
    doc.add(Heading("nsys_profile: where the time goes"))
    model = r.frame("model")
    cats = _profiled_configs(model) if not model.empty else model
    if cats.empty:
        _newest_kernel_table(doc, model)
        return r.note_missing(doc, "nsys_profile", "(a)-(e): profiles of our reference model's forward pass and "
                              "training step at two sizes and three contexts (`bash scripts/device_run.sh "
                              "report-gpu`, GPU)")
    answers = _profile_answers(model, cats)
    presets, contexts = shared_value(answers["preset"]), shared_value(answers["context"])
    doc.add(Paragraph(f"`cs336-bench model --preset {presets} --context {contexts} --dtype "
                      f"{shared_value(answers['dtype'])} --mode forward,train-step --profile` (our reference model, "
                      f"batch {shared_value(cats['batch'])}; torch.profiler over the timed steps, each device "
                      "kernel placed in the NVTX/record range open when it started: forward, loss, backward, "
                      "optimizer, and the attention's scores, softmax and final matmul; the ranges synchronise at "
                      "their edges). Nsight Systems is not on the lent machine; its command lines are in the "
                      "README, and the profiler reads the same CUPTI kernel records. " + environment(cats)))
    shown = answers.assign(**{
        "forward kernels ms": answers["forward kernels ms"].round(1),
        "forward timed ms": answers["forward timed ms"].round(1),
        "top forward kernel": answers["top forward kernel"].str.slice(0, 48),
        "matmul share forward": (100 * answers["matmul share forward"]).round(1).astype(str) + " %",
        "matmul share step": (100 * answers["matmul share step"]).round(1).astype(str) + " %",
        "softmax ms": answers["softmax ms"].round(2), "attention matmul ms": answers["attention matmul ms"].round(2),
        "matmul / softmax FLOPs": answers["matmul / softmax FLOPs"].round(1),
    })
    doc.add(Table(shown[["preset", "context", "forward kernels ms", "forward timed ms", "top forward kernel",
                         "its calls per forward", "same top in fwd+bwd", "matmul share forward", "matmul share step",
                         "softmax ms", "attention matmul ms", "matmul / softmax FLOPs"]],
                  "per profiled configuration; ms per step"))
    gap = (answers["forward kernels ms"] / answers["forward timed ms"]).dropna()
    if len(gap):
        why = ("below 1, the device idles between kernels while the host runs Python and launches them, most at "
               "small sizes and short contexts; near 1, the kernels keep it busy throughout")
        if gap.max() > 1.02:
            why += ("; above 1, the profiler's own cost per operation (synchronised ranges, recorded events) "
                    "outweighs the idle time between kernels")
        doc.add(Paragraph(f"(a) The forward's kernels add up to {span(gap, '{:.2f}')}x the forward time measured "
                          f"with the Python timer, a forward pass taking {span(answers['forward timed ms'], '{:.1f}')}"
                          f" ms: {why}."))
    same = answers["same top in fwd+bwd"].fillna(False).astype(bool)
    tops = ", ".join(f"`{str(k)[:70]}`" for k in answers["top forward kernel"].drop_duplicates())
    elsewhere = sorted({f"`{str(k)[:70]}`" for k in answers.loc[~same, "top fwd+bwd kernel"]})
    calls = ", ".join(f"{row['preset']} {row['context']}: {row['its calls per forward']:g}"
                      for _, row in answers.iterrows())
    doc.add(Paragraph(f"(b) The kernel with the most forward time: {tops}; calls per forward pass ({calls}). "
                      + ("It is also the top kernel of forward+backward in every configuration." if same.all() else
                         f"It is also the top kernel of forward+backward in {int(same.sum())} of {len(answers)} "
                         f"configurations; in the others that is {', '.join(elsewhere)}.")))
    doc.add(Paragraph("(c) Besides matrix multiplies, the forward's kernel time goes to (share of the forward): "
                      + "; ".join(f"{row['preset']} {row['context']}: {row['forward non-matmul']}"
                                  for _, row in answers.iterrows()) + "."))
    forward_share, step_share = answers["matmul share forward"], answers["matmul share step"]
    change = ("smaller" if (step_share < forward_share).all() else "larger" if (step_share > forward_share).all()
              else "smaller or larger by configuration")
    doc.add(Paragraph(f"(d) Matrix multiplies take {span(100 * forward_share, '{:.0f}')} % of the kernel time of a "
                      f"forward pass and {span(100 * step_share, '{:.0f}')} % of a training step with our AdamW, a "
                      f"{change} share: the step adds the loss, the backward's elementwise kernels (the softmax and "
                      "activation gradients) and the optimizer's per-parameter kernels around the products."))
    ratio = (answers["softmax ms"] / answers["attention matmul ms"]).replace([float("inf")], float("nan")).dropna()
    if len(ratio):
        doc.add(Paragraph(f"(e) Inside the attention, the softmax takes {span(ratio, '{:.2f}')}x the time of the "
                          "two matrix multiplies (scores and the weighted sum), although they do "
                          f"{span(answers['matmul / softmax FLOPs'], '{:.0f}')}x its FLOPs (4 d_head FLOPs per "
                          f"score against {SOFTMAX_FLOPS_PER_SCORE}): the softmax reads and writes the (seq, seq) "
                          "scores at memory bandwidth while the products run at matmul throughput."))
    r.missing.append(("nsys_profile", "an Nsight Systems report (nsys is not on the lent machine)"))
