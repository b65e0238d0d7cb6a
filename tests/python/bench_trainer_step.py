"""The PyTorch side of `cargo bench --bench trainer`: one trainer step written the usual way, on
the same model, batch and settings as moult's.

Usage: python bench_trainer_step.py MODEL_DIR BATCH_JSON

BATCH_JSON (written by the bench): "tokens", "loss_mask", "behaviour_logprobs" (one list per
sequence), "advantages" (one per sequence), and the settings "threads", "warmup", "steps",
"temperature", "eps_low", "eps_high", "is_low", "is_high", "lr", "betas", "adam_eps",
"weight_decay", "max_grad_norm".

A step, as moult's (`policy_loss`, backward, `clip_grad_norm`, AdamW): the logprobs with
gradient, π_old their detached copy (one update per batch); token-level IS mask between
behaviour and π_old (coef = ρ if is_low ≤ ρ ≤ is_high else 0); PPO-clip with asymmetric ε, token-mean; the metrics
moult's loss reports (entropy, mean |log ρ|, masked fraction); `loss.backward()`;
`clip_grad_norm_`; `torch.optim.AdamW.step()`; `zero_grad()`. Sequences are right-padded to the
longest (transformers' batched forward with an attention mask).

Prints one JSON line: {"phases_ms": [[loss forward, backward, optimizer] per
measured step], "losses": [every step, warm-up included], "grad_norms": [...], "threads",
"padded_tokens"}.
"""

import json
import sys
import time

import torch
from transformers import Qwen3ForCausalLM


def padded(rows, pad, dtype):
    width = max(len(r) for r in rows)
    return torch.tensor([list(r) + [pad] * (width - len(r)) for r in rows], dtype=dtype)


def token_logprobs(model, ids, attention, temperature):
    """logp[i, t] = log π(ids[i, t] | ids[i, :t]); column 0 (no prefix) is 0."""
    logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1].float()
    logp_all = torch.log_softmax(logits / temperature, dim=-1)
    picked = logp_all.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    zero = torch.zeros(ids.shape[0], 1)
    return torch.cat([zero, picked], dim=1), logp_all


def main():
    model_dir, batch_path = sys.argv[1], sys.argv[2]
    with open(batch_path) as f:
        b = json.load(f)
    torch.set_num_threads(b["threads"])
    torch.manual_seed(0)
    model = Qwen3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()

    ids = padded(b["tokens"], 0, torch.long)
    attention = padded([[1] * len(t) for t in b["tokens"]], 0, torch.long)
    mask = padded(b["loss_mask"], 0, torch.float32)
    behaviour = padded(b["behaviour_logprobs"], 0.0, torch.float32)
    adv_tok = torch.tensor(b["advantages"], dtype=torch.float32).unsqueeze(1) * mask
    temperature = b["temperature"]
    optimizer = torch.optim.AdamW(
        model.parameters(),
        lr=b["lr"],
        betas=tuple(b["betas"]),
        eps=b["adam_eps"],
        weight_decay=b["weight_decay"],
    )

    def step():
        """One step: its phases in milliseconds, the loss, the gradient norm before clipping."""
        clock = [time.perf_counter()]

        def lap():
            now = time.perf_counter()
            ms, clock[0] = (now - clock[0]) * 1e3, now
            return ms

        logp, logp_all = token_logprobs(model, ids, attention, temperature)
        logp_old = logp.detach()
        log_rho = (logp_old - behaviour) * mask
        rho = log_rho.exp()
        coef = rho * ((rho >= b["is_low"]) & (rho <= b["is_high"])).float() * mask
        ratio = (logp - logp_old).exp()
        clipped = ratio.clamp(1.0 - b["eps_low"], 1.0 + b["eps_high"])
        per_token = -torch.minimum(ratio * adv_tok, clipped * adv_tok) * coef.detach()
        loss = (per_token * mask).sum() / mask.sum().clamp(min=1.0)
        # The metrics moult's loss reports (read like moult reads them, as numbers).
        with torch.no_grad():
            tokens = mask.sum().clamp(min=1.0)
            entropy = -(logp_all.exp() * logp_all).sum(-1)
            _metrics = {
                "entropy": ((entropy * mask[:, 1:]).sum() / tokens).item(),
                "mean_abs_log_rho": ((log_rho.abs() * mask).sum() / tokens).item(),
                "masked_fraction": (((coef == 0).float() * mask).sum() / tokens).item(),
            }
        loss_value = loss.item()
        loss_ms = lap()
        loss.backward()
        backward_ms = lap()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), b["max_grad_norm"])
        optimizer.step()
        optimizer.zero_grad()
        optimizer_ms = lap()
        return [loss_ms, backward_ms, optimizer_ms], loss_value, grad_norm.item()

    losses, grad_norms, phases = [], [], []
    for i in range(b["warmup"] + b["steps"]):
        ms, loss, grad_norm = step()
        losses.append(loss)
        grad_norms.append(grad_norm)
        if i >= b["warmup"]:
            phases.append(ms)
    print(json.dumps({
        "phases_ms": phases,
        "losses": losses,
        "grad_norms": grad_norms,
        "threads": torch.get_num_threads(),
        "padded_tokens": int(ids.numel()),
    }))


if __name__ == "__main__":
    main()
