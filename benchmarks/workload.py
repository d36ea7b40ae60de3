"""The long-tailed workload that ``bench modes`` runs every mode on and ``bench profile`` measures this
machine's costs for: a module of its own, so that both import it and neither imports the other for it."""

# Tiny Llama on one device, 32 slots, groups of 4, 16 samples per update, length budgets up to 256 tokens (p50 8,
# 15% between 128 and 256): every batch meets the tail, as in large-batch RL.
TBS = 16


def workload(max_len: int = 256) -> list[str]:
    """The settings of every mode's run: task ``longtail`` with budgets up to ``max_len`` tokens (p50
    ``max_len / 32``), 32 slots, groups of 4, ``TBS`` samples per update, the trainer's length buckets at quarters of
    ``max_len``."""
    buckets = [max_len // 4, max_len // 2, 3 * max_len // 4, max_len, max_len + 64]
    return ["mesh.data=1", "mesh.fsdp=1", "mesh.tensor=1", "task.name=longtail", f"task.longtail_max_len={max_len}",
            "task.eval_size=0", "rollout.slots=32", f"rollout.max_new_tokens={max_len}", "rollout.max_prompt_len=32",
            "train.group_size=4", "train.learning_rate=0.002", f"train.max_response_tokens={max_len}",
            f"train.length_buckets={buckets}", f"dora.train_batch={TBS}", "run.checkpoint_every=0"]


OVERRIDES = workload()
