"""Sections: distributed_communication_single_node, the DDP variants, optimizer-state sharding and FSDP,
and communication_accounting (calculators)."""

from __future__ import annotations

import pandas as pd

from cs336_systems.analysis import collectives, ddp_overhead, memory, parallelism
from cs336_systems.config import ModelConfig
from cs336_systems.report.document import Code, Document, Figure, Heading, Paragraph, Table
from cs336_systems.report.sections.common import Results, environment, latest


def distributed_communication(doc: Document, r: Results) -> None:
    coll = r.open_section(doc, "distributed_communication_single_node: collectives", "collectives",
                          "distributed_communication_single_node", "collectives rows")
    if coll is not None:
        t = latest(coll[coll["metric"] == "time"], ["op", "size_mb", "world_size", "backend", "dtype"])
        wide = t.pivot_table(index=["backend", "op", "size_mb"], columns="world_size", values="median").reset_index()
        doc.add(Paragraph("`cs336-bench collectives` (fp32 tensors, median ms). " + environment(t)))
        doc.add(Table(wide.round(2), "median ms per collective, columns: world size"))
        from cs336_systems.plots import plot_collectives

        drawn = latest(coll[coll["metric"].isin(["time", "busbw"])],
                       ["op", "size_mb", "world_size", "backend", "dtype", "metric"])
        plot_collectives(drawn, r.figures_dir / "collectives.png")
        doc.add(Figure("figures/collectives.png", "time and bus bandwidth against size, drawn from the rows above"))
        doc.add(Paragraph(_latency_and_bandwidth(t) + " More ranks than cores oversubscribe the machine, so these "
                          "are not GPU figures."))
    r.missing.append(("distributed_communication_single_node", "NCCL on 2/4/6 GPUs (issue 9: no multi-GPU machine)"))
    doc.add(Paragraph("The bandwidth model (`cs336-analyze collective`), 1 GB over N devices at W = 450 GB/s "
                      "egress (an illustrative NVLink-class figure, not a measurement):"))
    doc.add(Code("\n".join(str(collectives.collective_time(k, 1e9, n, 4.5e11))
                           + f"   (N={n})" for n in (2, 8) for k in collectives.COLLECTIVES)))


def _latency_and_bandwidth(times) -> str:
    """What the all-reduce rows of the smallest world size say about latency and bandwidth, in numbers."""
    rows = times[(times["op"] == "all-reduce") & (times["world_size"] == times["world_size"].min())]
    if rows["size_mb"].nunique() < 2:
        return ""
    rows = rows.groupby("size_mb")["median"].median().sort_index()
    (small, t_small), (large, t_large) = (rows.index[0], rows.iloc[0]), (rows.index[-1], rows.iloc[-1])
    return (f"All-reduce on {int(times['world_size'].min())} ranks: {t_small:.2f} ms at {small:g} MB and "
            f"{t_large:.2f} ms at {large:g} MB, {t_large / t_small:.0f}x the time for {large / small:.0f}x the bytes: "
            f"{'the small sizes are latency-bound' if t_large / t_small < large / small / 2 else 'close to linear'}"
            f", the large ones run at {large / t_large:.2f} GB/s of tensor.")


def alternate_ring_all_reduce(doc: Document, r: Results) -> None:
    doc.add(Heading("alternate_ring_all_reduce: passing whole tensors around the ring"))
    n, size, bandwidth = 8, 1e9, 1.8e11
    ring = collectives.collective_time("all-reduce", size, n, bandwidth)
    alternate = collectives.collective_time("all-reduce-alternate", size, n, bandwidth)
    doc.add(Paragraph(f"{alternate.formula}, with V the handout's S: each of the N - 1 steps sends a whole V-byte "
                      f"tensor at W, where the ring reduce-scatter + all-gather sends chunks of V/N ({ring.formula}): "
                      f"N/2 times slower. For V = {size / 1e9:g} GB, N = {n}, W = {bandwidth:.2g} B/s "
                      "(`cs336-analyze collective`):"))
    doc.add(Code(f"{alternate}\n{ring}"))


