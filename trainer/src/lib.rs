//! What a training process embeds: save pipeline, restore, CheckpointManager, reference workload.
