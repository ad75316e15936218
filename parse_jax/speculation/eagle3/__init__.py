"""EAGLE-3: the head (`head`), its layouts on disk (`formats`: parse-jax, the original release, speculators),
chain and tree drafting and the continuation (`decode`), trees (`tree`: expansion, layout, acceptance). The
names are re-exported here, so
`from parse_jax.speculation.eagle3 import eagle_loop, head_applies, load_eagle3, ...` works as before the split."""

from parse_jax.speculation.eagle3.decode import (
    EagleContext,
    EagleFns,
    EagleLoop,
    EagleState,
    check_tree,
    continue_program,
    eagle3_generate,
    eagle3_launch,
    eagle3_speculate,
    eagle_loop,
    eagle_round,
    eagle_start,
    first_token,
    generate_program,
    head_applies,
)
from parse_jax.speculation.eagle3.formats import export_speculators, head_layout, load_eagle3, save_eagle3
from parse_jax.speculation.eagle3.head import (
    Eagle3,
    Eagle3Config,
    Eagle3Head,
    abstract_params,
    check_head,
    default_taps,
    draft_logits,
    embed,
    head_module,
    init_head,
    layer_params,
    lm_head,
    target_taps,
    to_target_vocab,
    ttt_logits,
)
from parse_jax.speculation.eagle3.tree import (
    Layout,
    Tree,
    accept_path,
    compact_kv,
    expand,
    expand_spine,
    layout,
    slots_needed,
)

__all__ = [
    "Eagle3", "Eagle3Config", "Eagle3Head", "EagleContext", "EagleFns", "EagleLoop", "EagleState", "abstract_params",
    "check_head", "check_tree", "continue_program", "default_taps", "draft_logits", "eagle3_generate", "eagle3_launch",
    "eagle3_speculate", "Layout", "Tree", "accept_path", "compact_kv", "expand", "expand_spine", "layout",
    "slots_needed",
    "eagle_loop", "eagle_round", "eagle_start", "embed", "first_token", "export_speculators", "generate_program",
    "head_applies",
    "head_layout", "head_module", "init_head", "layer_params", "lm_head", "load_eagle3", "save_eagle3", "target_taps",
    "to_target_vocab", "ttt_logits",
]