def _ddp_rows(r: Results) -> pd.DataFrame | None:
    """Step time and exposed communication per configuration of `cs336-bench ddp`, the latest run of each."""
    frame = r.frame("ddp")
    if frame.empty:
        return None
    rows = latest(frame[frame["metric"].isin(["step_time", "exposed_comm_time"])],
                  ["metric", "variant", "bucket_mb", "world_size", "preset", "backend", "provider"])
    wide = rows.pivot_table(index=["backend", "world_size", "preset", "provider", "variant", "bucket_mb"],
                            columns="metric", values="median", dropna=False).reset_index().dropna(subset=["step_time"])
    wide["communication %"] = (100 * wide["exposed_comm_time"] / wide["step_time"]).round(1)
    wide.attrs["environment"] = environment(rows)
    return wide.rename(columns={"step_time": "step ms", "exposed_comm_time": "exposed communication ms"})


def _ddp_section(doc: Document, r: Results, wide: pd.DataFrame | None, problem: str, title: str,
                 variants: list[str], compare: list[str]):
    """One DDP problem's heading, its variants' rows (`_ddp_rows`) against `compare`'s, and a sentence per world
    size."""
    doc.add(Heading(f"{problem}: {title}"))
    r.missing.append((problem, "xl on 1 node x 2 GPUs with NCCL (one GPU is lent)"))
    if wide is None:
        return r.note_missing(doc, problem, "`cs336-bench ddp` rows")
    shown = wide[wide["variant"].isin(variants + compare)]
    doc.add(Paragraph("`cs336-bench ddp --variant " + ",".join(variants + compare) + "` on gloo CPU processes (the xl "
                      "run on 2 GPUs is missing: one GPU is lent); ms per step, exposed communication = the time "
                      "after the backward spent waiting on gradients, and its share of the step. " +
                      wide.attrs["environment"]))
    doc.add(Table(shown.drop(columns=["backend"]).round(2)))
    sentences = []
    for world_size, group in shown.groupby("world_size"):
        by_variant = group.groupby("variant")["step ms"].min()
        ours = [v for v in variants if v in by_variant]
        others = [v for v in compare if v in by_variant]
        if ours and others:
            best, other = min(ours, key=by_variant.get), min(others, key=by_variant.get)
            sentences.append(f"{world_size} ranks: {best} {by_variant[best]:.1f} ms per step, {other} "
                             f"{by_variant[other]:.1f} ms ({best} takes {by_variant[best] / by_variant[other]:.2f}x "
                             "the time)")
    if sentences:
        doc.add(Paragraph("; ".join(sentences) + "."))
    return shown


def naive_ddp_benchmarking(doc: Document, r: Results) -> None:
    _ddp_section(doc, r, _ddp_rows(r), "naive_ddp_benchmarking", "one all-reduce per parameter after the backward",
                 ["naive"], [])


def minimal_ddp_flat_benchmarking(doc: Document, r: Results) -> None:
    _ddp_section(doc, r, _ddp_rows(r), "minimal_ddp_flat_benchmarking", "one all-reduce of the flattened gradients",
                 ["flat"], ["naive"])


def ddp_overlap_individual_parameters_benchmarking(doc: Document, r: Results) -> None:
    _ddp_section(doc, r, _ddp_rows(r), "ddp_overlap_individual_parameters_benchmarking",
                 "all-reduces started as each gradient is ready", ["overlap"], ["naive", "flat"])


def ddp_bucketed_benchmarking(doc: Document, r: Results) -> None:
    shown = _ddp_section(doc, r, _ddp_rows(r), "ddp_bucketed_benchmarking", "gradients all-reduced in buckets as "
                         "they fill", ["bucketed"], ["overlap", "flat", "torch-ddp"])
    if shown is not None:
        buckets = shown[shown["variant"] == "bucketed"].groupby("bucket_mb")["step ms"].median()
        if not buckets.empty:
            sizes = {preset: ModelConfig.from_name(preset).parameter_count * 4 / 2**20
                     for preset in shown["preset"].unique()}
            one_bucket = all(mb <= min(buckets.index) for mb in sizes.values())
            doc.add(Paragraph("Step time by bucket size (median over world sizes and presets): " +
                              ", ".join(f"{size:g} MB: {ms:.1f} ms" for size, ms in buckets.items()) + ". fp32 "
                              "gradients per preset: " + ", ".join(f"{p} {mb:.2f} MiB" for p, mb in sizes.items()) +
                              (": one bucket at every size tried, so these rows do not show the bucket count's "
                               "effect." if one_bucket else ".")))
            if one_bucket:
                r.missing.append(("ddp_bucketed_benchmarking", "a sweep whose gradients span several buckets"))
    xl_parameters = ModelConfig.from_name("xl").parameter_count
    s, w, o = xl_parameters * 4, 1e11, 5e-5
    doc.add(Paragraph("The overhead model (`cs336-analyze bucket`): with n_b equal buckets, the last bucket's "
                      "all-reduce is exposed and every call costs o, so overhead = s/(n_b w) + n_b o, minimised at "
                      f"bucket size sqrt(s w o). For xl's fp32 gradients ({xl_parameters / 1e9:.2f} B parameters, "
                      f"s = {s / 1e9:.2f} GB) at w = 100 GB/s and o = 50 us (illustrative inputs):"))
    doc.add(Code("\n".join(str(c) for c in ddp_overhead.optimal_bucket(s, w, o))))


