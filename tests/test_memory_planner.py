"""memory/planner.py: the recompute each checkpointing policy costs, and the ladder of policies the memory model
says fit (the leaderboard step's `--checkpoint auto`)."""


def test_policy_ladder_follows_the_memory_model(monkeypatch):
    import torch

    from cs336_systems.config import ModelConfig
    from cs336_systems.memory.model import predict
    from cs336_systems.memory.planner import FIT_FRACTION, policy_candidates, recompute_cost, recompute_flops

    cfg = ModelConfig.from_name("leaderboard-8b")
    kw = dict(attention="flash", dtype="bf16", fused=True, loss="fused", state_dtype="bf16")
    need = {m: predict(cfg, 1, 32768, policy=f"partial:{m}", **kw).peak for m in (20, 21)}
    free = (need[20] + need[21]) / 2 / FIT_FRACTION  # partial:21 fits, partial:20 does not
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (int(free), int(2 * free)))
    ladder = policy_candidates(cfg, 1, 32768, torch.device("cuda"), dtype="bf16", state_dtype="bf16",
                               attention="triton", fused=True, chunk_tokens=4096)
    def fits(policy):
        return predict(cfg, 1, 32768, policy=policy, **kw).peak < FIT_FRACTION * free

    # The first rung is the least recompute that fits: fewer fully checkpointed blocks (keeping their
    # attention) with the rest selective beats partial:21 and the best plain +keep-attn rung.
    names = [str(p) for p in ladder]  # the ladder holds CheckpointPolicy objects; their strings name them
    first = ladder[0]
    assert fits(first) and names[0].endswith("+keep-attn+selective")
    checkpointed = int(names[0].removesuffix("+keep-attn+selective").partition(":")[2])
    assert not fits(f"partial:{checkpointed - 1}+keep-attn+selective")  # one block fewer does not fit
    best_keep_attn = next(p for p in names if p.endswith("+keep-attn"))
    assert int(best_keep_attn.removesuffix("+keep-attn").partition(":")[2]) > checkpointed
    cost = {p: recompute_cost(cfg, 1, 32768, p) for p in (first, best_keep_attn, "partial:21")}
    assert cost[first] < cost[best_keep_attn] < cost["partial:21"]
    assert fits("partial:21") and not fits("partial:20") and "partial:21" in names
    assert recompute_flops(cfg, 1, 32768, "selective") == 0  # no product is recomputed...
    assert 0 < recompute_cost(cfg, 1, 32768, "selective") < recompute_cost(cfg, 1, 32768, "partial:2")  # ...only copies
    assert names[-2:] == ["every-block", "nested"] and names.index("every-block+keep-attn") < len(names) - 2
    # ffn (recompute each SwiGLU) sorts by its recomputed FLOPs between partial:13 and partial:14.
    flops = {p: recompute_flops(cfg, 1, 32768, p) for p in ("partial:13", "ffn", "partial:14")}
    assert flops["partial:13"] < flops["ffn"] < flops["partial:14"]
    assert "ffn" not in names  # predicted to need more memory than the first rung: no fallback
    first_peak = predict(cfg, 1, 32768, policy=first, **kw).peak
    assert all(predict(cfg, 1, 32768, policy=p, **kw).peak < first_peak for p in ladder[1:])
    assert [str(p) for p in policy_candidates(cfg, 1, 32768, torch.device("cpu"), dtype="bf16", state_dtype="bf16",
                                              attention="triton", fused=True, chunk_tokens=4096)] == ["none"]
    # A larger share of the free memory lets the first rung recompute less.
    roomier = policy_candidates(cfg, 1, 32768, torch.device("cuda"), dtype="bf16", state_dtype="bf16",
                                attention="triton", fused=True, chunk_tokens=4096, fit_fraction=0.97)
    assert recompute_cost(cfg, 1, 32768, roomier[0]) < recompute_cost(cfg, 1, 32768, first)
