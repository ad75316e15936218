"""`parse-jax eval`: JSONL records (GSM8K-style or the embedded task's), answer extraction, a resumable loop that
appends each record's result as it finishes, and accuracy with a 95% Wilson interval.

data.py loads and validates records; extract.py finds final answers; results.py is the resumable loop;
report.py computes intervals and summaries; evaluate.py is `pj.evaluate`, the call `parse-jax eval` makes (and a
training loop can make every N steps).
"""