def optimizer_state_sharding_accounting(doc: Document, r: Results) -> None:
    doc.add(Heading("optimizer_state_sharding_accounting: what ZeRO-1 saves, measured"))
    shard = r.frame("sharding")
    if shard.empty:
        r.note_missing(doc, "optimizer_state_sharding_accounting", "`cs336-bench sharding` rows")
    if not shard.empty:
        rows = latest(shard, ["metric", "optimizer", "world_size", "preset", "backend"])
        wide = rows.pivot_table(index=["backend", "world_size", "preset", "optimizer"], columns="metric",
                                values="median").reset_index()
        doc.add(Paragraph("`cs336-bench sharding` (bytes per rank in MiB, step ms). " + environment(rows)))
        doc.add(Table(wide.round(2)))
        state = wide.set_index(["backend", "world_size", "preset", "optimizer"]).get("bytes_optimizer_state")
        if state is not None:
            claims = []
            for (backend, n, preset), group in state.groupby(level=[0, 1, 2]):
                by = group.droplevel([0, 1, 2])
                if {"adamw", "zero1-sharded-adamw"} <= set(by.index):
                    claims.append(f"{preset} on {n} ranks ({backend}): AdamW state {by['adamw']:.1f} MiB per rank "
                                  f"unsharded, {by['zero1-sharded-adamw']:.1f} MiB sharded "
                                  f"({by['zero1-sharded-adamw'] / by['adamw']:.2f} of it; ZeRO-1 claims 1/{n})")
            if claims:
                held = ("the state held at each point (columns bytes_held_*: after init, before and after the step) "
                        "falls by that much after the first step" if "bytes_held_after_step" in wide else
                        "what a rank holds falls by that much, not by a factor of N (these rows predate the "
                        "bytes_held_* points: after init, before and after the step)")
                doc.add(Paragraph("Against ZeRO-1's claim that each rank keeps 1/N of the optimizer state: "
                                  + "; ".join(claims) + ". Sharding goes parameter by parameter (the largest "
                                  "rank's share is shown), and parameters and gradients stay whole on every rank, so "
                                  + held + "."))
        _sharding_answers(doc, wide)
    r.missing.append(("optimizer_state_sharding_accounting", "xl on 2 GPUs (one GPU is lent)"))


