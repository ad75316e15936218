"""Token-level speculation, one program per method: a draft model (draft_model) and an EAGLE-3 head (eagle3)."""
