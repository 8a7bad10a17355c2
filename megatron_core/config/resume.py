"""The resume policy: which recipe keys a resumed run may change from its checkpoint's recipe
(megatron_core.training.checkpointing refuses a resume that changes any other)."""

# The keys that say how long and how visibly a run trains, not how it computes: the run directory's name
# leaves them out, so `--set train_iters=2000` continues a finished 900-iteration run in place (Megatron's way
# to extend a run) and `convert`/`evaluate` find it without that --set.
RUN_EXTENDING_KEYS = frozenset(
    {
        "training.train_iters",
        "training.lr_decay_iters",
        "training.log_interval",
        "training.save_interval",
        "training.keep_last_checkpoints",
        "training.max_consecutive_nan_steps",
        "training.eval_interval",
        "training.eval_iters",
        "description",
        "hardware",
        "version",
        "evaluate",
    }
)

# Keys that may change between a checkpoint and its resume without changing what is learned: those above, and
# how the run computes. Another layout, device or attention backend names a run of its own, side by side
# (`--load` continues one from another).
RESUME_SAFE_KEYS = RUN_EXTENDING_KEYS | frozenset(
    {
        "model.attention_backend",
        "training.device",
        "training.optimizer",
        # The layout: a resume re-slices weights and optimizer state for any TP x PP x DP; the
        # vocabulary padding may change with it as long as the padded size stays (checked on load).
        "parallel",
        "model.make_vocab_size_divisible_by",
    }
)
