"""`python -m parse_jax.tasks [FOLDER]`: write the embedded tokenizer (default: parse_jax/assets/tokenizer/)."""

import sys

from parse_jax.tasks.tokenizer import TOKENIZER_DIR, write_tokenizer

if __name__ == "__main__":
    print(write_tokenizer(sys.argv[1] if len(sys.argv) > 1 else TOKENIZER_DIR))
