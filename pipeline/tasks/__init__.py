"""Built-in tasks and the tiny model they are made for: the toy and long-tail tasks, JSONL prompts,
the multi-turn tool task (prompts, reward and its agent), and the tiny char-level Qwen3 model with
its tokenizer. Tasks are data plus a reward (plus an agent for multi-turn ones), not stages."""

__all__: list[str] = []
