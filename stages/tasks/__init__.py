"""Built-in tasks and the tiny model they are made for: the toy task, JSONL prompts, and the tiny
char-level Qwen3 model with its tokenizer. Tasks are data plus a reward, not stages."""

__all__: list[str] = []
