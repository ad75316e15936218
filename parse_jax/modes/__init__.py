"""One module per generation mode: `target` (the target alone), `sd` (token-level speculative decoding with the
draft), `eagle3` (EAGLE-3 drafting), `sequential` (one verification pass per step), `parse` (single- and
multi-round PARSE, and parse+eagle3). `table.MODE_TABLE` describes them; each runs as `run(ctx, request)` over the
engine's `context.ModeContext`."""
