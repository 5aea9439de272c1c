"""The application: `narrows finetune` (the main job), its data, inference loading, the `narrows` command and doctor. The only layer of core that imports a sibling."""
