"""The embedded step-by-step task (modular arithmetic, one operation per step) and its tokenizer.

`load_task()` returns the default task; `build_tokenizer` / `write_tokenizer` make the tokenizer shipped in
`parse_jax/assets/tokenizer/`. See `parse_jax/tasks/README.md` and `parse_jax.tasks.arith` for the format.
"""

from parse_jax.tasks.arith import (
    ANSWER_MARK,
    CORRUPTIONS,
    DELIMITER,
    JUDGE_NO,
    JUDGE_YES,
    PRESETS,
    PROMPT_END,
    SYMBOLS,
    VERIFY_SUFFIX,
    Problem,
    Task,
    TaskConfig,
    load_task,
)
from parse_jax.tasks.tokenizer import (
    SPECIAL_TOKENS,
    TOKENIZER_DIR,
    build_tokenizer,
    tokenizer_config,
    write_tokenizer,
)

__all__ = ["ANSWER_MARK", "CORRUPTIONS", "DELIMITER", "JUDGE_NO", "JUDGE_YES", "PRESETS", "PROMPT_END",
           "SPECIAL_TOKENS", "SYMBOLS", "TOKENIZER_DIR", "VERIFY_SUFFIX", "Problem", "Task", "TaskConfig",
           "build_tokenizer", "load_task", "tokenizer_config", "write_tokenizer"]
