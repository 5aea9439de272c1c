"""Where the frozen base lives and how it reaches the GPU: host tiers (pinned RAM, disk), the prepared-slab cache, checkpoints loaded straight into the tiers, and the transfer engine."""
