"""Research probes on one held-out batch: attention sinks, attention sparsity, massive
activations and activation kurtosis, per layer (the softpick paper's measurements).

- sink rate: share of heads whose mean attention to the first token of the row exceeds
  ``probes.sink_threshold`` (0.3 in the paper), averaged over queries and the batch;
- attention sparsity: share of causal attention weights that are exactly zero (softmax gives
  none; softpick/rectified give many);
- max |hidden state| per layer output (massive activations);
- kurtosis of each layer's output activations (E[(x-mu)^4] / Var(x)^2; 3 for a Gaussian).

Attention probes need a model that returns attention weights (``output_attentions``): flame's
transformer does on every backend; linear-attention models report the hidden-state probes only.
"""

import torch


def kurtosis(x: torch.Tensor) -> float:
    x = x.double().flatten()
    centered = x - x.mean()
    var = centered.pow(2).mean()
    return float(centered.pow(4).mean() / var.clamp(min=1e-30).pow(2))


def attention_probes(weights: torch.Tensor, sink_threshold: float) -> dict[str, float]:
    """``weights``: [B, H, T, T] causal attention of one layer."""
    w = weights.double()
    t = w.shape[-1]
    per_head_first = w[..., 0].mean(dim=(0, 2))  # mean attention to token 0, per head
    causal = torch.ones(t, t, dtype=torch.bool, device=w.device).tril()
    zeros = ((w == 0) & causal).sum() / (causal.sum() * w.shape[0] * w.shape[1])
    return {
        "sink_rate": float((per_head_first > sink_threshold).double().mean()),
        "attention_sparsity": float(zeros),
    }


@torch.no_grad()
def run_probes(model: torch.nn.Module, input_ids: torch.Tensor, sink_threshold: float = 0.3) -> dict[str, float]:
    """Probe values keyed ``probes/<metric>/layer_<i>`` plus model-wide means."""
    was_training = model.training
    model.eval()
    # HF models' last hidden state is the final norm's output; the last block's own output (the
    # residual stream, where massive activations live) is taken from the block itself
    last_block: list[torch.Tensor] = []
    try:
        from flame.models.blocks import find_block_list

        _, _, blocks = find_block_list(model)
        handle = blocks[-1].register_forward_hook(
            lambda _m, _i, o: last_block.append(o[0] if isinstance(o, (tuple, list)) else o))
    except ValueError:  # no block list found: the hidden states as the model returns them
        handle = None
    try:
        try:
            out = model(input_ids=input_ids, output_hidden_states=True, output_attentions=True, use_cache=False)
        except (TypeError, ValueError):  # models without attention weights
            last_block.clear()
            out = model(input_ids=input_ids, output_hidden_states=True, use_cache=False)
    finally:
        model.train(was_training)
        if handle is not None:
            handle.remove()
    values: dict[str, float] = {}
    hidden = tuple(out.hidden_states[1:]) if out.hidden_states is not None else ()
    if hidden and last_block and torch.is_tensor(last_block[-1]) and last_block[-1].shape == hidden[-1].shape:
        hidden = hidden[:-1] + (last_block[-1],)
    for i, h in enumerate(hidden):
        values[f"probes/max_abs_hidden/layer_{i}"] = float(h.detach().abs().max())
        values[f"probes/kurtosis/layer_{i}"] = kurtosis(h.detach())
    attentions = getattr(out, "attentions", None) or ()
    sinks, sparsity = [], []
    for i, a in enumerate(attentions):
        if a is None:
            continue
        p = attention_probes(a.detach(), sink_threshold)
        values[f"probes/sink_rate/layer_{i}"] = p["sink_rate"]
        values[f"probes/attention_sparsity/layer_{i}"] = p["attention_sparsity"]
        sinks.append(p["sink_rate"])
        sparsity.append(p["attention_sparsity"])
    if sinks:
        values["probes/sink_rate"] = sum(sinks) / len(sinks)
        values["probes/attention_sparsity"] = sum(sparsity) / len(sparsity)
    if hidden:
        values["probes/max_abs_hidden"] = max(v for k, v in values.items() if k.startswith("probes/max_abs_hidden/"))
    return values
