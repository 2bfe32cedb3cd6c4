"""Built-in tasks: prompts, rewards and (for multi-turn tasks) agents, made for the tiny model."""
