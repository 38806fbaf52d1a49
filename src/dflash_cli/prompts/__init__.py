"""Built-in prompt sets for `dflash-cli bench`, one JSON object per line: {"id": ..., "prompt": ...}.

math.jsonl: grade-school word problems asking for step-by-step solutions; code.jsonl: short programming
tasks (write a function, fix a bug, explain a snippet); chat.jsonl: open conversational requests. The
prompts were written for this project; dflash_cli.prompts.reader.load_prompt_set reads them.
"""