def _sharding_answers(doc: Document, wide: pd.DataFrame) -> None:
    """(a) the peaks at the three points, (b) the step times, from the largest preset measured with both
    optimizers and the bytes_held_* points; (c) how our sharding differs from ZeRO stage 1."""
    points = ["bytes_held_after_init", "bytes_held_before_step", "bytes_held_after_step"]
    if not set(points) <= set(wide.columns):
        return
    measured = wide.dropna(subset=points)
    pairs = measured.groupby(["backend", "world_size", "preset"])["optimizer"].agg(set)
    pairs = pairs[pairs.map(lambda o: {"adamw", "zero1-sharded-adamw"} <= o)]
    if pairs.empty:
        return
    backend, n, preset = pairs.index[-1]
    case = measured[(measured["backend"] == backend) & (measured["world_size"] == n)
                    & (measured["preset"] == preset)].set_index("optimizer")
    plain, sharded = case.loc["adamw"], case.loc["zero1-sharded-adamw"]
    doc.add(Paragraph(
        f"(a) {preset} on {n} {backend} ranks, MiB held per rank: after init {plain['bytes_held_after_init']:.1f} "
        f"(the parameters, {plain['bytes_parameters']:.1f}) unsharded, {sharded['bytes_held_after_init']:.1f} "
        f"sharded; before the step "
        f"{plain['bytes_held_before_step']:.1f} (parameters and gradients, {plain['bytes_gradients']:.1f}); after the "
        f"step {plain['bytes_held_after_step']:.1f} unsharded against {sharded['bytes_held_after_step']:.1f} sharded, "
        f"the difference being AdamW's two moments: {plain['bytes_optimizer_state']:.1f} on every rank against "
        f"{sharded['bytes_optimizer_state']:.1f} on the largest shard. As expected: only the optimizer state is "
        "divided; parameters, gradients and activations are not."))
    doc.add(Paragraph(
        f"(b) Step time on the same ranks: {plain['step_time']:.1f} ms unsharded, {sharded['step_time']:.1f} ms "
        f"sharded ({sharded['step_time'] / plain['step_time']:.2f}x): each rank steps fewer parameters, but every "
        "parameter is then broadcast from its owner, on top of the gradients' all-reduce."))
    doc.add(Paragraph(
        "(c) ZeRO-1 (the paper's P_os) partitions the optimizer state as we do, but over equal slices of one flat "
        "parameter vector, where ours gives each whole parameter one owner (the shares are uneven). The paper "
        "reduce-scatters the gradients and all-gathers the updated slices: per rank, as many bytes as data "
        "parallelism's all-reduce alone. Ours keeps DDP's full all-reduce of the gradients and adds a broadcast of "
        "every parameter from its owner, half as much again (`ZeroReduceScatterOptimizer` is the paper's "
        "arrangement)."))


def fsdp_benchmarks(doc: Document, r: Results) -> None:
    """Our FSDP's step against torch's FSDP2, under the fsdp problem's heading."""
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
    r.missing.append(("fsdp", "xl on 2 GPUs (one GPU is lent)"))


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
    doc.add(Paragraph("To train with a smaller global batch: keep FSDP's axis short and add tensor (or sequence) "
                      "parallelism, overlap each layer's all-gather with the previous layer's compute, communicate "
                      "in bf16, and use activation checkpointing so a smaller per-device batch still fits."))


def fsdp_accounting(doc: Document, r: Results) -> None:
    """fsdp_accounting (a) from the memory model; (b) needs two GPUs and Nsight."""
    from cs336_systems.memory.model import predict

    doc.add(Heading("fsdp_accounting: what FSDP saves at the peak"))
    devices, batch, context = 2, 4, 512
    cfg = ModelConfig.from_name("xl", context_length=context)
    parts = predict(cfg, batch, context, dtype="fp32")
    gib = 2**30
    states = (parts.parameters + parts.optimizer_state) * (1 - 1 / devices)
    everything = states + parts.gradients * (1 - 1 / devices)
    doc.add(Paragraph(
        f"(a) xl in fp32 with AdamW, batch {batch}, context {context}, on N = {devices} GPUs (the memory model, "
        f"`cs336_systems.memory.model.predict`): parameters {parts.parameters / gib:.2f} GiB, gradients "
        f"{parts.gradients / gib:.2f} GiB, AdamW's two moments {parts.optimizer_state / gib:.2f} GiB, activations "
        f"{parts.activations / gib:.2f} GiB, predicted peak {parts.peak / gib:.2f} GiB (at the start of the backward, "
        f"before most gradients exist). FSDP keeps 1/N of parameters, gradients and optimizer state per GPU, so the "
        f"peak drops by at least {states / gib:.2f} GiB (parameters and moments) and at most {everything / gib:.2f} "
        f"GiB (with every gradient), to {(parts.peak - everything) / gib:.2f}-{(parts.peak - states) / gib:.2f} GiB, "
        "ignoring the gathered layer's full weights and the all-gather buffers as the problem allows; the "
        "activations, each GPU's for its own batch of the same size, are untouched."))
    r.missing.append(("fsdp_accounting", "(b): xl on 2 GPUs under Nsight, the all-gathers against the forward"))


