"""Our assignment-1 Transformer LM package, state-dict compatible with the staff `cs336_basics`.

Modules: `model` (layers and BasicsTransformerLM), `nn_utils` (softmax, cross-entropy,
gradient clipping), `optimizer` (AdamW, cosine schedule), `data` (batch sampling).
"""

__version__ = "0.1.0"
