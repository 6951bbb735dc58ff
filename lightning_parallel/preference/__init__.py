"""Preference tuning (DPO, Rafailov et al. 2023) of the package's causal LMs: the losses as TRL computes them
(loss.py, pure torch), preference pairs from local files tokenized once into a token cache (data.py), the reference
model's log-probabilities (reference.py: adapters off, a frozen copy sharded like the policy, or precomputed), the
LightningModule glue (module.py), what LitGPT's GPT needs (litgpt.py: its LoRA off, its copy's forward, its prompt
style) and a MoE's load-balancing loss as TRL adds it (moe.py)."""
