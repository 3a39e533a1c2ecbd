"""An activation-checkpointing policy as one object: `CheckpointPolicy.parse("partial:7+keep-attn+selective")`.

The command lines' policy strings are parsed here and nowhere else; checkpointing (`checkpointing.py`), the
memory model (`model.py`), the recompute FLOP count and the policy ladder (`planner.py`) take the object.
`str(policy)` gives the canonical string back, and `CheckpointPolicy.parse(str(p)) == p`.

Schemes, for N blocks (checkpointing.py says what each keeps and recomputes):
* none; every-block; every-k:K (groups of K); sqrt (K = round(sqrt(N))); nested (recursive halving);
* ffn / attn: only each block's SwiGLU / attention is checkpointed;
* partial:M: the first M blocks checkpointed one by one, the other N - M kept whole.

Modifiers:
* `+keep-attn` (on every-block, every-k:K, sqrt, partial:M): the checkpointed blocks keep their attention
  outputs, so their recompute skips the attention;
* `+selective` (on partial:M, after any +keep-attn): the blocks partial:M keeps whole are checkpointed
  selectively instead (weight products and attention outputs kept, pointwise ops recomputed).
  `selective` alone is partial:0+selective.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

SCHEMES = ("none", "every-block", "every-k", "sqrt", "nested", "ffn", "attn", "partial")
# The forms a user writes, for error messages and --help.
POLICY_FORMS = ("none", "every-block", "every-k:K", "partial:M", "sqrt", "nested", "ffn", "attn", "selective")
KEEP_ATTENTION = "+keep-attn"
SELECTIVE = "+selective"
KEEP_ATTENTION_SCHEMES = ("every-block", "every-k", "partial", "sqrt")


@dataclass(frozen=True)
class CheckpointPolicy:
    """scheme, its size (K of every-k, M of partial; else None) and the two modifiers."""

    scheme: str = "none"
    size: int | None = None
    keep_attention: bool = False
    selective_rest: bool = False

    def __post_init__(self):
        text = self._text()
        if self.scheme not in SCHEMES:
            raise ValueError(f"unknown checkpoint policy {text!r}; valid: {', '.join(POLICY_FORMS)}")
        if self.scheme == "every-k" and (self.size is None or self.size < 1):
            raise ValueError(f"checkpoint policy every-k needs a positive group size, e.g. every-k:4; got {text!r}")
        if self.scheme == "partial" and (self.size is None or self.size < 0):
            raise ValueError(f"checkpoint policy partial needs a block count M >= 0, e.g. partial:20; got {text!r}")
        if self.scheme not in ("every-k", "partial") and self.size is not None:
            raise ValueError(f"unknown checkpoint policy {text!r}; valid: {', '.join(POLICY_FORMS)}")
        if self.keep_attention and self.scheme not in KEEP_ATTENTION_SCHEMES:
            raise ValueError(f"checkpoint policy {text!r}: {KEEP_ATTENTION} applies to "
                             f"{', '.join(KEEP_ATTENTION_SCHEMES)}; got it on {self.scheme!r}")
        if self.selective_rest and self.scheme != "partial":
            raise ValueError(f"checkpoint policy {text!r}: {SELECTIVE} applies to partial:M "
                             f"(optionally partial:M{KEEP_ATTENTION}{SELECTIVE}); got it on {self.scheme!r}")

    @classmethod
    def parse(cls, text: str) -> CheckpointPolicy:
        """The policy a string names (the forms above); a ValueError that names the string otherwise."""
        if not isinstance(text, str):
            raise TypeError(f"checkpoint policy: expected a string such as 'every-k:4', got {type(text).__name__}")
        rest, selective = (text.removesuffix(SELECTIVE), True) if text.endswith(SELECTIVE) else (text, False)
        if rest.endswith(SELECTIVE):
            raise ValueError(f"unknown checkpoint policy {text!r}; valid: {', '.join(POLICY_FORMS)}")
        rest, keep = (rest.removesuffix(KEEP_ATTENTION), True) if rest.endswith(KEEP_ATTENTION) else (rest, False)
        if rest.endswith(SELECTIVE) or (rest == "selective" and keep):
            raise ValueError(f"checkpoint policy {text!r}: write {KEEP_ATTENTION} before {SELECTIVE}, "
                             f"e.g. partial:10{KEEP_ATTENTION}{SELECTIVE}")
        if rest == "selective":
            if selective:
                raise ValueError(f"checkpoint policy {text!r}: {SELECTIVE} applies to partial:M "
                                 f"(optionally partial:M{KEEP_ATTENTION}{SELECTIVE}); got it on 'selective'")
            return cls("partial", 0, selective_rest=True)
        scheme, colon, arg = rest.partition(":")
        if scheme == "every-k" and not (arg.isdigit() and int(arg) >= 1):
            raise ValueError(f"checkpoint policy every-k needs a positive group size, e.g. every-k:4; got {text!r}")
        if scheme == "partial" and not arg.isdigit():
            raise ValueError(f"checkpoint policy partial needs a block count M >= 0, e.g. partial:20; got {text!r}")
        if scheme not in SCHEMES or (colon and scheme not in ("every-k", "partial")):
            raise ValueError(f"unknown checkpoint policy {text!r}; valid: {', '.join(POLICY_FORMS)}")
        return cls(scheme, int(arg) if colon else None, keep, selective)

    @classmethod
    def of(cls, policy: CheckpointPolicy | str) -> CheckpointPolicy:
        """`policy` itself, or parsed where it is a string (Python callers may pass either)."""
        return policy if isinstance(policy, CheckpointPolicy) else cls.parse(policy)

    @staticmethod
    def _text_of(scheme: str, size: int | None, keep: bool, selective: bool) -> str:
        if scheme == "partial" and size == 0 and selective and not keep:
            return "selective"
        base = scheme if size is None else f"{scheme}:{size}"
        return base + (KEEP_ATTENTION if keep else "") + (SELECTIVE if selective else "")

    def _text(self) -> str:
        return self._text_of(self.scheme, self.size, self.keep_attention, self.selective_rest)

    def __str__(self) -> str:
        return self._text()

    def group_size(self, num_blocks: int) -> int | None:
        """Blocks per checkpointed group for the single-level schemes (None otherwise)."""
        if self.scheme == "every-block":
            return 1
        if self.scheme == "every-k":
            return min(self.size, num_blocks)
        if self.scheme == "sqrt":
            return max(1, round(math.sqrt(num_blocks)))
        return None

    def check_fits(self, num_blocks: int, where: str = "checkpoint policy") -> None:
        """A ValueError where the policy names more blocks than the model has (partial:M, every-k:K): the
        library caps them, but a command line that asks for them is most likely a mistake."""
        if self.scheme in ("partial", "every-k") and self.size > num_blocks:
            raise ValueError(f"{where}: {str(self)!r} names {self.size} blocks but the model has {num_blocks}")

    def checkpointed_blocks(self, num_blocks: int) -> int:
        """M of partial:M, at most the model's blocks (partial only)."""
        return min(self.size, num_blocks)


NO_CHECKPOINTING = CheckpointPolicy()  # keep every activation: the default everywhere