def parallelism_calcs(doc: Document, r: Results) -> None:
    """data_parallel_calcs, fsdp_calcs, tp_calcs, fsdp_tp_calcs: the handout's FFN (W1, W2: D x F; W3: F x D) in
    fp16 (b = 2), each answer as the calculator's formula, then the numbers for one example."""
    B, D, F, N, C, W = 65536, 16384, 53248, 64, 4.6e14, 1.8e11
    example = (f"For numbers: B = {B:,} tokens, D = {D:,}, F = {F:,} (the XXL dimensions), N = {N}, C = {C:.2g} "
               f"FLOP/s, W = {W:.2g} B/s (v5p-like illustrative inputs; `cs336-analyze ffn`).")
    answers = {
        "dp": ("data_parallel_calcs", "each device runs the whole FFN on B/N tokens; its gradients of the three "
               "D x F weights are all-reduced after the backward, and the forward communicates nothing."),
        "fsdp": ("fsdp_calcs", "the work is DP's; the three weights are all-gathered before the forward and again "
                 "before the backward, whose gradients are reduce-scattered instead of all-reduced."),
        "tp": ("tp_calcs", "every device sees all B tokens but 1/N of F: the column-parallel W1, W2 need no "
               "communication, the row-parallel W3 leaves partial sums of y (B x D) to all-reduce, and the backward "
               "all-reduces dx the same way."),
    }
    for strategy, (problem, why) in answers.items():
        doc.add(Heading(f"{problem}: {strategy.upper()} on the handout's FFN"))
        flops = parallelism.ffn_flops(B, D, F, devices=N)
        costs = {c.name: c for c in parallelism.ffn_costs(strategy, B, D, F, N, C, W)}
        phases = ("backward",) if strategy == "dp" else ("forward", "backward")
        limits = [parallelism.max_devices_before_comm_dominates(strategy, B, D, F, C, W, phase=p) for p in phases]
        doc.add(Paragraph(f"(a) FLOPs per device: forward {flops[0].formula}, backward {flops[1].formula} (three "
                          "matmuls of 2 B D F each, and two products per matmul in the backward, over N devices). "
                          f"(b) Communication: forward {costs['T_comm_forward'].formula}, backward "
                          f"{costs['T_comm_backward'].formula}: {why} (c) Bottlenecked once communication outlasts "
                          "the compute it overlaps; in the large-N limit: " +
                          "; ".join(f"{c.name.split('_')[-1]}: N <= {c.formula}" for c in limits) + "."))
        doc.add(Paragraph(example))
        doc.add(Code("\n".join(str(c) for c in [*flops, *costs.values(), *limits])))
        if strategy == "tp":
            doc.add(Paragraph("(a) The backward on device i, from dy (B x D), every product local but the last:"))
            doc.add(Code("\n".join(parallelism.TP_BACKWARD)))
    doc.add(Heading("fsdp_tp_calcs: FSDP x TP on the handout's FFN (forward)"))
    X, Y = 16, 4
    costs = {c.name: c for c in parallelism.ffn_costs("fsdp-tp", B, D, F, N, C, W, mesh=(X, Y))}
    overlapped = parallelism.max_devices_fsdp_tp(B, F, C, W)
    shared = parallelism.max_devices_fsdp_tp(B, F, C, W, overlapped=False)
    doc.add(Paragraph(f"(a) FLOPs per device: 6 B D F / (N_FSDP N_TP), the work split evenly over the mesh. (b) "
                      f"Communication, the two axes overlapped: max({costs['T_comm_forward_fsdp_axis'].formula}, "
                      f"{costs['T_comm_forward_tp_axis'].formula}) with X = N_FSDP and Y = N_TP: the all-gather of a "
                      "1/Y weight shard over the FSDP axis, and the all-reduce of the (B/X) x D output over the TP "
                      f"axis. (c) Each axis bounded on its own: N_FSDP <= {overlapped[0].formula} and N_TP <= "
                      f"{overlapped[1].formula}, so N = N_FSDP N_TP <= {overlapped[2].formula}. (d) Sharing the "
                      "links, the two times add: 3 F X + 2 B Y <= 6 B F W / (b C); for a given N = X Y the sum is "
                      "smallest where the two terms are equal (AM-GM), so N <= "
                      f"{shared[2].formula}, a quarter of (c), at N_FSDP = {shared[0].formula} and N_TP = "
                      f"{shared[1].formula}."))
    doc.add(Paragraph(example + f" Mesh {X} x {Y} for (b)."))
    doc.add(Code("\n".join(str(c) for c in [*costs.values(), *overlapped, *shared])))
